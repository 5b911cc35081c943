#!/usr/bin/env bash
# session 24 call 3: the learnable-ALiBi training rows on the current tree
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
R=/tmp/r3; mkdir -p $R
timeout 260 python eval/train_throughput.py --bias alibi --batchings unpadded-8k --backends tiled sdpa flex_attention --reps 2 --out $R/train-alibi > $R/train-alibi.txt 2>&1; echo "rc $?" >> $R/train-alibi.txt
tail -6 $R/train-alibi.txt
tar czf $OUT/r3.tgz -C /tmp r3
