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

Visibility of key ``j`` for query row ``i`` (``pos = i + diag_offset``, keys and positions in key
coordinates):

* always ``j < seq_kv``;
* ``CAUSAL``: ``j <= pos``;
* ``WINDOWED``: ``j > pos - window``, and when not causal also ``j < pos + window``;
* ``MASK_KIND`` 1 (bool, stored as uint8): ``mask[i, j] != 0``; 2 (additive float): the score
  gets ``+ mask[i, j]`` and ``-inf`` hides the key; 3: ``_mask_mod(b, h, i, j)`` (a user's
  mask_mod, see mods.py) on the tiles its block table marks partial.

With ``SCORE_MOD`` the (scaled, natural-unit) scores first pass through ``_score_mod(score, b,
h, i, j)``. The two mods are module globals here; launch.py builds one copy of the kernel per
user mod with them replaced, and ``Captures`` carries the tensors the mods read.

Only key tiles inside the causal/window range are visited (split over ``kv_splits`` blocks
when there are too few query tiles to fill the GPU, e.g. decode; merge.py combines the slices);
inside it, tiles that need no per-element mask skip the masking work, and with a mask's per-tile
state table (``MASK_TABLE``; 0: nothing visible, 1: partial, 2: all visible with zero bias; see
masks.py) empty tiles are skipped and full ones are not masked; the query tile's longest run
of full key tiles (from the table's ranges) is streamed without reading the table, so the loop
over it carries no branch, and its longest gap of empty tiles before that run is jumped.
Without the table (a key vector ``(B or 1, 1, 1, Skv)`` in a traced call, where building it per
call would cost more than it saves) the mask is applied on every visited tile. Every tuning
knob comes in as a constant from :class:`hf_tiled_attention.Schedule`.
"""

import math

import cuda.tile as ct

from .tile_rows import load_rows, store_lse, store_rows

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ConstFloat = ct.Constant[float]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

# Per-tile states of the mask's block table (see masks.py).
TILE_EMPTY = 0
TILE_PARTIAL = 1
TILE_FULL = 2
# MASK_KIND values (masks.py).
NO_MASK = 0
BOOL_MASK = 1
ADDITIVE_MASK = 2
MASK_MOD = 3


def _score_mod(score, b, h, q_idx, kv_idx, captures):
    """Stand-in for a user's score_mod (replaced per mod by launch.py)."""
    return score


def _mask_mod(b, h, q_idx, kv_idx, captures):
    """Stand-in for a user's mask_mod (replaced per mod by launch.py)."""
    return q_idx >= 0


@ct.kernel
def attention_forward(
    Q, K, V, Out, Lse, Mask, TileState, TileRange, Captures,
    score_scale: float,      # multiplies q.k (scale * SCORE_UNIT, or scale/softcap when SOFTCAP)
    softcap_out: float,      # softcap * SCORE_UNIT when SOFTCAP
    diag_offset: int,        # query row i sits at key position i + diag_offset
    window: int,
    kv_splits: int,          # >1: block (m, split) covers one slice of the key tiles and writes
                             # its fp32 partial output + LSE at [split, b * heads + head]
    GROUP: ConstInt,         # grid heads per key/value head: query heads, or with G_TILE > 1
                             # packed tiles (1; MQA's 32 heads as two tiles of 16: 2)
    G_TILE: ConstInt,        # 1, or decode: a kv head's query heads as rows, padded to a power of 2
    TILE_M: ConstInt,
    TILE_N: ConstInt,
    TILE_D: ConstInt,        # head dim rounded up to a power of two (loads pad with zeros),
                             # or its leading power-of-two part when TAIL_D > 0
    TAIL_D: ConstInt,        # 0, or the rest of the head dim as a second tile (80 = 64 + 16):
                             # no MMA work on zero padding
    CAUSAL: ConstBool,
    WINDOWED: ConstBool,
    SOFTCAP: ConstBool,
    APPROX_TANH: ConstBool,  # softcap's tanh: the hardware's approximate one (16-bit inputs)
    SCORE_MOD: ConstBool,    # scores pass through _score_mod
    MASK_KIND: ConstInt,     # NO_MASK, BOOL_MASK (uint8), ADDITIVE_MASK, MASK_MOD
    MASK_BATCHED: ConstBool,  # mask has a batch dim of size B (else 1)
    MASK_HEADED: ConstBool,   # mask has a head dim of size Hq (else 1)
    MASK_ROWS: ConstBool,     # mask has one row per query (else one row for all queries)
    MASK_TABLE: ConstBool,    # TileState holds each tile's state and TileRange each query tile's
                              # key-tile ranges (masks.BlockTable) (else: apply the mask on every
                              # visited tile; only for a key vector)
    SCORE_UNIT: ConstFloat,   # LOG2E: scores kept in log2 units; 1.0: natural units
    FOLD_SCALE: ConstBool,    # score_scale > 0 applied inside the exponent (no softcap/bias)
    WRITE_LSE: ConstBool,
    HEAVY_FIRST: ConstBool,   # causal: launch the longest query tiles first
    K_LATENCY: ConstInt,
    V_LATENCY: ConstInt,
):
    _query_tile(ct.bid(0), ct.bid(1), ct.bid(2), ct.num_blocks(0), Q, K, V, Out, Lse, Mask,
                TileState, TileRange, Captures, score_scale, softcap_out, diag_offset, window,
                kv_splits, GROUP, G_TILE, TILE_M, TILE_N, TILE_D, TAIL_D, CAUSAL, WINDOWED,
                SOFTCAP, APPROX_TANH, SCORE_MOD, MASK_KIND, MASK_BATCHED, MASK_HEADED,
                MASK_ROWS, MASK_TABLE, SCORE_UNIT, FOLD_SCALE, WRITE_LSE, HEAVY_FIRST, K_LATENCY,
                V_LATENCY)


def _query_tile(block_m, head, batch, m_blocks, Q, K, V, Out, Lse, Mask, TileState,
                TileRange, Captures, score_scale, softcap_out, diag_offset, window, kv_splits,
                GROUP, G_TILE, TILE_M, TILE_N, TILE_D, TAIL_D, CAUSAL, WINDOWED, SOFTCAP,
                APPROX_TANH, SCORE_MOD, MASK_KIND,
                MASK_BATCHED, MASK_HEADED, MASK_ROWS, MASK_TABLE, SCORE_UNIT, FOLD_SCALE,
                WRITE_LSE, HEAVY_FIRST, K_LATENCY, V_LATENCY):
    """One output tile: query block ``block_m`` (a query tile and, with kv_splits > 1, one slice
    of its keys) of one head (a kv head when G_TILE > 1) and batch row."""
    num_m_tiles = m_blocks // kv_splits
    m_tile = block_m // kv_splits
    split = block_m % kv_splits
    if HEAVY_FIRST:
        m_tile = num_m_tiles - 1 - m_tile
    kv_head = head // GROUP
    ROWS = TILE_M // G_TILE  # query positions per tile

    seq_q = Q.shape[2]
    seq_kv = K.shape[2]
    row_lo = m_tile * ROWS
    row_hi = min(row_lo + ROWS, seq_q) - 1
    # Key positions of the tile's first and last query rows.
    pos_lo = row_lo + diag_offset
    pos_hi = row_hi + diag_offset

    # Keys that some row of this tile may see: [lo_any, hi_any); that every row sees: [lo_all, hi_all).
    lo_any = 0
    lo_all = 0
    hi_any = seq_kv
    hi_all = seq_kv
    if WINDOWED:
        lo_any = max(pos_lo - window + 1, 0)
        lo_all = max(pos_hi - window + 1, 0)
        if not CAUSAL:
            hi_any = min(pos_hi + window, seq_kv)
            hi_all = min(pos_lo + window, seq_kv)
    if CAUSAL:
        hi_any = min(pos_hi + 1, seq_kv)
        hi_all = min(pos_lo + 1, seq_kv)
    first_tile = lo_any // TILE_N
    end_tile = max(ct.cdiv(hi_any, TILE_N), first_tile)

    mask_b = batch if MASK_BATCHED else 0
    mask_h = head if MASK_HEADED else 0
    mask_m = m_tile if MASK_ROWS else 0
    MASK_TILE_M = TILE_M if MASK_ROWS else 1
    # Key tiles [full_lo, full_hi) lie inside every row's causal/window/bounds range and, with a
    # block table, in its run of full tiles: they need no per-element mask and no table read.
    # With a table, [gap_lo, gap_hi) before them are empty tiles (StreamingLLM's gap between
    # sinks and window), skipped without reading their states.
    full_lo = ct.cdiv(lo_all, TILE_N)
    full_hi = hi_all // TILE_N
    gap_lo = first_tile
    gap_hi = first_tile
    if MASK_KIND != NO_MASK and MASK_TABLE:
        # Only the key tiles the block table has non-empty for this query tile.
        first_tile = max(first_tile, _table_range(TileRange, mask_b, mask_h, mask_m, 0))
        gap_lo = _table_range(TileRange, mask_b, mask_h, mask_m, 1)
        gap_hi = _table_range(TileRange, mask_b, mask_h, mask_m, 2)
        full_lo = max(full_lo, _table_range(TileRange, mask_b, mask_h, mask_m, 3))
        full_hi = min(full_hi, _table_range(TileRange, mask_b, mask_h, mask_m, 4))
        end_tile = max(min(end_tile, _table_range(TileRange, mask_b, mask_h, mask_m, 5)),
                       first_tile)
    # This block's slice of the visible key tiles (all of them unless kv_splits > 1).
    per_split = ct.cdiv(end_tile - first_tile, kv_splits)
    first_tile = min(first_tile + split * per_split, end_tile)
    end_tile = min(first_tile + per_split, end_tile)
    # first <= gap_lo <= gap_hi <= full_lo <= full_hi <= end
    full_lo = min(max(full_lo, first_tile), end_tile)
    full_hi = max(min(full_hi, end_tile), full_lo)
    gap_lo = min(max(gap_lo, first_tile), full_lo)
    gap_hi = min(max(gap_hi, gap_lo), full_lo)

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

    tile_args = (q, q_tail, K, V, Mask, TileState, Captures, batch, head, kv_head, mask_b, mask_h,
                 mask_m, q_idx, row_pos, col_in_tile, seq_kv, window, score_scale, softcap_out)
    tile_consts = (CAUSAL, WINDOWED, SOFTCAP, APPROX_TANH, SCORE_MOD, MASK_KIND, MASK_TABLE,
                   MASK_TILE_M, SCORE_UNIT, FOLD_SCALE, TILE_M, TILE_N, TILE_D, TAIL_D, K_LATENCY,
                   V_LATENCY)
    if MASK_KIND != NO_MASK and MASK_TABLE:  # (no gap without a table: keep the code small)
        for j in range(first_tile, gap_lo):
            m_i, l_i, acc, acc_tail = _attend_tile(j, m_i, l_i, acc, acc_tail, *tile_args, True,
                                                   *tile_consts)
    for j in range(gap_hi, full_lo):
        m_i, l_i, acc, acc_tail = _attend_tile(j, m_i, l_i, acc, acc_tail, *tile_args, True,
                                               *tile_consts)
    for j in range(full_lo, full_hi):
        m_i, l_i, acc, acc_tail = _attend_tile(j, m_i, l_i, acc, acc_tail, *tile_args, False,
                                               *tile_consts)
    for j in range(full_hi, end_tile):
        m_i, l_i, acc, acc_tail = _attend_tile(j, m_i, l_i, acc, acc_tail, *tile_args, True,
                                               *tile_consts)

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
    if WRITE_LSE:
        lse = ct.where(empty, -math.inf, m_i / SCORE_UNIT + ct.log(ct.where(empty, 1.0, l_i)))
        store_lse(Lse, out_0, out_1, m_tile, lse, ROWS, G_TILE)


def _attend_tile(j, m_i, l_i, acc, acc_tail, q, q_tail, K, V, Mask, TileState, Captures, batch,
                 head, kv_head, mask_b, mask_h, mask_m, q_idx, row_pos, col_in_tile, seq_kv,
                 window, score_scale, softcap_out, EDGE, CAUSAL, WINDOWED, SOFTCAP,
                 APPROX_TANH, SCORE_MOD, MASK_KIND, MASK_TABLE,
                 MASK_TILE_M, SCORE_UNIT, FOLD_SCALE, TILE_M, TILE_N, TILE_D, TAIL_D, K_LATENCY,
                 V_LATENCY):
    """One online-softmax step over key tile ``j``; returns the updated (m, l, acc, acc_tail).
    ``EDGE``: the tile may be partly hidden (apply the causal/window rule, read its state in
    the block table); else it is known full."""
    state = TILE_FULL
    if MASK_KIND != NO_MASK:
        if not MASK_TABLE:
            state = TILE_PARTIAL
        elif EDGE:
            state = ct.load(TileState, index=(mask_b, mask_h, mask_m, j),
                            shape=(1, 1, 1, 1)).item()
    if state != TILE_EMPTY:
        k = ct.load(K, index=(batch, kv_head, 0, j), shape=(1, 1, TILE_D, TILE_N),
                    order=(0, 1, 3, 2), padding_mode=ct.PaddingMode.ZERO,
                    latency=K_LATENCY).reshape((TILE_D, TILE_N))
        qk = _mma(q, k, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        if TAIL_D != 0:
            k_tail = ct.load(K, index=(batch, kv_head, TILE_D // TAIL_D, j),
                             shape=(1, 1, TAIL_D, TILE_N), order=(0, 1, 3, 2),
                             padding_mode=ct.PaddingMode.ZERO,
                             latency=K_LATENCY).reshape((TAIL_D, TILE_N))
            qk = _mma(q_tail, k_tail, qk)
        if SOFTCAP and APPROX_TANH:
            s = ct.tanh(qk * score_scale, rounding_mode=ct.RoundingMode.APPROX) * softcap_out
        elif SOFTCAP:
            s = ct.tanh(qk * score_scale) * softcap_out
        elif FOLD_SCALE:
            # Raw scores: a positive scale commutes with the max, so it is applied once per row
            # to the max and fused into the exponent's FMA (one multiply per score saved).
            s = qk
        else:
            s = qk * score_scale
        cols = j * TILE_N + col_in_tile
        if SCORE_MOD:  # before any masking: a mod must not see (or revive) a hidden -inf
            s = _score_mod(s, batch, head, q_idx, cols, Captures)

        if EDGE:
            visible = ct.full((TILE_M, TILE_N), True, dtype=ct.bool_) & (cols < seq_kv)
            if CAUSAL:
                visible = visible & (cols <= row_pos)
            if WINDOWED:
                visible = visible & (cols > row_pos - window)
                if not CAUSAL:
                    visible = visible & (cols < row_pos + window)
            s = ct.where(visible, s, -math.inf)
        if state == TILE_PARTIAL and MASK_KIND == MASK_MOD:
            visible = (ct.full((TILE_M, TILE_N), True, dtype=ct.bool_)
                       & _mask_mod(batch, head, q_idx, cols, Captures))
            s = ct.where(visible, s, -math.inf)
        elif state == TILE_PARTIAL:
            mask = ct.load(Mask, index=(mask_b, mask_h, mask_m, j),
                           shape=(1, 1, MASK_TILE_M, TILE_N),
                           padding_mode=ct.PaddingMode.ZERO).reshape((MASK_TILE_M, TILE_N))
            if MASK_KIND == BOOL_MASK:
                s = ct.where(mask != 0, s, -math.inf)
            else:
                # -inf hides the key outright, so a NaN score there does not leak (NaN + -inf).
                bias = mask.astype(ct.float32)
                s = ct.where(bias == -math.inf, -math.inf, s + bias)

        row_max = ct.max(s, axis=-1, keepdims=True)
        if FOLD_SCALE:
            row_max = row_max * score_scale
        m_new = max(m_i, row_max)
        m_shift = m_new
        if EDGE or MASK_KIND != NO_MASK or SCORE_MOD:
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
                    latency=V_LATENCY).reshape((TILE_N, TILE_D))
        p = p.astype(v.dtype)
        acc = _mma(p, v, acc * alpha)
        if TAIL_D != 0:
            v_tail = ct.load(V, index=(batch, kv_head, j, TILE_D // TAIL_D),
                             shape=(1, 1, TILE_N, TAIL_D), padding_mode=ct.PaddingMode.ZERO,
                             latency=V_LATENCY).reshape((TILE_N, TAIL_D))
            acc_tail = _mma(p, v_tail, acc_tail * alpha)
        m_i = m_new
    return m_i, l_i, acc, acc_tail


def _table_range(TileRange, mask_b, mask_h, mask_m, which):
    """Entry ``which`` of a query tile's key-tile ranges (masks.py): 0 first non-empty, 1 / 2
    the gap of empty tiles, 3 / 4 the run of full tiles, 5 end."""
    return ct.load(TileRange, index=(mask_b, mask_h, mask_m, which), shape=(1, 1, 1, 1)).item()


def _mma(a, b, acc):
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
