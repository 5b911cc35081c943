"""The cuTile kernel that merges key splits.

When a call's keys are split over several blocks (``kv_splits`` > 1: decode, or any call with
too few query tiles to fill the GPU), each block writes its slice's fp32 partial output ``O_s``
and natural-log LSE ``lse_s``. One block per output tile (the attention kernel's grid without
the splits) combines them on the GPU:

    lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * O_s

Rows no slice saw (every ``lse_s`` is -inf) get 0 and -inf; a NaN in any slice reaches the row.
The arrays have the attention kernel's layouts (see kernel.py): ``(S * B, H, Sq, D)``, or with
``G_TILE`` > 1 ``(S * B, Hkv, Sq, group, D)``, slice ``s`` of batch row ``b`` at ``s * B + b``.
"""

import math

import cuda.tile as ct

from .tile_rows import load_lse, load_rows, store_lse, store_rows

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


@ct.kernel
def merge_splits(
    PartOut, PartLse, Out, Lse,
    splits: int,
    G_TILE: ConstInt,     # 1, or the packed query heads per row group (kernel.py)
    ROWS: ConstInt,       # query positions per tile
    CHUNK_D: ConstInt,    # head-dim columns merged at a time (a power of two)
    D_CHUNKS: ConstInt,   # CHUNK_D * D_CHUNKS >= the head dim
    WRITE_LSE: ConstBool,
):
    m_tile = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    batches = ct.num_blocks(2)
    TILE_M = ROWS * G_TILE

    # The largest slice LSE and the sum of the slices' weights relative to it.
    top = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    total = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    for s in range(splits):
        lse_s = load_lse(PartLse, batch + s * batches, head, m_tile, ROWS, G_TILE)
        new_top = max(top, lse_s)
        shift = ct.where(new_top == -math.inf, 0.0, new_top)  # rows no slice saw yet
        total = total * ct.exp(top - shift) + ct.exp(lse_s - shift)
        top = new_top
    shift = ct.where(top == -math.inf, 0.0, top)
    empty = total == 0.0
    inv_total = 1.0 / ct.where(empty, 1.0, total)

    for c in range(D_CHUNKS):
        acc = ct.full((TILE_M, CHUNK_D), 0.0, dtype=ct.float32)
        for s in range(splits):
            slot = batch + s * batches
            weight = ct.exp(load_lse(PartLse, slot, head, m_tile, ROWS, G_TILE) - shift)
            acc = acc + weight * load_rows(PartOut, slot, head, m_tile, c, ROWS, G_TILE, CHUNK_D)
        store_rows(Out, batch, head, m_tile, c, ct.where(empty, 0.0, acc * inv_total), ROWS,
                   G_TILE, CHUNK_D)
    if WRITE_LSE:
        lse = ct.where(empty, -math.inf, top + ct.log(ct.where(empty, 1.0, total)))
        store_lse(Lse, batch, head, m_tile, lse, ROWS, G_TILE)
