"""transformers' mask interface for "tiled": :func:`tiled_mask` turns the pattern transformers
describes (a ``mask_function`` over absolute positions, the 2-D padding mask, the offsets of the
current queries and keys) into a :class:`TiledMask` for the attention function
(transformers_backend.py), which hands it to the op as it is.

The mask function is translated by the same translator as a user's mask_mod (mods.py). Its
structure (an intersection of rules, :func:`mods.conjuncts`) tells which parts are transformers'
causal / sliding-window / bidirectional rule, recognised by comparing their translations with
those of transformers' own public rule functions. Those parts become the kernel's causal /
window flags and the padding a ``(B, 1, 1, Skv)`` key vector; transformers' packed-rows overlay
becomes the documents rule of documents.py (its table from the ids' bounds per tile; on 5.19+
the rule remapped to per-document positions is the plain rule there); the rest (Llama 4
chunks, Gemma 3's image blocks, any user pattern), with the padding and the cache offsets
folded in, becomes one mask_mod. Never an ``O(Sq x Skv)`` tensor, except

* decoding an overlay pattern after a cache (at most 16 query rows): its few rows (one row has
  no row dim, so the decode path packs the query heads); and decoding with a StaticCache (whose
  offset is a tensor) as a plain tensor, the one thing that crosses into a compiled decode step
  without a recompile per step;
* a mask function the translator refuses (a warning names it once), and, under
  ``torch.compile`` (where the function's closure cannot be read), any pattern transformers
  does not declare plain through its ``allow_is_*_skip`` arguments.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .documents import key_documents, same_document, same_document_key
from .memo import Memo, memoize
from .mods import (CompiledMods, ModError, compile_mods, conjuncts, follow, mods_from_key,
                   structure)
from .schedule import DECODE_QUERY_ROWS
from .variants import and_masks

__all__ = ["TiledMask", "tiled_mask"]


@dataclass
class TiledMask:
    """What :func:`tiled_mask` hands every layer: the kernel's rule (``causal``, ``window``,
    ``diag_offset``), the key padding ``(B, 1, 1, Skv)`` (None: none padded), the overlays as a
    mask_mod (``mods``, with ``overlay`` the function it was translated from), or a ``dense``
    ``(B, 1, Sq, Skv)`` bool mask that holds everything (the flags are then off); ``memo``, what
    the layers that get this object share."""

    causal: bool
    window: Optional[int]
    diag_offset: int
    key_mask: Optional[torch.Tensor] = None
    dense: Optional[torch.Tensor] = None
    shape: tuple = ()
    mods: Optional[CompiledMods] = None
    overlay: Optional[Callable] = None
    # Per-forward memo shared by all layers that get this object (the adapter's launches,
    # document ids, compact masks: memo.remembered).
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def tensor(self) -> Optional[torch.Tensor]:
        return self.dense if self.dense is not None else self.key_mask

    # generate() with a compileable cache builds masks ahead and hands them back in as
    # `attention_mask`; transformers then asks for `.ndim` (4: not a padding mask).
    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    # A model whose own code uses the mask as a tensor (Bloom adds it to its scores) bypasses
    # the attention function, the one reader of this object: say so instead of a bare error.
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


def tiled_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
               mask_function=None, attention_mask: Optional[torch.Tensor] = None,
               local_size: Optional[int] = None, device="cpu", **kwargs):
    """``AttentionMaskInterface`` entry, called with ``sdpa_mask``'s arguments (transformers
    5.17 to 5.25); the query row ``i`` sits at position ``q_offset + i`` and key ``j`` at
    ``kv_offset + j``. Returns a :class:`TiledMask` (or, decoding with a StaticCache, a plain
    ``(B, 1, 1, Skv)`` bool tensor)."""
    from transformers import masking_utils as mu

    if isinstance(attention_mask, TiledMask):  # prepared ahead (generate + static cache)
        return attention_mask
    mask_function = mask_function or mu.causal_mask_function
    if kwargs.get("cache_position") is not None and not isinstance(q_offset, torch.Tensor) \
            and q_offset == 0:  # older call convention: absolute query positions
        q_offset = kwargs["cache_position"][0]
    kv_offset = _as_int(kv_offset)
    shape = (batch_size, 1, q_length, kv_length)

    def dense() -> torch.Tensor:
        return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                            q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                            attention_mask=attention_mask, allow_is_causal_skip=False,
                            allow_is_bidirectional_skip=False, device=device)

    offset_tensor = isinstance(q_offset, torch.Tensor)
    if offset_tensor and q_length == 1:  # StaticCache decode: see the module docstring
        return dense()
    if torch.compiler.is_compiling():
        pattern = _declared_pattern(local_size, kwargs)
        if pattern is None or offset_tensor:
            return TiledMask(False, None, 0, dense=dense(), shape=shape)
        causal, window, overlays = pattern
    else:
        try:
            causal, window, overlays = _pattern(mask_function)
        except ModError as exc:
            _warn_dense_once(getattr(mask_function, "__qualname__", repr(mask_function)),
                             str(exc))
            return TiledMask(False, None, 0, dense=dense(), shape=shape)
    if overlays and q_length <= DECODE_QUERY_ROWS and (offset_tensor or q_offset or kv_offset):
        # Decoding an overlay pattern: its few rows (one row lets the decode path pack heads).
        return TiledMask(False, None, 0, dense=dense(), shape=shape)
    pad = _padding(attention_mask, batch_size, kv_length, kv_offset, device)
    mask = TiledMask(causal, window, _as_int(q_offset) - kv_offset, shape=shape)
    documents = overlays and _packed_documents(overlays, pad, q_offset, kv_offset, q_length,
                                               kv_length)
    if documents:  # packed rows: the documents rule, on its two id vectors
        mask.overlay = same_document(*documents)
        mask.mods = mods_from_key(same_document_key(), documents)
    elif overlays:  # one mask_mod: the overlays at absolute positions, and the padding
        mask.overlay = _at_positions(functools.reduce(and_masks, overlays), q_offset, kv_offset,
                                     device)
        mask.mods = compile_mods(None, _with_padding(mask.overlay, pad))
    elif pad is not None and (torch.compiler.is_compiling() or not bool(pad.all())):
        mask.key_mask = pad[:, None, None, :]
    return mask


def _pattern(mask_function) -> tuple[bool, Optional[int], list]:
    """(causal, window, overlays): the parts of the mask function that are transformers' causal
    / sliding-window / bidirectional rules (recognised by their translation) as the kernel's
    flags (window in the op's convention), and the functions left to intersect with them.
    The analysis is memoised per :func:`mods.structure` (transformers makes new closures every
    forward); the overlays are found again in this function by their paths."""
    key = structure(mask_function)
    analysis = _analyses.get(key)
    if analysis is None:
        try:
            analysis = _analyse(mask_function)
        except ModError as exc:
            analysis = exc
        _analyses.put(key, analysis)
    if isinstance(analysis, ModError):
        raise analysis
    causal, window, paths = analysis
    return causal, window, [follow(mask_function, path) for path in paths]


_analyses = Memo("mask-function analyses", 256)


def _analyse(mask_function) -> tuple[bool, Optional[int], tuple]:
    templates = _rule_templates()
    parts = conjuncts(mask_function)
    texts = {text for _, text in parts}
    causal = templates["causal"] in texts
    if not (causal or templates["bidirectional"] in texts):
        remapped = _remapped_packed_rows(mask_function, parts)
        if remapped is not None:
            return remapped
        return False, None, ((),)  # no rule of the kernel's: the whole pattern
    # The window that goes with the base: kv > q - W (causal), |q - kv| <= W (both ways).
    window_template = templates["sliding" if causal else "both_ways"]
    window, overlays = None, []
    for path, text in parts:
        if text in (templates["causal"], templates["bidirectional"]):
            continue
        size = _size(window_template, text) if window is None else None
        if size is None:
            overlays.append(path)
        else:
            window = size if causal else size + 1  # the op's |d| < W + 1 both ways
    return causal, window, tuple(overlays)


def _remapped_packed_rows(mask_function, parts: list) -> Optional[tuple]:
    """transformers 5.19+ on packed rows: ``rule`` at per-document positions (its
    ``remap_positions_for_packed_sequence``) and the same-document overlay. Where ``rule`` is
    the kernel's (causal, window, both ways: functions of ``q - kv`` alone) and its positions
    rise by one inside each document (they do: that is how transformers finds the documents),
    the remap changes nothing, so the analysis is ``rule``'s with the overlay; else None."""
    if len(parts) != 2:
        return None
    functions = [follow(mask_function, path) for path, _ in parts]
    packed = [_is_packed_rule(fn) for fn in functions]
    if sorted(packed) != [False, True]:
        return None
    remap = functions[packed.index(False)]
    if getattr(remap, "__qualname__", "") != "remap_positions_for_packed_sequence.<locals>." \
            "inner_mask" or getattr(remap, "__module__", "") != "transformers.masking_utils":
        return None
    rule = inspect.getclosurevars(remap).nonlocals.get("mask_function")
    causal, window, overlays = _analyse(rule) if callable(rule) else (False, None, ((),))
    if overlays:
        return None
    return causal, window, (parts[packed.index(True)][0],)


def _is_packed_rule(fn) -> bool:
    """Whether ``fn`` is transformers' same-document rule of packed rows
    (``packed_sequence_mask_function``), by its translation; memoised per structure."""
    key = structure(fn)
    found = _packed_rules.get(key)
    if found is None:
        found = [text for _, text in conjuncts(fn)] == [_rule_templates()["packed"]]
        _packed_rules.put(key, found)
    return found


_packed_rules = Memo("packed-rows rules", 64)


def _packed_documents(overlays: list, pad, q_offset, kv_offset: int, q_length: int,
                      kv_length: int) -> Optional[tuple]:
    """``(query ids, key ids)`` int32 ``(B, S)`` where the one overlay is transformers'
    same-document rule of packed rows (found without a cache or padding, so at offset 0 over
    as many keys as queries): the adapter's own documents rule then stands in for it, whose
    block table comes from each tile's id bounds instead of every (query, key)
    (documents.document_cells)."""
    if len(overlays) != 1 or pad is not None or _as_int(q_offset) or kv_offset or \
            q_length != kv_length or not _is_packed_rule(overlays[0]):
        return None
    ids, = compile_mods(None, overlays[0]).captures
    if ids.dim() != 2 or ids.shape[1] != q_length:
        return None
    ids = ids.to(torch.int32)
    return ids, key_documents(ids)


@memoize(1)
def _rule_templates() -> dict:
    """The canonical translations of transformers' public rule functions; a window size is a
    placeholder that :func:`_size` reads back."""
    from transformers import masking_utils as mu

    def text(fn) -> str:
        (_, canonical), = conjuncts(fn)
        return canonical

    return {"causal": text(mu.causal_mask_function),
            "bidirectional": text(mu.bidirectional_mask_function),
            "sliding": text(mu.sliding_window_overlay(_PLACEHOLDER)),
            "both_ways": text(mu.sliding_window_bidirectional_overlay(_PLACEHOLDER)),
            "packed": text(mu.packed_sequence_mask_function(torch.zeros(1, 1, dtype=torch.long)))}


_PLACEHOLDER = 987654321


def _size(template: str, text: str) -> Optional[int]:
    pattern = re.escape(template).replace(str(_PLACEHOLDER), r"(\d+)")
    found = re.fullmatch(pattern, text)
    return None if found is None or int(found.group(1)) < 1 else int(found.group(1))


def _declared_pattern(local_size, kwargs) -> Optional[tuple]:
    """Under torch.compile: the plain patterns transformers declares through its documented
    ``allow_is_causal_skip`` / ``allow_is_bidirectional_skip`` (sdpa may drop the mask there),
    whose ``local_size`` is the config's sliding window (not a chunk); else None."""
    window = getattr(kwargs.get("config"), "sliding_window", None)
    if local_size is not None and (isinstance(local_size, bool) or local_size != window):
        return None
    if kwargs.get("allow_is_causal_skip") is True:
        return True, local_size, []
    if kwargs.get("allow_is_bidirectional_skip") is True:
        return False, None if local_size is None else local_size + 1, []
    return None


def _at_positions(overlay: Callable, q_offset, kv_offset: int, device) -> Callable:
    """transformers' mask functions take absolute positions; the kernel's indices start at 0.
    Non-zero offsets (chunked prefill after a cache) reach the mod as a captured tensor, so the
    generated code, and the kernel, stay the same from chunk to chunk."""
    q_offset = _as_int(q_offset)
    if not (q_offset or kv_offset):
        return overlay
    offsets = torch.tensor([q_offset, kv_offset], dtype=torch.int32, device=device)

    def at_positions(b, h, q_idx, kv_idx):
        return overlay(b, h, q_idx + offsets[0], kv_idx + offsets[1])
    return at_positions


def _with_padding(overlay: Callable, pad: Optional[torch.Tensor]) -> Callable:
    if pad is None:
        return overlay

    def key_padding(b, h, q_idx, kv_idx):
        return pad[b, kv_idx]
    return and_masks(overlay, key_padding)


def _padding(attention_mask, batch_size: int, kv_length: int, kv_offset: int,
             device) -> Optional[torch.Tensor]:
    """The current keys' padding, ``(B, kv_length)`` bool (True = may attend), or None."""
    if attention_mask is None:
        return None
    pad = attention_mask.to(device=device, dtype=torch.bool)
    if pad.dim() != 2:
        raise ValueError(f"tiled: expected a 2-D padding mask, got shape {tuple(pad.shape)}")
    if pad.shape[-1] < kv_length + kv_offset:  # StaticCache: unwritten positions stay hidden
        pad = torch.nn.functional.pad(pad, (0, kv_length + kv_offset - pad.shape[-1]))
    pad = pad[:, kv_offset:kv_offset + kv_length]
    return pad if pad.shape[0] == batch_size else pad.expand(batch_size, -1)


@memoize(256)
def _warn_dense_once(name: str, reason: str) -> None:
    warnings.warn(f"attn_implementation='tiled': the mask function {name} cannot run in the "
                  f"kernel ({reason}); it is applied as a dense (B, 1, Sq, Skv) mask instead.",
                  RuntimeWarning, stacklevel=4)


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)
