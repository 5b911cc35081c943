# Dev: the mask-walk knobs (correctness + backward kernel times per variant), then generate (issue 27).
export PYTHONUNBUFFERED=1
t0=$(date +%s)
V="causal documents sliding-window prefix-lm"
SCHEDS="edge_states=False,table_order=True edge_states=True,table_order=False edge_states=True,table_order=True edge_states=False,table_order=False"
timeout 260 python -m pytest -q -n 8 -m gpu tests/test_backward_gpu.py -k "mask_walk or mask_mods_train" -p no:cacheprovider > $OUT/tests.txt 2>&1 &
TP=$!
for v in $V; do for s in $SCHEDS; do
  timeout 200 python .dev/bwd_kernels.py $v --warm-only --backends tiled --schedule $s > /dev/null 2>&1 &
done; done
wait $TP; echo "tests rc $?"; tail -4 $OUT/tests.txt
wait; echo "warm $(( $(date +%s)-t0 )) s"
for v in $V; do for s in $SCHEDS; do timeout 60 python .dev/bwd_kernels.py $v --backends tiled --schedule $s 2>&1 | grep -v -i warn; done; done | tee $OUT/kernels.txt
echo "timed $(( $(date +%s)-t0 )) s"
timeout 240 python eval/generate_throughput.py --shapes llama3-8b --points 1x1024 1x8192 8x2048 --cache dynamic --backends tiled sdpa --new-tokens 64 --reps 5 --out $OUT/generate > $OUT/generate.log 2>&1; echo "generate rc $?"
grep -v -i warn $OUT/generate.log | tail -12
echo "total $(( $(date +%s)-t0 )) s"
