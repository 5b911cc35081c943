#!/usr/bin/env bash
# One part of the whole GPU suite on this tree, `bash exp/suite-call.sh a` then `... b` in two
# calls chained on the warm host (carry .gpu and a copy of .pending in exp/). Session 35: one
# call with both parts and the decode sweep ran out of its 600 s on a slow fresh host.
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
part=${1:?say a or b}
files="tests/test_varlen_gpu.py tests/test_kernel_gpu.py tests/test_variants_gpu.py tests/test_fp8_gpu.py tests/test_fp8_cache_gpu.py integration_tests"
[ "$part" = b ] && files="tests/test_backward_gpu.py tests/test_context_parallel_gpu.py"
mkdir -p "$OUT/suite"
t0=$(date +%s)
timeout 570 python -m pytest -q -n 16 -m gpu $files -p no:cacheprovider > "$OUT/suite/part_$part.txt" 2>&1
echo "rc $? after $(( $(date +%s) - t0 )) s" >> "$OUT/suite/part_$part.txt"
grep -E "^(FAILED|ERROR)" "$OUT/suite/part_$part.txt" | head -20
tail -2 "$OUT/suite/part_$part.txt"
