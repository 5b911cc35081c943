"""The cuTile attention backward kernels (FlashAttention-2's backward, its §3.1.2).

The forward saved each row's LSE; a first small kernel (:func:`attention_backward_rows`)
computes ``Delta = rowsum(dOut * Out) - dLse`` and the LSE in score units with a row that saw
no key made +inf, so its probabilities recompute as exactly 0. Then, per key tile j and
query tile i, with ``P = exp(S - lse)`` recomputed from the scores ``S``:

    dV_j += P^T dOut_i        dP = dOut_i V_j^T        dS = P * (dP - Delta_i) * dS/dscore
    dK_j += dS^T Q_i * scale  dQ_i += dS K_j * scale

Two kernels without atomics, so the gradients are bitwise reproducible run to run (the
deterministic mode; the additions below use TMA reduce-adds, and the fast mode takes ``DQ_ADD``
where the schedule table says so):

* :func:`attention_backward_kv`: a block per (key tile, kv head, batch row) holds dK and dV in
  fp32 and walks every query head of its group and the query tiles that see the key tile
  (visibility.query_tiles, the transpose of the forward's walk; a mask's transposed block table
  narrows it). It works on transposed tiles (keys x queries): ``S^T = K Q^T`` and
  ``dP^T = V dOut^T`` take the loaded Q and dOut as transposed MMA operands, and ``P^T`` and
  ``dS^T`` are already the left operands of the two accumulating MMAs.
* :func:`attention_backward_q`: a block per (query tile, query head, batch row) holds dQ and
  walks the key tiles the forward walked (recomputing S and dP: the price of no atomics).

The dK/dV kernel can also add, with TMA reduce-adds (``TiledView.atomic_store_add``, one
bulk ``UTMAREDG`` per tile): an additive mask's gradient, the scores' gradient itself
(``MASK_GRAD``; backward_launch.mask_grad_buffer says into what), and with ``DQ_ADD`` dQ into
an fp32 array, the dQ kernel then not launched (FlashAttention-3's layout; the fast mode's
default at head dims up to 64, where it measured faster: perf-notes step 46).

Both read the constants as the forward does (one ``kernel_params.AttentionConstants`` tuple;
TILE_M is the query tile, TILE_N the key tile; a head dim of two powers of two, 96 = 64 + 32,
is held as two tiles, :func:`_load_parts`) and hide scores with the forward's rules: the
visibility rule, a bool/additive mask or a mask_mod (``_mask_mod``, replaced per mod by the
launcher as in kernel.py). A score_mod runs here only when it adds terms to its score
(ALiBi, bias tables: derivative 1) or when mod_derivative derived its derivative in the
score (``_score_mod_grad``, which multiplies dS). When the tensors it reads need gradients,
the dK/dV kernel adds them (``_score_mod_capture_grad``, by atomics; in deterministic mode
each block into its own row, summed by torch in a fixed order); any other score_mod's backward
runs the reference path (op.backward).
"""

import math

import cuda.tile as ct

from . import kernel_params as P
from .kernel_params import (ADDITIVE_MASK, BOOL_MASK, LOG2E, MASK_GRAD_ROWS, MASK_MOD, NO_MASK,
                            NO_MASK_GRAD, TILE_EMPTY, TILE_FULL, TILE_PARTIAL)
from .tile_rows import key_tile_walk, load_rows, mma, store_rows, table_ranges, table_row
from .visibility import clip_tiles, edge_count, edge_tile, query_tiles, visible


def _score_mod(score, b, h, q_idx, kv_idx, captures):
    """Stand-in for a user's score_mod (replaced per mod by the launcher)."""
    return score


def _score_mod_grad(score, b, h, q_idx, kv_idx, captures):
    """Stand-in for the score_mod's derivative in its score (mod_derivative; replaced per mod
    by the launcher). Not called for a score_mod that adds terms to its score (derivative 1)."""
    return score * 0.0 + 1.0


def _score_mod_capture_grad(p, ds, score, b, h, q_idx, kv_idx, captures, LEARNABLE, PARTIALS):
    """Stand-in for the score_mod's capture-gradient adds (mod_translator
    .capture_grad_entries; replaced per mod by the launcher): adds ``ds`` times the mod's
    derivative in each learnable captured tensor into its gradient array, which ``captures``
    holds after the tensors (``PARTIALS``: into this block's row of it)."""
    return ds


def _mask_mod(b, h, q_idx, kv_idx, captures):
    """Stand-in for a user's mask_mod (replaced per mod by the launcher)."""
    return q_idx >= 0


# cuTile's calling convention: arrays and run-time scalars each a parameter, the compile-time
# constants in the one tuple C. LseB and Delta are (B, Hq, Sq) fp32 (attention_backward_rows).
def attention_backward_kv(
    Q, K, V, dOut, LseB, Delta, dK, dV, dQAdd, DMask, Mask, TileState, TileRange, Captures,
    score_scale: float,   # multiplies q.k as in the forward (scale * SCORE_UNIT, or scale/softcap)
    softcap_out: float,   # softcap * SCORE_UNIT when SOFTCAP
    grad_scale: float,    # d(score)/d(q.k) outside softcap's tanh: the scale
    diag_offset: int,
    window: int,
    C: ct.Constant,       # kernel_params.AttentionConstants (G_TILE 1; TAIL_D: _load_parts)
):
    TILE_M = C[P.TILE_M]
    TILE_N = C[P.TILE_N]
    MASK_KIND = C[P.MASK_KIND]
    n_tile = ct.bid(0)
    kv_head = ct.bid(1)
    batch = ct.bid(2)
    mask_b = batch if C[P.MASK_BATCHED] else 0
    if C[P.TABLE_ORDER]:  # (the group's first head's order when the mask has heads)
        n_tile = table_row(TileRange, mask_b, kv_head * C[P.GROUP] if C[P.MASK_HEADED] else 0,
                           n_tile)
    seq_q = Q.shape[2]
    seq_kv = K.shape[2]
    key_lo = n_tile * TILE_N
    key_hi = min(key_lo + TILE_N, seq_kv) - 1
    first, end, full_lo, full_hi = query_tiles(key_lo, key_hi, seq_q, diag_offset, window,
                                               TILE_M, C[P.CAUSAL], C[P.WINDOWED])
    k = _load_parts(K, batch, kv_head, n_tile, TILE_N, C)
    v = _load_parts(V, batch, kv_head, n_tile, TILE_N, C)
    if C[P.PDL]:  # the Delta kernel's rows are read from here on; the dQ kernel may start
        ct.grid_dependency_control_wait()
        ct.grid_dependency_control_launch_dependents()
    kv_idx = (key_lo + ct.arange(TILE_N, dtype=ct.int32))[:, None]
    row_in_tile = ct.arange(TILE_M, dtype=ct.int32)[None, :]
    # A mask with a row per query has a per-(key tile, query tile) table (transposed); one row
    # for all queries has a single state per key tile.
    ROW_TABLE = MASK_KIND != NO_MASK and C[P.MASK_ROWS]
    grads = (_zero_parts(TILE_N, C), _zero_parts(TILE_N, C))
    for g in range(C[P.GROUP]):
        head = kv_head * C[P.GROUP] + g
        mask_h = head if C[P.MASK_HEADED] else 0
        table = (0, 0, 0, 0, 0, 0)  # (not read without a row table)
        if ROW_TABLE:
            table = table_ranges(TileRange, mask_b, mask_h, n_tile)
        i_first, gap_lo, gap_hi, i_full_lo, i_full_hi, i_end = clip_tiles(
            first, end, full_lo, full_hi, table, ROW_TABLE, 0, 1)
        key_state = TILE_FULL
        if MASK_KIND != NO_MASK and not ROW_TABLE:
            key_state = _load_state(TileState, (mask_b, mask_h, n_tile, 0), C)
            if key_state != TILE_FULL:  # every query tile reads the mask (or none is walked)
                i_full_lo = i_end
                i_full_hi = i_end
            if key_state == TILE_EMPTY:
                i_first = i_end
                gap_lo = i_end
                gap_hi = i_end
        rows = (k, v, kv_idx, row_in_tile)
        where = (batch, head, mask_b, mask_h, n_tile, key_state)
        arrays = (Q, dOut, LseB, Delta, Mask, TileState, Captures, dQAdd, DMask, grad_scale)
        scalars = (seq_kv, diag_offset, window, score_scale, softcap_out)
        for t in range(edge_count(i_first, gap_lo, gap_hi, i_full_lo, i_full_hi, i_end)):
            i = edge_tile(t, i_first, gap_lo, gap_hi, i_full_lo, i_full_hi)
            grads = _key_tile_step(i, grads, rows, where, arrays, scalars, True, C)
        for i in range(i_full_lo, i_full_hi):
            grads = _key_tile_step(i, grads, rows, where, arrays, scalars, False, C)
    dk, dv = grads
    _store_parts(dK, batch, kv_head, n_tile, dk, grad_scale, TILE_N, C)
    _store_parts(dV, batch, kv_head, n_tile, dv, 1.0, TILE_N, C)


attention_backward_kv_kernel = ct.kernel(attention_backward_kv)


def _key_tile_step(i, grads, rows, where, arrays, scalars, EDGE, C):
    """dK/dV of one key tile from query tile ``i`` of one head, on transposed tiles (keys x
    queries). ``EDGE``: the tile may be partly hidden (else known full)."""
    dk, dv = grads
    k, v, kv_idx, row_in_tile = rows
    batch, head, mask_b, mask_h, n_tile, key_state = where
    Q, dOut, LseB, Delta, Mask, TileState, Captures, dQAdd, DMask, grad_scale = arrays
    TILE_M = C[P.TILE_M]
    TILE_N = C[P.TILE_N]
    tile_state = TILE_FULL
    if EDGE:
        tile_state = key_state
        if C[P.MASK_KIND] != NO_MASK and C[P.MASK_ROWS]:
            tile_state = _edge_state(TileState, (mask_b, mask_h, n_tile, i), C)
    if tile_state != TILE_EMPTY:
        q = _load_parts(Q, batch, head, i, TILE_M, C)
        do = _load_parts(dOut, batch, head, i, TILE_M, C)
        lse = _load_step_rows(LseB, batch, head, i, TILE_M, ct.PaddingMode.POS_INF, C)
        delta = _load_step_rows(Delta, batch, head, i, TILE_M, ct.PaddingMode.ZERO, C)
        qk = _contract(k, _transposed_parts(Q, q, batch, head, i, TILE_M, C),
                       ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32), C)
        s, tanh = _scores(qk, scalars, C)
        unmodified = s
        q_idx = i * TILE_M + row_in_tile
        if C[P.SCORE_MOD]:
            s = _score_mod(s, batch, head, q_idx, kv_idx, Captures)
        s = _hidden(s, q_idx, kv_idx, EDGE, tile_state, (batch, head, mask_b, mask_h, i,
                                                         n_tile), Mask, Captures, scalars,
                    True, C)
        p = _probabilities(s, lse.reshape((1, TILE_M)), C)
        dv = _accumulate(p.astype(dOut.dtype), do, dv, C)
        dp = _contract(v, _transposed_parts(dOut, do, batch, head, i, TILE_M, C),
                       ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32), C)
        ds = p * (dp - delta.reshape((1, TILE_M)))
        if C[P.MASK_GRAD] != NO_MASK_GRAD:
            _add_mask_grad(DMask, ds, batch, head, i, n_tile, C)
        if C[P.CAPTURE_GRADS] != 0:  # (dS of the mod's output, at the mod's input score)
            # a key tile's rows past seq_kv are walked as full (their dK/dV is not stored) and
            # have p > 0 and dS != 0: their weight is 0 here, or they add to the captures
            seen_p = ct.where(kv_idx < scalars[0], p, 0.0)
            _score_mod_capture_grad(seen_p, ds, unmodified, batch, head, q_idx, kv_idx,
                                    Captures, C[P.CAPTURE_GRADS], C[P.CAPTURE_PARTIALS])
        ds = _through_softcap(ds, tanh, C)
        if C[P.SCORE_MOD_GRAD]:
            ds = _through_score_mod(ds, p, unmodified, batch, head, q_idx, kv_idx, Captures)
        ds = ds.astype(Q.dtype)
        dk = _accumulate(ds, q, dk, C)
        if C[P.DQ_ADD]:
            _add_parts(dQAdd, batch, head, i, _dq_of_step(k, ds, C), grad_scale, TILE_M, C)
    return dk, dv


def attention_backward_q(
    Q, K, V, dOut, LseB, Delta, dQ, Mask, TileState, TileRange, Captures,
    score_scale: float,
    softcap_out: float,
    grad_scale: float,
    diag_offset: int,
    window: int,
    C: ct.Constant,
):
    TILE_M = C[P.TILE_M]
    TILE_N = C[P.TILE_N]
    m_tile = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    if C[P.TABLE_ORDER]:
        m_tile = table_row(TileRange, batch if C[P.MASK_BATCHED] else 0,
                           head if C[P.MASK_HEADED] else 0, m_tile)
    elif C[P.HEAVY_FIRST]:
        m_tile = ct.num_blocks(0) - 1 - m_tile
    kv_head = head // C[P.GROUP]
    seq_q = Q.shape[2]
    seq_kv = K.shape[2]
    row_lo = m_tile * TILE_M
    row_hi = min(row_lo + TILE_M, seq_q) - 1
    (mask_b, mask_h, mask_m), walk = key_tile_walk(TileRange, batch, head, m_tile, row_lo,
                                                   row_hi, diag_offset, seq_kv, window, 0, 1, C)
    first, gap_lo, gap_hi, full_lo, full_hi, end = walk
    q = _load_parts(Q, batch, head, m_tile, TILE_M, C)
    do = _load_parts(dOut, batch, head, m_tile, TILE_M, C)
    if C[P.PDL]:  # the rows come from the Delta kernel, done before the dK/dV kernel ends
        ct.grid_dependency_control_wait()
    lse = _load_step_rows(LseB, batch, head, m_tile, TILE_M, ct.PaddingMode.POS_INF,
                          C).reshape((TILE_M, 1))
    delta = _load_step_rows(Delta, batch, head, m_tile, TILE_M, ct.PaddingMode.ZERO,
                            C).reshape((TILE_M, 1))
    q_idx = (row_lo + ct.arange(TILE_M, dtype=ct.int32))[:, None]
    col_in_tile = ct.arange(TILE_N, dtype=ct.int32)[None, :]
    rows = (q, do, lse, delta, q_idx, col_in_tile)
    where = (batch, head, kv_head, mask_b, mask_h, mask_m)
    arrays = (K, V, Mask, TileState, Captures)
    scalars = (seq_kv, diag_offset, window, score_scale, softcap_out)
    dq = _zero_parts(TILE_M, C)
    for t in range(edge_count(first, gap_lo, gap_hi, full_lo, full_hi, end)):
        j = edge_tile(t, first, gap_lo, gap_hi, full_lo, full_hi)
        dq = _query_tile_step(j, dq, rows, where, arrays, scalars, True, C)
    for j in range(full_lo, full_hi):
        dq = _query_tile_step(j, dq, rows, where, arrays, scalars, False, C)
    _store_parts(dQ, batch, head, m_tile, dq, grad_scale, TILE_M, C)


attention_backward_q_kernel = ct.kernel(attention_backward_q)


def _query_tile_step(j, dq, rows, where, arrays, scalars, EDGE, C):
    """dQ of one query tile from key tile ``j`` (queries x keys, as in the forward)."""
    q, do, lse, delta, q_idx, col_in_tile = rows
    batch, head, kv_head, mask_b, mask_h, mask_m = where
    K, V, Mask, TileState, Captures = arrays
    TILE_M = C[P.TILE_M]
    TILE_N = C[P.TILE_N]
    tile_state = TILE_FULL
    if EDGE and C[P.MASK_KIND] != NO_MASK:
        tile_state = _edge_state(TileState, (mask_b, mask_h, mask_m, j), C)
    if tile_state != TILE_EMPTY:
        k = _load_parts(K, batch, kv_head, j, TILE_N, C)
        v = _load_parts(V, batch, kv_head, j, TILE_N, C)
        qk = _contract(q, _transposed_parts(K, k, batch, kv_head, j, TILE_N, C),
                       ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32), C)
        s, tanh = _scores(qk, scalars, C)
        unmodified = s
        kv_idx = j * TILE_N + col_in_tile
        if C[P.SCORE_MOD]:
            s = _score_mod(s, batch, head, q_idx, kv_idx, Captures)
        s = _hidden(s, q_idx, kv_idx, EDGE, tile_state,
                    (batch, head, mask_b, mask_h, mask_m, j), Mask, Captures, scalars, False, C)
        p = _probabilities(s, lse, C)
        dp = _contract(do, _transposed_parts(V, v, batch, kv_head, j, TILE_N, C),
                       ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32), C)
        ds = _through_softcap(p * (dp - delta), tanh, C)
        if C[P.SCORE_MOD_GRAD]:
            ds = _through_score_mod(ds, p, unmodified, batch, head, q_idx, kv_idx, Captures)
        dq = _accumulate(ds.astype(K.dtype), k, dq, C)
    return dq


def attention_backward_rows(
    Out, dOut, Lse, dLse, Delta, LseB,
    score_unit: float,    # the LSE's unit in the other two kernels (LOG2E or 1)
    TILE_M: ct.Constant,  # rows per block
    TILE_D: ct.Constant,  # the head dim's padded tile
    WITH_DLSE: ct.Constant,  # a gradient reaches the LSE (dLse is read)
    PDL: ct.Constant,     # the dK/dV kernel is its programmatic dependent (may start early)
):
    """What the other two kernels read per query row (reference.backward_rows is the torch
    twin): ``Delta = rowsum(dOut * Out) - dLse`` and the LSE in score units with -inf (a row
    that saw no key) made +inf, so that its recomputed probabilities are exactly 0. Grid:
    (row tiles, Hq, B); all arrays (B, Hq, Sq[, D]), Delta and LseB with Sq or, for
    unchecked loads, Sq padded to whole tiles (backward_launch.padded_rows): a padded row gets
    Delta 0 and LSE +inf."""
    if PDL:
        ct.grid_dependency_control_launch_dependents()
    m_tile = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    out = load_rows(Out, batch, head, m_tile, 0, TILE_M, 1, TILE_D).astype(ct.float32)
    d_out = load_rows(dOut, batch, head, m_tile, 0, TILE_M, 1, TILE_D).astype(ct.float32)
    delta = ct.sum(out * d_out, axis=-1)
    if WITH_DLSE:
        delta = delta - _load_row_values(dLse, batch, head, m_tile, TILE_M, ct.PaddingMode.ZERO)
    # (rows past Sq, stored when the arrays are padded to whole tiles, read -inf: LSE +inf)
    lse = _load_row_values(Lse, batch, head, m_tile, TILE_M, ct.PaddingMode.NEG_INF)
    lse = ct.where(lse == -math.inf, math.inf, lse * score_unit)
    ct.store(Delta, index=(batch, head, m_tile), tile=delta.reshape((1, 1, TILE_M)),
             allow_tma=False)
    ct.store(LseB, index=(batch, head, m_tile), tile=lse.reshape((1, 1, TILE_M)),
             allow_tma=False)


attention_backward_rows_kernel = ct.kernel(attention_backward_rows)


# The head dim as the kernels hold it: a tuple of its parts, (TILE_D columns,) or, with
# TAIL_D > 0 (80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32), (TILE_D columns, the TAIL_D after
# them), so that no MMA works on zero padding. Each helper below does one thing per part.

def _load_parts(Array, batch, head, index, ROWS, C):
    """Rows ``index`` (tiles of ROWS) of a (B, H, S, D) array, as the head dim's parts."""
    main = load_rows(Array, batch, head, index, 0, ROWS, 1, C[P.TILE_D])
    if C[P.TAIL_D] != 0:
        return main, load_rows(Array, batch, head, index, C[P.TILE_D] // C[P.TAIL_D], ROWS, 1,
                               C[P.TAIL_D])
    return (main,)


def _zero_parts(ROWS, C):
    """fp32 zero accumulators of ROWS rows, one per part."""
    main = ct.full((ROWS, C[P.TILE_D]), 0.0, dtype=ct.float32)
    if C[P.TAIL_D] != 0:
        return main, ct.full((ROWS, C[P.TAIL_D]), 0.0, dtype=ct.float32)
    return (main,)


def _store_parts(Array, batch, head, index, parts, scale, ROWS, C):
    """Stores fp32 parts times ``scale`` where :func:`_load_parts` reads them."""
    store_rows(Array, batch, head, index, 0, parts[0] * scale, ROWS, 1, C[P.TILE_D])
    if C[P.TAIL_D] != 0:
        store_rows(Array, batch, head, index, C[P.TILE_D] // C[P.TAIL_D], parts[1] * scale, ROWS,
                   1, C[P.TAIL_D])


def _add_parts(Array, batch, head, index, parts, scale, ROWS, C):
    """Adds fp32 parts times ``scale`` into a (B, H, S, D) fp32 array by TMA reduce-adds."""
    TILE_D = C[P.TILE_D]
    Array.tiled_view((1, 1, ROWS, TILE_D)).atomic_store_add(
        (batch, head, index, 0), (parts[0] * scale).reshape((1, 1, ROWS, TILE_D)))
    if C[P.TAIL_D] != 0:
        TAIL_D = C[P.TAIL_D]
        Array.tiled_view((1, 1, ROWS, TAIL_D)).atomic_store_add(
            (batch, head, index, TILE_D // TAIL_D),
            (parts[1] * scale).reshape((1, 1, ROWS, TAIL_D)))


def _contract(a, b, acc, C):
    """``acc + a @ b`` over the head dim: ``a`` (rows x D) and ``b`` (D x cols) in parts."""
    acc = mma(a[0], b[0], acc)
    if C[P.TAIL_D] != 0:
        acc = mma(a[1], b[1], acc)
    return acc


def _accumulate(a, b, acc, C):
    """``acc + a @ b`` part by part: ``b`` (rows x D) and ``acc`` in parts, D the columns."""
    main = mma(a, b[0], acc[0])
    if C[P.TAIL_D] != 0:
        return main, mma(a, b[1], acc[1])
    return (main,)


def _dq_of_step(k, ds, C):
    """A dK/dV step's share of dQ (query rows x D, in parts) from its transposed ``ds`` (keys x
    queries, the MMA's dtype) as ``(K^T dS^T)^T``: the product's rows are the head dim, so the
    warpgroup MMA gets M = D rather than a step's 16-64 query rows (``dS K`` takes thin
    register MMAs and spills at D=128)."""
    main = ct.transpose(mma(ct.transpose(k[0]), ds,
                            ct.full((C[P.TILE_D], C[P.TILE_M]), 0.0, dtype=ct.float32)))
    if C[P.TAIL_D] != 0:
        return main, ct.transpose(mma(ct.transpose(k[1]), ds, ct.full(
            (C[P.TAIL_D], C[P.TILE_M]), 0.0, dtype=ct.float32)))
    return (main,)


def _transposed_parts(Array, parts, batch, head, index, ROWS, C):
    """The parts of rows ``index`` of ``Array`` as (part width, ROWS) operands."""
    main = _transposed(Array, parts[0], batch, head, index, ROWS, C[P.TILE_D], 0, C)
    if C[P.TAIL_D] != 0:
        return main, _transposed(Array, parts[1], batch, head, index, ROWS, C[P.TAIL_D],
                                 C[P.TILE_D] // C[P.TAIL_D], C)
    return (main,)


def _transposed(Array, tile, batch, head, index, ROWS, WIDTH, column, C):
    """``tile`` (rows ``index``, column tile ``column`` of WIDTH, of ``Array``) as the (WIDTH,
    ROWS) operand of an MMA: loaded again in transposed order (C[LOAD_TRANSPOSED]) or
    transposed in registers."""
    if C[P.LOAD_TRANSPOSED]:
        return ct.load(Array, index=(batch, head, column, index), shape=(1, 1, WIDTH, ROWS),
                       order=(0, 1, 3, 2), padding_mode=ct.PaddingMode.ZERO
                       ).reshape((WIDTH, ROWS))
    return ct.transpose(tile)


def _edge_state(TileState, index, C):
    """The state of an edge step's tile: read from the block table (EDGE_STATES, or a mask
    with one row for all queries), else TILE_PARTIAL, a compile-time constant: the mask is
    applied, nothing is skipped and no branch waits on a load."""
    if C[P.EDGE_STATES] or not C[P.MASK_ROWS]:
        return _load_state(TileState, index, C)
    return TILE_PARTIAL


def _load_state(TileState, index, C):
    """One tile's state from a block table (its index is always inside the table: with
    UNCHECKED, loaded without the bounds check)."""
    return ct.load(TileState, index=index, shape=(1, 1, 1, 1),
                   check_bounds=not C[P.UNCHECKED]).item()


def _load_step_rows(Values, batch, head, tile, TILE_M, padding, C):
    """A step's LSE or Delta rows (:func:`_load_row_values`); with UNCHECKED, from arrays the
    Delta kernel padded to whole tiles, so without bounds checks (and no padding: cuTile's
    compiler rejects a padding mode on an unchecked load)."""
    if C[P.UNCHECKED]:
        return ct.load(Values, index=(batch, head, tile), shape=(1, 1, TILE_M),
                       check_bounds=False, allow_tma=False).reshape((TILE_M,))
    return _load_row_values(Values, batch, head, tile, TILE_M, padding)


def _load_row_values(Values, batch, head, tile, TILE_M, padding):
    """A (TILE_M,) slice of a (B, Hq, Sq) fp32 array; rows past Sq read ``padding`` (the LSE
    +inf, so their recomputed probabilities are 0)."""
    return ct.load(Values, index=(batch, head, tile), shape=(1, 1, TILE_M), padding_mode=padding,
                   allow_tma=False).reshape((TILE_M,))


def _scores(qk, scalars, C):
    """The forward's scores of raw ``q.k`` (in score units), and softcap's tanh (for its
    derivative; else the scores again, unused)."""
    seq_kv, diag_offset, window, score_scale, softcap_out = scalars
    if C[P.SOFTCAP] and C[P.APPROX_TANH]:
        tanh = ct.tanh(qk * score_scale, rounding_mode=ct.RoundingMode.APPROX)
        return tanh * softcap_out, tanh
    if C[P.SOFTCAP]:
        tanh = ct.tanh(qk * score_scale)
        return tanh * softcap_out, tanh
    s = qk * score_scale
    return s, s


def _hidden(s, q_idx, kv_idx, EDGE, tile_state, where, Mask, Captures, scalars, TRANSPOSED, C):
    """``s`` with the scores the forward hid set to -inf: the visibility rule on an edge tile,
    the mask on a partial one. ``q_idx`` / ``kv_idx`` broadcast to the tile's shape; with
    ``TRANSPOSED`` the tile is keys x queries."""
    batch, head, mask_b, mask_h, mask_m, n_tile = where
    seq_kv, diag_offset, window, score_scale, softcap_out = scalars
    TILE_M = C[P.TILE_M]
    TILE_N = C[P.TILE_N]
    MASK_KIND = C[P.MASK_KIND]
    SHAPE = (TILE_N, TILE_M) if TRANSPOSED else (TILE_M, TILE_N)
    if EDGE:
        seen = ct.full(SHAPE, True, dtype=ct.bool_) & visible(
            q_idx + diag_offset, kv_idx, seq_kv, window, C[P.CAUSAL], C[P.WINDOWED])
        s = ct.where(seen, s, -math.inf)
    if tile_state == TILE_PARTIAL and MASK_KIND == MASK_MOD:
        seen = ct.full(SHAPE, True, dtype=ct.bool_) & _mask_mod(batch, head, q_idx, kv_idx,
                                                                Captures)
        s = ct.where(seen, s, -math.inf)
    elif tile_state == TILE_PARTIAL:
        MASK_TILE_M = TILE_M if C[P.MASK_ROWS] else 1
        mask = ct.load(Mask, index=(mask_b, mask_h, mask_m if C[P.MASK_ROWS] else 0, n_tile),
                       shape=(1, 1, MASK_TILE_M, TILE_N),
                       padding_mode=ct.PaddingMode.ZERO).reshape((MASK_TILE_M, TILE_N))
        if TRANSPOSED:
            mask = ct.transpose(mask)
        if MASK_KIND == BOOL_MASK:
            s = ct.where(mask != 0, s, -math.inf)
        elif MASK_KIND == ADDITIVE_MASK:
            bias = mask.astype(ct.float32)
            s = ct.where(bias == -math.inf, -math.inf, s + bias)
    return s


def _probabilities(s, lse, C):
    """``exp(S - lse)``: the forward's softmax weights, recomputed (``lse`` in score units)."""
    if C[P.SCORE_UNIT] == 1.0:
        return ct.exp2((s - lse) * LOG2E, flush_to_zero=True)
    return ct.exp2(s - lse, flush_to_zero=True)


def _through_score_mod(ds, p, score, batch, head, q_idx, kv_idx, Captures):
    """``ds`` times the score_mod's derivative at the score it was given, where the weight is
    not 0 (a hidden score's derivative may be inf or NaN; its gradient is exactly 0)."""
    return ct.where(p > 0.0, ds * _score_mod_grad(score, batch, head, q_idx, kv_idx, Captures),
                    0.0)


def _through_softcap(ds, tanh, C):
    """The scores' gradient ``P * (dP - Delta)`` carried through softcap's tanh: dLoss/d(q.k)
    up to the scale (without softcap, ``ds`` itself)."""
    if C[P.SOFTCAP]:
        return ds * (1.0 - tanh * tanh)
    return ds


def _add_mask_grad(DMask, ds, batch, head, i, n_tile, C):
    """Adds the scores' gradient on the transposed tile (keys x queries) of query tile ``i``,
    key tile ``n_tile``, to the additive mask's gradient ``DMask`` (fp32, zeroed; its batch and
    head dims are 1 or full, and its rows are the query rows or, with MASK_GRAD_ROW_SUMS, one
    per query tile or one for all): an additive mask's gradient is the scores' gradient, summed
    over the dims it broadcasts. TMA reduce-adds, so blocks that share a target need no lock."""
    TILE_M = C[P.TILE_M]
    TILE_N = C[P.TILE_N]
    target_b = batch % DMask.shape[0]
    target_h = head % DMask.shape[1]
    if C[P.MASK_GRAD] == MASK_GRAD_ROWS:
        DMask.tiled_view((1, 1, TILE_M, TILE_N)).atomic_store_add(
            (target_b, target_h, i, n_tile), ct.transpose(ds).reshape((1, 1, TILE_M, TILE_N)))
    else:
        DMask.tiled_view((1, 1, 1, TILE_N)).atomic_store_add(
            (target_b, target_h, i % DMask.shape[2], n_tile),
            ct.sum(ds, axis=1).reshape((1, 1, 1, TILE_N)))
