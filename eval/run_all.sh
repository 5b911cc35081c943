#!/usr/bin/env bash
# The main job: install, then run the evals with their defaults. On a machine without a CUDA GPU
# the scripts say so and run only what makes sense on the CPU reference path.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m venv .venv && . .venv/bin/activate
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[eval]"
fi
python eval/kernel_bench.py "$@"
