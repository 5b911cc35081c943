"""Attention over requests packed into one row, each with its own query and key counts: the op
continuous batching runs (serving.py), on the kernel of varlen_kernel.py or, without a GPU, on
the reference below (the same semantics, in fp32).

``varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)`` follows
FlashAttention's varlen interface: request ``r`` owns query rows ``cu_seqlens_q[r] ..
cu_seqlens_q[r+1]`` and keys ``cu_seqlens_k[r] .. cu_seqlens_k[r+1]``; its queries are its last
tokens (causal, aligned at the end of the request). With ``key_slots``, ``key``/``value`` are a
paged cache ``(slots, Hkv, D)`` and ``key_slots[i]`` the slot of packed key ``i``: the kernel
reads the cache in place.

Nothing here reads a tensor's values on the host (no synchronisation, no allocation that
depends on them): a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .checks import SUPPORTED_DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM
from .kernel_params import LOG2E
from .launch import current_stream, launch_device, scaled_scores
from .memo import memoize
from .schedule import (VARLEN_DECODE_OCCUPANCY_MAX_D, VARLEN_PREFETCH_TILES,
                       VARLEN_PREFILL_LATENCY, head_dim_tile, varlen_tiles)

MAX_GROUP_TILE = 16  # query heads packed into one tile at most (a GQA group)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, *, scale: Optional[float] = None,
                     window: Optional[int] = None, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None,
                     key_slots: Optional[torch.Tensor] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of packed requests; returns ``(Tq, Hq, D)`` in the query's dtype.

    query ``(Tq, Hq, D)`` (any strides with a unit last one); key/value ``(Tk, Hkv, D)``
    unrepeated (Hq a multiple of Hkv), or with ``key_slots`` ``(Tk,)`` int32/64 the cache
    ``(slots, Hkv, D)``; cu_seqlens_q/k ``(R + 1,)`` int32, non-decreasing, from 0;
    ``max_seqlen_q``: at least the longest request's query count (rows past it are not
    computed). ``window``: each query sees the ``window`` keys ending at its own; ``softcap``:
    ``softcap * tanh(score / softcap)``; ``sinks`` ``(Hq,)``: a learned logit per head in each
    softmax. Rows of ``out`` past ``cu_seqlens_q[-1]`` are left as they are (zeros when the
    call allocates it)."""
    return varlen_attention_on_pages(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, scale=scale, window=window, softcap=softcap,
                                     sinks=sinks, key_slots=key_slots, key_pages=None, out=out)


def varlen_attention_on_pages(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *,
                              scale=None, window=None, softcap=None, sinks=None, key_slots=None,
                              key_pages: Optional[int], out=None,
                              every_row: bool = False) -> torch.Tensor:
    """:func:`varlen_attention` for the package's own callers whose slot lists are whole pages
    by construction (flash_attn_with_kvcache's expanded block table rows, "paged|tiled"'s read
    indices of full-attention layers). ``key_pages`` (with ``key_slots``) is their word that
    each request's keys lie on whole pages of that many slots, in order from its first key:
    each run of that many of its keys (the first from its key 0) in consecutive slots from a
    multiple of it; key tiles that divide it are then all read by block loads in one launch,
    with no launch that marks such requests on the device. Checked on the reference path
    (requests with queries); the GPU cannot look without reading the slots on the host, and a
    broken word there reads wrong keys, so this is not exported. ``every_row``: the caller's
    word that its requests' queries are all of ``query``'s rows (``cu_seqlens_q[-1]`` is its
    row count, ``max_seqlen_q`` the longest request's), so the kernel writes every row of an
    output the call allocates and it needs no zero fill (one kernel fewer a call in a graph:
    flash_attn_with_kvcache's layout); held to on the reference path as ``key_pages``."""
    scale = _check(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, window,
                   softcap, sinks, key_slots, out)
    _check_key_pages(key_pages, key_slots)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (query, key, value, sinks)):
        raise ValueError("varlen_attention has no backward (it serves inference); for training "
                         "on packed rows use attn_implementation='tiled' (cu_seq_lens_q/k or "
                         "restarting position_ids) or hf_tiled_attention.tiled_attention")
    from .op import kernel_available
    if query.numel() and kernel_available(query.device):
        if out is None:  # rows to a multiple of 16 (_rows_of_16), the extra ones not returned
            allocate = query.new_empty if every_row else query.new_zeros
            padded = allocate((query.shape[0] + 15) // 16 * 16, *query.shape[1:])
            out = padded[:query.shape[0]]
            written = out
        else:
            # ``out`` itself, or a copy that is copied back (never a view: the kernel writes)
            padded = _rows_of_16(out, may_view=False)
            written = padded[:out.shape[0]]
        _launch(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, window,
                softcap, sinks, key_slots, padded, key_pages=key_pages)
        if written.data_ptr() != out.data_ptr():
            out.copy_(written)
    else:
        if out is None:
            out = query.new_zeros(query.shape)
        if key_pages:
            _require_pages(key_slots, cu_seqlens_q, cu_seqlens_k, key_pages)
        if every_row:
            _require_every_row(query, cu_seqlens_q, max_seqlen_q)
        out.copy_(_reference(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale,
                             window, softcap, sinks, key_slots, out))
    return out


# ---------------------------------------------------------------------------------------------
# The kernel's launch
# ---------------------------------------------------------------------------------------------

def group_tile(heads_q: int, heads_kv: int) -> int:
    """Query heads per tile: the GQA group when it is a power of two up to MAX_GROUP_TILE (each
    key tile then serves the whole group), else 1."""
    group = heads_q // heads_kv
    return group if group & (group - 1) == 0 and group <= MAX_GROUP_TILE else 1


def launches(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, window,
             softcap, sinks, key_slots, out, key_pages=None) -> list[tuple]:
    """``(kernel, grid, args)`` of the call's launches: one of decode-shaped tiles for the
    requests with a few queries (a decode step's, one position of a head group per tile), and,
    when ``max_seqlen_q`` allows longer ones, one of prefill-shaped tiles for those. Which
    requests a launch serves is read on the device, so the launches depend only on shapes and
    ``max_seqlen_q`` (transformers pads that to the batch's token count under CUDA graphs, so
    it does not say whether a step is decode-only). From a paged cache each of those is two
    launches, after one that marks the requests whose key tiles are whole blocks of the cache
    (varlen_kernel.whole_tile_requests): one reads those by block loads, one gathers the
    others' keys row by row; where ``key_pages`` says every tile is a block, one launch reads
    them all by block loads (perf-notes step 65: the other two took 4.6-7.7% of a short step)."""
    from .varlen_kernel import (BLOCKS, CONSTANTS, EVERY_REQUEST, G_TILE, K_LATENCY, PAGED,
                                PREFETCH, SINKS, SOFTCAP, TILE_D, TILE_M, TILE_N, V_LATENCY,
                                WINDOWED, whole_tile_requests_kernel)
    heads_q, head_dim = query.shape[1], query.shape[2]
    g_tile = group_tile(heads_q, key.shape[1])
    heads = heads_q // g_tile
    requests = cu_seqlens_q.shape[0] - 1
    if key_slots is None:  # packed keys: their count varies like the queries'
        key, value = _rows_of_16(key), _rows_of_16(value)
    slots = _rows_of_16(key_slots if key_slots is not None else cu_seqlens_k)
    cu_q, cu_k = _rows_of_16(cu_seqlens_q), _rows_of_16(cu_seqlens_k)
    # Arrays the constants keep the kernel from reading stand in for the absent ones.
    head_rows = (_rows_of_16(query).unflatten(1, (heads, g_tile)), key, value)
    tail = (cu_q, cu_k, sinks.float() if sinks is not None else _no_sinks(query.device),
            out.unflatten(1, (heads, g_tile)))
    scalars = scaled_scores(scale, softcap, LOG2E) + (int(window) if window is not None else 0,)
    short_rows = varlen_tiles(1, g_tile)[0] // g_tile  # a decode tile's positions
    result = []
    whole = {}  # keys per tile -> requests whose tiles are whole blocks (1) or not (0)
    for low, high in ((0, short_rows), (short_rows, max(max_seqlen_q, short_rows))):
        if high <= low:
            continue
        tile_m, tile_n = varlen_tiles(high, g_tile)
        every_tile_a_block = key_slots is not None and bool(key_pages) and key_pages % tile_n == 0
        if key_slots is not None and requests and tile_n not in whole and not every_tile_a_block:
            whole[tile_n] = cu_k.new_empty(cu_k.shape[0])
            result.append((whole_tile_requests_kernel, (requests, 1, 1),
                           (slots, cu_k, whole[tile_n], (tile_n,))))
        constants = [0] * CONSTANTS
        constants[TILE_M], constants[TILE_N] = tile_m, tile_n
        constants[TILE_D], constants[G_TILE] = head_dim_tile(head_dim), g_tile
        constants[PAGED] = key_slots is not None
        constants[WINDOWED] = window is not None
        constants[SOFTCAP] = softcap is not None
        constants[SINKS] = sinks is not None
        if low:  # prefill-shaped tiles (decode tiles leave their loads to the compiler: 0)
            constants[K_LATENCY], constants[V_LATENCY] = (
                latency or 0 for latency in VARLEN_PREFILL_LATENCY)
        grid = (-(-high // (tile_m // g_tile)), requests, heads)
        arrays = head_rows + (slots, whole.get(tile_n, cu_k)) + tail
        reads = (EVERY_REQUEST,) if every_tile_a_block else \
            (True, False) if key_slots is not None else (False,)
        for blocks in reads:
            constants[BLOCKS] = blocks
            constants[PREFETCH] = _prefetch_tiles(bool(low)) if blocks else 0
            result.append((_kernel(arrays, constants, decoding=low == 0), grid,
                           arrays + scalars + (low, high, tuple(constants))))
    return result


def _prefetch_tiles(prefill: bool) -> int:
    """schedule.VARLEN_PREFETCH_TILES for decode- or prefill-shaped tiles, checked."""
    ahead = VARLEN_PREFETCH_TILES[1 if prefill else 0]
    if ahead not in (0, 1, 2):
        raise ValueError(f"schedule.VARLEN_PREFETCH_TILES: slots are loaded 0, 1 or 2 tiles "
                         f"ahead, got {VARLEN_PREFETCH_TILES!r}")
    return int(ahead)


def _rows_of_16(tensor: torch.Tensor, *, may_view: bool = True) -> torch.Tensor:
    """``tensor`` with its first dim a multiple of 16, the rows past its own never read: cuTile
    compiles a kernel per divisibility of each extent (by 16 or not); a serving step's token
    and request counts change at every step, and three extents free to vary would compile
    eight variants of each launch in the middle of serving. Where the tensor's storage reaches
    that far (``may_view``; transformers hands the cu_seqlens and slot lists as slices of larger
    static buffers) a view over it, else a copy with rows appended: on a GPU each copy is a
    kernel of its own, two to four per call (perf-notes step 62)."""
    rows = tensor.shape[0]
    if rows % 16 == 0:
        return tensor
    shape = ((rows + 15) // 16 * 16, *tensor.shape[1:])
    if may_view and tensor.numel():
        last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(shape, tensor.stride()))
        if last < tensor.untyped_storage().nbytes() // tensor.element_size():
            return tensor.as_strided(shape, tensor.stride())
    padded = tensor.new_empty(shape)
    padded[:rows].copy_(tensor)
    return padded


@memoize(16)
def _no_sinks(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_GROUP_TILE, dtype=torch.float32, device=device)


def _launch(*args, **options) -> None:
    import cuda.tile as ct

    device = args[0].device
    with launch_device(device):
        stream = current_stream(device)
        for kernel, grid, kernel_args in launches(*args, **options):
            ct.launch(stream, grid, kernel, kernel_args)


def _kernel(arrays: tuple, constants: list, decoding: bool):
    """The attention kernel's entry for a launch: 64-bit addresses for the cache, or where an
    array holds 2**31 elements or more (a long packed batch); else 32-bit (faster). Decode-
    shaped tiles that stream keys (packed, or whole blocks of the cache) take the entries with
    schedule.VARLEN_DECODE_OCCUPANCY blocks per SM, up to VARLEN_DECODE_OCCUPANCY_MAX_D;
    prefill-shaped tiles the entries with schedule.VARLEN_PREFILL_WORKER_WARPS."""
    from . import varlen_kernel as K
    wide = constants[K.PAGED] or any(a.numel() >= 2 ** 31 for a in arrays)
    streams = constants[K.BLOCKS] or not constants[K.PAGED]
    if not decoding:
        return K.varlen_prefill_paged_kernel if wide else K.varlen_prefill_kernel
    if streams and constants[K.TILE_D] <= VARLEN_DECODE_OCCUPANCY_MAX_D:
        return K.varlen_decode_paged_kernel if wide else K.varlen_decode_kernel
    return K.varlen_forward_paged_kernel if wide else K.varlen_forward_kernel


def export_cubins(*args, arch: str, **options) -> list[bytes]:
    """The cubins of a call's launches with these arguments (meta tensors are fine) for
    ``arch``, built without a GPU by cuTile's exporter."""
    from .fp8 import export_kernel_cubin
    return [export_kernel_cubin(kernel, kernel_args, arch)
            for kernel, _, kernel_args in launches(*args, **options)]


# ---------------------------------------------------------------------------------------------
# The reference (CPU, or a GPU without cuTile): request by request, in fp32
# ---------------------------------------------------------------------------------------------

def _reference(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, window,
               softcap, sinks, key_slots, out) -> torch.Tensor:
    result = out.float()
    group = query.shape[1] // key.shape[1]
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for request in range(len(cu_q) - 1):
        q_lo, q_hi, k_lo, k_hi = cu_q[request], cu_q[request + 1], cu_k[request], \
            cu_k[request + 1]
        if q_hi - q_lo > max_seqlen_q:
            raise ValueError(f"max_seqlen_q={max_seqlen_q} is below request {request}'s "
                             f"{q_hi - q_lo} queries")
        if q_hi == q_lo:
            continue
        if key_slots is not None:
            slots = key_slots[k_lo:k_hi].long()
            k, v = key[slots], value[slots]
        else:
            k, v = key[k_lo:k_hi], value[k_lo:k_hi]
        q = query[q_lo:q_hi].float().transpose(0, 1)                     # (Hq, q_len, D)
        k = k.float().transpose(0, 1).repeat_interleave(group, 0)         # (Hq, k_len, D)
        v = v.float().transpose(0, 1).repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(q_hi - q_lo)[:, None] + (k_hi - k_lo) - (q_hi - q_lo)
        keys = torch.arange(k_hi - k_lo)[None, :]
        seen = keys <= pos
        if window is not None:
            seen &= keys > pos - window
        scores = scores.masked_fill(~seen.to(scores.device), -math.inf)
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, q_hi - q_lo, 1)
            weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            weights = torch.softmax(scores, -1)
        weights = torch.nan_to_num(weights)  # a row that sees no key: zeros
        result[q_lo:q_hi] = (weights @ v).transpose(0, 1)
    return result.to(out.dtype)


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------

def _check(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, window, softcap,
           sinks, key_slots, out) -> float:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            layout = "(Tq, Hq, D)" if name == "query" else "(Tk or slots, Hkv, D)"
            raise ValueError(f"{name} must be a 3-D tensor {layout}, got "
                             f"{getattr(tensor, 'shape', type(tensor).__name__)}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last (head) dim")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError(f"query, key and value must be on one device, got {query.device}, "
                         f"{key.device}, {value.device}")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have one shape, got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    heads_q, head_dim = query.shape[1], query.shape[2]
    if key.shape[2] != head_dim or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"query and key must share a head dim between {MIN_HEAD_DIM} and "
                         f"{MAX_HEAD_DIM}, got {head_dim} and {key.shape[2]}")
    if key.shape[1] == 0 or heads_q % key.shape[1]:
        raise ValueError(f"the query heads ({heads_q}) must be a multiple of the key/value "
                         f"heads ({key.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or \
                cu.numel() < 1 or cu.device != query.device or not cu.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int32 tensor (R + 1,) on the "
                             f"query's device, got "
                             f"{getattr(cu, 'dtype', type(cu).__name__)} "
                             f"{tuple(getattr(cu, 'shape', ()))}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (R + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if not isinstance(max_seqlen_q, int) or isinstance(max_seqlen_q, bool) or max_seqlen_q < 1:
        raise ValueError(f"max_seqlen_q must be a positive int (the longest request's query "
                         f"count), got {max_seqlen_q!r}")
    if key_slots is not None and (not isinstance(key_slots, torch.Tensor) or
                                  key_slots.dim() != 1 or
                                  key_slots.dtype not in (torch.int32, torch.int64) or
                                  key_slots.device != query.device or
                                  not key_slots.is_contiguous()):
        raise ValueError("key_slots must be a contiguous 1-D int32 or int64 tensor (Tk,) on the "
                         "query's device: the cache slot of each packed key")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or
                               window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or
                              sinks.shape != (heads_q,) or not sinks.is_floating_point() or
                              sinks.device != query.device):
        raise ValueError(f"sinks must be a floating-point tensor of shape (Hq,) = ({heads_q},) "
                         f"on the query's device")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or
                            out.device != query.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {query.dtype} tensor of the query's shape "
                         f"{tuple(query.shape)} on its device")
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    return float(scale)


def _check_key_pages(key_pages, key_slots) -> None:
    if key_pages is None:
        return
    if not isinstance(key_pages, int) or isinstance(key_pages, bool) or key_pages < 1:
        raise ValueError(f"key_pages must be a positive int (the cache's page size) or None, "
                         f"got {key_pages!r}")
    if key_slots is None:
        raise ValueError("key_pages describes key_slots' layout: pass key_slots with it")


def _require_every_row(query, cu_seqlens_q, max_seqlen_q: int) -> None:
    """The reference path holds the caller to ``every_row``'s word (the GPU path cannot look
    without reading the offsets on the host)."""
    counts = cu_seqlens_q.diff()
    if int(cu_seqlens_q[-1]) != query.shape[0] or int(counts.max()) > max_seqlen_q:
        raise ValueError(f"every_row: the requests' queries ({int(cu_seqlens_q[-1])} rows, the "
                         f"longest {int(counts.max())}) must be all of query's "
                         f"{query.shape[0]} rows with max_seqlen_q = {max_seqlen_q} at least "
                         f"the longest")


def _require_pages(key_slots, cu_seqlens_q, cu_seqlens_k, key_pages: int) -> None:
    """The reference path holds the caller to ``key_pages``' word for each request with queries
    (one without reads nothing; the GPU path cannot look without reading the slots on the
    host)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for request in range(len(cu_k) - 1):
        if cu_q[request + 1] == cu_q[request]:
            continue
        slots = key_slots[cu_k[request]:cu_k[request + 1]].long().cpu()
        first = slots[::key_pages].repeat_interleave(key_pages)[:slots.numel()]
        offset = torch.arange(slots.numel()) % key_pages
        if (first % key_pages).any() or (slots != first + offset).any():
            raise ValueError(f"key_pages={key_pages}: request {request}'s key_slots are not "
                             f"whole pages of {key_pages} (each run of {key_pages} of its keys, "
                             f"from its first, must fill one page in order)")
