"""Where a training step's time goes, `tiled` against other backends, by torch.profiler.

    python eval/profile_train_step.py                 # packed-16k, Llama-3-8B shape, 8 layers
    python eval/profile_train_step.py --shape mistral-7b --batchings packed-16k unpadded-16k

The model, batches and step are train_throughput.py's (forward, backward, AdamW). For each
batching and backend: one warm-up step, ``--reps`` timed steps (their median is ``step_ms``),
then one profiled step:

* ``gpu_busy_ms``: the sum of all kernel times; ``attention_gpu_ms``: the attention kernels'
  share (ours: forward, Delta, dK/dV and dQ; sdpa's fused kernels; FlexAttention's compiled
  ones, by name: see profiling.ATTENTION_KERNELS); ``other_gpu_ms``: every other kernel;
* ``gpu_idle_ms``: the profiled step's wall time minus busy;
* ``kernels``: kernel launches in the step;
* ``host_attention_ms``, ``host_mask_ms``: host time inside the attention functions (the
  forward's layers) and inside the mask builders (block tables are built there or in the
  first layer's attention call).

train_step_kernels.txt lists each backend's top kernels and host ops (self time).
Results: eval/results/<gpu>/train/train_step_profile.csv, train_step_kernels.txt,
environment.json. Without a GPU a tiny model runs on the CPU (host times only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention  # noqa: E402,F401  (registers attn_implementation="tiled")
from eval.common import ResultsWriter, output_dir  # noqa: E402
from eval.models import SHAPES, model_device  # noqa: E402
from eval.profiling import (add_profile, finish_profile, profiled,  # noqa: E402
                            step_fields)
from eval.train_throughput import (BACKENDS, BATCHINGS, LONG_BATCHINGS,  # noqa: E402
                                   make_batch, step, training_model)

COLUMNS = ["model", "layers", "backend", "batching", "step_ms", "gpu_busy_ms",
           "attention_gpu_ms", "other_gpu_ms", "gpu_idle_ms", "kernels", "host_attention_ms",
           "host_mask_ms"]


def profile_step(model, optimizer, batch: dict, reps: int, on_gpu: bool) -> tuple:
    """(the row's fields, GPU us per kernel, host self-time us per op) of one backend."""
    step(model, optimizer, batch, on_gpu)  # warm-up (compiles)
    step_ms = statistics.median(step(model, optimizer, batch, on_gpu)[0] for _ in range(reps))
    started = time.perf_counter()
    kernels, host, launches, ranges = profiled(lambda: step(model, optimizer, batch, on_gpu),
                                               model, on_gpu)
    wall_ms = (time.perf_counter() - started) * 1e3
    return step_fields(step_ms, ranges, kernels, launches, wall_ms, on_gpu), kernels, host


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None, choices=list(SHAPES),
                        help="default: llama3-8b on a GPU, tiny-llama on a CPU")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batchings", nargs="+", default=["packed-16k"],
                        choices=BATCHINGS + LONG_BATCHINGS)
    parser.add_argument("--backends", nargs="+", default=None,
                        choices=[b for b in BACKENDS if b != "eager"],
                        help="default: tiled and flex_attention on a GPU, tiled and sdpa on a "
                        "CPU")
    parser.add_argument("--reps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--top", type=int, default=12, help="kernels and ops listed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.layers < 1 or args.reps < 1:
        raise SystemExit("--layers and --reps take positive numbers")
    on_gpu, device, dtype = model_device("profile_train_step")
    shape = args.shape or ("llama3-8b" if on_gpu else "tiny-llama")
    backends = args.backends or (["tiled", "flex_attention"] if on_gpu else ["tiled", "sdpa"])
    scale = 1 if on_gpu else 64
    warnings.simplefilter("ignore")
    out_dir = output_dir(args.out, "train")
    results = ResultsWriter(out_dir, "train_step_profile", COLUMNS, argv)

    config, model = training_model(shape, args.layers, device, dtype, backends[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    listing = []
    for batching in args.batchings:
        batch = {k: v.to(device) for k, v in make_batch(batching, config.vocab_size, device,
                                                        scale).items()}
        for backend in backends:
            model.set_attn_implementation(backend)
            fields, per_kernel, per_op = profile_step(model, optimizer, batch, args.reps,
                                                      on_gpu)
            add_profile(results, dict(model=shape, layers=args.layers, backend=backend,
                                      batching=batching),
                        fields, per_kernel, per_op, f"{backend} {batching}", listing, args.top)
    finish_profile(results, listing, out_dir / "train_step_kernels.txt", dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
