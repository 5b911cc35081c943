"""A decode step's attention from the FP8 KV cache against the bf16 cache.

    python eval/fp8_cache_decode_bench.py
    python eval/fp8_cache_decode_bench.py --batch 1 8 --keys 16384 65536

Each point is one decode step (one query per row) of ``--batch`` rows over ``--keys`` cached
keys each, Llama-3-8B's attention (32 query / 8 kv heads, D=128, bf16 queries). Modes:

* ``fp8_cache``: what "tiled" runs over the FP8 cache's rows (fp8_cache_attention.decode_step:
  the query rotated as the keys, then the decode kernel; ``D + 16`` bytes per token and head,
  0.56x bf16's);
* ``bf16_tiled``: the bf16 kernel over bf16 K/V (``tiled_attention``, the "tiled" decode);
* ``bf16_sdpa``: torch's SDPA over the same bf16 K/V (GQA without repeating them).

``kv_mb``: the bytes a step reads in that mode; ``read_tbps``: those over its time (back-to-back
calls); ``vs_bf16_tiled``: bf16_tiled's time over this mode's; ``rel_err``: the output's
relative RMS error against the fp64 definition on the bf16 K/V (FP8 rounding included;
the first batch row). ``graph_ms`` and ``graph_vs_bf16_tiled``: the same calls replayed from a
CUDA graph (no host work between them: the GPU's time, where a short step back to back times
the host).
Results: eval/results/<gpu>/decode/fp8_cache.csv. Without a GPU a tiny point runs through the
CPU path (the dequantised rows; numbers say nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eval.common import ResultsWriter, parse_heads, output_dir  # noqa: E402
from hf_tiled_attention import tiled_attention  # noqa: E402
from hf_tiled_attention.fp8_cache import (dequantize_rows, keys_from_rows,  # noqa: E402
                                          quantize_keys, quantize_rows)
from hf_tiled_attention.timing import (back_to_back_ms, graph_replay_ms,  # noqa: E402
                                       median_ms)

COLUMNS = ["batch", "keys", "heads_q", "heads_kv", "head_dim", "mode", "kv_mb", "ms",
           "read_tbps", "vs_bf16_tiled", "graph_ms", "graph_vs_bf16_tiled", "rel_err"]
MODES = ["fp8_cache", "bf16_tiled", "bf16_sdpa"]


def fp8_cache_step(query, key_rows, value_rows):
    """What "tiled" runs for a decode step over FP8 rows: the query rotated as the keys and
    the decode kernel on a GPU, the dequantised rows elsewhere."""
    if query.is_cuda:
        from hf_tiled_attention.fp8_cache_attention import decode_step
        return decode_step(query, key_rows, value_rows, causal=True)
    return tiled_attention(query, keys_from_rows(key_rows, query.dtype),
                           dequantize_rows(value_rows, query.dtype), is_causal=True)


def rel_err(out: torch.Tensor, q, k, v) -> float:
    """Relative RMS error against fp64 attention on the bf16 K/V (the decode step's one query
    sees every key), on the first batch row (the fp64 copies of every row would not fit)."""
    out, q, k, v = out[:1], q[:1], k[:1], v[:1]
    group = q.shape[1] // k.shape[1]
    kd, vd = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = (q.double() @ kd.transpose(2, 3)) * q.shape[-1] ** -0.5
    want = torch.softmax(scores, -1) @ vd
    return ((out.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--keys", type=int, nargs="+", default=None)
    parser.add_argument("--heads", type=parse_heads, default=(32, 8), help="Hq/Hkv, e.g. 32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    if not cuda:
        print("fp8_cache_decode_bench: no CUDA GPU here; a tiny point through the CPU path "
              "(numbers say nothing).")
    batches = args.batch or ([1, 8, 32] if cuda else [2])
    keys_list = args.keys or ([4096, 16384, 65536] if cuda else [300])
    heads_q, heads_kv = args.heads
    dim = args.head_dim
    out_dir = output_dir(args.out, "decode")
    writer = ResultsWriter(out_dir, "fp8_cache", COLUMNS, argv)
    reps = args.reps if cuda else 2
    for batch in batches:
        for keys in keys_list:
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(batch, heads_q, 1, dim, generator=g, device=device, dtype=dtype)
            k, v = (torch.randn(batch, heads_kv, keys, dim, generator=g, device=device,
                                dtype=dtype) for _ in range(2))
            k_rows, v_rows = quantize_keys(k), quantize_rows(v)
            calls = {
                "fp8_cache": (lambda: fp8_cache_step(q, k_rows, v_rows),
                              k_rows.nbytes + v_rows.nbytes),
                "bf16_tiled": (lambda: tiled_attention(q, k, v, is_causal=True),
                               k.nbytes + v.nbytes),
                "bf16_sdpa": (lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=False, enable_gqa=True), k.nbytes + v.nbytes),
            }
            measured = {}
            for mode, (call, nbytes) in calls.items():
                err = rel_err(call(), q, k, v)
                if cuda:
                    ms = back_to_back_ms(call, [()], reps=reps)
                    graph_ms = graph_replay_ms(call, calls=min(reps, 20))
                else:
                    ms, graph_ms = median_ms(call, [()], cuda=False, reps=reps), None
                measured[mode] = (ms, graph_ms, nbytes, err)
            bf16_ms, bf16_graph_ms = measured["bf16_tiled"][:2]
            for mode, (ms, graph_ms, nbytes, err) in measured.items():
                read = nbytes / ms / 1e9
                graph = dict(graph_ms="", graph_vs_bf16_tiled="") if graph_ms is None else dict(
                    graph_ms=f"{graph_ms:.4f}",
                    graph_vs_bf16_tiled=f"{bf16_graph_ms / graph_ms:.3f}")
                writer.add(dict(batch=batch, keys=keys, heads_q=heads_q, heads_kv=heads_kv,
                                head_dim=dim, mode=mode, kv_mb=f"{nbytes / 1e6:.3f}",
                                ms=f"{ms:.4f}", read_tbps=f"{read:.3f}",
                                vs_bf16_tiled=f"{bf16_ms / ms:.3f}", **graph,
                                rel_err=f"{err:.2e}"))
                in_graph = f", graph {graph['graph_ms']} ms" if cuda else ""
                print(f"fp8 cache decode B={batch} keys={keys} {mode}: {ms:.4f} ms, "
                      f"{nbytes / 1e6:.0f} MB, {read:.2f} TB/s{in_graph}, rel err {err:.1e}",
                      flush=True)
            del q, k, v, k_rows, v_rows
    print(f"fp8_cache_decode_bench: {writer.finish()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
