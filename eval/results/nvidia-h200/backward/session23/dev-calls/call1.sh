#!/usr/bin/env bash
# dev call 1 (session 23): dQ^T form of dq_add, exploration timings + its GPU test
nvidia-smi -L
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
R=/tmp/r1; mkdir -p $R
( python -m pytest -q -n 4 -m gpu tests/test_backward_gpu.py -k "dq_added" -p no:cacheprovider > $R/tests.txt 2>&1; echo "pytest rc $?" >> $R/tests.txt ) &
T=$!
for spec in "128 det 1" "128 det 0" "128 add 1" "128 add 0" "128 add128x64 1" "128 add128x64 0" "128 add64x64 1" "128 add64x64 0" "64 det 1" "64 det 0" "64 add 1" "64 add 0" "64 add128x64 1" "64 add128x64 0" "64 add128x32 1" "64 add128x32 0" "256 det 1" "256 add 1"; do
  python .dev/dq_explore.py compile $spec >> $R/compile.txt 2>&1 &
  PIDS="$PIDS $!"
  while [ $(jobs -r | wc -l) -ge 12 ]; do sleep 1; done
done
wait $PIDS
echo "compiles done $(date)"
wait $T
echo "tests done $(date)"; tail -3 $R/tests.txt
python .dev/dq_explore.py time $R/explore.json 2>&1 | tee $R/explore.txt
tar czf $OUT/r1.tgz -C /tmp r1
