#!/usr/bin/env bash
# The whole GPU suite on this tree in two parts; logs tarred into $OUT after each.
# Carry .gpu and a copy of .pending in exp/ (the decode variants: decode_sweep.py beside it).
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
r=$OUT/suite && mkdir -p "$r"
t0=$(date +%s)
timeout 330 python -m pytest -q -n 16 -m gpu tests/test_varlen_gpu.py tests/test_kernel_gpu.py \
  tests/test_variants_gpu.py tests/test_fp8_gpu.py tests/test_fp8_cache_gpu.py integration_tests \
  -p no:cacheprovider > "$r/part_a.txt" 2>&1
echo "rc $? after $(( $(date +%s) - t0 )) s" >> "$r/part_a.txt"
tar czf "$OUT/suite.tgz" -C "$OUT" suite
# decode variants compile beside part B and time once it releases the lock (decode_sweep.py)
for v in "bf16" "64 2 2 4 2 2" "64 2 2 4 2 1" "128 2 2 4 2 2"; do
  timeout $(( 585 - ($(date +%s) - t0) )) python "$(dirname "$0")/decode_sweep.py" $v > "$r/sweep_$(echo $v | tr ' ' _).txt" 2>&1 &
done
sleep 1
flock /tmp/sweep.lock timeout $(( 560 - ($(date +%s) - t0) )) python -m pytest -q -n 16 -m gpu tests/test_backward_gpu.py \
  tests/test_context_parallel_gpu.py -p no:cacheprovider > "$r/part_b.txt" 2>&1
echo "rc $? after $(( $(date +%s) - t0 )) s" >> "$r/part_b.txt"
wait
cat "$r"/sweep_*.txt | grep '^{' > "$r/sweep.jsonl"
tar czf "$OUT/suite.tgz" -C "$OUT" suite
cat "$r/sweep.jsonl"
for p in a b; do grep -E "FAILED|ERROR" "$r/part_$p.txt" | head -10; tail -2 "$r/part_$p.txt"; done
