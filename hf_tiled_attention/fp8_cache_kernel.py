"""cuTile kernels of the FP8 KV cache (fp8_cache.py): a decode step's attention read straight
from the cache's e4m3 rows, and the quantisation of new states into rows.

:func:`decode_cache_rows`: one block per (query tile, key split) of one grid head (a kv head
whose query heads share the tile's rows when ``G_TILE`` > 1, as the bf16 kernel's packed decode
tiles: tile_rows.py) and batch row. Each MMA either converts a tile's e4m3 values to fp16 in
registers (exact; the query scaled into fp16 exactly) for a 16-bit MMA (0 parts), or is itself
an e4m3 MMA: the other operand enters as one or two e4m3 parts (the second the first's rounding
error: ~8 bits together, as bf16's) against the tile as stored (QK_PARTS, PV_PARTS; the
defaults, schedule.py: QK^T in 16 bits, as an e4m3 QK^T loses the small products beside an
outlier channel's, and PV in e4m3 with two parts, fast accumulation below D=256). The scales go
on the scores' columns (K's) and the probabilities' columns (V's); the cache is read once, at 8
bits. Key tiles that every row of the tile sees whole take a step without the per-element rule
(as kernel.py's). Key splits write fp32 partial
results that :func:`merge_splits` combines (merge.py) in a second launch: merging them in the
same launch, as the bf16 kernel's split entry does, crashes tileiras 13.4 for sm_100.

:func:`quantize_tokens`: one block per tile of tokens of one head: each token's largest
magnitude, ``x * (448 / amax)`` rounded to e4m3 and ``amax * (1 / 448)`` written into its row
(fp8_cache.quantize_rows_torch rounds the same way).
"""

import math

import cuda.tile as ct

from .kernel_params import AMAX_FLOOR, E4M3_MAX, LN2, SCALE_PER_AMAX
from .fp8_quant_kernel import TILE_D as QUANT_D
from .fp8_quant_kernel import TILE_T as QUANT_TOKENS
from .fp8_quant_kernel import token_tile
from .merge import merge_query_tile
from .tile_rows import load_rows, store_lse, store_rows
from .visibility import key_tiles, visible

# The constants tuple C (fp8_cache_attention.py builds it).
ROWS = 0        # query positions per tile
G_TILE = 1      # query heads per tile row group (1: unpacked)
GROUP = 2       # grid heads per kv head
TILE_N = 3      # keys per step
TILE_D = 4      # head dim rounded up to a power of two (loads pad with zeros)
CAUSAL = 5
WINDOWED = 6
SOFTCAP = 7
KEY_MASK = 8    # KeyMask (B, Skv) uint8 hides keys
SPLIT = 9       # keys split: write partial results (PartOut / PartLse) for merge_splits
K_LATENCY = 10  # load latency hints (schedule.FP8_CACHE_LATENCY)
V_LATENCY = 11
QK_PARTS = 12   # 0: K converted to the query's type for a 16-bit QK^T; 1 or 2: the query as
                # that many e4m3 parts (the second the first's rounding error), QK^T in e4m3
PV_PARTS = 13   # 0: V converted for a 16-bit PV; 1 or 2: the probabilities (times V's scales
                # over the tile's largest, x448) as that many e4m3 parts, PV in e4m3
PV_FAST_ACC = 14  # the e4m3 PV MMAs' fast accumulation (ct.mma's use_fast_acc)
CONSTANTS = 15
# quantize_tokens' constants tuple: fp8_quant_kernel's first two fields (TILE_T, tokens per
# block, as QUANT_TOKENS; TILE_D, the head dim's tile, as QUANT_D), read by its token_tile


def decode_cache_rows(Q, K8, KScale, V8, VScale, KeyMask, Out, Lse, score_scale: float,
                      softcap_out: float, diag_offset: int, window: int, splits: int,
                      C: ct.Constant):
    """Q ``(B, Hq, Sq, D)`` (packed: ``(B, grid heads, Sq, pack, D)``); K8 / V8 the rows'
    e4m3 values ``(B, Hkv, Skv, D)`` and KScale / VScale their scales ``(B, Hkv, Skv)``;
    KeyMask ``(B, Skv)`` uint8 (read with KEY_MASK); Out / Lse the output and natural-log LSE,
    or with SPLIT the partial results ``(splits, B * grid heads, ...)``. Scores in log2 units
    (``score_scale`` holds LOG2E; with SOFTCAP ``softcap_out`` does)."""
    R = C[ROWS]
    G = C[G_TILE]
    TN = C[TILE_N]
    TD = C[TILE_D]
    TILE_M = R * G
    block = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    m_tile = block // splits
    split = block % splits
    kv_head = head // C[GROUP]
    seq_q = Q.shape[2]
    seq_kv = K8.shape[2]

    # This split's share of the key tiles any of the tile's rows may see; the tiles every row
    # sees whole need no per-element rule (without a key mask).
    row_lo = m_tile * R
    row_hi = min(row_lo + R, seq_q) - 1
    first, end, full_lo, full_hi = key_tiles(row_lo, row_hi, diag_offset, seq_kv, window, TN,
                                             C[CAUSAL], C[WINDOWED])
    per_split = ct.cdiv(max(end - first, 0), splits)
    first = first + split * per_split
    end = min(first + per_split, end)
    full_lo = min(max(full_lo, first), end)
    full_hi = max(min(full_hi, end), full_lo)
    if C[KEY_MASK]:
        full_hi = full_lo

    row_in_tile = ct.arange(TILE_M, dtype=ct.int32)
    if G > 1:  # rows are (position, head) pairs, heads fastest
        row_in_tile = row_in_tile // G
    row_pos = (row_lo + row_in_tile)[:, None] + diag_offset
    col_in_tile = ct.arange(TN, dtype=ct.int32)[None, :]

    q = load_rows(Q, batch, head, m_tile, 0, R, G, TD)
    qf = q.astype(ct.float32)
    if C[QK_PARTS]:
        # Each row scaled to e4m3's range; K's e4m3 tiles then feed the MMA as stored
        q_amax = ct.maximum(ct.max(ct.abs(qf), axis=-1, keepdims=True), AMAX_FLOOR)
        q_hi = qf * (E4M3_MAX / q_amax)
        q_lead = q_hi.astype(ct.float8_e4m3fn)
        # the second part is the first's rounding error: ~8 significant bits together, as
        # bf16's; parts of a row's small elements may fall in e4m3's subnormals, but those
        # lose no more than 2^-10 of a row whose largest element is 448
        q_rest = (q_hi - q_lead.astype(ct.float32)).astype(ct.float8_e4m3fn)
        q_unit = q_amax * SCALE_PER_AMAX
    else:
        # A 16-bit QK^T in fp16 whatever the query's type: e4m3 -> fp16 is one conversion per
        # pair of keys' values (to bf16 it takes three). The query scaled by a power of two
        # that puts the tile's largest element in (224, 448]: exact in fp16 for a bf16 query
        # (fp16 keeps 11 bits to 2^-24), and the scale folds into the keys' column scales.
        tile_amax = ct.maximum(ct.max(ct.max(ct.abs(qf), axis=-1, keepdims=True), axis=0,
                                      keepdims=True), AMAX_FLOOR)
        q_pow = ct.exp2(ct.floor(ct.log2(E4M3_MAX / tile_amax)))
        q_lead = (qf * q_pow).astype(ct.float16)
        q_rest = q_lead
        q_unit = 1.0 / q_pow
    query = (q_lead, q_rest, q_unit, row_pos, col_in_tile)
    where = (batch, kv_head, seq_kv, window, score_scale, softcap_out)
    arrays = (K8, KScale, V8, VScale, KeyMask)
    # m, l, acc (in units of the last tile's largest V scale: see _cache_step) and that scale
    state = (ct.full((TILE_M, 1), -math.inf, dtype=ct.float32),
             ct.full((TILE_M, 1), 0.0, dtype=ct.float32),
             ct.full((TILE_M, TD), 0.0, dtype=ct.float32),
             ct.full((1, 1), 1.0, dtype=ct.float32))
    for j in range(first, full_lo):
        state = _cache_step(j, state, query, where, arrays, True, C)
    for j in range(full_lo, full_hi):
        state = _cache_step(j, state, query, where, arrays, False, C)
    for j in range(full_hi, end):
        state = _cache_step(j, state, query, where, arrays, True, C)
    m_i, l_i, acc, v_top = state

    # Rows that saw no key: output 0, LSE -inf (a NaN in the cache reaches its rows).
    empty = l_i == 0.0
    inv_l = (v_top * (1.0 / E4M3_MAX)) / ct.where(empty, 1.0, l_i)
    lse = ct.where(empty, -math.inf, m_i * LN2 + ct.log(ct.where(empty, 1.0, l_i)))
    out_0 = batch
    out_1 = head
    if C[SPLIT]:
        out_0 = split
        out_1 = batch * Q.shape[1] + head
    store_rows(Out, out_0, out_1, m_tile, 0, ct.where(empty, 0.0, acc * inv_l), R, G, TD)
    store_lse(Lse, out_0, out_1, m_tile, lse, R, G)


def _cache_step(j, state, query, where, arrays, MASKED, C):
    """One key tile of :func:`decode_cache_rows`: the online softmax's step. ``acc`` holds the
    output times 448 over the tile's largest V scale (``v_top``): the probabilities times V's
    per-key scales over ``v_top`` (x448) are at most 448, the operand an e4m3 or fp16 MMA
    takes, and moving acc to the next tile's units is one multiply with the softmax's own
    rescale. ``MASKED``: the tile holds keys some row does not see (or a key mask)."""
    m_i, l_i, acc, top_before = state
    q_lead, q_rest, q_unit, row_pos, col_in_tile = query
    batch, kv_head, seq_kv, window, score_scale, softcap_out = where
    K8, KScale, V8, VScale, KeyMask = arrays
    TN = C[TILE_N]
    TD = C[TILE_D]
    k_scale = ct.load(KScale, index=(batch, kv_head, j), shape=(1, 1, TN),
                      padding_mode=ct.PaddingMode.ZERO, latency=C[K_LATENCY]).reshape((1, TN))
    zeros = ct.full((q_lead.shape[0], TN), 0.0, dtype=ct.float32)
    if C[QK_PARTS]:
        k8 = ct.transpose(ct.load(K8, index=(batch, kv_head, j, 0), shape=(1, 1, TN, TD),
                                  padding_mode=ct.PaddingMode.ZERO, latency=C[K_LATENCY])
                          .reshape((TN, TD)))
        qk = zeros
        if C[QK_PARTS] > 1:
            qk = ct.mma(q_rest, k8, zeros)
        s = ct.mma(q_lead, k8, qk) * (q_unit * (k_scale * score_scale))
    else:
        k = ct.load(K8, index=(batch, kv_head, 0, j), shape=(1, 1, TD, TN),
                    order=(0, 1, 3, 2), padding_mode=ct.PaddingMode.ZERO,
                    latency=C[K_LATENCY]).reshape((TD, TN)).astype(ct.float16)
        s = ct.mma(q_lead, k, zeros) * (k_scale * (score_scale * q_unit))
    if C[SOFTCAP]:
        s = ct.tanh(s) * softcap_out
    if MASKED:
        cols = j * TN + col_in_tile
        seen = ct.full(s.shape, True, dtype=ct.bool_) & visible(
            row_pos, cols, seq_kv, window, C[CAUSAL], C[WINDOWED])
        if C[KEY_MASK]:
            keep = ct.load(KeyMask, index=(batch, j), shape=(1, TN),
                           padding_mode=ct.PaddingMode.ZERO)
            seen = seen & (keep != 0)
        s = ct.where(seen, s, -math.inf)
    m_new = max(m_i, ct.max(s, axis=-1, keepdims=True))
    m_shift = ct.where(m_new == -math.inf, 0.0, m_new)  # no key seen yet: exp2 gives 0
    p = ct.exp2(s - m_shift, flush_to_zero=True)
    alpha = ct.exp2(m_i - m_shift, flush_to_zero=True)
    l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
    v8 = ct.load(V8, index=(batch, kv_head, j, 0), shape=(1, 1, TN, TD),
                 padding_mode=ct.PaddingMode.ZERO, latency=C[V_LATENCY]).reshape((TN, TD))
    v_scale = ct.load(VScale, index=(batch, kv_head, j), shape=(1, 1, TN),
                      padding_mode=ct.PaddingMode.ZERO, latency=C[V_LATENCY]).reshape((1, TN))
    # floored: a tile of a static cache's unwritten rows has scales 0 (and p 0)
    v_top = ct.maximum(ct.max(v_scale, axis=-1, keepdims=True), AMAX_FLOOR * SCALE_PER_AMAX)
    p_hi = p * (v_scale * (E4M3_MAX / v_top))
    acc = acc * (alpha * (top_before / v_top))
    if C[PV_PARTS]:
        p8 = p_hi.astype(ct.float8_e4m3fn)
        if C[PV_PARTS] > 1:
            acc = ct.mma((p_hi - p8.astype(ct.float32)).astype(ct.float8_e4m3fn), v8, acc,
                         use_fast_acc=C[PV_FAST_ACC])
        acc = ct.mma(p8, v8, acc, use_fast_acc=C[PV_FAST_ACC])
    else:
        acc = ct.mma(p_hi.astype(ct.float16), v8.astype(ct.float16), acc)
    return m_new, l_i, acc, v_top


def merge_splits(PartOut, PartLse, Out, Lse, splits: int, C: ct.Constant, M: ct.Constant):
    """One block per (query tile, grid head, batch row): merges the key splits'
    partial results into Out and Lse (merge.py; ``M`` its MergeConstants)."""
    m_tile = ct.bid(0)
    head = ct.bid(1)
    batch = ct.bid(2)
    merge_query_tile(PartOut, PartLse, Out, Lse, splits, batch, head, batch * Out.shape[1] + head,
                     m_tile, C[ROWS], C[G_TILE], M)


def quantize_tokens(X, Values, Scales, C: ct.Constant):
    """X ``(B, H, S, D)`` 16-bit states; Values ``(B, H, S, D)`` e4m3 and Scales ``(B, H, S)``
    fp32: views of the rows (fp8_cache.split_rows)."""
    T = C[QUANT_TOKENS]
    TD = C[QUANT_D]
    tile, head, batch, x = token_tile(X, C)
    amax = ct.maximum(ct.max(ct.abs(x), axis=-1, keepdims=True), AMAX_FLOOR)
    x8 = ct.minimum(ct.maximum(x * (E4M3_MAX / amax), -E4M3_MAX), E4M3_MAX)
    ct.store(Values, index=(batch, head, tile, 0),
             tile=x8.astype(ct.float8_e4m3fn).reshape((1, 1, T, TD)))
    ct.store(Scales, index=(batch, head, tile), tile=(amax * SCALE_PER_AMAX).reshape((1, 1, T)))


decode_cache_rows_kernel = ct.kernel(decode_cache_rows)
merge_splits_kernel = ct.kernel(merge_splits)
quantize_tokens_kernel = ct.kernel(quantize_tokens)
