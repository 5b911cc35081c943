"""Kernel sweep: `tiled` side by side with torch SDPA backends and eager attention.

Every backend's output is checked against an fp32 reference before it is timed; a backend that
refuses a shape is recorded as `unsupported` with the reason. Two times per point, both with
CUDA events and input sets rotated when they fit in L2: `ms`, the median of single calls from an
idle GPU (one call's latency: the host's launch work is in it), and `gpu_ms`, the median time
per call of calls queued back to back (throughput: the kernel alone unless the host is slower).

Sliding windows (`--window`) and left-padded batches (`--left-pad`) give `tiled` what the
transformers adapter gives it (the window, a (B, 1, 1, Skv) key mask) and the other backends
the dense (B, 1, Sq, Skv) mask transformers builds for them; TF/s then count only the visible
(query, key) pairs, so they compare with the plain causal kernel per useful FLOP.

    python eval/kernel_bench.py                         # the standard sweep on the GPU
    python eval/kernel_bench.py --seq 4096 --head-dim 128 --dtype bf16 --causal both
    python eval/kernel_bench.py --schedule tile_m=64,128 --schedule tile_n=64,128
    python eval/kernel_bench.py --preset standard           # the performance targets' sweep
    python eval/kernel_bench.py --preset masks              # windows and padding vs causal
    python eval/kernel_bench.py --profile --seq 8192 --head-dim 128 --causal on

Results: eval/results/<gpu>/kernel_sweep.csv, environment.json and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention as hta  # noqa: E402
from hf_tiled_attention.masks import compact_mask  # noqa: E402
from hf_tiled_attention.visibility import visible  # noqa: E402
from hf_tiled_attention.reference import reference_attention  # noqa: E402
from eval.common import (DTYPES, ResultsWriter, checked, first_call,  # noqa: E402
                         label_lengths, parse_heads, parse_schedules, results_dir, save_figure,
                         timed)

BACKENDS = ["tiled", "tiled_fp8", "sdpa_auto", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn",
            "sdpa_math", "eager"]
# FP8 attention (e4m3 operands): its own error bound, and the calls it does not take.
FP8_BOUND = 0.25
FP8_UNSUPPORTED = "FP8 attention takes 16-bit inputs without a key mask"
COLUMNS = ["backend", "dtype", "batch", "heads_q", "heads_kv", "seq_q", "seq_kv", "head_dim",
           "causal", "window", "left_pad", "schedule", "ms", "tflops", "gpu_ms", "gpu_tflops",
           "gpu_kv_tbs", "max_err", "status", "reason"]
L2_BYTES = 60 * 2**20
# SDPA backends with GPU kernels only.
CUDA_ONLY = "runs on CUDA only"
CUDA_ONLY_BACKENDS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn")
# Named sweeps; explicit flags still override them. Each writes to its own results subfolder.
PRESETS = {
    # The performance issue's standard sweep (its geomean / min ratio targets vs sdpa_auto).
    "standard": dict(seq=[1024, 2048, 4096, 8192, 16384], head_dim=[64, 128],
                     dtype=["fp16", "bf16"], heads=["32/8", "32/32"],
                     backends=["tiled", "sdpa_auto", "sdpa_flash", "sdpa_cudnn"]),
    # Head dims that are not powers of two, and 256, against every SDPA backend.
    "head-dims": dict(seq=[1024, 4096, 16384], head_dim=[80, 96, 256], dtype=["bf16"],
                      heads=["32/8"], backends=["tiled", "sdpa_auto", "sdpa_flash",
                                                "sdpa_efficient", "sdpa_cudnn"]),
    # Decode: one query against a cache of 1k-128k keys, every SDPA backend (gpu_kv_tbs: the
    # rate K/V are read at, the anchor of a memory-bound call).
    "decode": dict(seq=[1024, 4096, 16384, 65536, 131072], head_dim=[64, 128], dtype=["bf16"],
                   heads=["32/8", "32/4", "32/32"], decode="only", batch=[1, 8, 32],
                   causal="on", backends=["tiled", "sdpa_auto", "sdpa_flash", "sdpa_efficient",
                                          "sdpa_cudnn"]),
    # The masked-case targets: sliding window and left padding against plain causal
    # (Mistral's 4096 window at 16k; padding up to half of a row).
    "masks": dict(seq=[4096, 16384], head_dim=[128], dtype=["bf16"], heads=["32/8"],
                  causal="on", window=[0, 1024, 4096], left_pad=[0.0, 0.5], batch=[4],
                  backends=["tiled", "sdpa_auto", "sdpa_efficient", "sdpa_cudnn"]),
    # FP8 attention (issue 46's targets: >= 1.4x the bf16 tiled forward and >= 1.3x cuDNN bf16
    # at S >= 4k, D = 128, causal and not).
    "fp8": dict(seq=[4096, 8192, 16384], head_dim=[128], dtype=["bf16"], heads=["32/8"],
                backends=["tiled_fp8", "tiled", "sdpa_cudnn", "sdpa_flash"]),
}


# Where a preset writes, under eval/results/<gpu>/ (default sweep-<preset>).
PRESET_FOLDERS = {"decode": "decode"}


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
              "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
              "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_math": SDPBackend.MATH}.get(name)
    return sdpa_kernel([chosen]) if chosen is not None else contextlib.nullcontext()


def left_pad_mask(batch: int, seq_kv: int, fraction: float, device) -> torch.Tensor | None:
    """(B, 1, 1, Skv) bool key mask of a left-padded batch: row b's first
    ``fraction * Skv * (b + 1) / B`` keys are padding (rows of different lengths)."""
    if not fraction:
        return None
    pads = torch.tensor([int(fraction * seq_kv * (b + 1) / batch) for b in range(batch)],
                        device=device)
    return (torch.arange(seq_kv, device=device) >= pads[:, None])[:, None, None, :]


def dense_mask(seq_q: int, seq_kv: int, causal: bool, window: int,
               key_mask: torch.Tensor | None, device) -> torch.Tensor:
    """The (1 or B, 1, Sq, Skv) bool mask (True = visible) that the op's semantics define."""
    pos = torch.arange(seq_q, device=device)[:, None] + (seq_kv - seq_q)
    keys = torch.arange(seq_kv, device=device)[None, :]
    seen = visible(pos, keys, seq_kv, window or 0, causal, bool(window))
    seen = seen.expand(seq_q, seq_kv)[None, None]
    return seen if key_mask is None else seen & key_mask


def make_call(backend: str, causal: bool, schedule: hta.Schedule | None, window: int = 0,
              key_mask: torch.Tensor | None = None, dense: torch.Tensor | None = None):
    """A function (q, k, v) -> out for one backend, all with the op's semantics. ``tiled`` gets
    the window and key mask as the transformers adapter passes them; the others ``dense``, the
    :func:`dense_mask` of the call (built once, outside the timed call), when there is a window
    or a key mask."""
    if backend == "tiled":
        return lambda q, k, v: hta.tiled_attention(q, k, v, key_mask, is_causal=causal,
                                                   window=window or None, schedule=schedule)
    if backend == "tiled_fp8":
        return lambda q, k, v: hta.fp8_attention(q, k, v, is_causal=causal, window=window or None)
    mask = dense if window or key_mask is not None else None
    if backend == "eager":
        def eager(q, k, v):  # what transformers' eager path does: repeat kv, matmul, softmax
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            elif causal:
                sq, skv = q.shape[2], k.shape[2]
                hide = torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(skv - sq + 1)
                s = s.masked_fill(hide, float("-inf"))
            return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
        return eager

    def sdpa(q, k, v):
        with sdpa_backend(backend):
            # SDPA's is_causal is top-left aligned; bottom-right needs Sq == Skv (or Sq == 1).
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and causal and q.shape[2] > 1,
                enable_gqa=k.shape[1] != q.shape[1])
    return sdpa


def reference(q, k, v, causal, window=0, key_mask=None):
    mask = None if key_mask is None else compact_mask(key_mask, q.shape[0], q.shape[1],
                                                      q.shape[2], k.shape[2])
    out, _ = reference_attention(q.float(), k.float(), v.float(), mask, causal=causal,
                                 scale=q.shape[-1] ** -0.5, window=window or None, softcap=None,
                                 diag_offset=k.shape[2] - q.shape[2])
    return out


def run_point(dtype, batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, causal, window,
              left_pad, runs, args):
    """Measures one shape for each ``(backend, schedule)`` in ``runs``, yielding a row each.
    The inputs, the masks and the fp32 reference are built once per shape for all of them."""
    torch_dtype = DTYPES[dtype]
    one_set = 2 * batch * (heads_q * seq_q + 2 * heads_kv * seq_kv) * head_dim * \
        torch_dtype.itemsize
    n_sets = max(1, min(8, math.ceil(3 * L2_BYTES / one_set)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch_dtype)

    sets = [(rand(batch, heads_q, seq_q, head_dim), rand(batch, heads_kv, seq_kv, head_dim),
             rand(batch, heads_kv, seq_kv, head_dim)) for _ in range(n_sets)]
    key_mask = left_pad_mask(batch, seq_kv, left_pad, device)
    # Which (query, key) pairs are visible: the other backends' mask, the rows the check
    # compares and the useful work.
    visible = dense_mask(seq_q, seq_kv, causal, window, key_mask, device)
    # Check against an fp32 reference (first batch bounded in size), on the query rows that
    # see some key (what a backend returns for the others differs: 0, NaN).
    q, k, v = (t[:1] for t in sets[0])
    want = reference(q, k, v, causal, window, None if key_mask is None else key_mask[:1])
    seen = visible[:1].any(-1, keepdim=True)
    bound = {"fp16": 1e-2, "bf16": 5e-2, "fp32": 1e-2}[dtype]
    # Useful work: the visible (query, key) pairs; the bytes of K and V, each read once.
    flops = 4 * heads_q * head_dim * visible.sum().item() * batch // visible.shape[0]
    kv_bytes = 2 * batch * heads_kv * seq_kv * head_dim * torch_dtype.itemsize
    for backend, schedule in runs:
        row = dict(backend=backend, dtype=dtype, batch=batch, heads_q=heads_q,
                   heads_kv=heads_kv, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
                   causal=causal, window=window, left_pad=left_pad,
                   schedule=(schedule or hta.Schedule()).label(), ms="", tflops="", gpu_ms="",
                   gpu_tflops="", gpu_kv_tbs="", max_err="", status="ok", reason="")
        if backend in CUDA_ONLY_BACKENDS and device == "cpu":
            row.update(status="unsupported", reason=CUDA_ONLY)
            yield row
            continue
        if backend == "tiled_fp8" and (dtype == "fp32" or key_mask is not None):
            row.update(status="unsupported", reason=FP8_UNSUPPORTED)
            yield row
            continue
        fn = make_call(backend, causal, schedule, window, key_mask, visible)
        out = first_call(fn, sets[0], row)  # SDPA backends refuse shapes with a RuntimeError
        if out is None:
            yield row
            continue
        err = torch.where(seen, out[:1].float() - want, 0.0).abs().max().item()
        del out
        if checked(row, err, FP8_BOUND if backend == "tiled_fp8" else bound):
            gpu_ms = timed(row, fn, sets, flops, args.warmup, args.reps)
            if gpu_ms is not None:
                row.update(gpu_kv_tbs=f"{kv_bytes / gpu_ms / 1e9:.4g}")
                torch.cuda.empty_cache()
        yield row


def console_line(row: dict) -> str:
    """One result row as the console shows it: times when measured, the reason when not."""
    line = (f"{row['backend']:15s} {row['dtype']} b{row['batch']} h{row['heads_q']}/"
            f"{row['heads_kv']} q{row['seq_q']} k{row['seq_kv']} d{row['head_dim']} "
            f"causal={int(row['causal'])} w{row['window']} pad{row['left_pad']} "
            f"{row['schedule']:>10s}  {row['status']:11s}")
    if row["status"] != "ok":
        return f"{line} {row['reason']}"
    line += f" {row['ms']:>9s} ms {row['tflops']:>7s} TF/s"
    if row["gpu_ms"]:
        line += f" gpu {row['gpu_ms']:>9s} ms {row['gpu_tflops']:>7s} TF/s"
    return f"{line} err {row['max_err']}"


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["seq_q"] == r["seq_kv"]
          and not r["window"] and not r["left_pad"]]
    on_gpu = any(r["gpu_ms"] for r in ok)
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"], r["heads_q"], r["heads_kv"])
                     for r in ok})
    if not groups:
        return []
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.2 * len(groups)), squeeze=False)
    for (dtype, d, causal, hq, hkv), (ax_tf, ax_speed) in zip(groups, axes):
        sel = [r for r in ok if (r["dtype"], r["head_dim"], r["causal"], r["heads_q"],
                                 r["heads_kv"]) == (dtype, d, causal, hq, hkv)]
        tiled = {r["seq_q"]: float(r["ms"]) for r in sel if r["backend"] == "tiled"}
        for backend in BACKENDS:
            pts = sorted((r["seq_q"], float(r["tflops"]), float(r["ms"])) for r in sel
                         if r["backend"] == backend)
            if not pts:
                continue
            ax_tf.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
            if backend != "tiled":
                sp = [(s, ms / tiled[s]) for s, _, ms in pts if s in tiled]
                if sp:
                    ax_speed.plot([p[0] for p in sp], [p[1] for p in sp], marker="o",
                                  label=f"tiled vs {backend}")
        title = f"{dtype} D={d} Hq/Hkv={hq}/{hkv} causal={causal}"
        ax_tf.set(xscale="log", xlabel="sequence length", ylabel="TF/s", title=title)
        ax_speed.set(xscale="log", xlabel="sequence length", ylabel="speedup of tiled (x)",
                     title=title)
        ax_speed.axhline(1.0, color="gray", lw=0.8)
        seqs = sorted({r["seq_q"] for r in sel})
        for ax in (ax_tf, ax_speed):  # one labelled tick per measured length, no log clutter
            label_lengths(ax, seqs)
        ax_tf.legend(fontsize=7)
        ax_speed.legend(fontsize=7)
    return [save_figure(fig, out_dir / "kernel_sweep.png", dpi=80, measured_on_gpu=on_gpu)]


def plot_decode(rows: list[dict], out_dir: Path) -> list[Path]:
    """Decode points (one query): the rate K/V are read at by tiled (solid) and by the fastest
    SDPA backend of each point (dashed) against the cache length, a line pair per batch size,
    a panel per (dtype, heads, D)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["seq_q"] == 1 and r["gpu_ms"]]
    groups = sorted({(r["dtype"], r["heads_q"], r["heads_kv"], r["head_dim"]) for r in ok})
    if not groups:
        return []
    columns = min(3, len(groups))
    lines = -(-len(groups) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 3.2 * lines),
                             squeeze=False)
    for group, ax in zip(groups, axes.flat):
        sel = [r for r in ok if (r["dtype"], r["heads_q"], r["heads_kv"], r["head_dim"]) == group]
        for i, batch in enumerate(sorted({r["batch"] for r in sel})):
            best: dict = {}
            for r in sel:
                if r["batch"] == batch and r["backend"] != "tiled":
                    best[r["seq_kv"]] = max(float(r["gpu_kv_tbs"]), best.get(r["seq_kv"], 0.0))
            tiled = sorted((r["seq_kv"], float(r["gpu_kv_tbs"])) for r in sel
                           if r["batch"] == batch and r["backend"] == "tiled")
            color = f"C{i}"
            ax.plot([p[0] for p in tiled], [p[1] for p in tiled], marker="o", color=color,
                    label=f"tiled B={batch}")
            ax.plot(sorted(best), [best[k] for k in sorted(best)], ls="--", color=color,
                    label=f"best SDPA B={batch}")
        keys = sorted({r["seq_kv"] for r in sel})
        ax.set(xscale="log", xlabel="keys", ylabel="K/V read TB/s",
               title="{} Hq/Hkv={}/{} D={}".format(*group))
        label_lengths(ax, keys, [f"{k // 1024}k" if k >= 1024 else str(k) for k in keys])
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    return [save_figure(fig, out_dir / "decode.png", dpi=60, measured_on_gpu=True)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    parser.add_argument("--causal", choices=["on", "off", "both"], default="both")
    parser.add_argument("--heads", nargs="+", default=["32/8", "32/32"],
                        help="Hq/Hkv pairs, e.g. 32/8 (GQA) 32/32 (MHA)")
    parser.add_argument("--batch", type=int, nargs="+", default=[0],
                        help="batch sizes (0: 16k tokens per batch, as in FlashAttention's bench)")
    parser.add_argument("--decode", nargs="?", const="also", choices=["also", "only"],
                        help="also run Sq=1 against each Skv (`--decode only`: just those)")
    parser.add_argument("--window", type=int, nargs="+", default=[0],
                        help="sliding windows to sweep (0 = none)")
    parser.add_argument("--left-pad", type=float, nargs="+", default=[0.0],
                        help="left-padding fractions to sweep: batch row b pads "
                             "fraction * S * (b+1) / B keys (0 = no mask)")
    parser.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    parser.add_argument("--schedule", action="append", default=[],
                        help="sweep a Schedule field: FIELD=V1,V2 (repeatable; cross product)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--profile", action="store_true",
                        help="run the first configuration of `tiled` under torch.profiler and "
                             "print its kernel table (wrap with `ncu --clock-control none` for "
                             "hardware counters)")
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the plot from the --out folder's kernel_sweep.csv "
                             "(a run cut short by a time limit keeps its CSV but no plot)")
    parser.add_argument("--preset", choices=list(PRESETS),
                        help="a named sweep: " + ", ".join(PRESETS) + " (flags override it)")
    preset = parser.parse_known_args(argv)[0].preset
    if preset:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    out_dir = args.out or (results_dir() / PRESET_FOLDERS.get(preset, f"sweep-{preset}")
                           if preset else results_dir())
    if args.replot:
        rows = read_rows(out_dir / "kernel_sweep.csv")
        for path in plot(rows, out_dir) + plot_decode(rows, out_dir):
            print("plot:", path)
        return 0
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA GPU here; running tiny sizes on the CPU (tiled = the "
              "reference path). These numbers say nothing about GPU speed.")
        if argv is None:  # plain command line: shrink the default sweep to CPU sizes
            args.seq, args.head_dim, args.heads, args.dtype = [128, 256], [64], ["4/2"], ["bf16"]
            args.reps, args.warmup, args.batch = 3, 1, [1]
        cuda_only = [b for b in args.backends if b in CUDA_ONLY_BACKENDS]
        if cuda_only:  # (torch would warn at every call that it has no kernel for them)
            print(f"kernel_bench: {', '.join(cuda_only)} run on CUDA only: recorded as "
                  "unsupported here, not called.")
    if any(w < 0 for w in args.window):
        raise SystemExit(f"--window expects sizes >= 0 (0 = no window), got {args.window}")
    if any(not 0.0 <= f < 1.0 for f in args.left_pad):
        raise SystemExit(f"--left-pad expects fractions in [0, 1), got {args.left_pad}")
    schedules = parse_schedules(args.schedule)
    causal_values = {"on": [True], "off": [False], "both": [False, True]}[args.causal]
    heads = [parse_heads(h) for h in args.heads]
    if args.profile:
        return profile(args, heads[0], causal_values[0], schedules[0])

    out_dir.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")
    results = ResultsWriter(out_dir, "kernel_sweep", COLUMNS, argv)
    points = []
    for dtype, d, causal, (hq, hkv), batch, seq, window, pad in itertools.product(
            args.dtype, args.head_dim, causal_values, heads, args.batch, args.seq, args.window,
            args.left_pad):
        if window >= seq:  # the same work as no window
            continue
        batch = batch or max(1, 16384 // seq)
        if args.decode != "only":
            points.append((dtype, batch, hq, hkv, seq, seq, d, causal, window, pad))
        if args.decode:
            points.append((dtype, batch, hq, hkv, 1, seq, d, causal, window, pad))
    runs = [(backend, schedule) for backend in args.backends
            for schedule in (schedules if backend == "tiled" else [None])]
    for point in points:
        for row in run_point(*point, runs, args):
            results.add(row)
            if row["reason"] != CUDA_ONLY:  # (said once, before the sweep)
                print(console_line(row), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    csv_path = results.finish()
    for path in plot(results.rows, out_dir) + plot_decode(results.rows, out_dir):
        print("plot:", path)
    print("csv:", csv_path)
    print_summary(results.rows)
    return 0


def read_rows(path: Path) -> list[dict]:
    """A kernel_sweep.csv back as the rows run_point made (numbers as numbers)."""
    import csv
    types = dict(batch=int, heads_q=int, heads_kv=int, seq_q=int, seq_kv=int, head_dim=int,
                 causal=lambda v: v == "True", window=int, left_pad=float)
    with open(path) as f:
        return [{k: types[k](v) if k in types and v != "" else v for k, v in row.items()}
                for row in csv.DictReader(f)]


def print_summary(rows: list[dict]) -> None:
    """Geometric-mean speedup of tiled over each backend on the points both ran, for single-call
    latency (ms) and back-to-back throughput (gpu_ms)."""
    for column in ("ms", "gpu_ms"):
        by_key = {}
        for r in rows:
            if r["status"] == "ok" and r[column]:
                key = (r["dtype"], r["batch"], r["heads_q"], r["heads_kv"], r["seq_q"],
                       r["seq_kv"], r["head_dim"], r["causal"], r["window"], r["left_pad"])
                times = by_key.setdefault(key, {})
                # tiled may appear once per swept schedule: keep its best.
                times[r["backend"]] = min(float(r[column]), times.get(r["backend"], math.inf))
        for backend in BACKENDS[1:]:
            ratios = [v[backend] / v["tiled"] for v in by_key.values()
                      if backend in v and "tiled" in v]
            if ratios:
                gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
                print(f"[{column:6s}] tiled vs {backend:15s}: geomean speedup {gm:.3f}x over "
                      f"{len(ratios)} points, min {min(ratios):.3f}x")


def profile(args, heads, causal, schedule) -> int:
    """One configuration under torch.profiler. For hardware counters run this mode under
    `ncu --clock-control none --kernel-name regex:attention -c 3 python eval/kernel_bench.py
    --profile ...` and read sm__throughput / tensor-pipe utilisation and dram bytes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    hq, hkv = heads
    seq, d, dtype = args.seq[0], args.head_dim[0], DTYPES[args.dtype[0]]
    batch = args.batch[0] or max(1, 16384 // seq)
    q = torch.randn(batch, hq, seq, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, hkv, seq, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    fn = make_call("tiled", causal, schedule)
    for _ in range(3):
        fn(q, k, v)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            fn(q, k, v)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print("Reading it: the attention kernel's CUDA time per call is the number to compare with "
          "4*B*Hq*Sq*Skv*D (/2 if causal) FLOPs; host-side rows show launch overhead.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
