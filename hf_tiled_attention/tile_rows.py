"""How a kernel tile's rows map onto the query-shaped arrays (Q, Out, Lse and the key splits'
partial results) and onto a block table's rows, and the MMA every kernel uses: shared by the
attention kernel, the split merge and the backward kernels.

A tile holds ``ROWS`` consecutive query positions of one head (``G_TILE`` 1: arrays
``(B, H, Sq, ...)``), or ``ROWS`` positions x ``G_TILE`` query heads of one key/value head
(``G_TILE`` > 1: arrays ``(B, Hkv, Sq, group, ...)``, heads fastest within a position). Loads
past Sq or the group read zeros (LSE: -inf); stores there are dropped.
"""

import cuda.tile as ct

from . import kernel_params as P
from .kernel_params import (NO_MASK, RANGE_END, RANGE_FIRST, RANGE_FULL_HI, RANGE_FULL_LO,
                            RANGE_GAP_HI, RANGE_GAP_LO, RANGE_ORDER)
from .visibility import clip_tiles, key_tiles


def load_rows(Q, batch, head, m_tile, column, ROWS, G_TILE, WIDTH):
    """The ``(ROWS * G_TILE, WIDTH)`` tile at column tile ``column`` (in units of WIDTH)."""
    if G_TILE > 1:
        tile = ct.load(Q, index=(batch, head, m_tile, 0, column),
                       shape=(1, 1, ROWS, G_TILE, WIDTH), padding_mode=ct.PaddingMode.ZERO)
    else:
        tile = ct.load(Q, index=(batch, head, m_tile, column), shape=(1, 1, ROWS, WIDTH),
                       padding_mode=ct.PaddingMode.ZERO)
    return tile.reshape((ROWS * G_TILE, WIDTH))


def store_rows(Out, batch, head, m_tile, column, tile, ROWS, G_TILE, WIDTH):
    """Stores a ``(ROWS * G_TILE, WIDTH)`` fp32 tile where :func:`load_rows` reads it."""
    if G_TILE > 1:
        ct.store(Out, index=(batch, head, m_tile, 0, column),
                 tile=tile.reshape((1, 1, ROWS, G_TILE, WIDTH)).astype(Out.dtype))
    else:
        ct.store(Out, index=(batch, head, m_tile, column),
                 tile=tile.reshape((1, 1, ROWS, WIDTH)).astype(Out.dtype))


def store_lse(Lse, batch, head, m_tile, lse, ROWS, G_TILE):
    """Stores a ``(ROWS * G_TILE, 1)`` LSE column: ``(1, 1, ROWS[, G_TILE])`` of the Lse array.
    Plain stores, not TMA: a few bytes per tile."""
    if G_TILE > 1:
        ct.store(Lse, index=(batch, head, m_tile, 0), tile=lse.reshape((1, 1, ROWS, G_TILE)),
                 allow_tma=False)
    else:
        ct.store(Lse, index=(batch, head, m_tile), tile=lse.reshape((1, 1, ROWS)),
                 allow_tma=False)


def key_tile_walk(TileRange, batch, head, m_tile, row_lo, row_hi, diag_offset, seq_kv, window,
                  split, splits, C):
    """The key tiles query tile ``m_tile`` (rows ``row_lo .. row_hi``) walks, as the forward
    and the dQ kernel walk them: ``(mask_b, mask_h, mask_m)``, where the tile reads the mask
    and its block table, and ``(first, gap_lo, gap_hi, full_lo, full_hi, end)``
    (visibility.clip_tiles; ``split`` of ``splits`` blocks share the walk)."""
    first, end, full_lo, full_hi = key_tiles(row_lo, row_hi, diag_offset, seq_kv, window,
                                             C[P.TILE_N], C[P.CAUSAL], C[P.WINDOWED])
    mask_b = batch if C[P.MASK_BATCHED] else 0
    mask_h = head if C[P.MASK_HEADED] else 0
    mask_m = m_tile if C[P.MASK_ROWS] else 0
    TABLE = C[P.MASK_KIND] != NO_MASK and C[P.MASK_TABLE]
    table = (0, 0, 0, 0, 0, 0)  # (not read without a table)
    if TABLE:
        table = table_ranges(TileRange, mask_b, mask_h, mask_m)
    return (mask_b, mask_h, mask_m), clip_tiles(first, end, full_lo, full_hi, table, TABLE,
                                                split, splits)


def table_ranges(TileRange, mask_b, mask_h, row):
    """One row of a block table's ranges (a query tile's key tiles, or in a transposed table a
    key tile's query tiles), in kernel_params.RANGE_* order."""
    return (_table_range(TileRange, mask_b, mask_h, row, RANGE_FIRST),
            _table_range(TileRange, mask_b, mask_h, row, RANGE_GAP_LO),
            _table_range(TileRange, mask_b, mask_h, row, RANGE_GAP_HI),
            _table_range(TileRange, mask_b, mask_h, row, RANGE_FULL_LO),
            _table_range(TileRange, mask_b, mask_h, row, RANGE_FULL_HI),
            _table_range(TileRange, mask_b, mask_h, row, RANGE_END))


def table_row(TileRange, mask_b, mask_h, block):
    """The table row (tile) that grid block ``block`` takes: longest walk first."""
    return _table_range(TileRange, mask_b, mask_h, block, RANGE_ORDER)


def _table_range(TileRange, mask_b, mask_h, row, slot):
    return ct.load(TileRange, index=(mask_b, mask_h, row, slot), shape=(1, 1, 1, 1)).item()


def mma(a, b, acc):
    """``acc + a @ b`` on the tensor cores. fp32 operands use three TF32 products on a hi/lo
    split (a_hi b_hi + a_hi b_lo + a_lo b_hi), which keeps fp32-level accuracy (~1e-6 relative)
    where a single TF32 product would lose about three decimal digits."""
    if a.dtype == ct.float32:
        a_hi = a.astype(ct.tfloat32)
        b_hi = b.astype(ct.tfloat32)
        a_lo = (a - a_hi.astype(ct.float32)).astype(ct.tfloat32)
        b_lo = (b - b_hi.astype(ct.float32)).astype(ct.tfloat32)
        acc = ct.mma(a_lo, b_hi, acc)
        acc = ct.mma(a_hi, b_lo, acc)
        return ct.mma(a_hi, b_hi, acc)
    return ct.mma(a, b, acc)
