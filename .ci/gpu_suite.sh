#!/usr/bin/env bash
# The GPU suite in parts that each fit one call of the lent GPU (10 minutes a call):
#   bash .ci/gpu_suite.sh a     # varlen, kernel, variants, FP8, FP8 cache, value head dims,
#                               # integration_tests (2.5 min warm; a cold host compiles > 9)
#   bash .ci/gpu_suite.sh b     # backward and context parallelism (4.4 min)
# Chain the calls on one warm host (it keeps compiled kernels between them). Each part's log
# goes to $LOG_DIR (default: $OUT/gpu-suite on the lent machine, else gpu-suite-logs/) as
# part_<p>.txt, the GPU's name first and pytest's exit status and time last; SUITE_TIMEOUT
# (s, default 570) bounds pytest so the log comes back before the call's limit.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=.:${PYTHONPATH:-}
part=${1:?say a or b}
case $part in
  a) files="tests/test_varlen_gpu.py tests/test_kernel_gpu.py tests/test_variants_gpu.py
            tests/test_fp8_gpu.py tests/test_fp8_cache_gpu.py tests/test_value_head_dim.py
            integration_tests" ;;
  b) files="tests/test_backward_gpu.py tests/test_context_parallel_gpu.py" ;;
  *) echo "gpu_suite: the part is a or b, got '$part'" >&2; exit 2 ;;
esac
log_dir=${LOG_DIR:-${OUT:+$OUT/gpu-suite}}
log_dir=${log_dir:-gpu-suite-logs}
mkdir -p "$log_dir"
log=$log_dir/part_$part.txt
nvidia-smi --query-gpu=name --format=csv,noheader > "$log" 2>&1
start=$(date +%s)
# shellcheck disable=SC2086  (the file list splits into arguments)
timeout "${SUITE_TIMEOUT:-570}" python -m pytest -q -n 16 -m gpu $files -p no:cacheprovider \
  >> "$log" 2>&1
status=$?
echo "rc $status after $(( $(date +%s) - start )) s" >> "$log"
grep -E "^(FAILED|ERROR)" "$log" | head -20
tail -3 "$log"
exit $status
