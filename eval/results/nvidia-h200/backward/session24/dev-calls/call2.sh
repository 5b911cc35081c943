#!/usr/bin/env bash
# session 24 call 2: train.csv re-measure (both shapes) and generate() at batch 1 (issue 27)
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
python -c "import cuda.tile; print('cuda.tile ok')" || exit 3
R=/tmp/r2; mkdir -p $R
git log -1 --format=%H > $R/tree.txt 2>/dev/null
timeout 170 python eval/train_throughput.py --backends tiled sdpa flex_attention --reps 3 --out $R/train-llama > $R/train-llama.txt 2>&1; echo "rc $?" >> $R/train-llama.txt
tar czf $OUT/r2a.tgz -C /tmp r2
timeout 170 python eval/train_throughput.py --shape mistral-7b --backends tiled sdpa flex_attention --reps 3 --out $R/train-mistral > $R/train-mistral.txt 2>&1; echo "rc $?" >> $R/train-mistral.txt
tar czf $OUT/r2b.tgz -C /tmp r2
timeout 230 python eval/generate_throughput.py --shapes llama3-8b --points 1x1024 1x8192 8x2048 --reps 12 --new-tokens 64 --cache dynamic --backends tiled sdpa --out $R/gen > $R/gen.txt 2>&1; echo "rc $?" >> $R/gen.txt
tail -5 $R/*.txt
tar czf $OUT/r2.tgz -C /tmp r2
