"""transformers integration: ``attn_implementation="tiled"``.

Importing ``hf_tiled_attention`` calls :func:`register`, which adds two entries under one name:

* ``transformers.AttentionInterface["tiled"]``: :func:`tiled_attention_forward`, the attention
  function every model calls as ``(module, query, key, value, attention_mask, *, scaling,
  dropout, **kwargs)``;
* ``transformers.masking_utils.AttentionMaskInterface["tiled"]``: :func:`tiled_mask`, the mask
  builder ``create_causal_mask`` / ``create_sliding_window_causal_mask`` /
  ``create_bidirectional_mask`` call. Without it transformers would hand a custom backend
  ``attention_mask=None`` and padded batches would silently attend to padding.

Mask design
-----------
Whatever the mask builder returns reaches the attention function untouched (the models only put
it in a per-layer-type dict), so :func:`tiled_mask` returns a small :class:`TiledMask`
description instead of an ``O(Sq x Skv)`` tensor:

* ``key_mask``: the padding of the keys as a ``(B, 1, 1, Skv)`` bool tensor, or ``None`` when
  nothing is padded. The kernel streams it per key tile: ``O(B * Skv)`` memory.
* ``causal`` / ``window`` / ``diag_offset``: the kernel's own causal and sliding-window logic.
  transformers describes a mask by absolute positions: query ``i`` is at ``q_offset + i`` and key
  ``j`` at ``kv_offset + j`` (``kv_offset > 0`` for sliding-window caches that dropped old keys),
  so ``diag_offset = q_offset - kv_offset``. This one number covers DynamicCache
  (bottom-right), StaticCache (its prefill has K/V longer than the prompt: position aligned),
  sliding-window caches, chunked prefill and assisted decoding (``Sq > 1`` with a cache).
* ``mods``: the parts of a wrapped pattern (packed sequences detected from restarting
  ``position_ids``, ``or_mask_function`` / ``and_mask_function`` overlays such as Gemma 3's
  bidirectional image blocks, ``block_sequence_ids``, Llama 4's chunks, any user pattern)
  translated into one mask_mod (mods.py) with the padding folded in: transformers' mask
  functions have FlexAttention's signature, and their ``and_masks`` / ``or_masks`` are rebuilt
  from the variants' (:func:`_as_mod`). The plain base (causal, a sliding window) stays the
  kernel's own rule where :func:`_classify` finds one. Eager calls; at a cache offset (chunked
  prefill) the mod shifts the indices to absolute positions (the offsets a captured tensor:
  one kernel for every chunk).
* ``dense``: a full ``(B, 1, Sq, Skv)`` bool mask, used ONLY where no compact form exists:
    1. a wrapped pattern that ``mods`` cannot take: under ``torch.compile`` (mods run in eager
       calls only), or with a function the translator rejects (a method call, a loop); and
       decoding such a pattern after a cache (at most 16 query rows, so the mask is small, and
       a single row lets the decode path pack the query heads);
    2. under ``torch.compile`` with a StaticCache and ``Sq > 1`` (compiled chunked prefill), where
       the query offset is a traced tensor that cannot become the kernel's integer diagonal
       without a graph break.
  When ``dense`` is set the kernel's causal/window flags are off: the mask holds everything.

Decoding (``Sq == 1``) with a compileable cache (StaticCache, whose query offset is a tensor) gets
no :class:`TiledMask` but a plain ``(B, 1, 1, Skv)`` bool tensor with the causal/window limits
and the padding folded in: ``generate()`` builds that mask ahead of each compiled decode step,
and a tensor of fixed shape is the one thing that crosses into the compiled step without a
recompile per step (an object's identity or a Python int that changes per step would not). The
kernel applies it on every key tile it visits, with no per-tile table to rebuild per layer.

Learned attention sinks (gpt-oss and its kin pass them as ``s_aux``, one logit per query head)
go to the op's ``sinks``. Arguments the kernel has no mode for (``position_bias``, sparse
attention's ``indices``) are a clear error, never silently dropped.

The attention function additionally separates packed sequences signalled only through its
kwargs (``cu_seq_lens_q/k`` from ``DataCollatorWithFlattening``, or restarting ``position_ids``
when transformers did not already mask them because a cache was passed) with a mask_mod (see
mods.py) over per-token document ids: O(B x S) memory and a block table that skips the other
documents' tiles. Under torch.compile (mods run in eager calls only), or combined with a dense
or additive mask, it builds a per-document ``(B, 1, Sq, Skv)`` mask instead. A user-given 4-D
mask is passed to the op as is (it is already dense; the op keeps its broadcast dims compact).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from .checks import check_inputs, check_sinks
from .masks import CompactMask, compact_mask, position_visibility
from .mods import CompiledMods, ModError, compile_mods
from .op import attention as _op_attention
from .schedule import DECODE_QUERY_ROWS
from .variants import and_masks, document_mask, or_masks

__all__ = ["TiledMask", "register", "tiled_attention_forward", "tiled_mask"]

DEFAULT_NAME = "tiled"


@dataclass
class TiledMask:
    """Compact mask description handed from :func:`tiled_mask` to :func:`tiled_attention_forward`."""

    causal: bool
    window: Optional[int]
    diag_offset: int
    key_mask: Optional[torch.Tensor] = None  # (B, 1, 1, Skv) bool, True = may attend
    dense: Optional[torch.Tensor] = None  # (B, 1, Sq, Skv) bool fallback, holds everything
    shape: tuple = ()  # (B, 1, Sq, Skv) of the mask it describes
    mods: Optional[CompiledMods] = None  # overlays (packed sequences, ...) as a mask_mod
    # Per-forward memo shared by all layers that get this object (packed position_ids).
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def tensor(self) -> Optional[torch.Tensor]:
        return self.dense if self.dense is not None else self.key_mask

    # generate() with a compileable (static) cache builds the masks ahead of the forward and hands
    # them back in as `attention_mask`; transformers' `_preprocess_mask_arguments` then asks for
    # `.ndim` (not 2 -> not a padding mask) and the mask function gets this object back, which it
    # returns unchanged.
    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    # A model whose own code uses the mask as a tensor (Bloom adds it to its scores, Doge reads
    # its dtype) bypasses the attention function, the one reader of this object: say so by name
    # instead of a bare TypeError, or an AttributeError deep in the model.
    def __getattr__(self, name: str):
        if name.startswith("_"):  # copy, pickle and dataclass internals: the plain error
            raise AttributeError(name)
        raise AttributeError(_used_as_tensor(f"attribute .{name}"))

    def _refuse(self, *args):
        raise TypeError(_used_as_tensor("an operator"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __and__ = __rand__ = __or__ = __ror__ = __invert__ = __getitem__ = _refuse


def _used_as_tensor(what: str) -> str:
    return (f"attn_implementation='tiled' hands the model a compact TiledMask that only its "
            f"attention function reads, but the model's own code used it as a tensor ({what}): "
            "this model does not run all of its masking through transformers' "
            "AttentionInterface. Use attn_implementation='sdpa' or 'eager' for it.")


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # very old torch
        return False


# ---------------------------------------------------------------------------------------------
# Mask pattern recognition
# ---------------------------------------------------------------------------------------------

def _closure_vars(fn) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:
            pass
    return out


def _qualname(fn) -> str:
    return getattr(fn, "__qualname__", "")


def _and_parts(mask_function) -> tuple:
    """The functions an ``and_masks(...)`` of transformers intersects (nested ones flattened),
    or ``(mask_function,)``."""
    if _qualname(mask_function).startswith("and_masks."):
        parts = _closure_vars(mask_function).get("mask_functions")
        if isinstance(parts, tuple) and all(callable(p) for p in parts):
            return tuple(q for p in parts for q in _and_parts(p))
    return (mask_function,)


def _classify(mask_function) -> Optional[tuple[bool, Optional[int], tuple]]:
    """``(causal, window, overlays)`` for a transformers mask pattern: the base (causal or
    bidirectional) and sliding window the kernel applies itself (window in the op's
    convention), and the other functions it is intersected with (packed sequences, chunked
    attention, ...: empty for the plain patterns); ``None`` when there is no single base."""
    from transformers import masking_utils as mu

    bases = {mu.causal_mask_function: True}
    if getattr(mu, "bidirectional_mask_function", None) is not None:
        bases[mu.bidirectional_mask_function] = False
    parts = _and_parts(mask_function)
    base = [p for p in parts if p in bases]
    if len(base) != 1:
        return None
    causal = bases[base[0]]
    window, overlays = None, []
    for part in parts:
        if part is base[0]:
            continue
        size = _closure_vars(part).get("sliding_window")
        name = _qualname(part)
        sized = not isinstance(size, bool) and isinstance(size, int) and size >= 1
        if window is None and sized and causal and name.startswith("sliding_window_overlay."):
            window = size  # kv_idx > q_idx - W: exactly the op's window W
        elif (window is None and sized and not causal
              and name.startswith("sliding_window_bidirectional_overlay.")):
            window = size + 1  # |q_idx - kv_idx| <= W: the op's symmetric |d| < W + 1
        else:
            overlays.append(part)
    return causal, window, tuple(overlays)


def _as_mod(mask_function) -> Callable:
    """``mask_function`` with transformers' ``and_masks`` / ``or_masks`` (a loop, which the
    translator does not take) rebuilt from the variants' two-argument ones, recursively."""
    for prefix, combine in (("and_masks.", and_masks), ("or_masks.", or_masks)):
        if _qualname(mask_function).startswith(prefix):
            parts = _closure_vars(mask_function).get("mask_functions")
            if isinstance(parts, tuple) and parts and all(callable(p) for p in parts):
                return functools.reduce(combine, [_as_mod(p) for p in parts])
    return mask_function


def _overlay_mods(overlays: tuple, pad: Optional[torch.Tensor], q_offset: int, kv_offset: int,
                  device):
    """The overlays (and the key padding) as one translated mask_mod, or None when one of them
    cannot run in the kernel (it then takes the dense fallback). transformers' mask functions
    have FlexAttention's signature over absolute positions: query row ``i`` is at
    ``q_offset + i`` and key ``j`` at ``kv_offset + j``. Non-zero offsets (chunked prefill
    after a cache) reach the mod as a captured tensor, so the generated code, and the kernel,
    stay the same from chunk to chunk."""
    parts = [_as_mod(part) for part in overlays]
    if q_offset or kv_offset:
        overlay = functools.reduce(and_masks, parts)
        offsets = torch.tensor([q_offset, kv_offset], dtype=torch.int32, device=device)

        def at_positions(b, h, q_idx, kv_idx):
            return overlay(b, h, q_idx + offsets[0], kv_idx + offsets[1])
        parts = [at_positions]
    if pad is not None:
        def key_padding(b, h, q_idx, kv_idx):
            return pad[b, kv_idx]
        parts.append(key_padding)
    try:
        return compile_mods(None, functools.reduce(and_masks, parts))
    except ModError:
        return None


def _classify_traced(mask_function, *, local_size=None, use_vmap=False, config=None,
                     allow_is_causal_skip=None, allow_is_bidirectional_skip=None,
                     **_) -> Optional[tuple[bool, Optional[int]]]:
    """:func:`_classify` for code under ``torch.compile``, where dynamo cannot read a closure
    (``__closure__``), so wrapped patterns are recognised from how transformers' mask creators
    call us instead (identical in 5.17 and 5.24):

    * ``create_sliding_window_causal_mask`` passes ``local_size=config.sliding_window`` and keeps
      ``allow_is_causal_skip`` True unless it wrapped the pattern (packing, block ids, or/and
      overlays: those also set ``use_vmap`` or clear ``allow_is_causal_skip``);
    * ``create_bidirectional_sliding_window_mask`` passes ``local_size``, ``allow_is_causal_skip``
      False and ``allow_is_bidirectional_skip`` True unless it wrapped the pattern.

    Anything ambiguous returns None (dense fallback). The one plain pattern that lands there is
    sliding-window decoding with a compileable cache (transformers clears the skip flag then), and
    its dense mask is ``(B, 1, 1, Skv)``: compact anyway.
    """
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is getattr(mu, "bidirectional_mask_function", None):
        return False, None
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if (use_vmap or local_size is None or local_size != window or local_size == chunk
            or isinstance(local_size, bool) or not isinstance(local_size, int)):
        return None
    if allow_is_causal_skip is True:
        return True, local_size
    if allow_is_causal_skip is False and allow_is_bidirectional_skip is True:
        return False, local_size + 1
    return None


def _as_int(x) -> Any:
    if isinstance(x, torch.Tensor):
        return int(x.item())
    return int(x)


def _padding_slice(attention_mask: Optional[torch.Tensor], batch_size: int, kv_length: int,
                   kv_offset, device) -> Optional[torch.Tensor]:
    """Key-padding vector of the current keys, ``(B, kv_length)`` bool, or None."""
    if attention_mask is None:
        return None
    pad = attention_mask.to(device=device, dtype=torch.bool)
    if pad.dim() != 2:
        raise ValueError(f"tiled: expected a 2-D padding mask, got shape {tuple(pad.shape)}")
    need = kv_length + kv_offset
    if pad.shape[-1] < need:  # StaticCache: positions not written yet are not attendable
        pad = torch.nn.functional.pad(pad, (0, need - pad.shape[-1]), value=False)
    pad = pad[:, kv_offset:kv_offset + kv_length]
    if pad.shape[0] != batch_size:
        pad = pad.expand(batch_size, -1)
    return pad


def tiled_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
               mask_function=None, attention_mask: Optional[torch.Tensor] = None,
               local_size: Optional[int] = None, use_vmap: bool = False, device="cpu",
               **kwargs) -> Union[TiledMask, torch.Tensor]:
    """``AttentionMaskInterface`` entry: called by transformers' ``create_*_mask`` with the
    arguments it gives ``sdpa_mask`` (5.17 to 5.24: ``q_offset``/``kv_offset``, the pattern's
    ``mask_function``, the 2-D padding ``attention_mask``, ``local_size``, ``allow_*_skip``,
    ``dtype``, ``config``, ``use_vmap``, ``device``); unknown extras are ignored."""
    from transformers import masking_utils as mu

    if isinstance(attention_mask, TiledMask):  # prepared ahead (generate + static cache)
        return attention_mask
    if mask_function is None:
        mask_function = mu.causal_mask_function
    if "cache_position" in kwargs and kwargs["cache_position"] is not None and q_offset == 0:
        # Older call convention: absolute query positions instead of an offset.
        q_offset = kwargs["cache_position"][0]
    if isinstance(kv_offset, torch.Tensor):
        kv_offset = _as_int(kv_offset)
    overlay_mods = None
    if _compiling():
        pattern = _classify_traced(mask_function, local_size=local_size, use_vmap=use_vmap,
                                   **kwargs)
    else:
        pattern = _classify(mask_function)
        if pattern is None or pattern[2]:
            # Overlays (packed sequences, chunked attention, ...), or a pattern with no plain
            # base at all (transformers remaps positions for packed rows): as a mask_mod when
            # the functions translate; else the dense fallback. Decoding (at most
            # DECODE_QUERY_ROWS queries after a cache) keeps the dense mask: it is a few rows,
            # and one row (no row dim) lets the decode path pack the query heads, which a mod's
            # per-head indices do not.
            q_start = _as_int(q_offset)
            if not (q_length <= DECODE_QUERY_ROWS and (q_start or kv_offset)):
                parts = pattern[2] if pattern is not None else _and_parts(mask_function)
                overlay_mods = _overlay_mods(parts, _padding_slice(
                    attention_mask, batch_size, kv_length, kv_offset, device), q_start,
                    kv_offset, device)
            pattern = None if overlay_mods is None else (
                pattern[:2] if pattern is not None else (False, None))
        else:
            pattern = pattern[:2]
    shape = (batch_size, 1, q_length, kv_length)

    def dense_fallback() -> TiledMask:
        dense = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                             q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                             attention_mask=attention_mask, allow_is_causal_skip=False,
                             allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)
        return TiledMask(causal=False, window=None, diag_offset=0, dense=dense, shape=shape)

    if pattern is None:
        # Fallback 1 (see module docstring): a pattern the kernel cannot express.
        return dense_fallback()
    causal, window = pattern
    if overlay_mods is not None:  # the padding is in the mod
        return TiledMask(causal=causal, window=window, diag_offset=_as_int(q_offset) - kv_offset,
                         shape=shape, mods=overlay_mods)
    pad = _padding_slice(attention_mask, batch_size, kv_length, kv_offset, device)
    compiling = _compiling()

    if isinstance(q_offset, torch.Tensor) and q_length == 1:
        # Decoding with a compileable cache (StaticCache: its query offset is a tensor). The
        # causal/window limits go into the key vector, a plain (B, 1, 1, Skv) bool tensor of a
        # fixed shape: no .item() sync, and nothing that changes per step (a Python int, a new
        # object) reaches a compiled decode step, which generate() builds this mask for ahead
        # of the step. A plain tensor is what the attention function takes as a full mask.
        kv_pos = torch.arange(kv_length, device=device) + kv_offset
        q_pos = q_offset.to(device).reshape(())
        visible = position_visibility(q_pos, kv_pos, causal, window)
        visible = visible.expand(batch_size, kv_length)
        if pad is not None:
            visible = visible & pad
        return visible[:, None, None, :]
    if isinstance(q_offset, torch.Tensor) and compiling:
        # StaticCache under torch.compile with several queries: the offset is a traced tensor,
        # which cannot become the kernel's integer diagonal without a graph break.
        return dense_fallback()  # fallback 2

    diag_offset = _as_int(q_offset) - kv_offset
    key_mask = None
    if pad is not None:
        # Drop the vector when nothing is padded (not while tracing: that needs the values).
        if compiling or not bool(pad.all()):
            key_mask = pad[:, None, None, :]
    return TiledMask(causal=causal, window=window, diag_offset=diag_offset, key_mask=key_mask,
                     shape=shape)


# ---------------------------------------------------------------------------------------------
# Packed sequences
# ---------------------------------------------------------------------------------------------

def _doc_mask_from_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, seq_q: int, seq_kv: int,
                              causal: bool, window: Optional[int]) -> torch.Tensor:
    """(1, 1, Sq, Skv) bool: :func:`_packed_mask_mod`'s rule as a dense mask (for calls a mod
    cannot serve: traced, or with a dense or additive mask)."""
    mod = _packed_mask_mod(cu_q, cu_k, seq_q, seq_kv, causal, window, None)
    rows = torch.arange(seq_q, device=cu_q.device)[:, None]
    cols = torch.arange(seq_kv, device=cu_q.device)[None, :]
    return mod(0, 0, rows, cols)[None, None]


def _packed_mask_mod(cu_q: torch.Tensor, cu_k: torch.Tensor, seq_q: int, seq_kv: int,
                     causal: bool, window: Optional[int], key_mask: Optional[torch.Tensor],
                     overlay: Optional[Callable] = None) -> Callable:
    """Packed documents (FlashAttention varlen's rule: each document's causal / window diagonal
    bottom-right aligned to its own lengths; tokens past the last boundary see nothing) as a
    mask_mod over per-token vectors (document, local key position, each query's diagonal):
    O(Sq + Skv) memory. ``key_mask`` (1, 1, 1, Skv) hides padded keys; ``overlay``, a mask_mod,
    is intersected with it."""
    device = cu_q.device
    cu_q = cu_q.to(torch.long)
    cu_k = cu_k.to(device=device, dtype=torch.long)
    rows = torch.arange(seq_q, device=device)
    cols = torch.arange(seq_kv, device=device)
    last = max(cu_q.numel() - 2, 0)
    doc_q = (torch.searchsorted(cu_q, rows, right=True) - 1).clamp(0, last)
    doc_k = (torch.searchsorted(cu_k, cols, right=True) - 1).clamp(0, last)
    local_k = (cols - cu_k[doc_k]).to(torch.int32)
    shift = (cu_k[doc_q + 1] - cu_k[doc_q]) - (cu_q[doc_q + 1] - cu_q[doc_q])
    diag = (rows - cu_q[doc_q] + shift).to(torch.int32)
    # Tokens past the last boundary (and padded keys) belong to no document.
    hidden_k = cols >= cu_k[-1]
    if key_mask is not None:
        hidden_k = hidden_k | ~key_mask.reshape(-1)[-seq_kv:].to(device)
    doc_q = torch.where(rows < cu_q[-1], doc_q, -1).to(torch.int32)
    doc_k = torch.where(hidden_k, -2, doc_k).to(torch.int32)
    width = 0 if window is None else int(window)

    def same_document(b, h, q_idx, kv_idx):
        return doc_q[q_idx] == doc_k[kv_idx]

    def causal_rule(b, h, q_idx, kv_idx):
        return local_k[kv_idx] <= diag[q_idx]

    def window_behind(b, h, q_idx, kv_idx):
        return local_k[kv_idx] > diag[q_idx] - width

    def window_ahead(b, h, q_idx, kv_idx):
        return local_k[kv_idx] < diag[q_idx] + width

    mod = same_document
    if causal:
        mod = and_masks(mod, causal_rule)
    if window is not None:
        mod = and_masks(mod, window_behind)
        if not causal:
            mod = and_masks(mod, window_ahead)
    return mod if overlay is None else and_masks(overlay, mod)


def _doc_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) document index per token: a new document starts wherever the position does not
    continue the previous one by exactly 1."""
    first = position_ids[:, :1] - 1
    diff = torch.diff(position_ids, prepend=first, dim=-1)
    return (diff != 1).cumsum(-1)


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------

# Arguments that change what attention computes, for which the kernel has no mode: (name, what
# it is, what to use instead). A call with one fails rather than attend without it.
_UNSUPPORTED_KWARGS = (
    ("position_bias", "position_bias", "'eager' or 'sdpa'"),
    ("indices", "sparse attention (indices=...)", "'eager'"),  # the keys each query keeps (DSA)
    ("block_indices", "sparse attention (block_indices=...)", "'eager'"),
)


def tiled_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask, scaling: Optional[float] = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry. ``query`` ``(B, Hq, Sq, D)`` (a strided view is fine),
    ``key``/``value`` ``(B, Hkv, Skv, D)`` with unrepeated KV heads. Returns
    ``(out (B, Sq, Hq, D), None)``."""
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False) is True:
        raise ValueError(
            "attn_implementation='tiled' does not compute attention weights "
            "(output_attentions=True). Use attn_implementation='eager' to get them.")
    if dropout and getattr(module, "training", False):
        raise ValueError(
            f"attn_implementation='tiled' is an inference kernel and has no attention dropout, "
            f"but the module is in training mode with dropout={dropout}. Call model.eval(), set "
            "the attention dropout to 0, or use attn_implementation='sdpa' for training.")
    for name, what, instead in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='tiled' does not support {what}; use "
                             f"attn_implementation={instead}.")
    check_inputs(query, key, value)
    # gpt-oss and its kin pass learned attention sinks as s_aux: one logit per query head.
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    check_sinks(sinks, query)
    batch, heads_q, seq_q, _ = query.shape
    seq_kv = key.shape[2]
    softcap = kwargs.get("softcap")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)

    mask: Optional[torch.Tensor]
    memo: Optional[dict] = None
    mods = None  # a translated mask_mod: overlays from the mask function, packed documents
    if isinstance(attention_mask, TiledMask):
        causal, window = attention_mask.causal, attention_mask.window
        diag_offset = attention_mask.diag_offset
        mask = attention_mask.tensor
        has_padding = attention_mask.key_mask is not None or attention_mask.mods is not None
        is_dense = attention_mask.dense is not None
        memo = attention_mask._memo
        mods = attention_mask.mods
    elif attention_mask is None:
        # No mask from transformers (e.g. a mask builder that early-exited): trust the module.
        causal = is_causal
        window = kwargs.get("sliding_window")
        diag_offset = seq_kv - seq_q
        mask, has_padding, is_dense = None, False, False
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        # A raw 2-D padding mask (B, Skv): keep it compact.
        causal = is_causal
        window = kwargs.get("sliding_window")
        diag_offset = seq_kv - seq_q
        mask = attention_mask[:, -seq_kv:].to(torch.bool)[:, None, None, :]
        has_padding, is_dense = True, False
    elif isinstance(attention_mask, torch.Tensor):
        # A 4-D mask that holds the whole pattern, as for eager/sdpa: user-given (transformers
        # passes it through untouched), or the key vector of a static-cache decode step (see
        # tiled_mask). Slice away keys it does not cover (static caches).
        mask = attention_mask[..., :seq_kv]
        if mask.shape[-1] != seq_kv:
            raise ValueError(f"attention_mask covers {mask.shape[-1]} keys, but there are {seq_kv}")
        causal, window, diag_offset = False, None, 0
        has_padding, is_dense = True, True
    else:
        raise TypeError(f"attn_implementation='tiled' got an attention_mask of type "
                        f"{type(attention_mask).__name__}; expected a tensor, None or the "
                        "TiledMask built by its registered mask function")

    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if cu_q is not None or cu_k is not None:
        # Packed varlen batch (DataCollatorWithFlattening(return_flash_attn_kwargs=True)).
        cu_q = cu_k if cu_q is None else cu_q
        cu_k = cu_q if cu_k is None else cu_k
        if batch != 1:
            raise ValueError("cu_seq_lens_q/k describe one flattened sequence, so the batch size "
                             f"must be 1, got {batch}")
        if not is_dense and not _compiling():
            # Eager: the documents as a mask_mod over per-token vectors (a key padding mask
            # folded in), no dense mask.
            overlay = None if mods is None else mods.mask_mod
            mods = _remembered(memo, "cu_mods", (cu_q, cu_k, mask), lambda: compile_mods(
                None, _packed_mask_mod(cu_q, cu_k, seq_q, seq_kv, causal, window, mask,
                                       overlay)))
            mask = None
        else:
            doc_mask = _remembered(memo, "cu", (cu_q, cu_k), lambda: _doc_mask_from_cu_seqlens(
                cu_q, cu_k, seq_q, seq_kv, causal, window))
            if mask is None:
                mask = doc_mask
            elif mask.dtype == torch.bool:
                mask = doc_mask & mask
            else:  # additive: keep its biases, hide other documents
                mask = mask.masked_fill(~doc_mask, float("-inf"))
        causal, window, diag_offset = False, None, 0  # the documents' rule holds them
    elif (isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and not is_dense
          and not has_padding and seq_q == seq_kv and seq_q > 1 and diag_offset == 0
          and not _compiling()):
        # Restarting position_ids mark packed documents (FlashAttention's convention, used when
        # no padding mask exists). transformers masks them itself when no cache is passed (we
        # then get a dense mask and skip this); with a cache it would not. The documents become
        # a mask_mod over their ids (the kernel's causal/window flags still apply).
        def documents():
            pos = position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
            if pos.shape == (batch, seq_q):
                ids = _doc_ids_from_position_ids(pos)
                if bool((ids[:, -1] != 0).any()):
                    return compile_mods(None, document_mask(ids, causal=False))
            return None

        mods = _remembered(memo, "pos", (position_ids,), documents)

    if mask is not None:
        mask = _compact_for_layer(mask, memo, query.device, (batch, heads_q, seq_q, seq_kv))
    # A per-tile table pays off only when the forward's layers share it (through the memo).
    out, _ = _op_attention(query, key, value, mask, causal=causal, scale=scaling,
                           window=window, softcap=softcap, diag_offset=diag_offset,
                           return_lse=False, key_mask_table=memo is not None, mods=mods,
                           sinks=sinks)
    # (B, Sq, Hq, D) contiguous, as transformers' own attention functions return it (models may
    # .view() it). Free when Sq == 1; a copy of the output for prefill.
    return out.transpose(1, 2).contiguous(), None


def _compact_for_layer(mask: torch.Tensor, memo: Optional[dict], device: torch.device,
                       shape: tuple) -> CompactMask:
    """The op's compact form of ``mask`` on the layer's device. Kept in the forward's memo, so
    the layers that share a mask share one copy per GPU and its tile tables."""
    if memo is None or _compiling():
        # Nothing to share (a plain tensor mask), or traced: no object ids in traced code, which
        # dynamo would guard on (a recompile whenever the mask is a new object).
        return compact_mask(mask.to(device, non_blocking=True), *shape)
    if mask.device != device:
        # A model split over GPUs (device_map): transformers builds the mask once, on the
        # input's device, and accelerate's hooks move tensors but not a TiledMask.
        source = mask
        mask = _remembered(memo, ("moved", id(source), device), (source,),
                           lambda: source.to(device, non_blocking=True))
    return _remembered(memo, ("compact", id(mask), shape), (mask,),
                       lambda: compact_mask(mask, *shape))


def _remembered(memo: Optional[dict], key, sources: tuple, build):
    """``build()``, kept in the forward's ``memo`` (when there is one and nothing is being
    compiled) under ``key`` together with the objects it was built from, and rebuilt when any of
    them is not the one passed now. Holding them keeps their ids, used in keys, unique."""
    entry = None if memo is None else memo.get(key)
    if entry is None or any(old is not new for old, new in zip(entry[0], sources)):
        entry = (sources, build())
        if memo is not None and not _compiling():
            memo[key] = entry
    return entry[1]


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

def register(name: str = DEFAULT_NAME) -> str:
    """Register the attention function and its mask function under ``name`` in transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface``. Returns ``name``; use it as
    ``attn_implementation=name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, tiled_attention_forward)
    AttentionMaskInterface.register(name, tiled_mask)
    return name
