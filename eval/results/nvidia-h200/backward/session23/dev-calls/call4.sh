#!/usr/bin/env bash
# session 23 call 4 (exploration, no code change): the mask walk's edge states and dq_add
# under documents and a sliding window against FlexAttention, B=4, S=4k, 32/8, D=128, bf16
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
R=/tmp/r4; mkdir -p $R/pc
A="--backward-schedule edge_states=false"
B="--backward-schedule kv_queries=64 --backward-schedule dq_add=true"
for var in documents sliding-window; do
  python eval/backward_bench.py --preset variants-4k --variants $var --backends tiled flex --warmup 0 --reps 1 --out $R/pc/t-$var > $R/pc/t-$var.log 2>&1 &
  PIDS="$PIDS $!"
  python eval/backward_bench.py --preset variants-4k --variants $var --backends tiled $A --warmup 0 --reps 1 --out $R/pc/a-$var > $R/pc/a-$var.log 2>&1 &
  PIDS="$PIDS $!"
  python eval/backward_bench.py --preset variants-4k --variants $var --backends tiled $B --warmup 0 --reps 1 --out $R/pc/b-$var > $R/pc/b-$var.log 2>&1 &
  PIDS="$PIDS $!"
done
wait $PIDS; echo "precompile done $(date)"
V="--preset variants-4k --variants documents sliding-window --backends tiled flex --warmup 3 --reps 20"
timeout 200 python eval/backward_bench.py $V $A --out $R/edge-states > $R/edge-states.log 2>&1
echo "bench A rc $? $(date)"; tail -4 $R/edge-states.log
timeout 200 python eval/backward_bench.py $V $B --out $R/dq-add > $R/dq-add.log 2>&1
echo "bench B rc $? $(date)"; tail -4 $R/dq-add.log
rm -rf $R/pc; tar czf $OUT/r4.tgz -C /tmp r4
