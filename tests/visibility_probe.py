"""A small cuTile kernel that evaluates visibility.py's functions on the GPU (a file of its
own: cuTile reads a kernel's source). test_kernel_gpu.py compares what it writes with the same
functions evaluated on the host."""

import cuda.tile as ct

from hf_tiled_attention.visibility import clip_tiles, key_tiles, query_span, visible


@ct.kernel
def visibility_probe(Ranges, Seen, seq_q: int, seq_kv: int, diag_offset: int, window: int,
                     splits: int, C: ct.Constant):
    """Block (m, j): query tile m's key-tile walk (split 0 of ``splits``) into Ranges[m, 0:8],
    key tile j's query-row spans into Ranges[m, 8:12] (written by m == 0 only, at row j), and
    the element rule of the (m, j) tile into Seen."""
    TILE_M, TILE_N, CAUSAL, WINDOWED = C
    m = ct.bid(0)
    j = ct.bid(1)
    windowed = WINDOWED
    row_lo = m * TILE_M
    row_hi = min(row_lo + TILE_M, seq_q) - 1
    first, end, full_lo, full_hi = key_tiles(row_lo, row_hi, diag_offset, seq_kv, window, TILE_N,
                                             CAUSAL, windowed)
    walk = clip_tiles(first, end, full_lo, full_hi, (0, 0, 0, 0, 0, 0), False, 0, splits)
    key_hi = min(j * TILE_N + TILE_N, seq_kv) - 1
    span = query_span(j * TILE_N, key_hi, seq_q, diag_offset, window, CAUSAL, windowed)
    slot = ct.arange(16, dtype=ct.int32)
    values = ct.full((16,), 0, dtype=ct.int32)
    for i, value in ct.static_iter(enumerate((first, end, full_lo, full_hi) + walk)):
        values = ct.where(slot == i, value, values)
    for i, value in ct.static_iter(enumerate(span)):
        values = ct.where(slot == 10 + i, value, values)
    if j == 0:
        ct.store(Ranges, index=(m, 0), tile=values.reshape((1, 16)))
    if m == 0:
        ct.store(Ranges, index=(ct.num_blocks(0) + j, 0), tile=values.reshape((1, 16)))
    rows = (row_lo + ct.arange(TILE_M, dtype=ct.int32))[:, None] + diag_offset
    cols = (j * TILE_N + ct.arange(TILE_N, dtype=ct.int32))[None, :]
    seen = ct.full((TILE_M, TILE_N), True, dtype=ct.bool_) & visible(
        rows, cols, seq_kv, window, CAUSAL, windowed)
    ct.store(Seen, index=(m, j), tile=seen.astype(ct.int8))
