"""Experiment (sessions 57-58, for a device session): the decode launch that gathers the cache
row by row, in its two forms (schedule.VARLEN_ROW_GATHER: one TMA load per row, main's until
the series' seventh commit, or the threads' asynchronous copies), at 128 keys a tile
(schedule.varlen_tiles) and at 64, and with eight worker warps.

    python .pending/experiments/row_gather_tiles.py
    POINTS="[(64, 1024)]" python .pending/experiments/row_gather_tiles.py

That launch serves the requests whose key tiles are not whole blocks of the cache (pages
smaller than a tile, the index-based cache, transformers 5.17's sliding-window layers).
Compiled for sm_90 on the 32-bit entry (cuTile's exporter, eval/inspect_cubin.report; 64
requests x 1k keys over pages of 16, 32/8 heads, D=128, bf16), by TMA loads at 128 keys a
tile it takes 128 registers, 592 B of stack, 25,368 instructions (136 B and 14,944 at 64
keys; 480 B and 20,560 with eight warps); by copies 226 registers, no stack, 7,216
instructions (perf-notes steps 78-79). Block loads stay at 128 keys (faster than 64 on an
H100, perf-notes step 57); this times only the row gathers. Each point times the whole
paged call (its marking launch finds no whole block, so the row launch reads every request)
under each of VARIANTS, in one process from CUDA graphs, order alternated, and checks each
output against the gathered call's. Run it with paged-32bit-entry.mbox applied (its 32-bit
entry, launch.launch_each and the ROW_GATHER constant are the series').
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from eval.paged_decode_bench import decode_step  # noqa: E402
from hf_tiled_attention import varlen  # noqa: E402
from hf_tiled_attention import varlen_kernel as K  # noqa: E402
from hf_tiled_attention.launch import launch_each  # noqa: E402
from hf_tiled_attention.timing import graph_replay_ms  # noqa: E402


PAGE = 16  # smaller than any key tile: every request is read by the row launch
# (keys a tile, worker warps (None: the compiler's), form) of the row-gathering launch
VARIANTS = ((128, None, "tma"), (128, None, "copies"), (64, None, "tma"), (64, None, "copies"),
            (128, 8, "copies"))
FORMS = {"tma": K.GATHER_BY_TMA, "copies": K.GATHER_BY_COPIES}


def with_row_tile(parts, variant):
    """The call's launches with the row-gathering one's key tile, warps and form set to
    ``variant``."""
    keys_per_tile, warps, form = variant
    changed = []
    for kernel, grid, args in parts:
        constants = args[-1]
        if kernel is not K.whole_tile_requests_kernel and constants[K.PAGED] \
                and not constants[K.BLOCKS]:
            constants = list(constants)
            constants[K.TILE_N], constants[K.ROW_GATHER] = keys_per_tile, FORMS[form]
            args = args[:-1] + (tuple(constants),)
            if warps:
                kernel = kernel.replace_hints(num_worker_warps=warps)
        changed.append((kernel, grid, args))
    return changed


def run(parts, device):
    return lambda: launch_each(device, parts)


points = eval(os.environ.get("POINTS", "[(32, 2048), (64, 1024), (256, 1024), (32, 4096)]"))
for requests, keys in points:
    q, ck, cv, slots, cu_q, cu_k = decode_step(requests, keys, 32, 8, 128, PAGE, "cuda",
                                               torch.bfloat16)
    kf, vf = ck[slots], cv[slots]
    scale = q.shape[-1] ** -0.5
    want = varlen.varlen_attention(q, kf, vf, cu_q, cu_k, 1).float()
    mb = 2 * kf.numel() * kf.element_size() / 1e6
    outs, calls = {}, {}
    for variant in VARIANTS:
        outs[variant] = torch.full_like(q, float("nan"))
        parts = varlen.launches(q, ck, cv, cu_q, cu_k, 1, scale, None, None, None, slots,
                                outs[variant])
        calls[variant] = run(with_row_tile(parts, variant), q.device)
        calls[variant]()
    torch.cuda.synchronize()
    errors = {v: (outs[v].float() - want).abs().max().item() for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for order in (VARIANTS, VARIANTS[::-1]):
        for variant in order:
            times[variant].append(graph_replay_ms(calls[variant], calls=20))
    spare = torch.empty_like(q)
    gathered = graph_replay_ms(
        lambda: varlen.varlen_attention(q, kf, vf, cu_q, cu_k, 1, out=spare), calls=20)
    for (n, warps, form), runs in times.items():
        best = min(runs)
        print(f"R={requests} keys={keys} ({mb:.0f} MB) rows by {form}, {n} keys a tile, "
              f"{warps or 'default'} warps: {best * 1e3:.1f} us (runs "
              f"{', '.join(f'{m * 1e3:.1f}' for m in runs)}), {best / gathered:.3f}x the "
              f"gathered call's time, max err {errors[(n, warps, form)]:.1e}", flush=True)
    print(f"R={requests} keys={keys}: gathered call {gathered * 1e3:.1f} us", flush=True)
