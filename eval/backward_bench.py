"""Training kernels: `tiled`'s forward and backward timed separately, side by side with torch
SDPA's cuDNN and flash (FlashAttention-2) backends and FlexAttention (`torch.compile`d, the same
mods, its block mask), in one process.

    python eval/backward_bench.py                      # every preset on the GPU
    python eval/backward_bench.py --preset standard    # B*S = 16k tokens, S 1k/4k/16k
    python eval/backward_bench.py --preset variants    # mods and masks against FlexAttention
    python eval/backward_bench.py --preset variants-4k --variants alibi-learnable
    python eval/backward_bench.py --preset variants-4k --backward-schedule edge_states=true,false
    python eval/backward_bench.py --preset head-dims --backward-schedule kv_queries=32
    python eval/backward_bench.py --preset standard --dtype bf16 --deterministic-row
    python eval/backward_bench.py --preset head-dims --head-dims 96 256
    python eval/backward_bench.py --summary --out FOLDER   # a run's ratios again, from its CSV

``--backward-schedule FIELD=V1,V2`` (repeatable) adds, beside `tiled` with the table's
schedule, a `tiled[FIELD=V,...]` row per combination of the values: the point's
`schedule.BACKWARD_TABLE` row with those fields replaced (`BackwardSchedule`'s fields), timed in
the same process. `tiled` runs the backward's default (fast) mode; ``--deterministic-row`` adds
`tiled[deterministic]`, the bitwise-reproducible mode (`hta.set_deterministic(True)`: dQ by its
own kernel where the table's row has `dq_add`).

Presets: ``standard`` (B*S = 16k tokens at S 1k/4k/16k, 32/8 heads at D=128 and 32/32 at D=64,
causal and not, bf16 and fp16; against cuDNN and FA2: FlexAttention, compiled afresh per point,
is timed on the mods), ``padded`` (B=4, S=4k, rows right-padded by 0 to 1/2: `tiled`
gets a key mask, the SDPA backends the dense mask transformers gives them), ``head-dims``
(B=4, S=4k, 32/8, bf16, causal and not, D = 80, 96, 160, 192, 256; against cuDNN and FA2)
and ``variants``
(B=4 S=4k and B=1 S=16k, 32/8 heads, D=128, bf16: the mods of variants_bench.py, and ALiBi
and a T5 bias table whose slopes / table require grad, their gradient part of the timed
backward; ``variants-4k``: B=4 S=4k only).

Each pass is timed as in kernel_bench.py (`ms`: one call's median latency from an idle GPU;
`gpu_ms`: calls queued back to back). The forward runs with grad enabled (it saves what the
backward needs); the backward is ``torch.autograd.grad`` of its output for a fixed random dOut.
FLOPs count the visible (query, key) pairs only: the forward 4 * pairs * D, the backward 2.5x
that (FlashAttention's convention: five matmuls against the forward's two). `max_err`: the
largest error of dQ, dK or dV against fp32 gradients of the same attention (the package's
reference path) for the first batch row and the first key/value head's query group, relative
to that gradient's largest magnitude. Results: eval/results/<gpu>/backward/kernel_sweep.csv,
environment.json, backward.png; a run ends with tiled's backward against each other backend
(geomean of their time over tiled's on the points both ran: ``summary``). Without a GPU: tiny
sizes through the reference path, `tiled` only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention as hta  # noqa: E402
from hf_tiled_attention import variants as V  # noqa: E402
from hf_tiled_attention.masks import compact_mask, mod_mask  # noqa: E402
from hf_tiled_attention.mods import compile_mods  # noqa: E402
from hf_tiled_attention.reference import (reference_attention,  # noqa: E402
                                          reference_attention_backward)
from hf_tiled_attention.schedule import (BackwardSchedule, backward_schedule,  # noqa: E402
                                         set_backward_schedule)
from eval.common import (DTYPES, ResultsWriter, field_combinations, output_dir,  # noqa: E402
                         results_dir, save_figure, timed)
from eval.variants_bench import mask_rows, variant_mods, visible_pairs  # noqa: E402

COLUMNS = ["variant", "backend", "pass", "dtype", "batch", "heads_q", "heads_kv", "seq",
           "head_dim", "causal", "ms", "tflops", "gpu_ms", "gpu_tflops", "max_err", "status",
           "reason"]
BACKENDS = ["tiled", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex"]
TOKENS = 16384
# Largest gradient error accepted (relative to the gradient's largest magnitude) before a
# backend's times are recorded: bf16/fp16 rounding of P and dS, with margin.
MAX_ERR = 5e-2


def standard_points():
    for dtype in ("bf16", "fp16"):
        for seq in (1024, 4096, 16384):
            for heads, head_dim in (("32/8", 128), ("32/32", 64)):
                for causal in (False, True):
                    yield ("none", dtype, TOKENS // seq, heads, seq, head_dim, causal,
                           ["tiled", "sdpa_cudnn", "sdpa_flash"])


def head_dim_points():
    """The head dims besides 64 and 128 (Phi-3's 96, two-tile 80 / 160 / 192, Gemma's 256):
    B=4, S=4k, 32/8 heads, bf16, causal and not."""
    for head_dim in (80, 96, 160, 192, 256):
        for causal in (False, True):
            yield ("none", "bf16", 4, "32/8", 4096, head_dim, causal,
                   ["tiled", "sdpa_cudnn", "sdpa_flash"])


def padded_points():
    yield ("right-padded", "bf16", 4, "32/8", 4096, 128, True,
           ["tiled", "sdpa_cudnn", "sdpa_efficient", "flex"])


# softcap: tiled runs its built-in softcap; softcap-mod: the same function as a score_mod,
# whose backward multiplies dS by the mod's derived derivative (mod_derivative).
# alibi-learnable / t5-bias-learnable: the slopes / the (buckets, heads) bias table require
# grad, and every backend's backward computes their gradient too.
VARIANTS = ["causal", "sliding-window", "documents", "alibi", "softcap", "softcap-mod",
            "prefix-lm", "alibi-learnable", "t5-bias-learnable"]


def variant_points(shapes=((4, 4096), (1, 16384))):
    for variant in VARIANTS:
        for batch, seq in shapes:
            yield (variant, "bf16", batch, "32/8", seq, 128, None, ["tiled", "flex"])


PRESETS = {"standard": standard_points, "padded": padded_points, "variants": variant_points,
           "variants-4k": lambda: variant_points(((4, 4096),)), "head-dims": head_dim_points}


def pad_lengths(batch: int, seq: int) -> list[int]:
    """Row lengths of a right-padded batch: 0 to 1/2 of each row is padding."""
    return [seq - (seq * i) // (2 * max(batch - 1, 1)) for i in range(batch)]


def call_spec(variant: str, batch: int, heads: int, seq: int, causal, device) -> dict:
    """What every backend needs for one point: ``mods`` (tiled's keyword arguments, the
    variants' mods), ``mask_mod`` / ``score_mod`` (flex's), ``dense`` (SDPA's bool mask or
    None), ``is_causal`` and ``learnable`` (tensors the mods read that require grad)."""
    if variant == "none":
        return dict(mods=dict(is_causal=causal), mask_mod=V.causal_mask if causal else None,
                    score_mod=None, dense=None, is_causal=causal)
    if variant == "right-padded":
        lengths = torch.tensor(pad_lengths(batch, seq), device=device)
        keys = torch.arange(seq, device=device)[None, :] < lengths[:, None]   # (B, S)

        def padded_causal(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & keys[b, kv_idx]
        causal_dense = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        return dict(mods=dict(is_causal=True, attn_mask=keys[:, None, None, :]),
                    mask_mod=padded_causal, score_mod=None,
                    dense=causal_dense[None, None] & keys[:, None, None, :], is_causal=False)
    if variant.endswith("-learnable"):
        if variant == "alibi-learnable":
            learnable = V.alibi_slopes(heads).to(device).requires_grad_()
            score_mod = V.alibi(learnable)
        else:  # T5's table, (32 buckets, heads), read per score through the buckets
            learnable = (torch.randn(32, heads, generator=torch.Generator().manual_seed(0))
                         * 0.5).to(device).requires_grad_()
            score_mod = V.relative_position_bias(
                learnable, V.relative_position_buckets(seq, seq).to(device), seq)
        mods = dict(score_mod=score_mod, mask_mod=V.causal_mask)
        return dict(mods=mods, mask_mod=V.causal_mask, score_mod=score_mod, dense=None,
                    is_causal=False, learnable=(learnable,))
    mods = variant_mods(variant.removesuffix("-mod"), batch, heads, seq, device)
    flex = dict(mods)
    if variant == "softcap":  # tiled runs its built-in softcap (the same function, no mod)
        mods = dict(softcap=30.0, is_causal=True)
    return dict(mods=mods, mask_mod=flex.get("mask_mod"), score_mod=flex.get("score_mod"),
                dense=None, is_causal=False)


def make_call(backend: str, spec: dict, batch: int, heads: int, seq: int, device):
    if backend == "tiled":
        mods = dict(spec["mods"])
        mask = mods.pop("attn_mask", None)
        return lambda q, k, v: hta.tiled_attention(q, k, v, mask, **mods)
    if backend.startswith("sdpa_"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kind = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

        def sdpa(q, k, v):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=spec["dense"],
                                                      is_causal=spec["is_causal"],
                                                      enable_gqa=k.shape[1] != q.shape[1])
        return sdpa
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._dynamo.reset()  # a fresh compile per point (see variants_bench.py)
    flex = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if spec["mask_mod"] is not None:
        probe = mask_rows(dict(mask_mod=spec["mask_mod"]), batch, heads,
                          torch.arange(min(seq, 2), device=device), min(seq, 2), device)
        block_mask = create_block_mask(spec["mask_mod"], batch if probe.shape[0] > 1 else None,
                                       heads if probe.shape[1] > 1 else None, seq, seq,
                                       device=device)
    return lambda q, k, v: flex(q, k, v, score_mod=spec["score_mod"], block_mask=block_mask,
                                enable_gqa=k.shape[1] != q.shape[1])


def sees_no_later_key(mods: dict, batch: int, heads: int, seq: int, device) -> bool:
    """Whether no query row sees a key past its own position under ``mods`` (tiled's keyword
    arguments), checked on every row of a small sequence-spread sample."""
    rows = torch.arange(0, seq, max(1, seq // 256), device=device)
    later = torch.arange(seq, device=device)[None, :] > rows[:, None]
    return not bool((mask_rows(mods, batch, heads, rows, seq, device) & later).any())


@torch.no_grad()  # (a learnable tensor the mods read would make autograd track the sums)
def reference_grads(spec: dict, q, k, v, d_out) -> tuple:
    """fp32 dQ, dK, dV of batch row 0 and kv head 0's query group, by the reference path."""
    group = q.shape[1] // k.shape[1]
    q0, k0, v0, do0 = (t[:1, :n].float() for t, n in ((q, group), (k, 1), (v, 1),
                                                       (d_out, group)))
    mods = dict(spec["mods"])
    mask = mods.pop("attn_mask", None)
    compiled = None
    if mods.get("score_mod") is not None or mods.get("mask_mod") is not None:
        compiled = compile_mods(mods.get("score_mod"), mods.get("mask_mod"))
    if mask is not None:
        mask = compact_mask(mask[:1], 1, group, q0.shape[2], k0.shape[2])
    elif compiled is not None and compiled.mask_mod is not None:
        mask = mod_mask(compiled, 1, group, q0.shape[2], k0.shape[2], q.device, keep=False)
    options = dict(causal=bool(mods.get("is_causal")), scale=1.0 / math.sqrt(q.shape[-1]),
                   window=None, softcap=mods.get("softcap"), diag_offset=0)
    score_mod = None if compiled is None else compiled.score_mod
    out, lse = reference_attention(q0, k0, v0, mask, score_mod=score_mod, **options)
    dq, dk, dv, _, _ = reference_attention_backward(do0, q0, k0, v0, out, lse, None, mask,
                                                    mods=compiled, **options)
    return dq, dk, dv


def grad_error(grads: tuple, want: tuple, group: int) -> float:
    got = (grads[0][:1, :group], grads[1][:1, :1], grads[2][:1, :1])
    return max(((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
               for g, w in zip(got, want))


def schedule_labels(specs: list[str]) -> dict[str, dict]:
    """``["edge_states=true,false", "kv_keys=64"]`` -> ``{"tiled[edge_states=True,kv_keys=64]":
    {"edge_states": True, "kv_keys": 64}, ...}``, the cross product of the values."""
    combos = field_combinations(specs, BackwardSchedule, _field_value, "--backward-schedule")
    return {"tiled[" + ",".join(f"{k}={v}" for k, v in c.items()) + "]": c for c in combos}


def _field_value(name: str, text: str):
    if isinstance(getattr(backward_schedule(128), name), bool):
        if text.lower() not in ("0", "1", "false", "true"):
            raise SystemExit(f"--backward-schedule {name} expects true/false/1/0, got {text!r}")
        return text.lower() in ("1", "true")
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"--backward-schedule {name} expects an integer, got {text!r}") from None


# The label of tiled's row in deterministic mode (--deterministic-row) and its "overrides".
DETERMINISTIC = "tiled[deterministic]"


@contextlib.contextmanager
def tiled_schedule(overrides: dict | None, head_dim: int):
    """The backward runs the table's schedule for ``head_dim`` with ``overrides`` replaced
    (nothing changed without overrides); an override ``deterministic=True`` is no schedule
    field but the mode (hta.set_deterministic), which runs no dQ reduce-adds."""
    fields = dict(overrides or {})
    deterministic = fields.pop("deterministic", False)
    if fields:  # (first: a bad field raises before the mode is set)
        set_backward_schedule(dataclasses.replace(backward_schedule(head_dim), **fields))
    if deterministic:
        hta.set_deterministic(True)
    try:
        yield
    finally:
        if fields:
            set_backward_schedule(None)
        if deterministic:
            hta.set_deterministic(None)


def run_point(point, args, writer: ResultsWriter) -> None:
    variant, dtype, batch, heads, seq, head_dim, causal, backends = point
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the reference path: tiny sizes, tiled alone
        batch, seq, backends = 1, min(seq, args.cpu_seq), ["tiled"]
    heads_q, heads_kv = map(int, heads.split("/"))
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch_dtype,
                           generator=gen).requires_grad_()

    q, k, v = rand(batch, heads_q, seq, head_dim), rand(batch, heads_kv, seq, head_dim), \
        rand(batch, heads_kv, seq, head_dim)
    d_out = torch.randn(q.shape, device=device, dtype=torch_dtype, generator=gen)
    spec = call_spec(variant, batch, heads_q, seq, causal, device)
    flops = 4.0 * visible_pairs(spec["mods"], batch, heads_q, seq, device) * head_dim
    want = reference_grads(spec, q.detach(), k.detach(), v.detach(), d_out)
    if causal is None:  # a variant: its mods hold the causal rule, or not (prefix-LM)
        causal = sees_no_later_key(spec["mods"], batch, heads_q, seq, device)
    base = dict(variant=variant, dtype=dtype, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                seq=seq, head_dim=head_dim, causal=int(causal))
    labels = {}
    for backend in [b for b in backends if b in args.backends]:
        labels[backend] = None
        if backend == "tiled":  # (its rows with other schedules beside it)
            labels.update(args.tiled_schedules)
    for backend, overrides in labels.items():
        with tiled_schedule(overrides, head_dim):
            run_backend(backend, base, spec, (q, k, v, d_out), want, flops, args, writer)


def run_backend(backend: str, base: dict, spec: dict, tensors: tuple, want: tuple,
                flops: float, args, writer: ResultsWriter) -> None:
    """One backend's fwd and bwd rows of a point (``backend``: a BACKENDS name or a
    ``tiled[...]`` label of :func:`schedule_labels`)."""
    q, k, v, d_out = tensors
    batch, heads_q, heads_kv, seq = (base[k] for k in ("batch", "heads_q", "heads_kv", "seq"))
    variant, dtype, head_dim = base["variant"], base["dtype"], base["head_dim"]
    heads = f"{heads_q}/{heads_kv}"
    rows = {p: dict(base, backend=backend, **{"pass": p}) for p in ("fwd", "bwd")}
    try:
        call = make_call(backend.split("[")[0], spec, batch, heads_q, seq, q.device)
        out = call(q, k, v)
        # The gradient in the layout of this backend's output, as a model's next layer
        # hands it back (a contiguous one would add a copy to some backends, not others).
        grad = torch.empty_like(out).copy_(d_out)
        inputs = (q, k, v) + spec.get("learnable", ())
        grads = torch.autograd.grad(out, inputs, grad, retain_graph=True)
        err = grad_error(grads, want, heads_q // heads_kv)
    except Exception as exc:  # a backend that cannot run the point says why
        for row in rows.values():
            row.update(status="unsupported", reason=f"{type(exc).__name__}: {exc}"[:300])
            writer.add(row)
        print(f"  {variant} {backend}: unsupported ({type(exc).__name__})", flush=True)
        return
    for row in rows.values():
        row["max_err"] = f"{err:.3g}"
    if not err <= MAX_ERR:
        for row in rows.values():
            row.update(status="wrong", reason=f"gradient error {err:.3g} > {MAX_ERR}")
            writer.add(row)
        print(f"  {variant} {backend}: WRONG gradients ({err:.3g})", flush=True)
        return
    timed(rows["fwd"], lambda: call(q, k, v), [()], flops, args.warmup, args.reps)
    timed(rows["bwd"], lambda graph=out, grad=grad: torch.autograd.grad(
              graph, inputs, grad, retain_graph=True),
          [()], 2.5 * flops, args.warmup, args.reps)
    for p, row in rows.items():
        row["status"] = "ok"
        writer.add(row)
        back_to_back = (f" (back to back {row['gpu_tflops']} TF/s)"
                        if row.get("gpu_tflops") else "")
        print(f"  {variant:14s} {dtype} B{batch} S{seq} {heads} D{head_dim} "
              f"causal={base['causal']} {backend:14s} {p}: {row['ms']} ms "
              f"{row['tflops']} TF/s{back_to_back} err {row['max_err']}", flush=True)


POINT = ("variant", "dtype", "batch", "heads_q", "heads_kv", "seq", "head_dim", "causal")


def summary(rows: list[dict], field: str = "ms") -> list[str]:
    """Lines comparing `tiled`'s backward with each other backend (and `tiled[...]` variant)
    over the points both ran (status ok): the geometric mean of ``other / tiled`` times (above
    1: tiled faster) with the lowest and highest point, and how many points."""
    times: dict = {}
    for r in rows:
        if r["pass"] == "bwd" and r["status"] == "ok" and r.get(field):
            times.setdefault(r["backend"], {})[tuple(str(r[c]) for c in POINT)] = float(r[field])
    tiled = times.get("tiled", {})
    lines = []
    for backend, points in times.items():
        ratios = [points[p] / tiled[p] for p in points if p in tiled and backend != "tiled"]
        if ratios:
            geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
            lines.append(f"tiled against {backend}: {geomean:.3f}x geomean of {backend}'s "
                         f"{field} over tiled's (above 1: tiled faster), {min(ratios):.2f}-"
                         f"{max(ratios):.2f} over {len(ratios)} points")
    return lines


def plot(rows: list[dict], out_dir: Path) -> Path:
    """Backward TF/s (back to back; useful FLOPs) per point, one bar per backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["pass"] == "bwd"]
    field = "gpu_tflops" if any(r.get("gpu_tflops") for r in ok) else "tflops"
    points = list(dict.fromkeys(tuple(r[c] for c in POINT) for r in ok))
    backends = list(dict.fromkeys(r["backend"] for r in ok))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(points)), 4.5))
    width = 0.8 / max(len(backends), 1)
    for i, backend in enumerate(backends):
        values = {tuple(r[c] for c in POINT): float(r[field])
                  for r in ok if r["backend"] == backend}
        ax.bar([j + i * width for j in range(len(points))],
               [values.get(p, 0.0) for p in points], width, label=backend)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))])
    ax.set_xticklabels([f"{p[0]} {p[1]} S{p[5]} {p[3]}/{p[4]} D{p[6]}"
                        + (" c" if str(p[7]) == "1" else "") for p in points],
                       rotation=90, fontsize=6)
    ax.set_ylabel("backward TF/s (useful; 2.5x fwd FLOPs)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out_dir / "backward.png", dpi=110,
                       measured_on_gpu=field == "gpu_tflops")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", default=["standard", "padded", "variants"],
                        choices=list(PRESETS))
    parser.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"],
                        help="only the presets' points of these dtypes")
    parser.add_argument("--variants", nargs="+", default=None,
                        choices=["none", "right-padded"] + VARIANTS,
                        help="only the presets' points of these variants (none: the standard "
                        "preset's)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=None,
                        help="only the presets' points of these head dims")
    parser.add_argument("--backward-schedule", action="append", default=[],
                        metavar="FIELD=V1,V2", help="also time tiled with the table's "
                        "BackwardSchedule with these fields replaced (repeatable: the cross "
                        "product)")
    parser.add_argument("--deterministic-row", action="store_true",
                        help=f"also time tiled in deterministic mode ({DETERMINISTIC}: "
                        "bitwise reproducible gradients, no dQ reduce-adds); the `tiled` rows "
                        "run the default (fast) mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--cpu-seq", type=int, default=96,
                        help="sequence length of the CPU run (reference path)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--replot", action="store_true",
                        help="only redraw backward.png from the folder's kernel_sweep.csv")
    parser.add_argument("--summary", action="store_true",
                        help="only print the folder's kernel_sweep.csv summary (tiled's "
                        "backward against each other backend)")
    args = parser.parse_args(argv)
    args.tiled_schedules = schedule_labels(args.backward_schedule)
    if args.deterministic_row:
        args.tiled_schedules[DETERMINISTIC] = {"deterministic": True}
    if args.tiled_schedules and "tiled" not in args.backends:
        raise SystemExit("backward_bench: --backward-schedule / --deterministic-row vary "
                         f"tiled's backward, but --backends {args.backends} leaves tiled out")
    if args.replot or args.summary:
        import csv
        out_dir = args.out or results_dir("backward")
        with open(out_dir / "kernel_sweep.csv") as f:
            rows = list(csv.DictReader(f))
        if args.summary:
            print("\n".join(summary(rows)))
        else:
            print(f"backward_bench: {plot(rows, out_dir)}")
        return 0
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        print("backward_bench: no CUDA GPU; tiny sizes through the reference path (the numbers "
              "say nothing about speed)")
        args.warmup, args.reps = 1, 2
    out_dir = output_dir(args.out, "backward")
    writer = ResultsWriter(out_dir, "kernel_sweep", COLUMNS, argv)
    seen = set()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reference path.*")
        for preset in args.preset:
            for point in PRESETS[preset]():
                if point[1] not in args.dtype:
                    continue
                if args.variants is not None and point[0] not in args.variants:
                    continue
                if args.head_dims is not None and point[5] not in args.head_dims:
                    continue
                if not on_gpu and (point[0], point[1]) in seen:
                    continue  # on a CPU: one point per variant and dtype
                seen.add((point[0], point[1]))
                run_point(point, args, writer)
    path = writer.finish()
    print(f"backward_bench: {path}; plot {plot(writer.rows, out_dir)}")
    print("\n".join(summary(writer.rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
