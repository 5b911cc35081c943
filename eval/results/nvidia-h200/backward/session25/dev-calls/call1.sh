#!/usr/bin/env bash
# session 25 call 1 (issue 26): the backward's head-dim rows and the softcap / learnable rows
# on main's tree (cuTile's disk cache filled first by parallel processes, so no compile is timed)
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
python -c "import cuda.tile; print('cuda.tile ok')" || exit 3
R=/tmp/r1; W=/tmp/warm; mkdir -p $R $W; t0=$(date +%s)
git log -1 --format=%H > $R/tree.txt 2>/dev/null
for d in 80 96 160 192 256; do
  timeout 280 python eval/backward_bench.py --preset head-dims --head-dims $d --dtype bf16 \
    --backends tiled --warmup 0 --reps 1 --out $W/hd$d > $W/hd$d.log 2>&1 &
done
for v in softcap softcap-mod alibi-learnable t5-bias-learnable; do
  timeout 280 python eval/backward_bench.py --preset variants-4k --variants $v --backends tiled \
    --warmup 0 --reps 1 --out $W/$v > $W/$v.log 2>&1 &
done
# the shapes call 2 profiles (same heads, so the same kernels): D=128 both, D=64 fast mode
timeout 280 python eval/results/nvidia-h200/backward/session23/dev-calls/precompile.py 128 1 fast > $W/pc128c.log 2>&1 &
timeout 280 python eval/results/nvidia-h200/backward/session23/dev-calls/precompile.py 128 0 fast > $W/pc128n.log 2>&1 &
timeout 280 python eval/results/nvidia-h200/backward/session23/dev-calls/precompile.py 64 0 fast > $W/pc64n.log 2>&1 &
timeout 280 python eval/backward_bench.py --preset variants-4k --variants documents \
  --backends tiled --warmup 0 --reps 1 --out $W/documents > $W/documents.log 2>&1 &
wait; echo "warm $(( $(date +%s)-t0 )) s"; tail -n 2 $W/*.log > $R/warm.txt
timeout 120 python eval/backward_bench.py --preset head-dims --dtype bf16 \
  --backends tiled sdpa_cudnn sdpa_flash --warmup 2 --reps 10 --out $R/head-dims \
  > $R/head-dims.txt 2>&1; echo "rc $?" >> $R/head-dims.txt
echo "head-dims $(( $(date +%s)-t0 )) s"; tar czf $OUT/r1a.tgz -C /tmp r1
timeout 200 python eval/backward_bench.py --preset variants-4k \
  --variants softcap softcap-mod alibi-learnable t5-bias-learnable --backends tiled flex \
  --warmup 2 --reps 10 --out $R/learnable > $R/learnable.txt 2>&1; echo "rc $?" >> $R/learnable.txt
echo "total $(( $(date +%s)-t0 )) s"; tail -n 4 $R/*.txt
tar czf $OUT/r1.tgz -C /tmp r1
