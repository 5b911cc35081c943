#!/usr/bin/env bash
# session 25 call 6: host time of a batch-1 decode call at 8k keys, be290e3 (new) against main's
# copy in .dev/old (old), alternating new/old/new/old on one host
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
python -c "import cuda.tile; print('cuda.tile ok')" || exit 3
R=/tmp/r6; mkdir -p $R
for round in 1 2; do for tree in new old; do
  script=eval/host_overhead.py; [ $tree = old ] && script=.dev/old/eval/host_overhead.py
  timeout 40 python $script --batch 1 --seq-q 1 --seq 8192 > $R/host-b1-8k-$tree-$round.txt 2>&1
  echo "$tree $round rc $?"; grep -E "model's layers|bare|transformers sdpa|torch.empty" $R/host-b1-8k-$tree-$round.txt
done; done
tar czf $OUT/r6.tgz -C /tmp r6
