"""Attention variants written as mods: `tiled` (the mods compiled into the cuTile kernel) side by
side with FlexAttention (`torch.compile`d, the same mods, its block mask) and with `tiled`'s
built-in causal kernel per useful FLOP.

    python eval/variants_bench.py                       # bf16 and fp16, D 64/128, S 4k/16k/64k
    python eval/variants_bench.py --seq 4096 --dtype bf16 --head-dim 128 --variants alibi documents

Each variant's output is checked against an fp32 computation of its last query rows before it
is timed. TF/s count the visible (query, key) pairs only (the useful FLOPs), so a variant
compares with the built-in causal kernel (`builtin-causal` rows: `is_causal=True`, no mod). Times
as in kernel_bench.py: `ms` one call's median latency, `gpu_ms` calls queued back to back.
Results: eval/results/<gpu>/variants/kernel_sweep.csv, environment.json, variants.png. Without a
GPU: small sizes through the reference path, `tiled` only (numbers say nothing about speed).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention as hta  # noqa: E402
from hf_tiled_attention import variants as V  # noqa: E402
from hf_tiled_attention.mods import index_grid  # noqa: E402
from eval.common import (DTYPES, ResultsWriter, checked, first_call,  # noqa: E402
                         label_lengths, parse_heads, output_dir, save_figure, timed)

COLUMNS = ["variant", "backend", "dtype", "batch", "heads_q", "heads_kv", "seq", "head_dim",
           "visible", "ms", "tflops", "gpu_ms", "gpu_tflops", "max_err", "status", "reason"]
# Query rows checked against fp32 (the last ones: they see the most keys).
CHECK_ROWS = 64


def variant_mods(name: str, batch: int, heads: int, seq: int, device) -> dict:
    """The op keyword arguments (mods) of one variant at one shape."""
    if name == "builtin-causal":
        return dict(is_causal=True)
    if name == "causal":
        return dict(mask_mod=V.causal_mask)
    if name == "alibi":
        return dict(score_mod=V.alibi(V.alibi_slopes(heads).to(device)), mask_mod=V.causal_mask)
    if name == "softcap":
        return dict(score_mod=V.softcap(30.0), mask_mod=V.causal_mask)
    if name == "sliding-window":
        return dict(mask_mod=V.sliding_window(1024))
    if name == "sinks":
        return dict(mask_mod=V.sliding_window_with_sinks(1024, 4))
    if name == "chunked":
        return dict(mask_mod=V.chunked_attention(seq // 4))
    if name == "prefix-lm":
        return dict(mask_mod=V.prefix_lm(torch.full((batch,), seq // 4, device=device)))
    if name == "documents":  # packed documents of 1/16 to 1/4 of the sequence each
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(seq // 16, seq // 4, (64,), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        cu = torch.cat([cu[cu < seq], torch.tensor([seq])])
        return dict(mask_mod=V.document_mask(V.document_ids_from_cu_seqlens(cu.to(device))))
    if name == "t5-bias":
        gen = torch.Generator().manual_seed(0)
        bias = torch.randn(32, heads, generator=gen).to(device)
        buckets = V.relative_position_buckets(seq, seq).to(device)
        return dict(score_mod=V.relative_position_bias(bias, buckets, seq))
    raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")


VARIANTS = ["builtin-causal", "causal", "alibi", "softcap", "sliding-window", "sinks", "chunked",
            "prefix-lm", "documents", "t5-bias"]


def mask_rows(mods: dict, batch: int, heads: int, rows: torch.Tensor, seq: int,
              device) -> torch.Tensor:
    """Visibility (B or 1, H or 1, rows, seq) of some query rows under ``mods`` (the op's
    keyword arguments: is_causal, mask_mod, and a bool key mask as attn_mask)."""
    cols = torch.arange(seq, device=device)
    b, h, q_idx, kv_idx = index_grid(batch, (heads,), rows, cols)
    visible = torch.ones(1, 1, len(rows), seq, dtype=torch.bool, device=device)
    if mods.get("is_causal"):
        visible = visible & (kv_idx <= q_idx)
    if mods.get("mask_mod") is not None:
        visible = visible & mods["mask_mod"](b, h, q_idx, kv_idx)
    if mods.get("attn_mask") is not None:  # a bool key mask (B or 1, 1, 1, seq)
        visible = visible & mods["attn_mask"]
    return visible


def visible_pairs(mods: dict, batch: int, heads: int, seq: int, device) -> float:
    """Visible (query, key) pairs summed over batch rows and heads, a few rows at a time."""
    total = 0.0
    step = max(1, (1 << 26) // (seq * batch * heads))
    for r0 in range(0, seq, step):
        rows = torch.arange(r0, min(r0 + step, seq), device=device)
        visible = mask_rows(mods, batch, heads, rows, seq, device)
        total += visible.sum().item() * batch * heads / (visible.shape[0] * visible.shape[1])
    return total


def checked_rows(mods: dict, q, k, v) -> torch.Tensor:
    """fp32 attention of the last CHECK_ROWS query rows (rows with no visible key: 0)."""
    batch, heads, seq, head_dim = q.shape
    rows = torch.arange(seq - min(CHECK_ROWS, seq), seq, device=q.device)
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, 1)
    vf = v.float().repeat_interleave(group, 1)
    s = q[:, :, rows].float() @ kf.transpose(-1, -2) / math.sqrt(head_dim)
    b, h, q_idx, kv_idx = index_grid(batch, (heads,), rows, torch.arange(seq, device=q.device))
    if mods.get("score_mod") is not None:
        s = torch.broadcast_to(mods["score_mod"](s, b, h, q_idx, kv_idx), s.shape)
    s = s.masked_fill(~mask_rows(mods, batch, heads, rows, seq, q.device), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ vf


def make_call(backend: str, mods: dict, batch: int, heads: int, seq: int, device):
    if backend == "tiled":
        return lambda q, k, v: hta.tiled_attention(q, k, v, **mods)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # A fresh compile per point: dynamo's recompile limit would otherwise send later points to
    # flex's uncompiled path, which materialises every score.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    mask_mod = mods.get("mask_mod")
    if mods.get("is_causal"):
        mask_mod = V.causal_mask
    block_mask = None
    if mask_mod is not None:
        probe = mask_rows(dict(mask_mod=mask_mod), batch, heads,
                          torch.arange(min(seq, 2), device=device), min(seq, 2), device)
        block_mask = create_block_mask(mask_mod, batch if probe.shape[0] > 1 else None,
                                       heads if probe.shape[1] > 1 else None, seq, seq,
                                       device=device)
    score_mod = mods.get("score_mod")
    return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                enable_gqa=k.shape[1] != q.shape[1])


def run_point(variant, dtype, batch, heads_q, heads_kv, seq, head_dim, backends, args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(heads):
        return torch.randn(batch, heads, seq, head_dim, generator=gen, device=device,
                           dtype=torch_dtype)

    q, k, v = rand(heads_q), rand(heads_kv), rand(heads_kv)
    mods = variant_mods(variant, batch, heads_q, seq, device)
    pairs = visible_pairs(mods, batch, heads_q, seq, device)
    flops = 4 * head_dim * pairs
    want = checked_rows(mods, q, k, v)
    bound = {"fp16": 1e-2, "bf16": 5e-2}[dtype]
    for backend in backends:
        row = dict(variant=variant, backend=backend, dtype=dtype, batch=batch, heads_q=heads_q,
                   heads_kv=heads_kv, seq=seq, head_dim=head_dim,
                   visible=f"{pairs / (batch * heads_q * seq * seq):.4f}", ms="", tflops="",
                   gpu_ms="", gpu_tflops="", max_err="", status="ok", reason="")
        if backend == "flex" and variant == "builtin-causal":
            continue  # flex's causal is the "causal" variant
        fn = make_call(backend, mods, batch, heads_q, seq, device)
        # Any error: a backend that cannot run a variant (a mod flex or cuTile rejects) says why.
        out = first_call(fn, (q, k, v), row, refusals=(Exception,))
        if out is None:
            yield row
            continue
        err = (out[:, :, -want.shape[2]:].float() - want).abs().max().item()
        del out
        if checked(row, err, bound):
            timed(row, fn, [(q, k, v)], flops, args.warmup, args.reps)
        yield row
    if device == "cuda":
        torch.cuda.empty_cache()


def plot(rows: list[dict], out_dir: Path) -> Path:
    """Per (dtype, head dim): tiled's speed-up over flex per variant, and tiled's useful TF/s
    as a fraction of the built-in causal kernel's, against the sequence length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    column = "gpu_tflops" if any(r["gpu_tflops"] for r in ok) else "tflops"
    speed = {(r["variant"], r["backend"], r["dtype"], int(r["head_dim"]), int(r["seq"])):
             float(r[column]) for r in ok}
    groups = sorted({(r["dtype"], int(r["head_dim"])) for r in ok})
    # Without FlexAttention rows (the CPU runs tiled alone) there is no tiled / flex panel.
    with_flex = any(r["backend"] == "flex" for r in ok)
    columns = 2 if with_flex else 1
    fig, axes = plt.subplots(max(len(groups), 1), columns,
                             figsize=(5.5 * columns, 3 * max(len(groups), 1)), squeeze=False)
    for (dtype, head_dim), panels in zip(groups, axes):
        ax_flex, ax_causal = panels if with_flex else (None, panels[0])
        seqs = sorted({int(r["seq"]) for r in ok if (r["dtype"], int(r["head_dim"])) ==
                       (dtype, head_dim)})
        for variant in [v for v in VARIANTS if v != "builtin-causal"]:
            flex_pts = [(s, speed[(variant, "tiled", dtype, head_dim, s)]
                         / speed[(variant, "flex", dtype, head_dim, s)]) for s in seqs
                        if (variant, "flex", dtype, head_dim, s) in speed
                        and (variant, "tiled", dtype, head_dim, s) in speed]
            causal_pts = [(s, speed[(variant, "tiled", dtype, head_dim, s)]
                           / speed[("builtin-causal", "tiled", dtype, head_dim, s)])
                          for s in seqs if ("builtin-causal", "tiled", dtype, head_dim, s)
                          in speed and (variant, "tiled", dtype, head_dim, s) in speed]
            for ax, pts in ((ax_flex, flex_pts), (ax_causal, causal_pts)):
                if pts and ax is not None:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        for ax, ylabel, target in ((ax_flex, "tiled / flex (useful TF/s)", 1.5),
                                   (ax_causal, "tiled variant / built-in causal", 0.9)):
            if ax is None:
                continue
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
            ax.set(xscale="log", xlabel="sequence", ylabel=ylabel,
                   title=f"{dtype}, D={head_dim}")
            if seqs:
                label_lengths(ax, seqs)
            ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, out_dir / "variants.png", dpi=70,
                       measured_on_gpu=column == "gpu_tflops")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    parser.add_argument("--head-dim", type=int, nargs="+", default=None)
    parser.add_argument("--seq", type=int, nargs="+", default=None)
    parser.add_argument("--heads", default="32/8", help="Hq/Hkv")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backends", nargs="+", default=None, choices=["tiled", "flex"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--append", action="store_true",
                        help="keep the rows already in the --out folder's kernel_sweep.csv "
                             "(a sweep measured in several runs)")
    args = parser.parse_args(argv)
    heads_q, heads_kv = parse_heads(args.heads)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        print("variants_bench: no CUDA GPU; small sizes through the CPU reference path, tiled "
              "only (numbers say nothing about speed).")
    seqs = args.seq or ([4096, 16384, 65536] if on_gpu else [256])
    head_dims = args.head_dim or ([64, 128] if on_gpu else [64])
    backends = args.backends or (["tiled", "flex"] if on_gpu else ["tiled"])
    if not on_gpu:
        heads_q, heads_kv = min(heads_q, 4), min(heads_kv, 2)
        args.reps, args.warmup = min(args.reps, 2), min(args.warmup, 1)
    warnings.simplefilter("ignore")
    out_dir = output_dir(args.out, "variants")
    results = ResultsWriter(out_dir, "kernel_sweep", COLUMNS, argv, append=args.append)
    for dtype in args.dtype:
        for head_dim in head_dims:
            for seq in seqs:
                for variant in args.variants:
                    for row in run_point(variant, dtype, args.batch, heads_q, heads_kv, seq,
                                         head_dim, backends, args):
                        results.add(row)
                        print(" ".join(f"{k}={v}" for k, v in row.items() if v != ""),
                              flush=True)
    csv_path = results.finish()
    print(f"csv: {csv_path}\nplot: {plot(results.rows, out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
