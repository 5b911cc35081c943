"""The cuTile kernel for a batch of requests packed into one row (continuous batching).

Request ``r`` owns query rows ``CuQ[r] .. CuQ[r+1]`` and keys ``CuK[r] .. CuK[r+1]`` of the
packed row; a request's query count may differ from its key count (a decode step, a chunk of a
prefill after its cached part), and its queries are the last tokens of its keys: query ``i``
(counted within the request) sits at key position ``i + k_len - q_len`` and sees the keys up to
it (and, in a window, the ``window`` keys ending there). One block (grid: query tiles x requests
x heads) computes one output tile of one request, with the online softmax of kernel.py, over
that request's keys only.

Keys come either packed like the queries (K, V ``(Tk, Hkv, D)``: ``PAGED`` False), or straight
from a paged cache (K, V ``(slots, Hkv, D)``, the whole cache of the layer; ``Slots[CuK[r] + j]``
is the slot holding the request's key ``j``), so a decode step reads the cache in place, with no
gathered copy. A paged call is two launches of the kernel: one reads the requests whose key tiles
each sit in one block of the cache (pages of whole tiles, what continuous batching's
full-attention layers give) by block loads only, the other gathers the rest row by row; which
request is whose was decided on the device by :func:`whole_tile_requests` (``Whole``), unless
the caller's layout makes every tile a block (one launch, ``EVERY_REQUEST``). A key
loop with both reads in it, chosen per tile, reads at half the rate of the block loads alone
(perf-notes step 56).

A tile's rows are ``ROWS`` positions x ``G_TILE`` query heads of one key/value head (heads
fastest; ``G_TILE`` 1: one query head), so each key tile is read once for the whole group.
"""

import math
from typing import Annotated

import cuda.tile as ct

from .kernel_params import LOG2E
from .schedule import VARLEN_DECODE_OCCUPANCY, VARLEN_PREFILL_WORKER_WARPS
from .tile_rows import mma
from .visibility import visible

# The constants tuple C (varlen.py builds it): tile shapes, then the features compiled in.
TILE_M = 0     # rows per tile (positions x heads)
TILE_N = 1     # keys per tile
TILE_D = 2     # head dim, rounded up to a power of two (extra columns read as zeros)
G_TILE = 3     # query heads per tile (1, or the GQA group when it is a power of two)
PAGED = 4      # K/V are the cache, read through Slots
WINDOWED = 5   # a sliding window (the scalar ``window``)
SOFTCAP = 6    # tanh softcap: scores = softcap * tanh(qk * scale / softcap)
SINKS = 7      # a learned sink logit per query head joins each row's softmax
BLOCKS = 8     # PAGED: this launch takes the requests Whole marks, by block loads (else the
               # other requests, by row gathers); EVERY_REQUEST: all of them by block loads
PREFETCH = 9   # BLOCKS: the first slots of the next 1 or 2 tiles are loaded ahead (schedule.py)
K_LATENCY = 10  # K's and V's load latency hints, 0 the compiler's (schedule.VARLEN_PREFILL_LATENCY)
V_LATENCY = 11
CONSTANTS = 12  # the tuple's length
EVERY_REQUEST = 2  # BLOCKS: the caller's layout makes every tile a block (Whole unread)


def varlen_forward(Q, K, V, Slots, Whole, CuQ, CuK, Sinks, Out,
                   score_scale: float,   # scale * LOG2E, or scale / softcap with SOFTCAP
                   softcap_out: float,   # softcap * LOG2E with SOFTCAP
                   window: int,
                   min_queries: int,     # the launch serves the requests with more queries than
                   max_queries: int,     # this and at most that many (varlen.py: two launches)
                   C: ct.Constant):
    """Q, Out ``(Tq, heads, G_TILE, D)`` (``heads`` = Hq / G_TILE); K, V ``(Tk, Hkv, D)``
    packed like the queries (PAGED False); CuQ, CuK ``(R + 1,)`` int32; Sinks ``(Hq,)`` fp32
    (read with SINKS only); Slots and Whole unread."""
    _request(Q, K, V, Slots, Whole, CuQ, CuK, Sinks, Out, score_scale, softcap_out, window,
             min_queries, max_queries, C)


varlen_forward_kernel = ct.kernel(varlen_forward)

# A paged cache (or a long packed batch) may hold 2**31 elements or more: its addresses take
# 64-bit arithmetic. The packed entry above keeps 32-bit ones for smaller arrays (with 64-bit
# ones in one shared entry, its decode read rate measured 3.2 TB/s against 4.3 before, R=256 x
# 16k keys: paged_decode_bench, a run each); varlen.py chooses.
Wide = Annotated[ct.Array, ct.ArrayAnnotation(index_dtype=ct.int64)]


def varlen_forward_paged(Q: Wide, K: Wide, V: Wide, Slots, Whole, CuQ, CuK, Sinks, Out: Wide,
                         score_scale: float, softcap_out: float, window: int, min_queries: int,
                         max_queries: int, C: ct.Constant):
    """As :func:`varlen_forward` with 64-bit addresses: K and V the cache ``(slots, Hkv, D)``
    and Slots ``(Tk,)`` int32/64 the slot of each packed key, Whole ``(R,)`` int32 1 where a
    request's key tiles are blocks of the cache (PAGED True), or packed keys (PAGED False) where
    an array holds 2**31 elements or more."""
    _request(Q, K, V, Slots, Whole, CuQ, CuK, Sinks, Out, score_scale, softcap_out, window,
             min_queries, max_queries, C)


varlen_forward_paged_kernel = ct.kernel(varlen_forward_paged)

# The same entries for decode-shaped tiles that stream keys (varlen.py picks): with
# schedule.VARLEN_DECODE_OCCUPANCY blocks per SM, where the compiler alone gives one.
varlen_decode_kernel = varlen_forward_kernel.replace_hints(occupancy=VARLEN_DECODE_OCCUPANCY)
varlen_decode_paged_kernel = varlen_forward_paged_kernel.replace_hints(
    occupancy=VARLEN_DECODE_OCCUPANCY)
# And for prefill-shaped tiles: schedule.VARLEN_PREFILL_WORKER_WARPS.
varlen_prefill_kernel = varlen_forward_kernel.replace_hints(
    num_worker_warps=VARLEN_PREFILL_WORKER_WARPS)
varlen_prefill_paged_kernel = varlen_forward_paged_kernel.replace_hints(
    num_worker_warps=VARLEN_PREFILL_WORKER_WARPS)


def _request(Q, K, V, Slots, Whole, CuQ, CuK, Sinks, Out, score_scale, softcap_out, window,
             min_queries, max_queries, C):
    """Query tile ``bid(0)`` of request ``bid(1)``, head ``bid(2)`` (a kv head when G_TILE > 1),
    if the request's query count is in the launch's range (and, paged, its reads this
    launch's)."""
    ROWS = C[TILE_M] // C[G_TILE]
    m_tile = ct.bid(0)
    request = ct.bid(1)
    head = ct.bid(2)
    kv_head = head if C[G_TILE] > 1 else head // (Q.shape[1] // K.shape[1])
    q_start = ct.load(CuQ, index=(request,), shape=(1,)).item()
    q_len = ct.load(CuQ, index=(request + 1,), shape=(1,)).item() - q_start
    k_start = ct.load(CuK, index=(request,), shape=(1,)).item()
    k_len = ct.load(CuK, index=(request + 1,), shape=(1,)).item() - k_start
    row_lo = m_tile * ROWS
    if row_lo < q_len and q_len > min_queries and q_len <= max_queries and \
            _reads_mine(Whole, request, C):
        _request_tile(Q, K, V, Slots, Sinks, Out, score_scale, softcap_out, window, C, ROWS,
                      m_tile, head, kv_head, q_start, q_len, k_start, k_len, row_lo)


def _reads_mine(Whole, request, C):
    """Whether this launch reads the request's keys: always, unless paged, where one launch
    takes the requests whose tiles are whole blocks (BLOCKS) and the other the rest, unless
    the caller's layout makes every tile a block (BLOCKS == EVERY_REQUEST: one launch)."""
    if C[PAGED] and C[BLOCKS] != EVERY_REQUEST:
        return ct.load(Whole, index=(request,), shape=(1,)).item() == (1 if C[BLOCKS] else 0)
    return True


def _request_tile(Q, K, V, Slots, Sinks, Out, score_scale, softcap_out, window, C, ROWS,
                  m_tile, head, kv_head, q_start, q_len, k_start, k_len, row_lo):
    N = C[TILE_N]
    D = C[TILE_D]
    M = C[TILE_M]
    G = C[G_TILE]
    offset = k_len - q_len                      # query i sits at key position i + offset
    row_hi = min(row_lo + ROWS, q_len) - 1
    pos_lo = row_lo + offset
    pos_hi = row_hi + offset
    # Keys some row sees: [lo_any, hi_any); keys every row sees: [lo_all, hi_all).
    hi_any = min(pos_hi + 1, k_len)
    hi_all = min(pos_lo + 1, k_len)
    lo_any = 0
    lo_all = 0
    if C[WINDOWED]:
        lo_any = max(pos_lo - window + 1, 0)
        lo_all = max(pos_hi - window + 1, 0)
    first = lo_any // N
    end = ct.cdiv(hi_any, N)
    full_lo = min(max(ct.cdiv(lo_all, N), first), end)
    full_hi = max(min(hi_all // N, end), full_lo)

    Q_rows = Q.slice(axis=0, start=q_start, stop=q_start + q_len)
    Out_rows = Out.slice(axis=0, start=q_start, stop=q_start + q_len)
    Slots_req = Slots
    K_req = K
    V_req = V
    if C[PAGED]:
        Slots_req = Slots.slice(axis=0, start=k_start, stop=k_start + k_len)
    else:
        K_req = K.slice(axis=0, start=k_start, stop=k_start + k_len)
        V_req = V.slice(axis=0, start=k_start, stop=k_start + k_len)

    q = ct.load(Q_rows, index=(m_tile, head, 0, 0), shape=(ROWS, 1, G, D),
                padding_mode=ct.PaddingMode.ZERO).reshape((M, D))
    row_in_tile = ct.arange(M, dtype=ct.int32)
    if G > 1:
        row_in_tile = row_in_tile // G
    row_pos = (pos_lo + row_in_tile)[:, None]
    cols = ct.arange(N, dtype=ct.int32)[None, :]

    m_i = ct.full((M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((M, D), 0.0, dtype=ct.float32)
    # The next tiles' first slots ride along with the softmax state (read with PREFETCH).
    ahead = (ct.full((1,), 0, dtype=ct.int32), ct.full((1,), 0, dtype=ct.int32))
    if C[PAGED] and C[BLOCKS] and C[PREFETCH]:
        ahead = (_first_slot(Slots_req, first, N), ahead[1])
        if C[PREFETCH] == 2:
            ahead = (ahead[0], _first_slot(Slots_req, first + 1, N))
    state = (m_i, l_i, acc, ahead)
    arrays = (K_req, V_req, Slots_req)
    where = (q, row_pos, cols, kv_head, k_len, window, score_scale, softcap_out)
    for j in range(first, full_lo):
        state = _key_tile(j, state, arrays, where, True, C)
    for j in range(full_lo, full_hi):
        state = _key_tile(j, state, arrays, where, False, C)
    for j in range(full_hi, end):
        state = _key_tile(j, state, arrays, where, True, C)
    m_i, l_i, acc, _ = state

    if C[SINKS]:
        # The sink is one more logit in each row's softmax, with no value: it adds to l only.
        sink = ct.load(Sinks, index=(head,), shape=(G,)).astype(ct.float32)
        sink = ct.broadcast_to(sink.reshape((1, G)), (ROWS, G)).reshape((M, 1)) * LOG2E
        m_new = max(m_i, sink)
        l_i = l_i * ct.exp2(m_i - m_new, flush_to_zero=True) + \
            ct.exp2(sink - m_new, flush_to_zero=True)
        acc = acc * ct.exp2(m_i - m_new, flush_to_zero=True)
    empty = l_i == 0.0
    out = ct.where(empty, 0.0, acc / ct.where(empty, 1.0, l_i))
    ct.store(Out_rows, index=(m_tile, head, 0, 0),
             tile=out.reshape((ROWS, 1, G, D)).astype(Out.dtype))


def _first_slot(Slots, j, N):
    """The first slot of a request's key tile ``j``, as a (1,) tile (0 past its keys)."""
    return ct.load(Slots, index=(j * N,), shape=(1,),
                   padding_mode=ct.PaddingMode.ZERO).astype(ct.int32)


def _paged_tile(K, V, Slots, j, ahead, kv_head, k_len, EDGE, C):
    """Key tile ``j`` of a request from the cache, and the first slots of the tiles after it
    (``ahead``: tiles ``j + 1`` and, with PREFETCH 2, ``j + 2``; loaded here, else passed on).
    BLOCKS: one block load from the tile's first slot (``ahead[0]`` with PREFETCH; the request's
    tiles are whole blocks; rows past its keys are the cache's, and read as zeros below); else
    a gather row by row."""
    N = C[TILE_N]
    D = C[TILE_D]
    valid = j * N + ct.arange(N, dtype=ct.int32) < k_len
    if C[BLOCKS]:
        if C[PREFETCH]:
            first = ahead[0].item()
            later = _first_slot(Slots, j + C[PREFETCH], N)
            if C[PREFETCH] == 2:
                ahead = (ahead[1], later)
            else:
                ahead = (later, ahead[1])
        else:
            first = _first_slot(Slots, j, N).item()
        k = ct.load(K, index=(first // N, kv_head, 0), shape=(N, 1, D),
                    padding_mode=ct.PaddingMode.ZERO, latency=_hint(C[K_LATENCY])).reshape((N, D))
        v = ct.load(V, index=(first // N, kv_head, 0), shape=(N, 1, D),
                    padding_mode=ct.PaddingMode.ZERO, latency=_hint(C[V_LATENCY])).reshape((N, D))
    else:
        slots = ct.load(Slots, index=(j,), shape=(N,),
                        padding_mode=ct.PaddingMode.ZERO).astype(ct.int32)
        first = _first_slot(Slots, j, N).item()
        slots = ct.where(valid, slots, first)
        # Gather from the lowest slot on: row offsets stay small for int32 address math.
        base = ct.min(slots)
        rows = slots - base
        k = ct.load_advanced_indexing(K.slice(axis=0, start=base, stop=K.shape[0]),
                                      (rows, ct.Slice(kv_head, 1), ct.Slice(0, D)),
                                      padding_mode=ct.PaddingMode.ZERO,
                                      latency=_hint(C[K_LATENCY])).reshape((N, D))
        v = ct.load_advanced_indexing(V.slice(axis=0, start=base, stop=V.shape[0]),
                                      (rows, ct.Slice(kv_head, 1), ct.Slice(0, D)),
                                      padding_mode=ct.PaddingMode.ZERO,
                                      latency=_hint(C[V_LATENCY])).reshape((N, D))
    if EDGE:  # a padded row is a real cache row (another request's, or stale): 0 * NaN is NaN
        v = ct.where(valid[:, None], v, 0.0)
    return k, v, ahead


def _key_tile(j, state, arrays, where, EDGE, C):
    """One online-softmax step over the request's key tile ``j``. ``EDGE``: the tile may hold
    keys some rows do not see (apply the causal/window rule); else every row sees all of it."""
    m_i, l_i, acc, ahead = state
    K, V, Slots = arrays
    q, row_pos, cols, kv_head, k_len, window, score_scale, softcap_out = where
    N = C[TILE_N]
    D = C[TILE_D]
    if C[PAGED]:
        k, v, ahead = _paged_tile(K, V, Slots, j, ahead, kv_head, k_len, EDGE, C)
    else:
        k = ct.load(K, index=(j, kv_head, 0), shape=(N, 1, D),
                    padding_mode=ct.PaddingMode.ZERO, latency=_hint(C[K_LATENCY])).reshape((N, D))
        v = ct.load(V, index=(j, kv_head, 0), shape=(N, 1, D),
                    padding_mode=ct.PaddingMode.ZERO, latency=_hint(C[V_LATENCY])).reshape((N, D))
    qk = mma(q, ct.transpose(k), ct.full((C[TILE_M], N), 0.0, dtype=ct.float32))
    if C[SOFTCAP]:
        s = ct.tanh(qk * score_scale) * softcap_out
    else:
        s = qk * score_scale
    if EDGE:
        seen = ct.full((C[TILE_M], N), True, dtype=ct.bool_) & visible(
            row_pos, j * N + cols, k_len, window, True, C[WINDOWED])
        s = ct.where(seen, s, -math.inf)
    m_new = max(m_i, ct.max(s, axis=-1, keepdims=True))
    m_shift = ct.where(m_new == -math.inf, 0.0, m_new)  # a row with no key yet: exp2 gives 0
    p = ct.exp2(s - m_shift, flush_to_zero=True)
    alpha = ct.exp2(m_i - m_shift, flush_to_zero=True)
    l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
    acc = mma(p.astype(v.dtype), v, acc * alpha)
    return m_new, l_i, acc, ahead


def _hint(latency):
    """A load's latency hint from the constants: 0 leaves it to the compiler."""
    return latency if latency else None


def whole_tile_requests(Slots, CuK, Whole, C: ct.Constant):
    """``Whole[r]`` = 1 where every key tile of request ``bid(0)`` (``C[0]`` keys) is one block of
    the cache: its slots consecutive from a multiple of ``C[0]`` (the last tile up to the
    request's last key); else 0. Slots ``(Tk,)`` int32/64, CuK ``(R + 1,)``, Whole ``(R,)``
    int32. The paged attention launches read it on the device, so no host decision waits on
    the slot list (a CUDA graph can hold the call)."""
    N = C[0]
    request = ct.bid(0)
    k_start = ct.load(CuK, index=(request,), shape=(1,)).item()
    k_len = ct.load(CuK, index=(request + 1,), shape=(1,)).item() - k_start
    Slots_req = Slots.slice(axis=0, start=k_start, stop=k_start + k_len)
    cols = ct.arange(N, dtype=ct.int32)
    strays = ct.full((1,), 0, dtype=ct.int32)   # slots off their tile's block, so far
    for j in range(ct.cdiv(k_len, N)):
        slots = ct.load(Slots_req, index=(j,), shape=(N,),
                        padding_mode=ct.PaddingMode.ZERO).astype(ct.int32)
        first = ct.load(Slots_req, index=(j * N,), shape=(1,)).astype(ct.int32)
        off = ct.where((j * N + cols < k_len) & (slots != first + cols), 1, 0)
        strays = strays + ct.sum(off, keepdims=True) + ct.where(first % N == 0, 0, 1)
    ct.store(Whole, index=(request,), tile=ct.where(strays == 0, 1, 0).astype(ct.int32))


whole_tile_requests_kernel = ct.kernel(whole_tile_requests)
