"""The cuTile attention forward kernel.

One block (grid: query tiles x heads x batch) computes one output tile: it streams the key/value
tiles that the query tile can see and keeps an online softmax (running max ``m``, running sum
``l`` and the unnormalised output ``acc``) in fp32.

A tile's rows are either consecutive query positions of one query head (``G_TILE`` 1: Q, Out and
Lse are ``(B, Hq, Sq, ...)``), or, for short queries (decode), up to 16 query heads that share
one key/value head at a few positions (``G_TILE`` > 1: Q and Out are ``(B, Hq / pack, Sq, pack,
D)`` views, ``pack`` heads per tile; a tile holds ``TILE_M // G_TILE`` positions x ``G_TILE``
heads), so each K/V tile is read once per pack and the tile stays big enough for the warpgroup
MMA.

Which keys a query sees (bounds, causal, window) is :mod:`visibility`'s rule, shared with the
host. On top of it the mask (``MASK_KIND``, see kernel_params.py): a bool or additive tensor,
or a user's mask_mod (``_mask_mod``, on the tiles its block table marks partial). With
``SCORE_MOD`` the (scaled, natural-unit) scores first pass through ``_score_mod(score, b, h,
i, j)``. The two mods are module globals here; launch.py builds one copy of the kernel per
user mod with them replaced, and ``Captures`` carries the tensors the mods read.

Only key tiles inside the causal/window range are visited (split over ``kv_splits`` blocks
when there are too few query tiles to fill the GPU, e.g. decode: the split entry's last block
of a query tile combines the slices, merge.py); inside it, tiles that need no per-element mask
skip the masking work, and with a mask's block table (``MASK_TABLE``) empty tiles are skipped
and full ones are not masked; the query tile's longest run of full key tiles is streamed
without reading the table, so the loop over it carries no branch, and its longest gap of empty
tiles before that run is jumped. Without the table (a key vector in a traced call, where
building it per call would cost more than it saves) the mask is applied on every visited tile.
Every tuning knob comes in as a constant from :class:`hf_tiled_attention.Schedule`.
"""

import math

import cuda.tile as ct

from . import kernel_params as P
from .kernel_params import (ADDITIVE_MASK, BOOL_MASK, LOG2E, MASK_MOD, NO_MASK, TILE_EMPTY,
                            TILE_FULL, TILE_PARTIAL)
from .merge import merge_query_tile
from .tile_rows import key_tile_walk, load_rows, mma, store_lse, store_rows
from .visibility import visible


def _score_mod(score, b, h, q_idx, kv_idx, captures):
    """Stand-in for a user's score_mod (replaced per mod by launch.py)."""
    return score


def _mask_mod(b, h, q_idx, kv_idx, captures):
    """Stand-in for a user's mask_mod (replaced per mod by launch.py)."""
    return q_idx >= 0


# The parameter list is cuTile's calling convention: arrays and run-time scalars each as their
# own parameter; every compile-time constant travels in the one tuple C (kernel_params). A plain
# function, made a kernel below: launch.py copies it for kernels with user mods.
def attention_forward(
    Q, K, V, Out, Lse, Mask, TileState, TileRange, Captures,
    score_scale: float,      # multiplies q.k (scale * SCORE_UNIT, or scale/softcap when SOFTCAP)
    softcap_out: float,      # softcap * SCORE_UNIT when SOFTCAP
    diag_offset: int,        # query row i sits at key position i + diag_offset
    window: int,
    kv_splits: int,          # >1 (the split entry's calls): block (m, split) covers one slice
                             # of the key tiles and writes its fp32 partial output + LSE at
                             # [split, b * heads + head] of Out and Lse
    C: ct.Constant,          # kernel_params.AttentionConstants
):
    _query_tile(Q, K, V, Out, Lse, Mask, TileState, TileRange, Captures, score_scale,
                softcap_out, diag_offset, window, kv_splits, C)


attention_forward_kernel = ct.kernel(attention_forward)


def attention_forward_lean(
    Q, K, V, Out,
    score_scale: float, softcap_out: float, diag_offset: int, window: int, kv_splits: int,
    C: ct.Constant,
):
    """The entry for a call with no mask, no mods, no LSE and unsplit keys (launch.py's
    LaunchPlan.lean; most decode calls): cuTile's launch costs host time per array, and such a
    call would pass four that the constants keep the kernel from reading (Lse, Mask,
    TileState, TileRange). Its own arrays stand in for them."""
    _query_tile(Q, K, V, Out, Out, K, K, K, (), score_scale, softcap_out, diag_offset, window,
                kv_splits, C)


attention_forward_lean_kernel = ct.kernel(attention_forward_lean)


def attention_forward_split(
    Q, K, V, Out, Lse, Mask, TileState, TileRange, Captures, PartOut, PartLse, Arrivals,
    score_scale: float, softcap_out: float, diag_offset: int, window: int, kv_splits: int,
    C: ct.Constant,
    M: ct.Constant,          # kernel_params.MergeConstants
):
    """The entry for a call whose keys are split over ``kv_splits`` blocks per query tile, in
    one launch: each block writes its slice's fp32 partial output and LSE (PartOut, PartLse)
    and adds 1 to its query tile's count in Arrivals (``(B, heads, query tiles)`` int32, zero
    between launches); the block that brings the count to ``kv_splits`` merges the slices into
    Out and Lse (merge.py) and sets the count back to zero. The count's atomic add is
    acquire-release: it publishes the block's partials, and the last block sees everyone's."""
    m_tile = _query_tile(Q, K, V, PartOut, PartLse, Mask, TileState, TileRange, Captures,
                         score_scale, softcap_out, diag_offset, window, kv_splits, C)
    head = ct.bid(1)
    batch = ct.bid(2)
    arrived = ct.atomic_add(Arrivals, (batch, head, m_tile), 1)
    if arrived == kv_splits - 1:
        ct.scatter(Arrivals, (batch, head, m_tile), 0)
        merge_query_tile(PartOut, PartLse, Out, Lse, kv_splits, batch, head,
                         batch * ct.num_blocks(1) + head, m_tile, C[P.TILE_M] // C[P.G_TILE],
                         C[P.G_TILE], M)


attention_forward_split_kernel = ct.kernel(attention_forward_split)


def _query_tile(Q, K, V, Out, Lse, Mask, TileState, TileRange, Captures, score_scale,
                softcap_out, diag_offset, window, kv_splits, C):
    """One output tile: query block ``bid(0)`` (a query tile and, with kv_splits > 1, one slice
    of its keys) of head ``bid(1)`` (a kv head when G_TILE > 1) and batch row ``bid(2)``.
    Returns the query tile's index."""
    TILE_M = C[P.TILE_M]
    TILE_N = C[P.TILE_N]
    TILE_D = C[P.TILE_D]
    TAIL_D = C[P.TAIL_D]
    G_TILE = C[P.G_TILE]
    MASK_KIND = C[P.MASK_KIND]
    block_m = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    num_m_tiles = ct.num_blocks(0) // kv_splits
    m_tile = block_m // kv_splits
    split = block_m % kv_splits
    if C[P.HEAVY_FIRST]:
        m_tile = num_m_tiles - 1 - m_tile
    kv_head = head // C[P.GROUP]
    ROWS = TILE_M // G_TILE  # query positions per tile

    seq_q = Q.shape[2]
    seq_kv = K.shape[2]
    row_lo = m_tile * ROWS
    row_hi = min(row_lo + ROWS, seq_q) - 1
    (mask_b, mask_h, mask_m), walk = key_tile_walk(TileRange, batch, head, m_tile, row_lo,
                                                   row_hi, diag_offset, seq_kv, window, split,
                                                   kv_splits, C)
    first, gap_lo, gap_hi, full_lo, full_hi, end = walk
    TABLE = MASK_KIND != NO_MASK and C[P.MASK_TABLE]

    row_in_tile = ct.arange(TILE_M, dtype=ct.int32)
    if G_TILE > 1:  # rows are (position, head) pairs, heads fastest
        row_in_tile = row_in_tile // G_TILE
    q_idx = (row_lo + row_in_tile)[:, None]   # query rows (a mod's q_idx)
    row_pos = q_idx + diag_offset              # their key positions
    col_in_tile = ct.arange(TILE_N, dtype=ct.int32)[None, :]

    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, TILE_D), 0.0, dtype=ct.float32)

    q = load_rows(Q, batch, head, m_tile, 0, ROWS, G_TILE, TILE_D)
    # The head dim's second part (TAIL_D > 0): its own query tile and accumulator. Without one
    # these stand-ins are never read and the compiler drops them.
    q_tail = q
    acc_tail = acc
    if TAIL_D != 0:
        q_tail = load_rows(Q, batch, head, m_tile, TILE_D // TAIL_D, ROWS, G_TILE, TAIL_D)
        acc_tail = ct.full((TILE_M, TAIL_D), 0.0, dtype=ct.float32)

    # What every key tile step reads: the query tile, where it sits, the arrays, the scalars.
    rows = (q, q_tail, q_idx, row_pos, col_in_tile)
    where = (batch, head, kv_head, mask_b, mask_h, mask_m)
    arrays = (K, V, Mask, TileState, Captures)
    scalars = (seq_kv, window, score_scale, softcap_out)
    state = (m_i, l_i, acc, acc_tail)
    if TABLE:  # (no gap without a table: keep the code small)
        for j in range(first, gap_lo):
            state = _attend_tile(j, state, rows, where, arrays, scalars, True, C)
    for j in range(gap_hi, full_lo):
        state = _attend_tile(j, state, rows, where, arrays, scalars, True, C)
    for j in range(full_lo, full_hi):
        state = _attend_tile(j, state, rows, where, arrays, scalars, False, C)
    for j in range(full_hi, end):
        state = _attend_tile(j, state, rows, where, arrays, scalars, True, C)
    m_i, l_i, acc, acc_tail = state

    # Rows that saw no key (l exactly 0): output 0 and lse -inf. A NaN score or value makes l or
    # acc NaN, and that NaN must reach the output, as in eager attention.
    empty = l_i == 0.0
    inv_l = 1.0 / ct.where(empty, 1.0, l_i)   # one division per row, not per output element
    # Out and Lse are (B, heads, ...), or with split keys the slices' partial results
    # (kv_splits, B * heads, ...) that merge.py reads.
    out_0 = batch
    out_1 = head
    if kv_splits > 1:
        out_0 = split
        out_1 = batch * Q.shape[1] + head
    store_rows(Out, out_0, out_1, m_tile, 0, ct.where(empty, 0.0, acc * inv_l), ROWS, G_TILE,
               TILE_D)
    if TAIL_D != 0:
        store_rows(Out, out_0, out_1, m_tile, TILE_D // TAIL_D,
                   ct.where(empty, 0.0, acc_tail * inv_l), ROWS, G_TILE, TAIL_D)
    if C[P.WRITE_LSE]:
        lse = ct.where(empty, -math.inf,
                       m_i / C[P.SCORE_UNIT] + ct.log(ct.where(empty, 1.0, l_i)))
        store_lse(Lse, out_0, out_1, m_tile, lse, ROWS, G_TILE)
    return m_tile


def _attend_tile(j, state, rows, where, arrays, scalars, EDGE, C):
    """One online-softmax step over key tile ``j``; returns the updated ``(m, l, acc,
    acc_tail)``. ``EDGE``: the tile may be partly hidden (apply the causal/window rule, read its
    state in the block table); else it is known full."""
    m_i, l_i, acc, acc_tail = state
    q, q_tail, q_idx, row_pos, col_in_tile = rows
    batch, head, kv_head, mask_b, mask_h, mask_m = where
    K, V, Mask, TileState, Captures = arrays
    seq_kv, window, score_scale, softcap_out = scalars
    TILE_M = C[P.TILE_M]
    TILE_N = C[P.TILE_N]
    TILE_D = C[P.TILE_D]
    TAIL_D = C[P.TAIL_D]
    MASK_KIND = C[P.MASK_KIND]
    FOLD_SCALE = C[P.FOLD_SCALE]
    SCORE_UNIT = C[P.SCORE_UNIT]

    tile_state = TILE_FULL
    if MASK_KIND != NO_MASK:
        if not C[P.MASK_TABLE]:
            tile_state = TILE_PARTIAL
        elif EDGE:
            tile_state = ct.load(TileState, index=(mask_b, mask_h, mask_m, j),
                                 shape=(1, 1, 1, 1)).item()
    if tile_state != TILE_EMPTY:
        k = ct.load(K, index=(batch, kv_head, 0, j), shape=(1, 1, TILE_D, TILE_N),
                    order=(0, 1, 3, 2), padding_mode=ct.PaddingMode.ZERO,
                    latency=C[P.K_LATENCY]).reshape((TILE_D, TILE_N))
        qk = mma(q, k, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        if TAIL_D != 0:
            k_tail = ct.load(K, index=(batch, kv_head, TILE_D // TAIL_D, j),
                             shape=(1, 1, TAIL_D, TILE_N), order=(0, 1, 3, 2),
                             padding_mode=ct.PaddingMode.ZERO,
                             latency=C[P.K_LATENCY]).reshape((TAIL_D, TILE_N))
            qk = mma(q_tail, k_tail, qk)
        if C[P.SOFTCAP] and C[P.APPROX_TANH]:
            s = ct.tanh(qk * score_scale, rounding_mode=ct.RoundingMode.APPROX) * softcap_out
        elif C[P.SOFTCAP]:
            s = ct.tanh(qk * score_scale) * softcap_out
        elif FOLD_SCALE:
            # Raw scores: a positive scale commutes with the max, so it is applied once per row
            # to the max and fused into the exponent's FMA (one multiply per score saved).
            s = qk
        else:
            s = qk * score_scale
        cols = j * TILE_N + col_in_tile
        if C[P.SCORE_MOD]:  # before any masking: a mod must not see (or revive) a hidden -inf
            s = _score_mod(s, batch, head, q_idx, cols, Captures)

        if EDGE:
            seen = ct.full((TILE_M, TILE_N), True, dtype=ct.bool_) & visible(
                row_pos, cols, seq_kv, window, C[P.CAUSAL], C[P.WINDOWED])
            s = ct.where(seen, s, -math.inf)
        if tile_state == TILE_PARTIAL and MASK_KIND == MASK_MOD:
            seen = (ct.full((TILE_M, TILE_N), True, dtype=ct.bool_)
                    & _mask_mod(batch, head, q_idx, cols, Captures))
            s = ct.where(seen, s, -math.inf)
        elif tile_state == TILE_PARTIAL:
            MASK_TILE_M = TILE_M if C[P.MASK_ROWS] else 1
            mask = ct.load(Mask, index=(mask_b, mask_h, mask_m, j),
                           shape=(1, 1, MASK_TILE_M, TILE_N),
                           padding_mode=ct.PaddingMode.ZERO).reshape((MASK_TILE_M, TILE_N))
            if MASK_KIND == BOOL_MASK:
                s = ct.where(mask != 0, s, -math.inf)
            elif MASK_KIND == ADDITIVE_MASK:
                # -inf hides the key outright, so a NaN score there does not leak (NaN + -inf).
                bias = mask.astype(ct.float32)
                s = ct.where(bias == -math.inf, -math.inf, s + bias)

        row_max = ct.max(s, axis=-1, keepdims=True)
        if FOLD_SCALE:
            row_max = row_max * score_scale
        m_new = max(m_i, row_max)
        m_shift = m_new
        if EDGE or MASK_KIND != NO_MASK or C[P.SCORE_MOD]:
            # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_shift = ct.where(m_new == -math.inf, 0.0, m_new)
        if FOLD_SCALE:
            p = ct.exp2(s * score_scale - m_shift, flush_to_zero=True)
            alpha = ct.exp2(m_i - m_shift, flush_to_zero=True)
        elif SCORE_UNIT == 1.0:
            p = ct.exp2((s - m_shift) * LOG2E, flush_to_zero=True)
            alpha = ct.exp2((m_i - m_shift) * LOG2E, flush_to_zero=True)
        else:
            p = ct.exp2(s - m_shift, flush_to_zero=True)
            alpha = ct.exp2(m_i - m_shift, flush_to_zero=True)
        l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
        v = ct.load(V, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, TILE_D),
                    padding_mode=ct.PaddingMode.ZERO,
                    latency=C[P.V_LATENCY]).reshape((TILE_N, TILE_D))
        p = p.astype(v.dtype)
        acc = mma(p, v, acc * alpha)
        if TAIL_D != 0:
            v_tail = ct.load(V, index=(batch, kv_head, j, TILE_D // TAIL_D),
                             shape=(1, 1, TILE_N, TAIL_D), padding_mode=ct.PaddingMode.ZERO,
                             latency=C[P.V_LATENCY]).reshape((TILE_N, TAIL_D))
            acc_tail = mma(p, v_tail, acc_tail * alpha)
        m_i = m_new
    return m_i, l_i, acc, acc_tail
