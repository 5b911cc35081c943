"""torch.profiler pieces the profile scripts share (profile_decode_step.py,
profile_train_step.py): profiler ranges around a model's attention function and mask
builders, and a profile's events tallied into kernels, host ops and those ranges."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import defaultdict

import torch

# Host-time ranges the profiled runs add around the attention functions and the mask builders.
ATTENTION_RANGE, MASK_RANGE = "profile::attention", "profile::mask"
# Kernel names that are attention: our cuTile kernels (the forward's entries, the backward's
# three), sdpa's backends and FlexAttention's compiled kernels.
ATTENTION_KERNELS = ("attention_forward", "attention_backward", "flash", "fmha",
                     "cudnn", "efficient_attention", "sdpa", "flex_attention")
# transformers' mask builders, as a model's modeling module imports them.
MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


def is_attention_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in ATTENTION_KERNELS)


@contextlib.contextmanager
def ranges_around_attention(model):
    """Wraps the model's attention function and the mask builders of its modeling module in
    profiler ranges (their inclusive host time), for the profiled runs only."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def in_range(name, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return wrapped

    backend = model.config._attn_implementation
    saved_attention = ALL_ATTENTION_FUNCTIONS.get(backend)
    modeling = sys.modules[type(model).__module__]
    saved_masks = {name: getattr(modeling, name) for name in MASK_BUILDERS
                   if hasattr(modeling, name)}
    if saved_attention is not None:  # eager is the module's own function, not in the registry
        ALL_ATTENTION_FUNCTIONS._global_mapping[backend] = in_range(ATTENTION_RANGE,
                                                                    saved_attention)
    for name, builder in saved_masks.items():
        setattr(modeling, name, in_range(MASK_RANGE, builder))
    try:
        yield
    finally:
        if saved_attention is not None:
            ALL_ATTENTION_FUNCTIONS._global_mapping[backend] = saved_attention
        for name, builder in saved_masks.items():
            setattr(modeling, name, builder)


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
    """Runs ``fn`` under torch.profiler; its events tallied (:func:`tally`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with ranges_around_attention(model), profile(activities=activities) as prof:
        fn()
    return tally(prof.events())


def step_fields(step_ms: float, ranges: dict, kernels: dict, launches: float,
                wall_ms: float, on_gpu: bool) -> dict:
    """A profile row's timing fields from one step's tally (ranges and kernels in us):
    ``step_ms``, the host ranges' ms where they ran, and on a GPU its busy, attention, other and
    idle ms (``wall_ms`` less busy) and kernel launches."""
    fields = dict(step_ms=step_ms)
    for column, name in (("host_attention_ms", ATTENTION_RANGE), ("host_mask_ms", MASK_RANGE)):
        if name in ranges:
            fields[column] = ranges[name] / 1e3
    if on_gpu:
        busy = sum(kernels.values()) / 1e3
        attention = sum(us for name, us in kernels.items() if is_attention_kernel(name)) / 1e3
        fields.update(gpu_busy_ms=busy, attention_gpu_ms=attention,
                      other_gpu_ms=busy - attention, gpu_idle_ms=max(wall_ms - busy, 0.0),
                      kernels=launches)
    return fields


def add_profile(results, row: dict, fields: dict, per_kernel: dict, per_op: dict, label: str,
                listing: list, top: int) -> None:
    """One backend's profile: ``row`` with ``fields`` (floats to 3 decimals) into ``results``
    (a ResultsWriter) and printed, and the ``top`` kernels and host ops into ``listing`` as
    sections titled with ``label``."""
    row = dict(row, **{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in fields.items()})
    results.add(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    for title, table in (("GPU us per step, by kernel", per_kernel),
                         ("host self-time us per step, by op", per_op)):
        listing.append(f"## {label}: {title}")
        for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            listing.append(f"{us:10.1f}  {name[:110]}")
        listing.append("")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def finish_profile(results, listing: list, path, dtype) -> None:
    """Closes ``results`` and writes ``listing`` to ``path``."""
    csv_path = results.finish(extra={"dtype": str(dtype)})
    path.write_text("\n".join(listing) + "\n")
    print(f"csv: {csv_path}\nkernels: {path}")
