#!/usr/bin/env bash
# session 23 call 6: GPU suite part B on the final tree, then the masks bench (no code change)
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
R=/tmp/r6; mkdir -p $R
python -m pytest -q -n 14 -m gpu tests/test_kernel_gpu.py tests/test_variants_gpu.py integration_tests -p no:cacheprovider > $R/suite_b.txt 2>&1; echo "pytest rc $?" >> $R/suite_b.txt
echo "suite B done $(date)"; tail -3 $R/suite_b.txt
timeout 170 python eval/backward_bench.py --preset variants-4k --variants causal prefix-lm alibi documents sliding-window --backends tiled flex --backward-schedule edge_states=true --warmup 2 --reps 10 --out $R/masks > $R/masks.log 2>&1
echo "bench rc $? $(date)"; tail -4 $R/masks.log
tar czf $OUT/r6.tgz -C /tmp r6
