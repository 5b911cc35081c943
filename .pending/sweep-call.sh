#!/usr/bin/env bash
# The H200 call that made h200-2026-12-05/decode_sweep.jsonl and decode_step_profile.csv, on the
# patch's tree (carry .gpu and a copy of this folder, e.g. exp/: `bash .gpu/install.sh
# >/dev/null 2>&1 && source /tmp/cutile-tk/env.sh && bash exp/sweep-call.sh`): the FP8 cache's
# GPU tests (holding the timing lock), the decode kernel's knob sweep (decode_sweep.py, compiled
# in parallel, timed one process at a time), then a profile of a bf16 "tiled" decode step of
# generate() at batch 8 / 8k. Everything tarred into $OUT/c2.tgz.
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
here=$(dirname "$0")
r=$OUT/c2 && mkdir -p "$r"
( flock /tmp/sweep.lock timeout 200 python -m pytest -q -n 8 -m gpu tests/test_fp8_cache_gpu.py \
  integration_tests/test_fp8_cache_generate.py > "$r/gpu_tests.txt" 2>&1
  echo "gpu tests rc $?" >> "$r/gpu_tests.txt" ) &
sleep 3
for v in "64 2 2 4 0 0" "128 2 2 4 0 0" "64 4 2 4 0 0" "64 2 2 4 1 0" "64 2 2 4 2 0" "64 2 2 4 0 1" \
         "64 2 2 4 1 1" "64 2 2 4 2 1" "128 2 2 4 1 1" "64 4 2 4 2 1"; do
  timeout 240 python "$here/decode_sweep.py" $v > "$r/sweep_$(echo $v | tr ' ' _).txt" 2>&1 &
done
wait
timeout 100 python eval/profile_decode_step.py --shape llama3-8b --layers 8 --batch 8 --prompt 8192 \
  --steps 16 --reps 2 --out "$r/profile" > "$r/profile.txt" 2>&1; echo "rc $?" >> "$r/profile.txt"
cat "$r"/sweep_*.txt | grep '^{' > "$r/sweep.jsonl"
tar czf "$OUT/c2.tgz" -C "$OUT" c2
tail -8 "$r/gpu_tests.txt"; tail -6 "$r/profile.txt"; cat "$r/sweep.jsonl"
