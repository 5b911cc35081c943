#!/usr/bin/env bash
# dev call 1 (session 24): dq_add as dS K at 64-row steps; old form from .dev/old
nvidia-smi -L
python -c "import cuda.tile; print('cuda.tile ok')" || exit 3
export PYTHONUNBUFFERED=1
R=/tmp/r1; mkdir -p $R
( PYTHONPATH=$PWD:$PYTHONPATH python -m pytest -q -n 4 -m gpu tests/test_backward_gpu.py -k "dq_added" -p no:cacheprovider > $R/tests.txt 2>&1; echo "pytest rc $?" >> $R/tests.txt ) &
T=$!
PIDS=""
for tree in new old; do
  [ $tree = old ] && SPECS="64 det 1|64 det 0|64 add 1|64 add 0" || SPECS="128 det 1|128 det 0|128 det128x64 1|128 det128x64 0|128 add128x64 1|128 add128x64 0|64 det 1|64 det 0|64 add 1|64 add 0"
  if [ $tree = new ]; then PP=$PWD:$PYTHONPATH; else PP=$PWD/.dev/old:$PWD:$PYTHONPATH; fi
  IFS='|' read -ra ARR <<< "$SPECS"
  for spec in "${ARR[@]}"; do
    PYTHONPATH=$PP python .dev/dsk_explore.py compile $spec >> $R/compile-$tree.txt 2>&1 &
    PIDS="$PIDS $!"
    while [ $(jobs -r | wc -l) -ge 13 ]; do sleep 1; done
  done
done
wait $PIDS; tar czf $OUT/r1-compile.tgz -C /tmp r1
echo "compiles done $(date)"; grep -c compiled $R/compile-*.txt
wait $T
echo "tests done $(date)"; tail -3 $R/tests.txt
timeout 150 env PYTHONPATH=$PWD:$PYTHONPATH python .dev/dsk_explore.py time $R/new.json > $R/new.txt 2>&1
PYTHONPATH=$PWD/.dev/old:$PWD:$PYTHONPATH python .dev/which.py >> $R/old.txt
timeout 100 env PYTHONPATH=$PWD/.dev/old:$PWD:$PYTHONPATH python .dev/dsk_explore.py time $R/old.json >> $R/old.txt 2>&1
cat $R/new.txt $R/old.txt
tar czf $OUT/r1.tgz -C /tmp r1
