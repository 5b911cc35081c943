"""Where a decode step of `generate()` spends its time, `tiled` against `sdpa`, by
torch.profiler.

    python eval/profile_decode_step.py                       # Llama-3-8B shape, 32 layers
    python eval/profile_decode_step.py --batch 8 --prompt 8192 --steps 32

For each (batch, prompt) and backend, greedy `generate()` (dynamic cache) is run for
``--steps + 1`` new tokens and for 1 (the prefill); their difference divided by ``--steps`` is
one decode step. Per step:

* ``step_ms``: wall time, the median over ``--reps`` unprofiled runs of a run less the smaller
  of its own prefill and the median prefill (``generate_throughput.decode_seconds``);
* ``gpu_busy_ms``: the sum of all GPU kernel times; ``attention_gpu_ms``: the attention kernels'
  share (ours: the attention kernel, which merges key splits itself; sdpa's: its fused kernels);
  ``other_gpu_ms``: every other kernel (matmuls, norms, RoPE, cache appends);
* ``gpu_idle_ms``: wall minus busy, time the GPU waits on the host;
* ``kernels``: kernel launches per step;
* ``host_attention_ms``, ``host_mask_ms``: host time inside the attention function (all layers)
  and inside the mask builder (once per forward), from profiler ranges around them.

decode_step_kernels.txt lists each backend's top kernels and top host ops (self time) per step.
Results: eval/results/<gpu>/generate/decode_step_profile.csv, decode_step_kernels.txt,
environment.json. Without a GPU a tiny model runs on the CPU (host times only; numbers say
nothing about GPU speed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention  # noqa: E402,F401  (registers attn_implementation="tiled")
from eval.common import ResultsWriter, progress, output_dir  # noqa: E402
from eval.generate_throughput import decode_seconds, timed_generate  # noqa: E402
from eval.models import SHAPES, build_config, build_models, model_device  # noqa: E402
from eval.profiling import (add_profile, finish_profile, profiled,  # noqa: E402
                            step_fields)

COLUMNS = ["model", "layers", "backend", "batch", "prompt", "steps", "step_ms", "gpu_busy_ms",
           "attention_gpu_ms", "other_gpu_ms", "gpu_idle_ms", "kernels", "host_attention_ms",
           "host_mask_ms"]
def difference(full: dict, first: dict, steps: int) -> dict:
    return {name: (full.get(name, 0.0) - first.get(name, 0.0)) / steps
            for name in set(full) | set(first)}


@torch.inference_mode()
def profile_decode(model, ids, steps: int, reps: int, on_gpu: bool) -> tuple[dict, dict, dict]:
    """A decode step of generate(): the difference between generating ``steps + 1`` tokens and
    one (the prefill), per step. Returns (the row's timing fields, GPU us per kernel, host
    self-time us per op)."""
    full = lambda: timed_generate(model, ids, steps + 1, "dynamic")  # noqa: E731
    first = lambda: timed_generate(model, ids, 1, "dynamic")  # noqa: E731
    full()  # warm-up
    # Taking turns: a load change on the host during the timed runs hits a run and its
    # prefill alike.
    runs = [(full(), first()) for _ in range(reps)]
    median_first = statistics.median(p for _, p in runs)
    step_ms = statistics.median(decode_seconds(f, p, median_first)
                                for f, p in runs) / steps * 1e3
    if step_ms <= 0:
        raise RuntimeError(f"profile_decode_step: {steps + 1}-token runs took no longer than "
                           "their prefill; raise --steps")
    kernels_full, host_full, launches_full, ranges_full = profiled(full, model, on_gpu)
    kernels_first, host_first, launches_first, ranges_first = profiled(first, model, on_gpu)
    kernels = difference(kernels_full, kernels_first, steps)
    host = difference(host_full, host_first, steps)
    ranges = {name: us for name, us in difference(ranges_full, ranges_first, steps).items()
              if name in ranges_full}
    fields = step_fields(step_ms, ranges, kernels, (launches_full - launches_first) / steps,
                         step_ms, on_gpu)
    return fields, kernels, host


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None, choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the config-built model (default: 32; 2 on a CPU)")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, nargs="+", default=None, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    parser.add_argument("--reps", type=int, default=3, help="timed runs (median)")
    parser.add_argument("--backends", nargs="+", default=["tiled", "sdpa"],
                        choices=["tiled", "sdpa", "eager"])
    parser.add_argument("--top", type=int, default=8, help="kernels listed per backend")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 1 or min(args.batch or [1]) < 1 or min(args.prompt or [1]) < 1:
        raise SystemExit("--steps, --batch and --prompt take positive numbers")
    on_gpu, device, dtype = model_device("profile_decode_step")
    shape = args.shape or ("llama3-8b" if on_gpu else "tiny-llama")
    layers = args.layers or (32 if on_gpu else 2)
    batches = args.batch or ([1, 8] if on_gpu else [1, 2])
    prompts = args.prompt or ([1024, 8192] if on_gpu else [32])
    warnings.simplefilter("ignore")
    out_dir = output_dir(args.out, "generate")
    results = ResultsWriter(out_dir, "decode_step_profile", COLUMNS, argv)
    config = build_config(shape, layers)
    models = build_models(args.backends, config, dtype, device)
    listing = []
    for batch, prompt in progress([(b, p) for b in batches for p in prompts], desc="profile"):
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(3, config.vocab_size, (batch, prompt), generator=gen).to(device)
        for backend, model in models.items():
            fields, per_kernel, per_op = profile_decode(model, ids, args.steps, args.reps,
                                                        on_gpu)
            add_profile(results, dict(model=shape, layers=layers, backend=backend, batch=batch,
                                      prompt=prompt, steps=args.steps),
                        fields, per_kernel, per_op, f"{backend} batch {batch} prompt {prompt}",
                        listing, args.top)
    finish_profile(results, listing, out_dir / "decode_step_kernels.txt", dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
