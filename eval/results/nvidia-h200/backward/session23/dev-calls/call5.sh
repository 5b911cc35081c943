#!/usr/bin/env bash
# session 23 call 5: GPU suite part A on the final tree + precompile of the masks bench
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
R=/tmp/r5; mkdir -p $R/pc
( python -m pytest -q -n 12 -m gpu tests/test_backward_gpu.py tests/test_context_parallel_gpu.py -p no:cacheprovider > $R/suite_a.txt 2>&1; echo "pytest rc $?" >> $R/suite_a.txt ) &
T=$!
for var in causal prefix-lm alibi documents sliding-window; do
  python eval/backward_bench.py --preset variants-4k --variants $var --backends tiled flex --backward-schedule edge_states=true --warmup 0 --reps 1 --out $R/pc/$var > $R/pc/$var.log 2>&1 &
done
wait $T; echo "suite A done $(date)"; tail -3 $R/suite_a.txt
wait; echo "precompile done $(date)"
rm -rf $R/pc; tar czf $OUT/r5.tgz -C /tmp r5
