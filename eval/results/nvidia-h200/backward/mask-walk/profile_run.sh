# Dev: where the backward's time goes per variant (tiled vs flex), then ncu of documents/window.
export PYTHONUNBUFFERED=1
V="builtin-causal causal documents sliding-window prefix-lm"
S2="kv_keys=64,kv_queries=64,q_rows=64,q_keys=64"
t0=$(date +%s)
for v in $V; do timeout 200 python .dev/bwd_kernels.py $v --warm-only > /dev/null 2>&1 & done
timeout 200 python .dev/bwd_kernels.py documents --warm-only --backends tiled --schedule $S2 > /dev/null 2>&1 &
timeout 200 python .dev/bwd_kernels.py causal --warm-only --backends tiled --schedule $S2 > /dev/null 2>&1 &
wait; echo "warm $(( $(date +%s)-t0 )) s"
for v in $V; do timeout 120 python .dev/bwd_kernels.py $v 2>&1 | grep -v Warn; done | tee $OUT/kernels.txt
for v in documents causal; do timeout 60 python .dev/bwd_kernels.py $v --backends tiled --schedule $S2 2>&1 | grep -v Warn; done | tee -a $OUT/kernels.txt
echo "timed $(( $(date +%s)-t0 )) s"
for v in documents sliding-window; do
  timeout 150 python eval/ncu_profile.py --backward --variant $v --backends tiled flex --out $OUT/ncu-$v > $OUT/ncu-$v.log 2>&1; echo "ncu $v rc $?"
done
cd $OUT && tar czf ncu.tgz ncu-* && rm -rf ncu-documents ncu-sliding-window
echo "total $(( $(date +%s)-t0 )) s"
