"""The merge of a query tile's key splits, run by the attention kernel itself.

When a call's keys are split over several blocks (``kv_splits`` > 1: decode, or any call with
too few query tiles to fill the GPU), each block writes its slice's fp32 partial output ``O_s``
and natural-log LSE ``lse_s``, then counts itself in; the last of a query tile's blocks to
arrive combines the slices (kernel.attention_forward_split):

    lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * O_s

Rows no slice saw (every ``lse_s`` is -inf) get 0 and -inf; a NaN in any slice reaches the row.
The partial results are ``(S, B * H, Sq, D)``, or with ``G_TILE`` > 1 ``(S, B * Hkv, Sq, group,
D)`` (see kernel.py); the output has the attention kernel's layout without the split dim.

The merge takes ``MERGE_ROWS`` query positions x ``G_TILE`` heads x ``CHUNK_D`` columns at a
time (``MERGE_ROWS`` at most the query's own length, so a decode step reads no padding rows)
and reads ``SPLIT_TILE`` slices per load, so a decode step's 30-60 slices take a few loads
rather than a chain of one latency per slice.
"""

import math

import cuda.tile as ct

from . import kernel_params as P
from .tile_rows import store_lse, store_rows


def merge_query_tile(PartOut, PartLse, Out, Lse, splits, batch, head, part_row, m_tile,
                     TILE_ROWS, G_TILE, M):
    """Merges the slices of query tile ``m_tile`` (``TILE_ROWS`` positions; a multiple of
    MERGE_ROWS) of head ``head`` and batch row ``batch``, whose partial results sit at
    ``part_row``; row tiles past the query's end are skipped. ``M``: the MergeConstants."""
    ROWS = M[P.MERGE_ROWS]
    SPLIT_TILE = M[P.SPLIT_TILE]
    CHUNK_D = M[P.CHUNK_D]
    WRITE_LSE = M[P.MERGE_LSE]
    seq_q = Out.shape[2]
    first = m_tile * (TILE_ROWS // ROWS)
    for rows in range(first, first + ct.cdiv(min(TILE_ROWS, seq_q - m_tile * TILE_ROWS), ROWS)):
        for chunk in range(M[P.D_CHUNKS]):
            _merge_rows(PartOut, PartLse, Out, Lse, splits, batch, head, part_row, rows, chunk,
                        G_TILE, ROWS, SPLIT_TILE, CHUNK_D, WRITE_LSE)


def _merge_rows(PartOut, PartLse, Out, Lse, splits, batch, head, part_row, m_tile, chunk,
                G_TILE, ROWS, SPLIT_TILE, CHUNK_D, WRITE_LSE):
    """One ``ROWS`` x ``G_TILE`` row tile's column chunk ``chunk`` (and its LSE with the
    first chunk)."""
    TILE_M = ROWS * G_TILE
    top = ct.full((1, TILE_M), -math.inf, dtype=ct.float32)   # largest slice LSE so far
    total = ct.full((1, TILE_M), 0.0, dtype=ct.float32)       # sum of weights relative to it
    acc = ct.full((TILE_M, CHUNK_D), 0.0, dtype=ct.float32)
    for slab in range(ct.cdiv(splits, SPLIT_TILE)):
        lse = _load_slices(PartLse, slab, part_row, m_tile, 0, ROWS, G_TILE, SPLIT_TILE, 0,
                           ct.PaddingMode.NEG_INF).reshape((SPLIT_TILE, TILE_M))
        new_top = max(top, ct.max(lse, axis=0, keepdims=True))
        shift = ct.where(new_top == -math.inf, 0.0, new_top)  # rows no slice saw yet
        alpha = ct.exp(top - shift)
        weight = ct.exp(lse - shift)                           # (SPLIT_TILE, TILE_M)
        total = total * alpha + ct.sum(weight, axis=0, keepdims=True)
        parts = _load_slices(PartOut, slab, part_row, m_tile, chunk, ROWS, G_TILE, SPLIT_TILE,
                             CHUNK_D, ct.PaddingMode.ZERO).reshape((SPLIT_TILE, TILE_M, CHUNK_D))
        acc = (acc * alpha.reshape((TILE_M, 1))
               + ct.sum(parts * weight.reshape((SPLIT_TILE, TILE_M, 1)), axis=0))
        top = new_top

    empty = (total == 0.0).reshape((TILE_M, 1))
    total = total.reshape((TILE_M, 1))
    inv_total = 1.0 / ct.where(empty, 1.0, total)
    store_rows(Out, batch, head, m_tile, chunk, ct.where(empty, 0.0, acc * inv_total), ROWS,
               G_TILE, CHUNK_D)
    if WRITE_LSE and chunk == 0:
        shift = ct.where(top == -math.inf, 0.0, top).reshape((TILE_M, 1))
        lse = ct.where(empty, -math.inf, shift + ct.log(ct.where(empty, 1.0, total)))
        store_lse(Lse, batch, head, m_tile, lse, ROWS, G_TILE)


def _load_slices(Part, slab, part_row, m_tile, chunk, ROWS, G_TILE, SPLIT_TILE, CHUNK_D,
                 padding):
    """``SPLIT_TILE`` slices of one tile's rows (and, when CHUNK_D > 0, one column chunk) of the
    partial LSE (CHUNK_D 0) or output arrays; slices past the last read as ``padding``."""
    if CHUNK_D == 0:
        if G_TILE > 1:
            return ct.load(Part, index=(slab, part_row, m_tile, 0),
                           shape=(SPLIT_TILE, 1, ROWS, G_TILE), padding_mode=padding,
                           allow_tma=False)
        return ct.load(Part, index=(slab, part_row, m_tile), shape=(SPLIT_TILE, 1, ROWS),
                       padding_mode=padding, allow_tma=False)
    if G_TILE > 1:
        return ct.load(Part, index=(slab, part_row, m_tile, 0, chunk),
                       shape=(SPLIT_TILE, 1, ROWS, G_TILE, CHUNK_D), padding_mode=padding)
    return ct.load(Part, index=(slab, part_row, m_tile, chunk),
                   shape=(SPLIT_TILE, 1, ROWS, CHUNK_D), padding_mode=padding)
