"""Where a decode step of `generate()` spends its time, `tiled` against `sdpa`, by
torch.profiler.

    python eval/profile_decode_step.py                       # Llama-3-8B shape, 32 layers
    python eval/profile_decode_step.py --batch 8 --prompt 8192 --steps 32

For each (batch, prompt) and backend, greedy `generate()` (dynamic cache) is run for
``--steps + 1`` new tokens and for 1 (the prefill); their difference divided by ``--steps`` is
one decode step. Per step:

* ``step_ms``: wall time (medians of ``--reps`` unprofiled runs);
* ``gpu_busy_ms``: the sum of all GPU kernel times; ``attention_gpu_ms``: the attention kernels'
  share (ours: the attention kernel and the split merge; sdpa's: its fused kernels);
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
import contextlib
import functools
import statistics
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention  # noqa: E402,F401  (registers attn_implementation="tiled")
from eval.common import ResultsWriter, progress, results_dir  # noqa: E402
from eval.generate_throughput import timed_generate  # noqa: E402
from eval.models import SHAPES, build_config, build_models, model_device  # noqa: E402

COLUMNS = ["model", "layers", "backend", "batch", "prompt", "steps", "step_ms", "gpu_busy_ms",
           "attention_gpu_ms", "other_gpu_ms", "gpu_idle_ms", "kernels", "host_attention_ms",
           "host_mask_ms"]
# Host-time ranges the profiled runs add around the attention functions and the mask builder.
ATTENTION_RANGE, MASK_RANGE = "decode_profile::attention", "decode_profile::mask"
# Kernel names that are attention: our two cuTile kernels and sdpa's backends.
ATTENTION_KERNELS = ("attention_forward", "merge_splits", "flash", "fmha", "cudnn",
                     "efficient_attention", "sdpa")


def is_attention_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in ATTENTION_KERNELS)


@contextlib.contextmanager
def ranges_around_attention(model):
    """Wraps the model's attention function and its mask builder in profiler ranges (their
    inclusive host time), for the profiled runs only."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    def in_range(name, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return wrapped

    backend = model.config._attn_implementation
    saved_attention = ALL_ATTENTION_FUNCTIONS.get(backend)
    saved_mask = modeling_llama.create_causal_mask
    if saved_attention is not None:  # eager is the module's own function, not in the registry
        ALL_ATTENTION_FUNCTIONS._global_mapping[backend] = in_range(ATTENTION_RANGE,
                                                                    saved_attention)
    modeling_llama.create_causal_mask = in_range(MASK_RANGE, saved_mask)
    try:
        yield
    finally:
        if saved_attention is not None:
            ALL_ATTENTION_FUNCTIONS._global_mapping[backend] = saved_attention
        modeling_llama.create_causal_mask = saved_mask


def tally(events) -> tuple[dict, dict, int, dict]:
    """A profile's events as (GPU us per kernel name, host self-time us per op name, kernel
    launches, inclusive host us of the attention and mask ranges)."""
    kernels, host = defaultdict(float), defaultdict(float)
    launches = 0
    ranges = {}  # a range that never ran stays absent: its column is left empty
    for event in events:
        # With CUDA profiling on, each range comes back twice under its name: on the host, and
        # as a GPU annotation spanning its kernels (no host time, not a kernel: taking it for
        # either read the ranges as 0 and counted them into the GPU busy time).
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if not (getattr(event, "is_user_annotation", False)
                    or event.name in (ATTENTION_RANGE, MASK_RANGE)):
                kernels[event.name] += event.device_time_total
                launches += 1
        elif event.name in (ATTENTION_RANGE, MASK_RANGE):
            ranges[event.name] = ranges.get(event.name, 0.0) + event.cpu_time_total
    for entry in events.key_averages():
        if entry.key not in (ATTENTION_RANGE, MASK_RANGE):
            host[entry.key] += entry.self_cpu_time_total
    return kernels, host, launches, ranges


def profiled(fn, model, on_gpu: bool) -> tuple[dict, dict, int, dict]:
    """Runs ``fn`` under torch.profiler; its events tallied (`tally`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with ranges_around_attention(model), profile(activities=activities) as prof:
        fn()
    return tally(prof.events())


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
    # Taking turns: a load change on the host during the timed runs hits both medians alike.
    runs = [(full(), first()) for _ in range(reps)]
    step_ms = (statistics.median(f for f, _ in runs)
               - statistics.median(p for _, p in runs)) / steps * 1e3
    kernels_full, host_full, launches_full, ranges_full = profiled(full, model, on_gpu)
    kernels_first, host_first, launches_first, ranges_first = profiled(first, model, on_gpu)
    kernels = difference(kernels_full, kernels_first, steps)
    host = difference(host_full, host_first, steps)
    fields = dict(step_ms=step_ms)
    for column, name in (("host_attention_ms", ATTENTION_RANGE), ("host_mask_ms", MASK_RANGE)):
        if name in ranges_full:
            fields[column] = difference(ranges_full, ranges_first, steps)[name] / 1e3
    if on_gpu:
        busy = sum(kernels.values()) / 1e3
        attention = sum(us for name, us in kernels.items() if is_attention_kernel(name)) / 1e3
        fields.update(gpu_busy_ms=busy, attention_gpu_ms=attention,
                      other_gpu_ms=busy - attention, gpu_idle_ms=max(step_ms - busy, 0.0),
                      kernels=(launches_full - launches_first) / steps)
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
    out_dir = args.out or results_dir() / "generate"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = ResultsWriter(out_dir, "decode_step_profile", COLUMNS, sys.argv)
    config = build_config(shape, layers)
    models = build_models(args.backends, config, dtype, device)
    listing = []
    for batch, prompt in progress([(b, p) for b in batches for p in prompts], desc="profile"):
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(3, config.vocab_size, (batch, prompt), generator=gen).to(device)
        for backend, model in models.items():
            fields, per_kernel, per_op = profile_decode(model, ids, args.steps, args.reps,
                                                        on_gpu)
            row = dict(model=shape, layers=layers, backend=backend, batch=batch, prompt=prompt,
                       steps=args.steps)
            row.update({k: (f"{v:.3f}" if isinstance(v, float) else v)
                        for k, v in fields.items()})
            results.add(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            for title, table in (("GPU us per step, by kernel", per_kernel),
                                 ("host self-time us per step, by op", per_op)):
                listing.append(f"## {backend} batch {batch} prompt {prompt}: {title}")
                for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:args.top]:
                    listing.append(f"{us:10.1f}  {name[:110]}")
                listing.append("")
            if on_gpu:
                torch.cuda.empty_cache()
    csv_path = results.finish(extra={"dtype": str(dtype)})
    kernels_path = out_dir / "decode_step_kernels.txt"
    kernels_path.write_text("\n".join(listing) + "\n")
    print(f"csv: {csv_path}\nkernels: {kernels_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
