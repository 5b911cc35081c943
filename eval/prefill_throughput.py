"""Prefill throughput of whole models: `tiled` (and `tiled_fp8`) against `sdpa` and `eager`.

    python eval/prefill_throughput.py                              # Llama-3-8B and Mistral-7B shapes
    python eval/prefill_throughput.py --shapes llama3-8b --seq 2048 8192 32768 --layers 8
    python eval/prefill_throughput.py --model /path/to/model --seq 4096 --pad-fraction 0.25
    python eval/prefill_throughput.py --backends tiled_fp8 tiled sdpa --seq 8192 16384 32768

`tiled_fp8` (FP8 attention) runs in bf16/fp16 only (a CPU run in fp32 leaves it out unless
``--dtype bf16``), and a padded batch, which it refuses, is recorded as `unsupported`.

Models are built from configs with random weights (no download); each backend's model gets its
own config object. Reports tokens/s (median of repeats, CUDA events), latency and peak GPU memory;
an out-of-memory run is recorded as `oom`. Results: eval/results/<gpu>/prefill.csv and plots.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention  # noqa: E402,F401  (registers attn_implementation="tiled")
from eval.common import (DTYPES, ResultsWriter, label_lengths, output_dir,  # noqa: E402
                         save_figure)
from eval.models import SHAPES, build_config, build_models, model_device  # noqa: E402
from hf_tiled_attention.timing import median_ms  # noqa: E402

BACKENDS = ["tiled", "tiled_fp8", "sdpa", "eager"]
COLUMNS = ["model", "layers", "backend", "batch", "seq", "pad_fraction", "tokens_per_s", "ms",
           "peak_gib", "status", "reason"]

def make_batch(batch: int, seq: int, pad_fraction: float, vocab: int, device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    mask = None
    if pad_fraction > 0:
        # Left padding, growing along the batch: row b has (b+1)/B * pad_fraction of its tokens padded.
        mask = torch.ones(batch, seq, dtype=torch.long, device=device)
        for b in range(batch):
            pad = int(seq * pad_fraction * (b + 1) / batch)
            mask[b, :pad] = 0
    return ids, mask


@torch.inference_mode()
def measure(model, ids, mask, warmup: int, reps: int) -> tuple[float, float]:
    """(median ms, peak GiB) of one prefill forward, logits for the last position only."""
    def forward():
        model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)

    if ids.is_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(forward, cuda=ids.is_cuda, warmup=warmup, reps=reps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if ids.is_cuda else float("nan")
    return ms, peak


def plot(rows: list[dict], out_dir: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(r["model"], r["batch"], r["pad_fraction"]) for r in rows})
    # Peak GPU memory exists only on a GPU (left empty on the CPU): no empty panel there.
    with_memory = any(r["status"] == "ok" and r["peak_gib"] for r in rows)
    columns = 2 if with_memory else 1
    fig, axes = plt.subplots(len(groups), columns, figsize=(5.5 * columns, 3.2 * len(groups)),
                             squeeze=False)
    for (model, batch, pad), panels in zip(groups, axes):
        for backend in BACKENDS:
            pts = sorted((r["seq"], float(r["tokens_per_s"]), float(r["peak_gib"] or "nan"))
                         for r in rows
                         if (r["model"], r["batch"], r["pad_fraction"], r["backend"]) ==
                         (model, batch, pad, backend) and r["status"] == "ok")
            for ax, column in zip(panels, (1, 2)):
                if pts:
                    ax.plot([p[0] for p in pts], [p[column] for p in pts], marker="o",
                            label=backend)
        title = f"{model} batch={batch} pad={pad}"
        seqs = sorted({r["seq"] for r in rows if r["model"] == model})
        for ax, ylabel in zip(panels, ("tokens/s", "peak GiB")):
            ax.set(xscale="log", xlabel="sequence length", ylabel=ylabel, title=title)
            label_lengths(ax, seqs)
            ax.legend(fontsize=7)
    return save_figure(fig, out_dir / "prefill.png", dpi=80, measured_on_gpu=with_memory)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=None, choices=list(SHAPES))
    parser.add_argument("--model", default=None, help="also measure a real model (id or path)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the config-built models")
    parser.add_argument("--seq", type=int, nargs="+", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--pad-fraction", type=float, nargs="+", default=[0.0],
                        help="left-pad up to this fraction of each row (0 = no padding)")
    parser.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="default bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    on_gpu, device, dtype = model_device("prefill")
    dtype = DTYPES[args.dtype] if args.dtype else dtype
    if dtype == torch.float32:  # FP8 attention quantises 16-bit activations only
        args.backends = [b for b in args.backends if b != "tiled_fp8"]
    shapes = args.shapes if args.shapes is not None else (
        ["llama3-8b", "mistral-7b"] if on_gpu else ["tiny-llama"])
    seqs = args.seq or ([512, 2048, 8192, 16384, 32768] if on_gpu else [64, 256])
    warnings.simplefilter("ignore")
    out_dir = output_dir(args.out)
    results = ResultsWriter(out_dir, "prefill", COLUMNS, argv)
    targets = [(name, build_config(name, args.layers)) for name in shapes]
    if args.model:
        from transformers import AutoConfig
        targets.append((args.model, AutoConfig.from_pretrained(args.model)))
    for name, config in targets:
        models = build_models(args.backends, config, dtype, device)
        for batch in args.batch:
            for pad in args.pad_fraction:
                for seq in seqs:
                    ids, mask = make_batch(batch, seq, pad, config.vocab_size, device)
                    for backend, model in models.items():
                        row = dict(model=name, layers=config.num_hidden_layers, backend=backend,
                                   batch=batch, seq=seq, pad_fraction=pad, tokens_per_s="",
                                   ms="", peak_gib="", status="ok", reason="")
                        try:
                            ms, peak = measure(model, ids, mask, args.warmup, args.reps)
                            row.update(ms=f"{ms:.3f}", peak_gib=f"{peak:.2f}" if on_gpu else "",
                                       tokens_per_s=f"{batch * seq / ms * 1e3:.0f}")
                        except torch.cuda.OutOfMemoryError as exc:
                            row.update(status="oom", reason=str(exc).splitlines()[0][:120])
                        except ValueError as exc:  # a call the backend refuses (FP8: padding)
                            if backend != "tiled_fp8":
                                raise
                            row.update(status="unsupported",
                                       reason=str(exc).splitlines()[0][:120])
                        results.add(row)
                        print(" ".join(f"{k}={v}" for k, v in row.items() if v != ""), flush=True)
                        if on_gpu:
                            torch.cuda.empty_cache()
        del models
    csv_path = results.finish(extra={"dtype": str(dtype)})
    print(f"csv: {csv_path}\nplot: {plot(results.rows, out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
