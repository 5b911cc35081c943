#!/usr/bin/env bash
# The FP8 cache decode on this tree (fast accumulation on, then off) and on main's package
# (git archive main), each in its own process with the bf16 kernel timed beside it.
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
P="--batch 8 --keys 16384 65536 --reps 20"
mkdir -p $OUT/r /tmp/oldroot/eval
timeout 100 python eval/fp8_cache_decode_bench.py $P --out $OUT/r/new > $OUT/r/new.txt 2>&1; echo "new rc $?"
grep "fp8 cache decode" $OUT/r/new.txt
(git archive main hf_tiled_attention || git archive HEAD hf_tiled_attention) | tar -x -C /tmp/oldroot && git log -1 --format=%h main; cp eval/*.py /tmp/oldroot/eval/; grep -c PV_FAST_ACC /tmp/oldroot/hf_tiled_attention/fp8_cache_kernel.py
(cd /tmp/oldroot && PYTHONPATH=/tmp/oldroot:${PYTHONPATH} timeout 100 python eval/fp8_cache_decode_bench.py $P --out $OUT/r/old > $OUT/r/old.txt 2>&1; echo "old rc $?")
grep "fp8 cache decode" $OUT/r/old.txt
timeout 80 python - > $OUT/r/noacc.txt 2>&1 <<'PY'
import hf_tiled_attention.fp8_cache_attention as f
f.fp8_cache_pv_fast_acc = lambda head_dim: False
from eval import fp8_cache_decode_bench as b
import os
b.main("--batch 8 --keys 16384 65536 --reps 20 --out".split() + [os.environ["OUT"] + "/r/noacc"])
PY
echo "noacc rc $?"; grep "fp8 cache decode" $OUT/r/noacc.txt
tail -3 $OUT/r/new.txt $OUT/r/old.txt $OUT/r/noacc.txt | grep -i "error\|Trace" | head
