#!/usr/bin/env bash
# session 25 call 2 (issue 26): Nsight Compute of the backward on main's tree beside cuDNN's
# (D=128 B=4 S=4k causal and not; D=64 B=16 S=1k not causal, the fast mode) and Flex's (documents)
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
python -c "import cuda.tile; print('cuda.tile ok')" || exit 3
R=/tmp/r2; mkdir -p $R; t0=$(date +%s)
run() { name=$1; shift
  timeout 170 python eval/ncu_profile.py --backward "$@" --out $R/$name > $R/$name.log 2>&1
  echo "$name rc $? $(( $(date +%s)-t0 )) s"; tar czf $OUT/r2.tgz -C /tmp r2; }
run d128-causal --causal --backends tiled sdpa_cudnn
run documents --variant documents --backends tiled flex
run d64-s1k --batch 16 --seq 1024 --heads 32/32 --head-dim 64 --backends tiled sdpa_cudnn
run d128-noncausal --backends tiled sdpa_cudnn
