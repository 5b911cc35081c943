#!/usr/bin/env bash
# The first H200 call after `git am --keep-cr .pending/fp8-kv-cache.mbox` (carry .gpu; run as
# `bash .gpu/install.sh >/dev/null 2>&1 && source /tmp/cutile-tk/env.sh && bash .pending/first-call.sh`
# before .pending is removed, or from a copy): the FP8 cache's GPU tests, its decode bench and
# generate() with it, every log and CSV tarred into $OUT/fp8-cache.tgz (8 files come back).
set -u
r=$OUT/fp8-cache && mkdir -p "$r"
python -m pytest -q -n 8 -m gpu tests/test_fp8_cache_gpu.py integration_tests/test_fp8_cache_generate.py \
  > "$r/gpu_tests.txt" 2>&1; echo "gpu tests rc $?" >> "$r/gpu_tests.txt"
python eval/fp8_cache_decode_bench.py --out "$r/decode" > "$r/decode_bench.txt" 2>&1
python eval/generate_throughput.py --shapes llama3-8b --layers 8 --cache dynamic static \
  --points 1x8192 8x8192 32x4096 --backends tiled tiled_fp8_cache sdpa --out "$r/generate" \
  > "$r/generate.txt" 2>&1
tar czf "$OUT/fp8-cache.tgz" -C "$OUT" fp8-cache && tail -5 "$r/gpu_tests.txt" "$r/decode_bench.txt"
