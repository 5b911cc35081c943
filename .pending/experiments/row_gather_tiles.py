"""Experiment (session 57, for a device session): the decode launch that gathers the cache row
by row, at 128 keys a tile (today's, schedule.varlen_tiles) against 64 and 32.

    python .pending/experiments/row_gather_tiles.py
    POINTS="[(64, 1024)]" python .pending/experiments/row_gather_tiles.py

That launch serves the requests whose key tiles are not whole blocks of the cache (pages
smaller than a tile, the index-based cache, transformers 5.17's sliding-window layers).
Compiled for sm_90 on the 32-bit entry (cuTile's exporter, eval/inspect_cubin.report; 64
requests x 1k keys over pages of 16, 32/8 heads, D=128, bf16) it spills at 128 keys a tile:
128 registers, 592 B of stack, 25,368 instructions; at 64 keys 136 B and 14,944; at 32 keys
136 B and 9,576 (perf-notes step 77 saw the spills; session 57 the smaller tiles). Block
loads stay at 128 keys (faster than 64 on an H100, perf-notes step 57); this times only the
row gathers. Each point times the whole paged call (its marking launch finds no whole
block, so the row launch reads every request), with the row launch's key tile at 128, 64
and 32, in one process from CUDA graphs, order alternated, and checks each output against
the gathered call's. Run it on the 32-bit entry (paged-32bit-entry.mbox applied) or on main
(64-bit entry: the numbers then say what the tiles do there).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from eval.paged_decode_bench import decode_step  # noqa: E402
from hf_tiled_attention import varlen  # noqa: E402
from hf_tiled_attention import varlen_kernel as K  # noqa: E402
from hf_tiled_attention.launch import current_stream  # noqa: E402
from hf_tiled_attention.timing import graph_replay_ms  # noqa: E402

import cuda.tile as ct  # noqa: E402

PAGE = 16  # smaller than any key tile: every request is read by the row launch
TILES = (128, 64, 32)


def with_row_tile(parts, keys_per_tile):
    """The call's launches with the row-gathering one's key tile set to ``keys_per_tile``."""
    changed = []
    for kernel, grid, args in parts:
        constants = args[-1]
        if kernel is not K.whole_tile_requests_kernel and constants[K.PAGED] \
                and not constants[K.BLOCKS]:
            constants = tuple(keys_per_tile if i == K.TILE_N else c
                              for i, c in enumerate(constants))
            args = args[:-1] + (constants,)
        changed.append((kernel, grid, args))
    return changed


def run(parts, device):
    def fn():
        stream = current_stream(device)
        for kernel, grid, args in parts:
            ct.launch(stream, grid, kernel, args)
    return fn


points = eval(os.environ.get("POINTS", "[(32, 2048), (64, 1024), (256, 1024), (32, 4096)]"))
for requests, keys in points:
    q, ck, cv, slots, cu_q, cu_k = decode_step(requests, keys, 32, 8, 128, PAGE, "cuda",
                                               torch.bfloat16)
    kf, vf = ck[slots], cv[slots]
    scale = q.shape[-1] ** -0.5
    want = varlen.varlen_attention(q, kf, vf, cu_q, cu_k, 1).float()
    mb = 2 * kf.numel() * kf.element_size() / 1e6
    outs, calls = {}, {}
    for n in TILES:
        outs[n] = torch.full_like(q, float("nan"))
        parts = varlen.launches(q, ck, cv, cu_q, cu_k, 1, scale, None, None, None, slots,
                                outs[n])
        calls[n] = run(with_row_tile(parts, n), q.device)
        calls[n]()
    torch.cuda.synchronize()
    errors = {n: (outs[n].float() - want).abs().max().item() for n in TILES}
    times = {n: [] for n in TILES}
    for order in (TILES, TILES[::-1]):
        for n in order:
            times[n].append(graph_replay_ms(calls[n], calls=20))
    spare = torch.empty_like(q)
    gathered = graph_replay_ms(
        lambda: varlen.varlen_attention(q, kf, vf, cu_q, cu_k, 1, out=spare), calls=20)
    for n in TILES:
        best = min(times[n])
        print(f"R={requests} keys={keys} ({mb:.0f} MB) rows of {n} keys a tile: "
              f"{best * 1e3:.1f} us (runs {', '.join(f'{m * 1e3:.1f}' for m in times[n])}), "
              f"{best / gathered:.3f}x the gathered call's time, max err {errors[n]:.1e}",
              flush=True)
    print(f"R={requests} keys={keys}: gathered call {gathered * 1e3:.1f} us", flush=True)
