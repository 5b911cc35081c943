#!/usr/bin/env bash
# dev call 1: tests of the new backward paths + exploration timings
set -x
nvidia-smi -L
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
python -c "import hf_tiled_attention as h; print(h.__file__)"
( python -m pytest -q -n 10 -m gpu tests/test_backward_gpu.py -k "mask_gradients_on_the_kernels or deterministic or torch_deterministic or long_sequences or fp32_gradients or (test_gradients_match_definition and bf16)" -p no:cacheprovider > $OUT/tests.txt 2>&1; echo "pytest rc $?" >> $OUT/tests.txt ) &
T=$!
for spec in "128 det 1" "128 det 0" "128 add64x64 1" "128 add64x64 0" "128 add128x16 1" "128 add128x16 0" "128 add64x32 1" "128 add64x32 0" "64 det 1" "64 det 0" "64 add64x64 1" "64 add64x64 0" "64 add128x64 1" "64 add128x64 0" "256 det 1" "256 add64x64 1"; do
  python .dev/bwd_explore.py compile $spec >> $OUT/compile.txt 2>&1 &
  while [ $(jobs -r | wc -l) -ge 8 ]; do sleep 1; done
done
wait $(jobs -p | grep -v "^$T$") 2>/dev/null
echo "compiles done $(date)"
wait $T
echo "tests done $(date)"; tail -5 $OUT/tests.txt
python .dev/bwd_explore.py time $OUT/explore.json 2>&1 | tee $OUT/explore.txt
