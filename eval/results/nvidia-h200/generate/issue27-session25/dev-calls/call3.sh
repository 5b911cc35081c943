#!/usr/bin/env bash
# session 25 call 3 (issue 27, tree: be290e3, branch decode-one-launch): the GPU suite's part B,
# then generate() with the dynamic cache, tiled and sdpa in turns
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
python -c "import cuda.tile; print('cuda.tile ok')" || exit 3
R=/tmp/r3; mkdir -p $R; t0=$(date +%s)
timeout 330 python -m pytest -q -n 14 -m gpu tests/test_kernel_gpu.py \
  tests/test_variants_gpu.py integration_tests > $R/suite-b.txt 2>&1
echo "pytest rc $? $(( $(date +%s)-t0 )) s" >> $R/suite-b.txt; tail -n 3 $R/suite-b.txt
tar czf $OUT/r3.tgz -C /tmp r3
timeout 170 python eval/generate_throughput.py --shapes llama3-8b \
  --points 1x1024 1x8192 8x2048 --reps 10 --new-tokens 64 --cache dynamic \
  --backends tiled sdpa --out $R/gen > $R/gen.txt 2>&1; echo "gen rc $? $(( $(date +%s)-t0 )) s"
tail -n 8 $R/gen.txt; tar czf $OUT/r3.tgz -C /tmp r3
