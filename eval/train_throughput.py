"""Training-step throughput of a whole model: `tiled` against `sdpa`, `flex_attention` and
`eager`, taking turns step by step on one model.

    python eval/train_throughput.py                        # Llama-3-8B shape, 8 layers, bf16
    python eval/train_throughput.py --batchings packed-16k --reps 5

A step is the forward, the backward and an AdamW step, timed with CUDA events between
synchronisations. One model and one optimizer serve every backend: the backends take turns
step by step (``model.set_attn_implementation``), so each runs on the same weights as the others
at that moment, and a slow or noisy stretch of the GPU falls on all of them. Each backend's first
step per batching is a warm-up (kernel compilation, FlexAttention's torch.compile) and is not
timed. ``tokens_per_s`` counts the real tokens (padding excluded); ``peak_gib`` is the step's
peak GPU memory (empty on a CPU); ``loss_first`` / ``loss_last`` the backend's first and last timed losses (the
weights move a little between them: learning rate 1e-5).

Batchings: ``unpadded-8k`` / ``unpadded-16k`` (B=1), ``padded-4k`` (B=4, rows right-padded by a
quarter to a half), ``packed-16k`` (one 16k-token row of documents of 256-4096 tokens, made by
transformers' DataCollatorWithFlattening: position ids restart per document; no cache, so
transformers masks the documents for sdpa, flex and eager, and tiled reads them from the
position ids); ``packed-32k``, the same at 32k tokens, only when named. An out-of-memory step
is recorded as ``oom``.

``--bias alibi``: a learnable-bias model, the same shape with trainable ALiBi slopes (fp32, one
per query head and layer, in the optimizer) added to its causal scores, unpadded batchings
only: tiled runs them as a score_mod (the backward kernels add the slopes' gradient), flex as
the same score_mod, sdpa as a dense (1, H, S, S) additive mask that carries their gradient. Results:
eval/results/<gpu>/train/train.csv and environment.json. Without a GPU: a tiny model at a
64th of the lengths through the reference path (rows labelled by their real length,
``unpadded-128``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention  # noqa: E402,F401  (registers attn_implementation="tiled")
from eval.common import ResultsWriter, output_dir  # noqa: E402
from eval.models import build_config, model_device  # noqa: E402

BACKENDS = ["tiled", "sdpa", "flex_attention", "eager"]
BIAS_BACKENDS = ["tiled", "sdpa", "flex_attention"]  # --bias alibi
BATCHINGS = ["unpadded-8k", "unpadded-16k", "padded-4k", "packed-16k"]
# Run when named: a 32k packed row (expected about twice the 16k row's peak, 64 GiB on the H200).
LONG_BATCHINGS = ["packed-32k"]
COLUMNS = ["model", "layers", "backend", "batching", "batch", "seq", "tokens_per_s", "ms",
           "peak_gib", "loss_first", "loss_last", "status", "reason"]
# Eager attention materialises (B, H, S, S) scores per layer: only up to this many per row.
EAGER_MAX_SEQ = 4096


def make_batch(batching: str, vocab: int, device, scale: int = 1) -> dict:
    """The model inputs of one batching (``scale`` divides the lengths: the CPU run)."""
    gen = torch.Generator().manual_seed(0)
    kind, size = batching.split("-")
    seq = int(size.removesuffix("k")) * 1024 // scale
    if kind == "unpadded":
        ids = torch.randint(3, vocab, (1, seq), generator=gen)
        return dict(input_ids=ids, labels=ids)
    if kind == "padded":
        batch = 4
        ids = torch.randint(3, vocab, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.long)
        for b in range(batch):  # a quarter to a half of each row is padding, on the right
            mask[b, seq - int(seq * (0.25 + 0.25 * b / (batch - 1))):] = 0
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    from transformers import DataCollatorWithFlattening
    docs, total = [], 0
    while total < seq:
        n = min(int(torch.randint(256 // scale, 4096 // scale + 1, (1,), generator=gen)),
                seq - total)
        docs.append({"input_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()})
        total += n
    return dict(DataCollatorWithFlattening(return_tensors="pt")(docs))


def batching_label(batching: str, scale: int) -> str:
    """The batching's name with the row length it really has: ``unpadded-8k`` on the GPU,
    ``unpadded-128`` for the CPU run's lengths (divided by ``scale``)."""
    kind, size = batching.split("-")
    return batching if scale == 1 else f"{kind}-{int(size.removesuffix('k')) * 1024 // scale}"


def real_tokens(batch: dict) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def training_model(shape: str, layers: int, device, dtype, backend: str):
    """``(config, model)``: ``shape``'s model with ``layers`` layers and random weights on
    ``device``, in training mode, its attention ``backend``."""
    from transformers import AutoModelForCausalLM
    config = build_config(shape, layers)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=backend)
    return config, model.train()


def step(model, optimizer, batch: dict, cuda: bool) -> tuple[float, float, float]:
    """(ms, loss, peak GiB) of one training step."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    optimizer.step()
    if cuda:
        end.record()
        end.synchronize()
        return start.elapsed_time(end), loss.item(), torch.cuda.max_memory_allocated() / 2**30
    return (time.perf_counter() - t0) * 1e3, loss.item(), float("nan")


def alibi_attention(backend: str):
    """The attention function, for ``backend``, of a layer that adds its learnable ALiBi
    slopes (``module.alibi_slopes``) to causal scores; registered as ``alibi-<backend>``."""
    import torch.nn.functional as F

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
        slopes = module.alibi_slopes

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        seq = query.shape[2]
        if backend == "tiled":
            out = hf_tiled_attention.tiled_attention(query, key, value, is_causal=True,
                                                     scale=scaling, score_mod=score_mod)
        elif backend == "flex_attention":
            out = _flex()(query, key, value, score_mod=score_mod, block_mask=_causal_blocks(
                seq, query.device), scale=scaling, enable_gqa=True)
        else:
            distance = torch.arange(seq, device=query.device)
            distance = (distance[None, :] - distance[:, None]).float()
            bias = (slopes[:, None, None] * distance).masked_fill(distance > 0, float("-inf"))
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias[None].to(
                query.dtype), scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return attention


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _causal_blocks(seq: int, device):
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, q, kv: kv <= q, None, None, seq, seq, device=device)


def with_alibi(model, backends: list[str]) -> list[str]:
    """Gives every attention layer of ``model`` learnable ALiBi slopes and registers
    :func:`alibi_attention` for ``backends``; returns the names to switch between."""
    from transformers import AttentionInterface

    from hf_tiled_attention.variants import alibi_slopes
    for layer in model.model.layers:
        attn = layer.self_attn
        heads = model.config.num_attention_heads
        attn.alibi_slopes = torch.nn.Parameter(alibi_slopes(heads).to(attn.q_proj.weight.device))
    names = []
    for backend in backends:
        AttentionInterface.register(f"alibi-{backend}", alibi_attention(backend))
        names.append(f"alibi-{backend}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None, help="eval/models.py shape (default: "
                        "llama3-8b on a GPU, tiny-llama on a CPU)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batchings", nargs="+", default=BATCHINGS,
                        choices=BATCHINGS + LONG_BATCHINGS)
    parser.add_argument("--backends", nargs="+", default=None, choices=BACKENDS)
    parser.add_argument("--reps", type=int, default=3, help="timed steps per backend")
    parser.add_argument("--bias", choices=["none", "alibi"], default="none",
                        help="alibi: the learnable-bias model (see the module docstring)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    on_gpu, device, dtype = model_device("train_throughput")
    shape = args.shape or ("llama3-8b" if on_gpu else "tiny-llama")
    backends = args.backends or (BACKENDS if on_gpu else ["tiled", "sdpa", "eager"])
    if args.bias == "alibi":
        backends = args.backends or (BIAS_BACKENDS if on_gpu else ["tiled", "sdpa"])
        if any(not b.startswith("unpadded") for b in args.batchings):
            raise SystemExit("train_throughput: --bias alibi runs the unpadded batchings only "
                             "(its attention functions apply the causal rule alone), got "
                             f"{args.batchings}")
        if any(b not in BIAS_BACKENDS for b in backends):
            raise SystemExit(f"train_throughput: --bias alibi runs {BIAS_BACKENDS}, got "
                             f"{backends}")
    scale = 1 if on_gpu else 64
    warnings.simplefilter("ignore")
    out_dir = output_dir(args.out, "train")
    results = ResultsWriter(out_dir, "train", COLUMNS, argv)

    config, model = training_model(shape, args.layers, device, dtype, backends[0])
    if args.bias == "alibi":
        backends = with_alibi(model, backends)
        shape = f"{shape}+alibi"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for batching in args.batchings:
        batch = {k: v.to(device) for k, v in make_batch(batching, config.vocab_size, device,
                                                        scale).items()}
        rows, seq = batch["input_ids"].shape
        runs = {b: dict(ms=[], loss=[], peak=0.0, status="ok", reason="") for b in backends}
        if "eager" in runs and seq > EAGER_MAX_SEQ // scale:
            runs["eager"].update(status="skipped", reason=f"eager attention stores (B, H, S, S) "
                                 f"scores per layer; run up to S={EAGER_MAX_SEQ // scale}")
        for rep in range(args.reps + 1):  # rep 0: each backend's warm-up step
            for backend in backends:
                run = runs[backend]
                if run["status"] != "ok":
                    continue
                model.set_attn_implementation(backend)
                try:
                    ms, loss, peak = step(model, optimizer, batch, on_gpu)
                except torch.OutOfMemoryError as exc:
                    run.update(status="oom", reason=str(exc).split("\n")[0][:200])
                    optimizer.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                    continue
                except Exception as exc:  # a backend that cannot train this batching
                    run.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:300])
                    optimizer.zero_grad(set_to_none=True)
                    continue
                if rep:
                    run["ms"].append(ms)
                    run["loss"].append(loss)
                    run["peak"] = max(run["peak"], peak)
        for backend, run in runs.items():
            label = batching_label(batching, scale)
            row = dict(model=shape, layers=args.layers, backend=backend, batching=label,
                       batch=rows, seq=seq, status=run["status"], reason=run["reason"])
            if run["status"] == "ok" and run["ms"]:
                ms = statistics.median(run["ms"])
                row.update(ms=f"{ms:.2f}", tokens_per_s=f"{real_tokens(batch) / ms * 1e3:.1f}",
                           peak_gib=f"{run['peak']:.2f}" if on_gpu else "",
                           loss_first=f"{run['loss'][0]:.4f}",
                           loss_last=f"{run['loss'][-1]:.4f}")
            peak = (f"{row['peak_gib']} GiB" if row.get("peak_gib") else
                    "n/a (CPU)" if not on_gpu else "-")
            results.add(row)
            print(f"train {label:13s} {backend:15s} {row['status']:8s} "
                  f"{row.get('tokens_per_s', '-'):>10s} tokens/s {row.get('ms', '-'):>9s} ms "
                  f"peak {peak} loss {row.get('loss_first', '-')} -> "
                  f"{row.get('loss_last', '-')} {row['reason'][:80]}", flush=True)
        optimizer.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.empty_cache()
    print(f"train_throughput: {results.finish()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
