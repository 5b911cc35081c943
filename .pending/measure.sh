#!/usr/bin/env bash
# Measurements on the final tree (carry .gpu and exp): `bash exp/measure.sh decode` (the FP8
# cache decode bench, default points) or `bash exp/measure.sh backward` (issue 47 item 4: the
# standard fp16 rows and the right-padded rows of backward/kernel_sweep.csv).
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
what=${1:?say decode or backward}
mkdir -p $OUT/m
nvidia-smi --query-gpu=name --format=csv,noheader
case $what in
  decode) timeout 230 python eval/fp8_cache_decode_bench.py --out $OUT/m/decode > $OUT/m/decode.txt 2>&1; echo "decode rc $?"; tail -25 $OUT/m/decode.txt ;;
  backward)
    timeout 330 python eval/backward_bench.py --preset standard --dtype fp16 --out $OUT/m/fp16 > $OUT/m/fp16.txt 2>&1; echo "fp16 rc $?"; tail -8 $OUT/m/fp16.txt
    timeout 200 python eval/backward_bench.py --preset padded --dtype bf16 --out $OUT/m/padded > $OUT/m/padded.txt 2>&1; echo "padded rc $?"; tail -8 $OUT/m/padded.txt ;;
esac
(cd $OUT && tar -czf m-$what.tgz m && rm -rf m)
