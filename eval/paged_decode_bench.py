"""A continuous-batching decode step's attention: how fast the kernel reads a paged cache.

    python eval/paged_decode_bench.py
    python eval/paged_decode_bench.py --requests 32 256 --keys 1024 16384
    python eval/paged_decode_bench.py --queries 256 --requests 8 32 --keys 4096   # prefill chunks

Each point is one decode step of ``--requests`` requests (one query each, or ``--queries``: a
chunk of a prompt each, its last keys, causal) over ``--keys`` keys each, Llama-3-8B's
attention (32 query / 8 kv heads, D=128, bf16), the keys on pages of ``--page`` slots shuffled
over the cache as transformers' allocator leaves them. Modes:

* ``paged``: ``varlen_attention`` reading the cache through the slot list alone (a marking
  launch, then block loads and row gathers: what pages smaller than a key tile get);
* ``paged-pages``: the same told the slots are whole pages from each request's first key
  (``key_pages``: what ``flash_attn_with_kvcache`` says of a block table's rows, and
  "paged|tiled" of transformers 5.17-5.18's read indices): one launch of block loads, no
  marking launch and no row-gathering one;
* ``pages-as-kvcache``: ``paged-pages`` over the offsets and slot list that
  ``flash_attn_with_kvcache`` hands it (each request's block table row expanded to slots, an
  empty request after each real one: 2R requests in the launch's grid), none of its other
  steps: ``kvcache`` minus this is the call's bookkeeping, this minus ``paged-pages`` its layout;
* ``kvcache``: ``flash_attn_with_kvcache`` over the same pages as a block table, the request's
  last ``queries`` keys passed as its new tokens (written into the cache first, the values
  already there): the whole decode call of transformers 5.19+'s Hub-kernel route, with the
  launch that writes the new tokens and builds the offsets and slot list (torch steps on a
  CPU);
* ``gathered``: the same kernel on K/V already gathered into request order (no page lookups);
* ``gather+kernel``: ``index_select`` of K and V first, then ``gathered`` (what a step costs
  when the cache hands attention a gathered copy, as transformers' other paged backends do).

``read_tbps``: the K/V bytes a step must read over its time (back-to-back calls); ``tflops``:
the step's visible query-key pairs at 4 * D FLOPs each over the same time (what a prefill chunk,
bound by its MMAs rather than its reads, is measured by);
``vs_copy``: that over the copy rate (bytes read and written by a ``copy_`` of the same size,
measured in the same process). Back to back, a short step can time the host's work instead
(on an H100 both agreed within 5% from 134 MB up: perf-notes step 63); ``graph_ms``,
``graph_read_tbps`` and ``graph_vs_copy`` time the same calls replayed from a CUDA graph, as a
server that captures its steps runs them (transformers 5.25's Hub-kernel route by default,
5.17-5.18 with ``use_cuda_graph=True``): the GPU's time. Not for ``gather+kernel``, whose
copies a graph would hold on to beside the cache (256 x 16k keys: 17 GB more). Results:
eval/results/<gpu>/serve/paged_decode.csv. Without a GPU a few tiny points run through the CPU
reference path (numbers say nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eval.common import ResultsWriter, output_dir  # noqa: E402
from hf_tiled_attention import varlen_attention  # noqa: E402
from hf_tiled_attention.flash_interface import (_append_in_torch, _layout,  # noqa: E402
                                                flash_attn_with_kvcache, slot_list)
from hf_tiled_attention.varlen import varlen_attention_on_pages  # noqa: E402
from hf_tiled_attention.timing import (back_to_back_ms, graph_replay_ms,  # noqa: E402
                                       median_ms)

COLUMNS = ["requests", "queries", "keys", "heads_q", "heads_kv", "head_dim", "page", "mode",
           "kv_mb", "ms", "read_tbps", "tflops", "copy_tbps", "vs_copy", "graph_ms",
           "graph_read_tbps", "graph_vs_copy", "max_err_vs_gathered"]
MODES = ["paged", "paged-pages", "pages-as-kvcache", "kvcache", "gathered", "gather+kernel"]


def decode_step(requests: int, keys: int, heads_q: int, heads_kv: int, head_dim: int,
                page: int, device: str, dtype, seed: int = 0, queries: int = 1):
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per = -(-keys // page)
    pages = requests * pages_per
    order = torch.randperm(pages, generator=g, device=device)
    within = torch.arange(keys, device=device)
    slots = (order.view(requests, pages_per)[:, within // page] * page + within % page).flatten()
    cache_k = torch.randn(pages * page, heads_kv, head_dim, generator=g, device=device,
                          dtype=dtype)
    cache_v = torch.randn(pages * page, heads_kv, head_dim, generator=g, device=device,
                          dtype=dtype)
    q = torch.randn(requests * queries, heads_q, head_dim, generator=g, device=device,
                    dtype=dtype)
    # transformers hands the cu_seqlens as slices of larger static buffers (5.17's
    # continuous_batching/input_outputs.py), which the call reads in place; a tensor of exactly
    # R + 1 rows costs it a copy kernel each (varlen._rows_of_16), so slice one here too.
    starts = torch.arange(-(-(requests + 1) // 16) * 16, device=device, dtype=torch.int32)
    cu_q, cu_k = (starts * queries)[:requests + 1], (starts * keys)[:requests + 1]
    return q, cache_k, cache_v, slots, cu_q, cu_k


def kvcache_layout(table: torch.Tensor, keys: int, queries: int, page: int):
    """The offsets and slot list ``flash_attn_with_kvcache`` hands the varlen call for a block
    table whose requests hold ``keys`` keys each (its own shape-fixed layout, the lengths added
    as it adds them): request ``b``'s queries and keys, then an empty request to the end of its
    table row; the rows expanded to slots."""
    requests, max_pages = table.shape
    cu_q, cu_k_starts, offsets = _layout(requests, queries, max_pages, page, table.device)
    slots = slot_list(table, offsets, page)
    lengths = torch.full((requests,), keys, dtype=torch.int32, device=table.device)
    cu_k = _append_in_torch(slots, lengths, None, None, None, None, cu_k_starts, table.device)
    return cu_q, cu_k[:2 * requests + 1], slots.flatten()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=None)
    parser.add_argument("--keys", type=int, nargs="+", default=None)
    parser.add_argument("--queries", type=int, nargs="+", default=[1],
                        help="queries per request: 1 a decode step, more a prefill chunk")
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=256)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.queries) < 1:
        parser.error(f"--queries must be at least 1, got {args.queries}")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if not cuda:
        print("paged_decode_bench: no CUDA GPU here; tiny points through the CPU reference path "
              "(numbers say nothing).")
    requests_list = args.requests or ([32, 64, 128, 256] if cuda else [4])
    keys_list = args.keys or ([1024, 4096, 16384] if cuda else [300])
    out_dir = output_dir(args.out, "serve")
    writer = ResultsWriter(out_dir, "paged_decode", COLUMNS, argv)
    reps = args.reps if cuda else 2
    points = [(r, k, n) for r in requests_list for k in keys_list for n in args.queries]
    if any(n > k for _, k, n in points):
        parser.error(f"--queries {args.queries} must not exceed --keys {keys_list}: a "
                     "request's queries are its last keys")
    for requests, keys, queries in points:
        q, cache_k, cache_v, slots, cu_q, cu_k = decode_step(
            requests, keys, *args.heads, args.head_dim, args.page, device, dtype,
            queries=queries)
        pairs = requests * (queries * keys - queries * (queries - 1) // 2)  # causal
        flops = 4 * args.heads[0] * args.head_dim * pairs
        kv_bytes = 2 * slots.numel() * args.heads[1] * args.head_dim * q.element_size()
        k_flat, v_flat = cache_k[slots], cache_v[slots]
        copy_src = torch.empty(kv_bytes // 2, dtype=torch.int16, device=device)
        copy_dst = torch.empty_like(copy_src)
        if cuda:
            copy_ms = back_to_back_ms(copy_dst.copy_, [(copy_src,)], reps=reps)
        else:
            copy_ms = median_ms(copy_dst.copy_, [(copy_src,)], cuda=False, reps=reps)
        copy_tbps = 2 * kv_bytes / copy_ms / 1e9
        # freed before the gather+kernel mode makes its copies: with them 256 x 16k keys
        # (17 GB of K/V) ran out of an 80 GB H100's memory
        del copy_src, copy_dst
        out = torch.empty_like(q)
        # the block table behind the slots (each request's slots start on a page), and the
        # request's last keys as the new tokens flash_attn_with_kvcache writes before reading
        table = (slots.view(requests, keys)[:, ::args.page] // args.page).to(torch.int32)
        pages = (-1, args.page, *cache_k.shape[1:])
        new_k, new_v = (flat.view(requests, keys, *flat.shape[1:])[:, keys - queries:]
                        for flat in (k_flat, v_flat))
        seqlens = torch.full((requests,), keys - queries, dtype=torch.int32, device=device)
        q_rows = q.view(requests, queries, *q.shape[1:])
        cu_q_call, cu_k_call, slots_call = kvcache_layout(table, keys, queries, args.page)
        calls = {
            "paged": lambda: varlen_attention(q, cache_k, cache_v, cu_q, cu_k, queries,
                                              key_slots=slots, out=out),
            "paged-pages": lambda: varlen_attention_on_pages(
                q, cache_k, cache_v, cu_q, cu_k, queries, key_slots=slots, key_pages=args.page,
                out=out),
            "pages-as-kvcache": lambda: varlen_attention_on_pages(
                q, cache_k, cache_v, cu_q_call, cu_k_call, queries, key_slots=slots_call,
                key_pages=args.page, out=out),
            "kvcache": lambda: flash_attn_with_kvcache(
                q_rows, cache_k.view(pages), cache_v.view(pages), new_k, new_v,
                cache_seqlens=seqlens, block_table=table, causal=True).flatten(0, 1),
            "gathered": lambda: varlen_attention(q, k_flat, v_flat, cu_q, cu_k, queries,
                                                 out=out),
            "gather+kernel": lambda: varlen_attention(
                q, cache_k.index_select(0, slots), cache_v.index_select(0, slots), cu_q,
                cu_k, queries, out=out),
        }
        reference = calls["gathered"]().clone()
        for mode, call in calls.items():
            err = (call().float() - reference.float()).abs().max().item()
            graph = dict(graph_ms="", graph_read_tbps="", graph_vs_copy="")
            if not cuda:
                ms = median_ms(call, [()], cuda=False, reps=reps)
            else:
                ms = back_to_back_ms(call, [()], reps=reps)
                if mode != "gather+kernel":
                    graph_ms = graph_replay_ms(call, calls=min(reps, 20))
                    graph_read = kv_bytes / graph_ms / 1e9
                    graph = dict(graph_ms=f"{graph_ms:.4f}",
                                 graph_read_tbps=f"{graph_read:.3f}",
                                 graph_vs_copy=f"{graph_read / copy_tbps:.3f}")
            read = kv_bytes / ms / 1e9
            row = dict(requests=requests, queries=queries, keys=keys,
                       heads_q=args.heads[0], heads_kv=args.heads[1],
                       head_dim=args.head_dim, page=args.page, mode=mode,
                       kv_mb=f"{kv_bytes / 1e6:.1f}", ms=f"{ms:.4f}",
                       read_tbps=f"{read:.3f}", tflops=f"{flops / ms / 1e9:.1f}",
                       copy_tbps=f"{copy_tbps:.3f}",
                       vs_copy=f"{read / copy_tbps:.3f}", **graph,
                       max_err_vs_gathered=f"{err:.2e}")
            writer.add(row)
            in_graph = f", graph {graph['graph_ms']} ms ({graph['graph_vs_copy']}x)" \
                if graph["graph_ms"] else ""
            print(f"paged step R={requests} queries={queries} keys={keys} {mode}: "
                  f"{ms:.4f} ms, {flops / ms / 1e9:.1f} TF/s, "
                  f"{kv_bytes / 1e6:.0f} MB, {read:.2f} TB/s ({read / copy_tbps:.2f}x copy "
                  f"{copy_tbps:.2f}){in_graph}, err {err:.1e}", flush=True)
        del q, cache_k, cache_v, slots, k_flat, v_flat, new_k, new_v, q_rows, slots_call
    print(f"paged_decode_bench: {writer.finish()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
