"""What one attention call of a transformers model asks for, read once, and where it runs.

transformers hands the attention function the layer module, the mask its mask interface made
(a :class:`~hf_tiled_attention.transformers_mask.TiledMask`, a tensor or None) and keyword
arguments; :func:`read_call` turns them into a :class:`LayerCall`, which both the local op call
(transformers_backend.py) and a routed call take. Context parallelism (context_parallel.py,
above the adapter) routes the calls of its block over the whole sequence (:func:`routed`), and
claims the inputs it laid out for one rank (:func:`claim`), so that a call given them outside
its block is refused (:func:`route_for`) instead of attending within that rank's positions.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .checks import check_sinks
from .documents import documents_from_cu_seq_lens, documents_from_positions
from .memo import remembered
from .mods import CompiledMods
from .transformers_mask import TiledMask

__all__ = ["LayerCall", "active_owner", "causal_flag", "claim", "read_call", "route_for",
           "routed"]


@dataclass(frozen=True, eq=False)
class LayerCall:
    """The kernel's rule (``causal``, ``window``, ``diag_offset``: query row ``i`` sits at key
    position ``i + diag_offset``), ``scale``, ``softcap``, ``sinks`` ``(Hq,)``, and what else
    masks the call: ``mask``, a key vector ``(B, 1, 1, Skv)`` or, with ``dense``, a mask that
    holds the whole pattern (the flags are then off), ``given`` when it is a tensor the model
    passed rather than one transformers' mask interface made; ``mods``, transformers' overlays
    as a mask_mod, translated from ``overlay``; ``documents``, per-token ids ``(B, S)`` of packed
    rows the kwargs reveal; ``position_bias``, T5's additive bias. ``memo``: the forward's memo,
    shared by its layers (None when the mask object carries none)."""
    causal: bool
    window: Optional[int]
    diag_offset: int
    scale: Optional[float] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    dense: bool = False
    given: bool = False
    mods: Optional[CompiledMods] = None
    overlay: Optional[Callable] = None
    documents: Optional[torch.Tensor] = None
    position_bias: Optional[torch.Tensor] = None
    memo: Optional[dict] = None


def causal_flag(module: torch.nn.Module, kwargs: dict) -> bool:
    """The call's own causal flag: the ``is_causal`` kwarg, else the module's (default True)."""
    is_causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)


def read_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask,
              scaling: Optional[float], kwargs: dict, *, sharded: bool = False) -> LayerCall:
    """The :class:`LayerCall` of an attention function's arguments. ``sharded``: the call's
    positions are one rank's share of a sequence (context parallelism), so its
    ``position_ids`` are global positions, not packed rows restarting."""
    batch, _, seq_q, _ = query.shape
    seq_kv = key.shape[2]
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # gpt-oss's learned sinks, one per head
    check_sinks(sinks, query)
    rule = dict(causal=causal_flag(module, kwargs), window=kwargs.get("sliding_window"),
                diag_offset=seq_kv - seq_q)
    masks: dict = {}
    if isinstance(attention_mask, TiledMask):
        rule = dict(causal=attention_mask.causal, window=attention_mask.window,
                    diag_offset=attention_mask.diag_offset)
        masks = dict(mask=attention_mask.tensor, dense=attention_mask.dense is not None,
                     mods=attention_mask.mods, overlay=attention_mask.overlay,
                     memo=attention_mask.memo)
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        masks = dict(mask=attention_mask[:, -seq_kv:].to(torch.bool)[:, None, None, :],
                     given=True)  # key padding
    elif isinstance(attention_mask, torch.Tensor):
        # A 4-D mask that holds the whole pattern: user-given, or a static-cache decode step's.
        dense = attention_mask[..., :seq_kv]
        if dense.shape[-1] != seq_kv:
            raise ValueError(f"attention_mask covers {dense.shape[-1]} keys, but there are "
                             f"{seq_kv}")
        rule = dict(causal=False, window=None, diag_offset=0)
        masks = dict(mask=dense, dense=True, given=True)
    elif attention_mask is not None:
        raise TypeError(f"attn_implementation='tiled' got an attention_mask of type "
                        f"{type(attention_mask).__name__}; expected a tensor, None or the "
                        "TiledMask built by its registered mask function")
    documents = _documents(kwargs, batch, seq_q, seq_kv, rule["diag_offset"], masks, sharded)
    if documents is not None and masks.get("dense") and not masks.get("given") and \
            kwargs.get("cu_seq_lens_q") is not None:
        # FlashAttention's varlen rule, which transformers' flash path follows with these
        # kwargs: the documents, the module's causal flag and window. The dense mask (what a
        # traced mask function could not describe otherwise) says the same from position_ids.
        rule = dict(causal=causal_flag(module, kwargs), window=kwargs.get("sliding_window"),
                    diag_offset=0)
        masks.update(mask=None, dense=False)
    return LayerCall(**rule, scale=scaling, softcap=kwargs.get("softcap"), sinks=sinks,
                     documents=documents, position_bias=kwargs.get("position_bias"), **masks)


def _documents(kwargs: dict, batch: int, seq_q: int, seq_kv: int, diag_offset: int,
               masks: dict, sharded: bool) -> Optional[torch.Tensor]:
    """Per-token document ids ``(B, S)`` of packed rows the kwargs reveal, or None:
    ``cu_seq_lens_q/k`` (``DataCollatorWithFlattening``), or restarting ``position_ids`` in an
    eager call that transformers did not mask itself (with a cache) and nothing pads."""
    memo = masks.get("memo")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        cu = cu_q if cu_q is not None else cu_k
        if batch != 1 or seq_q != seq_kv or not _same_boundaries(cu, cu_k):
            raise ValueError("cu_seq_lens_q/k describe one flattened row of documents: batch 1, "
                             "as many queries as keys and equal boundaries, got batch "
                             f"{batch}, {seq_q} queries, {seq_kv} keys")
        return remembered(memo, "cu", (cu,), lambda: documents_from_cu_seq_lens(cu, seq_q)[0])
    position_ids = kwargs.get("position_ids")
    if (sharded or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or seq_q == 1 or seq_q != seq_kv or diag_offset != 0 or torch.compiler.is_compiling()
            or masks.get("mask") is not None or masks.get("mods") is not None):
        return None

    def restarts():
        pos = position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
        return documents_from_positions(pos) if pos.shape == (batch, seq_q) else None
    return remembered(memo, "pos", (position_ids,), restarts)


def _same_boundaries(cu_q: torch.Tensor, cu_k: Optional[torch.Tensor]) -> bool:
    """Whether ``cu_seq_lens_k`` (if given) holds the same boundaries as ``cu_seq_lens_q``.
    DataCollatorWithFlattening returns them as two equal tensors. Comparing their values is
    data-dependent, which torch.compile cannot trace without a graph break: while tracing only
    the shapes are compared (eager calls check the values)."""
    if cu_k is None or cu_k is cu_q:
        return True
    if cu_k.shape != cu_q.shape:
        return False
    return torch.compiler.is_compiling() or torch.equal(cu_k, cu_q)


# The active routes, innermost last: (owner, route(call, query, key, value) -> out). Module
# state, not a context variable: autograd's backward threads recompute checkpointed layers and
# must see it too.
_routes: list = []
# Claimed tensors, by id: (weak reference to the tensor, to its owner).
_claimed: dict = {}


@contextlib.contextmanager
def routed(owner, route: Callable):
    """Inside, every call's :func:`route_for` is ``route`` (innermost block first)."""
    entry = (owner, route)
    _routes.append(entry)
    try:
        yield
    finally:
        _routes.remove(entry)


def active_owner():
    """The owner of the innermost active route, or None."""
    return _routes[-1][0] if _routes else None


def claim(tensor: torch.Tensor, owner) -> None:
    """Record ``tensor`` (a model input laid out for one route, e.g. shard_batch's
    ``position_ids``) as ``owner``'s."""
    key = id(tensor)
    _claimed[key] = (weakref.ref(tensor, lambda _: _claimed.pop(key, None)), weakref.ref(owner))


def route_for(position_ids) -> Optional[Callable]:
    """Where a call runs: the innermost active route, or None (locally). A call whose
    ``position_ids`` another owner claimed than the active route's (or any, outside every
    route) is refused. (Eager calls: a traced call's tensors are not the claimed objects.)"""
    active = _routes[-1] if _routes else None
    if torch.compiler.is_compiling():
        return None if active is None else active[1]
    entry = _claimed.get(id(position_ids))
    owner = None if entry is None or entry[0]() is not position_ids else entry[1]()
    if owner is not None and (active is None or owner is not active[0]):
        if active is None:
            raise ValueError(
                "attn_implementation='tiled' got shard_batch's inputs (one rank's share of the "
                "sequence) outside context_parallel: run the model, and its backward when "
                "layers are checkpointed, inside `with hf_tiled_attention.context_parallel("
                "sharded):`; outside it each rank would attend only within its own positions")
        raise ValueError("attn_implementation='tiled' got the inputs of another shard_batch "
                         "than the active context_parallel's: enter context_parallel with the "
                         "ShardedBatch whose inputs the model runs on")
    return None if active is None else active[1]
