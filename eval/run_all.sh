#!/usr/bin/env bash
# The main job: install, then run the evals with their defaults, writing
# eval/results/<gpu>/. Without a CUDA GPU each script says so and runs small sizes through the
# CPU reference path. SKIP_INSTALL=1 uses the current Python environment as it is (offline hosts).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${SKIP_INSTALL:-}" ]; then
  bash .ci/install.sh
  . .venv/bin/activate
elif ! python -c "import torch, transformers, hf_tiled_attention" 2>/dev/null; then
  echo "run_all: SKIP_INSTALL=1 runs the current Python ($(command -v python || echo none))," \
    "which cannot import torch, transformers and hf_tiled_attention: activate the project's" \
    "environment first (. .venv/bin/activate, made by bash .ci/install.sh), or run without" \
    "SKIP_INSTALL to install it" >&2
  exit 1
fi
# Public-domain texts (Canterbury corpus, shipped in brotli's source archive), unless staged.
texts=eval/data
if [ -d /tmp/stage/text ]; then texts=/tmp/stage/text; fi
if [ ! -f "$texts/alice29.txt" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python -m pip download -q --no-deps --no-binary :all: -d "$tmp" brotli==1.2.1
  tar xzf "$tmp"/brotli-1.2.1.tar.gz -C "$tmp"
  mkdir -p "$texts"
  for t in alice29 lcet10; do tr -d '\r' < "$tmp/brotli-1.2.1/tests/testdata/$t.txt" > "$texts/$t.txt"; done
fi
gpu=$(python -c "import torch; print(int(torch.cuda.is_available()))")
# On a CPU the "tiled" rows are the reference path, and in bf16/fp16 a 2k-token parity check
# against CPU sdpa compares two rounding schemes (eager and sdpa differ by ~7e-4 there): fp32
# is the meaningful check.
if [ "$gpu" = 1 ]; then ppl_args=(); else ppl_args=(--max-tokens 2048 --windows 256 512 --dtypes fp32); fi
# Every eval runs even if one fails; the job fails at the end if any did.
failed=()
python eval/kernel_bench.py || failed+=(kernel_bench)
python eval/perplexity.py --text-file "$texts/alice29.txt" "$texts/lcet10.txt" "${ppl_args[@]}" \
  || failed+=(perplexity)
python eval/prefill_throughput.py || failed+=(prefill_throughput)
python eval/generate_throughput.py || failed+=(generate_throughput)
python eval/variants_bench.py || failed+=(variants_bench)
python eval/backward_bench.py || failed+=(backward_bench)
python eval/train_throughput.py || failed+=(train_throughput)
python eval/finetune_parity.py --text-file "$texts/alice29.txt" || failed+=(finetune_parity)
python eval/context_parallel_balance.py || failed+=(context_parallel_balance)
python eval/serve_throughput.py || failed+=(serve_throughput)
python eval/paged_decode_bench.py || failed+=(paged_decode_bench)
python eval/fp8_cache_decode_bench.py || failed+=(fp8_cache_decode_bench)
python eval/fp8_numerics.py || failed+=(fp8_numerics)
# Context parallelism over the host's GPUs; without two, a smoke run on 2 CPU processes (gloo).
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  python -m torch.distributed.run --nproc-per-node "$gpus" eval/context_parallel_throughput.py \
    || failed+=(context_parallel_throughput)
else
  CUDA_VISIBLE_DEVICES="" python -m torch.distributed.run --nproc-per-node 2 \
    eval/context_parallel_throughput.py || failed+=(context_parallel_throughput)
fi
if [ ${#failed[@]} -gt 0 ]; then echo "run_all: failed: ${failed[*]}" >&2; exit 1; fi
echo "run_all: all evals done; results in eval/results/"
