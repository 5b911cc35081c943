#!/usr/bin/env bash
# The next H200 session's calls, one part each (.pending/README.md says why and in what order).
# Apply .pending/experiments/paged-32bit-entry.mbox here first (`git am`): parts 1 and 2 run
# the GPU suite on that tree. Run each part through the device tool, carry [".gpu"]:
#   export CALL_START=$(date +%s); bash .gpu/install.sh >/dev/null 2>&1 &&
#   source /tmp/cutile-tk/env.sh && export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1;
#   bash .pending/device_calls.sh 1
# (quick on a warm host) and chain them: the host goes back 30 s after a call.
# Results go to /tmp/r (kept between calls on a warm host) and come back as $OUT/r<part>.tgz.
#   1: the GPU suite whole, cold (bounded so its log comes back; 537 s on an H100)
#   2: the suite again, warm, unless part 1's finished; the entry-width experiment (both
#      entries, one process); the row gathers' two forms (TMA loads, copies); the paged decode
#      bench at serve/paged_decode.csv's points
#   3: the prompt-chunk points (serve/paged-prefill-chunks.txt's); the packed training step
#      profiled at 16k and 32k, tiled against FlexAttention
#   4: (if device time is left) serve/serve.csv's run again on this tree (it is from e1fd5c9)
set -u
part=${1:?say 1, 2, 3 or 4}
grep -q "^VARLEN_ROW_GATHER = " hf_tiled_attention/schedule.py || {
  echo "device_calls: apply .pending/experiments/paged-32bit-entry.mbox first" >&2; exit 2; }
mkdir -p /tmp/r
snap() { tar czf "${OUT:-/tmp}/r$part.tgz" -C /tmp r 2>/dev/null; }
trap snap EXIT TERM
start=${CALL_START:-$(date +%s)}  # the call's start, the install's time included
left() { echo $(( $1 - ($(date +%s) - start) )); }
timed() {  # timed LOG LIMIT COMMAND...: the command's output to /tmp/r/LOG, its status last
  local log=/tmp/r/$1 limit=$2; shift 2
  if [ "$limit" -le 0 ]; then echo "skipped: no time left in the call" > "$log"; return; fi
  timeout "$limit" "$@" > "$log" 2>&1
  echo "rc $? after $(( $(date +%s) - start )) s" >> "$log"
}
suite() { timed "$1" "$2" python -m pytest -q -n 16 -m gpu tests integration_tests \
            -p no:cacheprovider; grep -E "^(FAILED|ERROR)" "/tmp/r/$1" | head -20
          tail -3 "/tmp/r/$1"; cp "/tmp/r/$1" "${OUT:-/tmp}/" 2>/dev/null; }  # kept if cut
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "/tmp/r/gpu$part.txt"
case $part in
  1) suite suite_cold.txt "$(left 580)" ;;  # CALL_START: the install counts against the call
  2) grep -q "^rc 0 after" /tmp/r/suite_cold.txt 2>/dev/null || suite suite.txt 400
     timed entry_width.txt 150 python .pending/experiments/paged_entry_width.py
     tail -24 /tmp/r/entry_width.txt
     rows=$(left 560); [ "$rows" -gt 200 ] && rows=200  # (the bench gets what is left)
     timed row_tiles.txt "$rows" python .pending/experiments/row_gather_tiles.py
     tail -24 /tmp/r/row_tiles.txt
     timed paged_bench.txt "$(left 575)" python eval/paged_decode_bench.py \
       --requests 32 64 128 256 --keys 1024 2048 4096 --out /tmp/r/serve
     tail -30 /tmp/r/paged_bench.txt ;;
  3) timed paged_prefill.txt 120 python eval/paged_decode_bench.py \
       --queries 128 512 --requests 8 32 --keys 4096 --out /tmp/r/serve-prefill
     tail -12 /tmp/r/paged_prefill.txt
     timed train_profile.txt "$(left 575)" python eval/profile_train_step.py \
       --batchings packed-16k packed-32k --out /tmp/r/train-profile
     tail -30 /tmp/r/train_profile.txt ;;
  4) timed serve.txt 560 python eval/serve_throughput.py --shapes llama3-8b \
       --concurrency 32 128 --backends tiled sdpa --out /tmp/r/serve-throughput
     tail -12 /tmp/r/serve.txt ;;
  *) echo "device_calls: the part is 1, 2, 3 or 4, got '$part'" >&2; exit 2 ;;
esac
