"""The tiled kernels behind FlashAttention's function interface (``flash_attn_func``,
``flash_attn_varlen_func``, ``flash_attn_with_kvcache``), for transformers' Hub-kernel route
(hub_kernel/, serving.py): transformers 5.19 and later serve continuous batching only through
FlashAttention names, and call a kernel loaded that way through these functions (the last one
for decode steps on its block table).

What FlashAttention computes and these do not (dropout, bidirectional packed rows, a right
window that differs from the left one under causal) is an error naming the argument."""

from __future__ import annotations

from typing import Optional

import torch

from . import varlen
from .launch import current_stream, launch_device, next_power_of_two
from .memo import Memo, may_keep_device_memory
from .op import kernel_available, tiled_attention
from .schedule import head_dim_tile


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    s_aux: Optional[torch.Tensor] = None, deterministic: bool = False
                    ) -> torch.Tensor:
    """Batched attention: q ``(B, Sq, Hq, D)``, k/v ``(B, Skv, Hkv, D)``; returns ``(B, Sq,
    Hq, D)``. Causal is aligned at the end (query ``i`` sees keys up to ``i + Skv - Sq``)."""
    _no_dropout(dropout_p)
    out = tiled_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          is_causal=causal, scale=softmax_scale,
                          window=_window(window_size, causal), softcap=softcap or None,
                          sinks=s_aux)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q, max_seqlen_k=None, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           s_aux: Optional[torch.Tensor] = None, deterministic: bool = False
                           ) -> torch.Tensor:
    """Packed requests: q ``(Tq, Hq, D)``, k/v ``(Tk, Hkv, D)``, cumulative lengths ``(R + 1,)``;
    returns ``(Tq, Hq, D)`` (:func:`hf_tiled_attention.varlen_attention`, forward only)."""
    _no_dropout(dropout_p)
    if not causal:
        raise ValueError("flash_attn_varlen_func on the tiled kernels is causal only (causal="
                         "False: bidirectional packed rows); use attn_implementation='tiled' "
                         "for such a model")
    if isinstance(max_seqlen_q, torch.Tensor):
        max_seqlen_q = int(max_seqlen_q)
    return varlen.varlen_attention(
        q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_seqlen_q),
        scale=softmax_scale, window=_window(window_size, causal), softcap=softcap or None,
        sinks=s_aux)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                            cache_seqlens: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            s_aux: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over a paged cache, appending new keys first (transformers' decode steps on its
    block table): q ``(B, Sq, Hq, D)``; k_cache/v_cache ``(pages, page, Hkv, D)``; k/v ``(B, Sn,
    Hkv, D)`` the new tokens, written at positions ``cache_seqlens[b] ..`` of request ``b``,
    whose pages ``block_table`` ``(B, max_pages)`` lists; then request ``b``'s queries attend to
    its ``cache_seqlens[b] + Sn`` keys (causal at the end) where they lie in the cache. Returns
    ``(B, Sq, Hq, D)``.

    On a GPU one launch writes the new tokens and makes the key offsets and the slot list
    (kvcache_kernel.py),
    then one :func:`varlen.varlen_attention_on_pages` reads the cache (no gathered copy), with
    every shape fixed by the arguments' shapes and nothing read on the host, so a CUDA graph
    can hold it:
    request ``b``'s slots are row ``b`` of the block table expanded to ``max_pages * page``
    slots, and a request with no queries after each real one takes the rest of its row."""
    if block_table is None or cache_seqlens is None:
        raise ValueError("flash_attn_with_kvcache on the tiled kernels reads a paged cache: "
                         "pass block_table (B, max_pages) and cache_seqlens (B,)")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must be (pages, page, Hkv, D) of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass the new tokens' k and v together (got "
                         f"k {'None' if k is None else tuple(k.shape)}, "
                         f"v {'None' if v is None else tuple(v.shape)})")
    if k is not None and (k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0]
                          or k.shape[2:] != k_cache.shape[2:]):
        raise ValueError("flash_attn_with_kvcache: k and v must be (B, Sn, Hkv, D) of one shape "
                         f"with q's B = {q.shape[0]} and the cache's (Hkv, D) = "
                         f"{tuple(k_cache.shape[2:])}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k is not None and not k.dtype == v.dtype == k_cache.dtype:
        raise TypeError(f"flash_attn_with_kvcache: k and v must have the cache's dtype "
                        f"{k_cache.dtype}, got {k.dtype} and {v.dtype}")
    batch, queries = q.shape[:2]
    if not causal and queries > 1:
        raise ValueError("flash_attn_with_kvcache on the tiled kernels is causal only (causal="
                         f"False with {queries} queries a request)")
    page = k_cache.shape[1]
    k_slots, v_slots = k_cache.flatten(0, 1), v_cache.flatten(0, 1)   # (pages * page, Hkv, D)
    # Each eager torch step is a kernel of its own, about 3 us in a graph beside a short
    # step's 50-110 us attention: the shape-fixed parts are made once per shape (_layout), and
    # on a GPU the new tokens' writes, the key offsets and the slot list are one launch
    # (perf-notes steps 69 and 71);
    # every output row is a request's query, so the output needs no zero fill (every_row).
    cu_q, cu_k_starts, offsets = _layout(batch, queries, block_table.shape[1], page, q.device)
    if k is not None and k.shape[1] and kernel_available(q.device):
        slots, cu_k = _append_on_device(block_table, cache_seqlens, k, v, k_slots, v_slots,
                                        cu_k_starts, page)
    else:
        slots = slot_list(block_table, offsets, page)
        cu_k = _append_in_torch(slots, cache_seqlens, k, v, k_slots, v_slots, cu_k_starts,
                                q.device)
    out = varlen.varlen_attention_on_pages(
        q.flatten(0, 1), k_slots, v_slots, cu_q, cu_k[:2 * batch + 1], queries,
        scale=softmax_scale, window=_window(window_size, True), softcap=softcap or None,
        sinks=s_aux, key_slots=slots.flatten(), key_pages=page, every_row=True)
    return out.unflatten(0, (batch, queries))


def _append_on_device(block_table, cache_seqlens, k, v, k_slots, v_slots, cu_k_starts,
                      page: int):
    """The new tokens written, the varlen call's key offsets (request ``b``'s keys, then an
    empty request to the end of its table row) and its slot list (the table's rows expanded to
    slots) in one launch (kvcache_kernel.py), where :func:`_append_in_torch` and the slot
    list's add take 16 small kernels. Returns ``(slots (B, max_pages * page) int64, offsets
    int32 shaped as _layout's cu_k_starts)`` (varlen reads both in place)."""
    import cuda.tile as ct

    device = k.device
    cu_k = torch.empty_like(cu_k_starts)
    slots = torch.empty(k.shape[0], block_table.shape[1] * page, dtype=torch.int64,
                        device=device)
    with launch_device(device):
        ct.launch(current_stream(device), *append_launch(block_table, cache_seqlens, k, v,
                                                         k_slots, v_slots, cu_k, slots, page))
    return slots, cu_k


def append_launch(block_table, cache_seqlens, k, v, k_slots, v_slots, cu_k, slots, page: int):
    """``(grid, kernel, args)`` of :func:`_append_on_device`'s launch (meta tensors are fine:
    the CPU tests export its cubins). The slot list's tiles: a page's slots to a power of two
    (at most 1024 a tile), pages to about 4096 slots a tile."""
    from .kvcache_kernel import append_new_tokens_kernel
    slot_tile = min(next_power_of_two(page), 1024)
    pages_tile = min(next_power_of_two(block_table.shape[1]), max(4096 // slot_tile, 1))
    constants = (page, next_power_of_two(k.shape[2]), head_dim_tile(k.shape[3]), pages_tile,
                 slot_tile)
    return ((k.shape[0], 1, 1), append_new_tokens_kernel,
            (block_table, cache_seqlens, k, v, k_slots, v_slots, cu_k,
             slots.view(-1, page), constants))


def _append_in_torch(slots, cache_seqlens, k, v, k_slots, v_slots, cu_k_starts, device):
    """:func:`_append_on_device` in torch steps (the CPU, a GPU without cuTile, or no new
    tokens)."""
    lengths = cache_seqlens
    batch = cache_seqlens.shape[0]
    if k is not None:
        new = k.shape[1]
        position = cache_seqlens[:, None] + _counting(new, device)        # int64 (B, Sn)
        written = slots.gather(1, position.clamp(min=0)).flatten()
        # A padding row (transformers pads a graph's batch: cache_seqlens -1, its table row -1)
        # writes nothing: it repeats the first real row's write, the same value to the same
        # slot. (index_select, not [first]: a tensor index is read on the host, which a graph
        # forbids.)
        real = (position >= 0).flatten()
        source = torch.where(real, _counting(batch * new, device),
                             real.int().argmax().view(1))
        written = written.index_select(0, source)
        for cache, rows in ((k_slots, k), (v_slots, v)):
            cache.index_copy_(0, written, rows.flatten(0, 1).index_select(0, source))
        lengths = cache_seqlens + new
    cu_k = cu_k_starts.clone()  # request b's keys: [b * row, b * row + length)
    cu_k[1:2 * batch:2].add_(lengths.clamp(min=0))
    return cu_k


def slot_list(block_table: torch.Tensor, offsets: torch.Tensor, page: int) -> torch.Tensor:
    """The block table's rows expanded to slots, ``(B, max_pages * page)`` int64: the ``o``-th
    key of row ``b``'s ``i``-th page at ``block_table[b, i] * page + o`` (``offsets``: _layout's
    ``arange(page)``; on a GPU with new tokens the bookkeeping launch makes it instead)."""
    return torch.add(offsets, block_table[:, :, None], alpha=page).flatten(1)


# A few KB each, never dropped in practice: a CUDA graph captured over one keeps reading it.
_LAYOUTS = Memo("flash_interface.layouts", 1024)


def _kept(key: tuple, make, device: torch.device):
    """``make()``, kept per key where a GPU tensor may be kept (memo.may_keep_device_memory:
    not while a CUDA graph is being captured, whose pool would hold it). A kept one is finished
    before it is returned (its stream synchronised, once per shape), so it serves every stream:
    a graph's capture runs on a stream of its own, and with one tensor per stream it made the
    layout again inside the graph, small kernels of about 10 us a call that its warm-up on
    another stream had made already (perf-notes step 72)."""
    if may_keep_device_memory(not torch.compiler.is_compiling(), device):
        return _LAYOUTS.get_or_make(key, lambda: _finished(make(), device))
    return _LAYOUTS.get_or_make(key, make, keep=False)   # (in a capture: a kept one, if any)


def _finished(value, device: torch.device):
    """``value``, after the kernels on ``device``'s current stream that made it have run."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return value


def _counting(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)``, int64, made once per size."""
    return _kept(("counting", n, device),
                 lambda: torch.arange(n, device=device, dtype=torch.int64), device)


def _layout(batch: int, queries: int, max_pages: int, page: int, device: torch.device):
    """What a flash_attn_with_kvcache call's shapes fix: the varlen call's query offsets (each
    request then an empty one: ``(2B + 1,)``), its key offsets before the lengths are added
    (request ``b``'s keys start at its block table row, ``b * max_pages * page``), both int32
    with storage to a multiple of 16 rows (varlen reads them in place, with no copy), and a
    page's slot offsets (int64: the slot list feeds index_copy_)."""
    def make():
        rows = -(-(2 * batch + 1) // 16) * 16
        index = torch.arange(rows, device=device, dtype=torch.int32)
        cu_q = ((index + 1) // 2 * queries)[:2 * batch + 1]
        cu_k_starts = index // 2 * (max_pages * page)
        return cu_q, cu_k_starts, torch.arange(page, device=device, dtype=torch.int64)
    return _kept(("layout", batch, queries, max_pages, page, device), make, device)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise ValueError(f"the tiled kernels have no attention dropout (dropout_p={dropout_p}); "
                         "set the model's attention dropout to 0 or call model.eval()")


def _window(window_size, causal: bool) -> Optional[int]:
    """FlashAttention's (left, right) window as the kernels' ``window`` (keys seen back from a
    query, itself included); -1 is unbounded."""
    left, right = (int(w) for w in window_size)
    if left < 0 and right < 0:
        return None
    if causal or left == right:  # under causal the right side sees nothing anyway
        if left < 0:
            return None
        return left + 1
    raise ValueError(f"window_size={tuple(window_size)}: the tiled kernels take one window for "
                     "both sides (or causal with any right side)")
