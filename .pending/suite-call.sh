#!/usr/bin/env bash
# One part of the whole GPU suite on this tree: `bash exp/suite-call.sh a`, then `b` (or `b1`
# and `b2` apart), chained on the warm host (carry .gpu and exp, a copy of .pending). `b` runs
# b1 and b2 in one call; `SUITE_TIMEOUT` (s, default 570) bounds pytest. Parts b1 and b2 are
# the backward and context-parallel tests in two halves by node id (exp/part_b1.ids,
# part_b2.ids; regenerate them if those tests change), so a slow fresh host fits each in one
# call. Session 36 (H100): a 328 s, b1 200 s, b2 107 s; session 37 (H100): a 476 s and b1
# 240 s each on a fresh host, b2 116 s.
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
part=${1:?say a, b, b1 or b2}
case $part in
  a) args="tests/test_varlen_gpu.py tests/test_kernel_gpu.py tests/test_variants_gpu.py tests/test_fp8_gpu.py tests/test_fp8_cache_gpu.py tests/test_value_head_dim.py integration_tests" ;;
  b1|b2) args=$(cat exp/part_$part.ids) ;;
  b) args=$(cat exp/part_b1.ids exp/part_b2.ids) ;;
  *) echo "part: expected a, b, b1 or b2, got $part"; exit 2 ;;
esac
mkdir -p "$OUT/suite"
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/suite/part_$part.txt"
t0=$(date +%s)
timeout ${SUITE_TIMEOUT:-570} python -m pytest -q -n 16 -m gpu $args -p no:cacheprovider >> "$OUT/suite/part_$part.txt" 2>&1
echo "rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/suite/part_$part.txt"
grep -E "^(FAILED|ERROR)" "$OUT/suite/part_$part.txt" | head -20
tail -3 "$OUT/suite/part_$part.txt"
