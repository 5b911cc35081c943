#!/usr/bin/env bash
# Before the suite (carry .gpu and exp, a copy of .pending): the fast-accumulation patch's two
# unsplit GPU cases, then the decode bench at 32 rows x 16k / 64k keys (one block sums 256 /
# 1024 key tiles: exact accumulation with the patch) and the same with fast accumulation
# forced on everywhere (main's behaviour), each process timing the bf16 kernel beside it.
# Keep the patch if the cases pass; its speed cost is the two runs' ms at equal bf16 ms.
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
mkdir -p $OUT/c
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest -q -m gpu tests/test_fp8_cache_gpu.py -k unsplit -p no:cacheprovider > $OUT/c/tests.txt 2>&1; echo "tests rc $?"; tail -3 $OUT/c/tests.txt
timeout 90 python eval/fp8_cache_decode_bench.py --batch 32 8 --keys 16384 65536 --reps 20 --out $OUT/c/exact > $OUT/c/exact.txt 2>&1; echo "exact rc $?"
grep "fp8 cache decode" $OUT/c/exact.txt
timeout 90 python - > $OUT/c/fast.txt 2>&1 <<'PY'
import os
import hf_tiled_attention.fp8_cache_attention as f
f.fp8_cache_pv_fast_acc = lambda head_dim, tiles: head_dim <= 128
from eval import fp8_cache_decode_bench as b
b.main("--batch 32 8 --keys 16384 65536 --reps 20 --out".split() + [os.environ["OUT"] + "/c/fast"])
PY
echo "fast rc $?"; grep "fp8 cache decode" $OUT/c/fast.txt
(cd $OUT && tar -czf c.tgz c && rm -rf c)
