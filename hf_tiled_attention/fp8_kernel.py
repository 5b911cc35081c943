"""The cuTile FP8 (e4m3) attention forward kernel: both products on the FP8 tensor cores.

Its inputs come from :func:`hf_tiled_attention.fp8.quantize`: Q8, K8 ``(B, H, S, D)`` e4m3
(rotated, both less their means) with one fp32 scale per token (QScale, KScale ``(B, H, S)``),
KBias ``(B, Hq, Skv)`` fp32, the scores' exact part ``mean(q) . k``, and V transposed, Vt8
``(B, Hkv, D, Skv)`` e4m3, with one scale per channel (VScale ``(B, Hkv, D)``).
FP8 MMAs want both operands K-major (contiguous along the summed dim): K8 is, for Q K^T; for
P V the summed dim is the keys, hence V's transposed copy.

One block (grid: query tiles x query heads x batch) computes one output tile with the online
softmax of kernel.py. A score is ``q8 . k8 * q_scale * k_scale + k_bias``; the probabilities (at most 1
after the running max is subtracted) are stored as e4m3 times 448, e4m3's largest value, so
the accumulator holds ``448 * P V8``; V's channel scales and the 448 are applied once, to the
output. Causal (query ``i`` at key position ``i + diag_offset``), windows, softcap and sinks
as in the bf16 kernel; no mask and no mods.
"""

import math

import cuda.tile as ct

from .kernel_params import E4M3_MAX, LOG2E
from .visibility import key_tiles, visible


# The constants tuple C (fp8.py builds it).
TILE_M = 0     # query rows per tile
TILE_N = 1     # keys per tile
TILE_D = 2     # head dim rounded up to a power of two (extra columns read as zeros)
GROUP = 3      # query heads per key/value head
CAUSAL = 4
WINDOWED = 5
SOFTCAP = 6
SINKS = 7
FAST_ACC = 8   # the FP8 MMA's fast accumulation (fp8_mma_probe: e4m3 outruns bf16 only with it)
CONSTANTS = 9  # the tuple's length


def fp8_forward(Q8, QScale, K8, KScale, KBias, Vt8, VScale, Sinks, Out,
                score_scale: float,   # scale * LOG2E, or scale / softcap with SOFTCAP
                softcap_out: float,   # softcap * LOG2E with SOFTCAP
                diag_offset: int,
                window: int,
                C: ct.Constant):
    m_tile = ct.bid(0)
    if m_tile * C[TILE_M] < Q8.shape[2]:  # the grid is rounded up to whole clusters
        _output_tile(Q8, QScale, K8, KScale, KBias, Vt8, VScale, Sinks, Out, score_scale,
                     softcap_out, diag_offset, window, m_tile, C)


def _output_tile(Q8, QScale, K8, KScale, KBias, Vt8, VScale, Sinks, Out, score_scale,
                 softcap_out, diag_offset, window, m_tile, C):
    M = C[TILE_M]
    N = C[TILE_N]
    D = C[TILE_D]
    head = ct.bid(1)
    batch = ct.bid(2)
    kv_head = head // C[GROUP]
    seq_q = Q8.shape[2]
    seq_kv = K8.shape[2]
    row_lo = m_tile * M
    row_hi = min(row_lo + M, seq_q) - 1
    first, end, full_lo, full_hi = key_tiles(row_lo, row_hi, diag_offset, seq_kv, window, N,
                                             C[CAUSAL], C[WINDOWED])
    full_lo = min(max(full_lo, first), end)
    full_hi = max(min(full_hi, end), full_lo)

    q = ct.load(Q8, index=(batch, head, m_tile, 0), shape=(1, 1, M, D),
                padding_mode=ct.PaddingMode.ZERO).reshape((M, D))
    q_scale = ct.load(QScale, index=(batch, head, m_tile), shape=(1, 1, M),
                      padding_mode=ct.PaddingMode.ZERO).reshape((M, 1)) * score_scale
    row_pos = (row_lo + ct.arange(M, dtype=ct.int32))[:, None] + diag_offset
    cols = ct.arange(N, dtype=ct.int32)[None, :]

    m_i = ct.full((M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((M, D), 0.0, dtype=ct.float32)
    state = (m_i, l_i, acc)
    arrays = (K8, KScale, KBias, Vt8)
    where = (q, q_scale, row_pos, cols, batch, head, kv_head, seq_kv, window, score_scale,
             softcap_out)
    for j in range(first, full_lo):
        state = _key_tile(j, state, arrays, where, True, C)
    for j in range(full_lo, full_hi):
        state = _key_tile(j, state, arrays, where, False, C)
    for j in range(full_hi, end):
        state = _key_tile(j, state, arrays, where, True, C)
    m_i, l_i, acc = state

    if C[SINKS]:
        # The sink is one more logit in each row's softmax, with no value: it adds to l only.
        sink = ct.load(Sinks, index=(head,), shape=(1,)).astype(ct.float32).reshape((1, 1))
        sink = sink * LOG2E
        m_new = max(m_i, sink)
        l_i = l_i * ct.exp2(m_i - m_new, flush_to_zero=True) + \
            ct.exp2(sink - m_new, flush_to_zero=True)
        acc = acc * ct.exp2(m_i - m_new, flush_to_zero=True)
    v_scale = ct.load(VScale, index=(batch, kv_head, 0), shape=(1, 1, D),
                      padding_mode=ct.PaddingMode.ZERO).reshape((1, D)) * (1.0 / E4M3_MAX)
    empty = l_i == 0.0
    out = ct.where(empty, 0.0, acc * v_scale / ct.where(empty, 1.0, l_i))
    ct.store(Out, index=(batch, head, m_tile, 0),
             tile=out.reshape((1, 1, M, D)).astype(Out.dtype))



def _key_tile(j, state, arrays, where, EDGE, C):
    """One online-softmax step over key tile ``j``. ``EDGE``: the tile may hold keys some rows
    do not see (apply the causal/window rule and the sequence's end)."""
    m_i, l_i, acc = state
    K8, KScale, KBias, Vt8 = arrays
    q, q_scale, row_pos, cols, batch, head, kv_head, seq_kv, window, score_scale, \
        softcap_out = where
    M = C[TILE_M]
    N = C[TILE_N]
    D = C[TILE_D]
    k = ct.load(K8, index=(batch, kv_head, j, 0), shape=(1, 1, N, D),
                padding_mode=ct.PaddingMode.ZERO).reshape((N, D))
    k_scale = ct.load(KScale, index=(batch, kv_head, j), shape=(1, 1, N),
                      padding_mode=ct.PaddingMode.ZERO).reshape((1, N))
    qk = ct.mma(q, ct.transpose(k), ct.full((M, N), 0.0, dtype=ct.float32),
                use_fast_acc=C[FAST_ACC])
    k_bias = ct.load(KBias, index=(batch, head, j), shape=(1, 1, N),
                     padding_mode=ct.PaddingMode.ZERO).reshape((1, N))
    s = qk * q_scale * k_scale + k_bias * score_scale
    if C[SOFTCAP]:
        s = ct.tanh(s) * softcap_out
    if EDGE:
        seen = ct.full((M, N), True, dtype=ct.bool_) & visible(
            row_pos, j * N + cols, seq_kv, window, C[CAUSAL], C[WINDOWED])
        s = ct.where(seen, s, -math.inf)
    m_new = max(m_i, ct.max(s, axis=-1, keepdims=True))
    m_shift = ct.where(m_new == -math.inf, 0.0, m_new)  # a row with no key yet: exp2 gives 0
    p = ct.exp2(s - m_shift, flush_to_zero=True)
    alpha = ct.exp2(m_i - m_shift, flush_to_zero=True)
    l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
    v = ct.load(Vt8, index=(batch, kv_head, 0, j), shape=(1, 1, D, N),
                padding_mode=ct.PaddingMode.ZERO).reshape((D, N))
    p8 = (p * E4M3_MAX).astype(ct.float8_e4m3fn)
    acc = ct.mma(p8, ct.transpose(v), acc * alpha, use_fast_acc=C[FAST_ACC])
    return m_new, l_i, acc
