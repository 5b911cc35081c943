#!/usr/bin/env bash
# session 23 call 2: GPU suite part A on the tree + precompile of the standard bench's variants
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
R=/tmp/r2; mkdir -p $R
( python -m pytest -q -n 12 -m gpu tests/test_backward_gpu.py tests/test_context_parallel_gpu.py -p no:cacheprovider > $R/suite_a.txt 2>&1; echo "pytest rc $?" >> $R/suite_a.txt ) &
T=$!
for spec in "64 1 fast" "64 0 fast" "64 1 det" "64 0 det" "128 1 fast" "128 0 fast"; do
  python .dev/precompile.py $spec >> $R/precompile.txt 2>&1 &
  PIDS="$PIDS $!"
done
wait $PIDS; echo "precompile done $(date)" | tee -a $R/precompile.txt
wait $T; echo "suite A done $(date)"; tail -4 $R/suite_a.txt
tar czf $OUT/r2.tgz -C /tmp r2
