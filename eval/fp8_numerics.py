"""FP8 attention's numerics, simulated exactly on the CPU: which scales and rotation an FP8
kernel needs to stay near the bf16 kernel's error (groundwork for issue 46; no kernel here).

    python eval/fp8_numerics.py
    python eval/fp8_numerics.py --seq 2048 --outlier-scale 20 100 --out /tmp/fp8

Each scheme rounds what an FP8 kernel would hold in e4m3 (torch.float8_e4m3fn: round to
nearest even, saturating at 448) and computes the rest in fp32, against fp64 attention on the
same (unrounded) inputs:

* ``bf16``: the bf16 kernel: Q, K, V and the probabilities P in bf16, fp32 accumulation;
* ``fp8-head``: Q, K, V in e4m3 with one scale per head (amax / 448), P in e4m3 with the fixed
  scale 448 (P <= 1 after the running max is subtracted, so P * 448 fills e4m3's range);
* ``fp8-block``: as fp8-head, with one scale per head and block of ``--block`` tokens (Q's
  block: a query tile; K's and V's: a key tile), what a kernel can compute per tile;
* ``...+rot``: Q and K first multiplied by the same random orthogonal Hadamard matrix (signs
  times a normalised Walsh-Hadamard matrix), which leaves q.k unchanged and spreads a few large
  channels over all of them (FlashAttention-3's incoherent processing);
* ``fp8-token+rot``: Q and K with one scale per token (a kernel multiplies the score tile by
  the outer product of the two scale vectors), V per block, after the rotation;
* ``...+smooth``: K's mean over the sequence (per head and channel) subtracted first, which
  shifts every score of a query row by the same ``q . mean(k)`` (softmax does not see it) and
  leaves K's rounding error on the smaller differences (SageAttention's smoothing of K);
* ``...+qsmooth``: Q's mean over the sequence likewise taken out before rounding and its
  scores added back exactly, ``mean(q) . k`` one fp32 bias per key (SageAttention2's
  smoothing of Q; a decode step's single query then leaves nothing to round in Q K^T);
* ``...+vchan``: V with one scale per head and channel (over the sequence), which a kernel
  applies to the output once, where a per-block V scale rescales every P @ V product;
* ``fp8-qk-block+rot`` / ``fp8-qk-token+rot``: only Q K^T in FP8 (as fp8-block+rot /
  fp8-token+rot), V and P in bf16; ``fp8-pv-block``: only P @ V in FP8 (as fp8-block), Q and
  K in bf16: where the error comes from.

Inputs: Gaussian Q, K, V (``gaussian``), and the same with ``--outliers`` channels of Q and K
multiplied by each ``--outlier-scale`` (``outliers-xN``), as LLM activations have a few
channels far above the rest. Causal, one batch row. Metrics against fp64, over all outputs:
``max_abs`` and ``rms`` error, ``rel_rms`` (rms error over the output's rms).
With ``--text-file``, every scheme also runs as the attention of a real model (the perplexity
eval's SmolLM2-135M by default, fp32 otherwise) over non-overlapping windows of the text:
``ppl`` and ``ppl_rel_diff`` against exact fp32 attention (scheme ``fp32``), in
fp8_perplexity.csv.
Results: eval/results/<gpu or cpu>/fp8-numerics/; the committed run (CPU: the numerics are
exact rounding, a GPU kernel's accumulation order differs only in fp32's last bits) is in
eval/results/fp8-numerics/.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eval.common import ResultsWriter, output_dir  # noqa: E402
from hf_tiled_attention.fp8 import E4M3_MAX, hadamard, to_e4m3  # noqa: E402

COLUMNS = ["inputs", "scheme", "seq", "heads", "head_dim", "block", "max_abs", "rms", "rel_rms"]
SCHEMES = ["bf16", "fp8-head", "fp8-block", "fp8-head+rot", "fp8-block+rot", "fp8-token+rot",
           "fp8-token+rot+smooth", "fp8-token+rot+smooth+vchan",
           "fp8-token+rot+smooth+qsmooth+vchan", "fp8-qk-block+rot",
           "fp8-qk-token+rot", "fp8-qk-token+rot+smooth", "fp8-pv-block", "fp8-pv-vchan"]


def e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` stored as e4m3 with ``scale`` (x / scale rounded, saturating), read back in fp32."""
    return to_e4m3(x, scale).float() * scale


def amax_scale(x: torch.Tensor, block: int | None) -> torch.Tensor:
    """One scale per head (``block`` None), per head and block of rows, or (``block`` 0) per
    head and channel: amax / 448."""
    heads, seq, dim = x.shape
    if block == 0:
        amax = x.abs().amax(dim=1, keepdim=True)
    elif block is None:
        amax = x.abs().amax(dim=(1, 2), keepdim=True)
    else:
        blocks = x.reshape(heads, seq // block, block, dim).abs().amax(dim=(2, 3), keepdim=True)
        amax = blocks.expand(-1, -1, block, 1).reshape(heads, seq, 1)
    return amax.clamp_min(1e-12) / E4M3_MAX


def attention(q, k, v, scale, round_p=None, bias=None) -> torch.Tensor:
    """Causal softmax((q k^T + bias) * scale) v in the inputs' dtype math (fp32 or fp64);
    ``round_p`` rounds the probabilities after the row max is subtracted (before they meet V),
    as a kernel holds them for the P @ V product; ``bias`` (heads, 1, seq) one per key."""
    seq = q.shape[1]
    scores = q @ k.transpose(1, 2)
    if bias is not None:
        scores = scores + bias
    scores = scores * scale
    hidden = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(hidden, -math.inf)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    denominator = p.sum(-1, keepdim=True)   # the kernel sums P in fp32, before rounding it
    if round_p is not None:
        p = round_p(p)
    return p @ v / denominator


def scheme_output(name: str, q, k, v, scale, block: int, rotation) -> torch.Tensor:
    if name == "bf16":
        bf = [t.bfloat16().float() for t in (q, k, v)]
        return attention(*bf, scale, round_p=lambda p: p.bfloat16().float())
    # The name's parts: "fp8-pv-vchan" -> fp8, pv, vchan; "fp8-token+rot+smooth" -> ... smooth.
    options = re.split(r"[-+]", name)
    if "smooth" in options:  # q.(k - mean k) = q.k - q.mean k: the same for every key of a row
        k = k - k.mean(dim=1, keepdim=True)
    bias = None
    if "qsmooth" in options:  # q.k = (q - mean q).k + mean q.k, the last term exact
        q_mean = q.mean(dim=1, keepdim=True)
        bias = q_mean @ k.transpose(1, 2)
        q = q - q_mean
    if "rot" in options:
        q, k = q @ rotation, k @ rotation
    rows = block if "block" in options else 1 if "token" in options else None
    p_scale = torch.tensor(1.0 / E4M3_MAX)
    if "pv" in options:  # Q K^T in bf16
        q, k = q.bfloat16().float(), k.bfloat16().float()
    else:
        q, k = (e4m3(t, amax_scale(t, rows)) for t in (q, k))
    if "qk" in options:  # P @ V in bf16
        return attention(q, k, v.bfloat16().float(), scale,
                         round_p=lambda p: p.bfloat16().float())
    v_rows = 0 if "vchan" in options else block if rows == 1 else rows  # V per block at least
    v8 = e4m3(v, amax_scale(v, v_rows))
    return attention(q, k, v8, scale, round_p=lambda p: e4m3(p, p_scale), bias=bias)


PPL_COLUMNS = ["model", "text", "window", "tokens", "scheme", "ppl", "ppl_rel_diff"]


def scheme_attention(scheme: str, block: int, seed: int):
    """An attention function (transformers' AttentionInterface signature) computing ``scheme``
    (or plain fp32 attention for "fp32") per batch row, causal; K/V heads repeated for GQA; the
    rotation drawn once per head dim from ``seed``."""
    rotations: dict = {}

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        dim = query.shape[-1]
        if dim not in rotations:
            rotations[dim] = hadamard(dim, torch.Generator().manual_seed(seed))
        rotation = rotations[dim]
        group = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(group, 1)
        value = value.repeat_interleave(group, 1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        rows = []
        for b in range(query.shape[0]):
            q, k, v = (t[b].float() for t in (query, key, value))
            if scheme == "fp32":
                rows.append(attention(q, k, v, scale))
            else:
                rows.append(scheme_output(scheme, q, k, v, scale, block, rotation))
        return torch.stack(rows).transpose(1, 2).to(query.dtype), None
    return forward


@torch.inference_mode()
def perplexity_rows(text_files: list[Path], schemes: list[str], window: int, max_tokens: int,
                    block: int, seed: int, model_path=None, gguf_file=None):
    """Perplexity of each scheme as the model's attention, per text (the perplexity eval's
    window loop, one model copy per scheme: a model reads its attention from its config)."""
    import copy

    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from eval.perplexity import evaluate, find_default_model

    if model_path is None:
        model_path, gguf_file = find_default_model()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(model_path, **kwargs)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                attn_implementation="eager", **kwargs).eval()
    models = {}
    for scheme in ["fp32"] + schemes:
        name = f"fp8-numerics-{scheme}"
        AttentionInterface.register(name, scheme_attention(scheme, block, seed))
        models[scheme] = copy.deepcopy(base)
        models[scheme].set_attn_implementation(name)
    rows = []
    for path in text_files:
        ids = tokenizer(Path(path).read_text(encoding="utf-8", errors="replace"),
                        return_tensors="pt").input_ids[0, :max_tokens]
        ppl = {scheme: result["ppl"] for scheme, result in
               evaluate(models, ids, window, "cpu").items()}
        for scheme, value in ppl.items():
            rows.append(dict(model=Path(gguf_file or model_path).name, text=Path(path).stem,
                             window=window, tokens=ids.numel() // window * window, scheme=scheme,
                             ppl=f"{value:.4f}", ppl_rel_diff=f"{value / ppl['fp32'] - 1:.3e}"))
            print(f"fp8 perplexity {Path(path).stem} {scheme:16s} {value:.4f} "
                  f"({value / ppl['fp32'] - 1:+.2e})", flush=True)
    return rows


def make_inputs(heads, seq, dim, outliers, outlier_scale, generator):
    q, k, v = (torch.randn(heads, seq, dim, generator=generator, dtype=torch.float64)
               for _ in range(3))
    if outlier_scale:
        channels = torch.randperm(dim, generator=generator)[:outliers]
        q[..., channels] *= outlier_scale
        k[..., channels] *= outlier_scale
    return q, k, v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--outliers", type=int, default=4, help="channels made large")
    parser.add_argument("--outlier-scale", type=float, nargs="+", default=[20.0, 100.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-file", nargs="*", default=[],
                        help="texts for the perplexity rows (none: no perplexity rows)")
    parser.add_argument("--model", default=None, help="a transformers id or folder "
                        "(default: the perplexity eval's SmolLM2 GGUF)")
    parser.add_argument("--gguf-file", default=None)
    parser.add_argument("--window", type=int, default=1024, help="perplexity window (tokens)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.seq % args.block or args.head_dim & (args.head_dim - 1):
        raise SystemExit("--seq must be a multiple of --block and --head-dim a power of two")
    out_dir = output_dir(args.out, "fp8-numerics")
    writer = ResultsWriter(out_dir, "fp8_numerics", COLUMNS, argv)
    generator = torch.Generator().manual_seed(args.seed)
    rotation = hadamard(args.head_dim, generator)
    scale = 1.0 / math.sqrt(args.head_dim)
    for factor in [0.0] + list(args.outlier_scale):
        label = "gaussian" if not factor else f"outliers-x{factor:g}"
        q, k, v = make_inputs(args.heads, args.seq, args.head_dim, args.outliers, factor,
                              generator)
        # Softmax scale folded so the outlier runs are not one-hot: the scores' spread grows
        # with the outliers, and a real model's learned scale keeps it in range.
        run_scale = scale / max(1.0, factor * math.sqrt(args.outliers / args.head_dim))
        exact = attention(q, k, v, run_scale)
        for name in SCHEMES:
            out = scheme_output(name, q.float(), k.float(), v.float(), run_scale, args.block,
                                rotation)
            err = out.double() - exact
            rms = err.pow(2).mean().sqrt().item()
            row = dict(inputs=label, scheme=name, seq=args.seq, heads=args.heads,
                       head_dim=args.head_dim, block=args.block,
                       max_abs=f"{err.abs().max().item():.3e}", rms=f"{rms:.3e}",
                       rel_rms=f"{rms / exact.pow(2).mean().sqrt().item():.3e}")
            writer.add(row)
            print(f"fp8 numerics {label:14s} {name:14s} max {row['max_abs']} rms {row['rms']} "
                  f"rel {row['rel_rms']}", flush=True)
    print(f"fp8_numerics: {writer.finish()}")
    if args.text_file:
        if args.window % args.block:
            raise SystemExit("--window must be a multiple of --block")
        ppl = ResultsWriter(out_dir, "fp8_perplexity", PPL_COLUMNS, argv)
        for row in perplexity_rows(args.text_file, SCHEMES, args.window, args.max_tokens,
                                   args.block, args.seed, args.model, args.gguf_file):
            ppl.add(row)
        print(f"fp8_numerics: {ppl.finish()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
