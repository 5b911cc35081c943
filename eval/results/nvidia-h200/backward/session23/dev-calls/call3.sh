#!/usr/bin/env bash
# session 23 call 3: the standard bf16 backward sweep, both modes, then GPU suite part B
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
R=/tmp/r3; mkdir -p $R
nvidia-smi -L > $R/gpu.txt
timeout 330 python eval/backward_bench.py --preset standard --dtype bf16 --backward-schedule dq_add=false --warmup 2 --reps 10 --out $R/standard > $R/standard.log 2>&1
echo "bench rc $? $(date)"; tail -12 $R/standard.log
python -m pytest -q -n 12 -m gpu tests/test_kernel_gpu.py tests/test_variants_gpu.py integration_tests -p no:cacheprovider > $R/suite_b.txt 2>&1; echo "pytest rc $?" >> $R/suite_b.txt
tail -4 $R/suite_b.txt
tar czf $OUT/r3.tgz -C /tmp r3
