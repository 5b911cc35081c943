#!/usr/bin/env bash
# session 25 call 4 (issue 27, tree: be290e3): the GPU suite's part A, the host time of a
# batch-1 decode call at 8k keys (this tree, then main's copy in .dev/old), the static cache's
# generate() (8 layers) against sdpa
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
python -c "import cuda.tile; print('cuda.tile ok')" || exit 3
R=/tmp/r4; mkdir -p $R; t0=$(date +%s)
timeout 360 python -m pytest -q -n 12 -m gpu tests/test_backward_gpu.py \
  tests/test_context_parallel_gpu.py > $R/suite-a.txt 2>&1
echo "pytest rc $? $(( $(date +%s)-t0 )) s" >> $R/suite-a.txt; tail -n 3 $R/suite-a.txt
tar czf $OUT/r4.tgz -C /tmp r4
for tree in new old; do
  script=eval/host_overhead.py; [ $tree = old ] && script=.dev/old/eval/host_overhead.py
  timeout 40 python $script --batch 1 --seq-q 1 --seq 8192 > $R/host-b1-8k-$tree.txt 2>&1
  echo "host $tree rc $? $(( $(date +%s)-t0 )) s"
done
tar czf $OUT/r4.tgz -C /tmp r4
timeout 90 python eval/generate_throughput.py --shapes llama3-8b --layers 8 \
  --batch 1 --prompt 1024 8192 --cache static --backends tiled sdpa --new-tokens 64 --reps 3 \
  --out $R/static-b1 > $R/static-b1.txt 2>&1; echo "static rc $? $(( $(date +%s)-t0 )) s"
tail -n 6 $R/*.txt; tar czf $OUT/r4.tgz -C /tmp r4
