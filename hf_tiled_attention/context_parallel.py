"""Context parallelism for transformers models on "tiled": one long sequence over the ranks of a
process group, each rank holding a share of its positions.

    import hf_tiled_attention as hta

    sharded = hta.shard_batch(batch, group)      # every rank passes the same whole batch
    with hta.context_parallel(sharded):          # "tiled" attends over the whole sequence
        loss = model(**sharded.inputs).loss      # this rank's positions only
        loss.backward()                          # inside too: checkpointing recomputes attention
    print(sharded.global_loss(loss))             # the one-process loss

:func:`~hf_tiled_attention.batch_sharding.shard_batch` cuts the batch (and says how the loss is
accounted for). Inside :func:`context_parallel` the model's "tiled" attention calls run
:func:`~hf_tiled_attention.sharded_attention.sharded_attention` with the rule transformers'
mask function describes (causal, sliding window, bidirectional, index-only overlays), the
documents and padding of the whole batch, softcap and sinks.

Used otherwise, it refuses rather than compute a wrong loss: a "tiled" call given shard_batch's
inputs outside the context (or inside another batch's), and a context in which no attention
over the sharded sequence ran (a model on another attention implementation attends only within
each rank's positions), are errors.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .batch_sharding import ShardedBatch, shard_batch  # noqa: F401  (this module's old home)
from .mods import compile_mods
from .sharded_attention import SequenceShards, sharded_attention

__all__ = ["active_shards", "context_parallel", "shard_batch"]

# The shards "tiled" attends over, innermost last (module state, not a context variable:
# autograd's backward threads recompute checkpointed layers and must see it too).
_active: list = []


@contextlib.contextmanager
def context_parallel(sharded):
    """Inside, every "tiled" attention call of a transformers model attends over the whole
    sequence of ``sharded`` (a :class:`ShardedBatch` or
    :class:`~hf_tiled_attention.sharded_attention.SequenceShards`), from this rank's share of
    its positions. Run the backward inside too when layers are checkpointed."""
    shards = sharded.shards if isinstance(sharded, ShardedBatch) else sharded
    if not isinstance(shards, SequenceShards):
        raise TypeError(f"context_parallel takes a ShardedBatch or SequenceShards, got "
                        f"{type(sharded).__name__}")
    _active.append(shards)
    try:
        yield shards
    finally:
        _active.remove(shards)
    if not shards.calls:  # (not reached when the block raised)
        raise RuntimeError(
            "context_parallel: no attention over the sharded sequence ran inside this block, "
            "so the model attended only within each rank's positions (a wrong loss). Run a "
            "model whose attention is attn_implementation='tiled' (hf_tiled_attention."
            "register()) on sharded.inputs inside it; 'sdpa', 'eager' and FlashAttention do "
            "not see the other ranks' positions.")


def check_laid_out(position_ids) -> None:
    """Refuses a "tiled" call whose ``position_ids`` shard_batch laid out for other shards than
    the active context's (or outside any context): it would attend within the rank's rows.
    (Eager calls: a traced one's tensors are not the objects shard_batch made.)"""
    if torch.compiler.is_compiling():
        return
    owner = SequenceShards.owner(position_ids)
    if owner is None or owner is active_shards():
        return
    if active_shards() is None:
        raise ValueError(
            "attn_implementation='tiled' got shard_batch's inputs (one rank's share of the "
            "sequence) outside context_parallel: run the model, and its backward when layers "
            "are checkpointed, inside `with hf_tiled_attention.context_parallel(sharded):`; "
            "outside it each rank would attend only within its own positions")
    raise ValueError("attn_implementation='tiled' got the inputs of another shard_batch than "
                     "the active context_parallel's: enter context_parallel with the "
                     "ShardedBatch whose inputs the model runs on")


def active_shards() -> Optional[SequenceShards]:
    return _active[-1] if _active else None


def transformers_attention(shards: SequenceShards, module, query, key, value, attention_mask,
                           scaling, sinks, kwargs) -> torch.Tensor:
    """The "tiled" attention function's work inside :func:`context_parallel`: the rule of
    transformers' mask (made for this rank's positions) read back in global terms. Returns
    ``(B, Hq, L, D)``."""
    from .transformers_mask import TiledMask
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise ValueError("context parallelism got cu_seq_lens_q/k in the model's kwargs: pass "
                         "the batch through shard_batch, which reads them as document ids of "
                         "the whole sequence")
    mask_mod = None
    if isinstance(attention_mask, TiledMask):
        if attention_mask.dense is not None:
            raise ValueError(
                "context parallelism: transformers' mask reached 'tiled' as a dense mask over "
                "this rank's positions (traced by torch.compile, or a mask function the "
                "translator refuses), which cannot be made global; run the model eagerly")
        if attention_mask.diag_offset != 0 or key.shape[2] != query.shape[2]:
            raise ValueError("context parallelism runs without a cache: pass use_cache=False "
                             "(shard_batch's inputs do)")
        causal, window = attention_mask.causal, attention_mask.window
        if attention_mask.overlay is not None:
            if compile_mods(None, attention_mask.overlay).captures:
                raise ValueError(
                    f"context parallelism: the model's mask function "
                    f"{getattr(attention_mask.overlay, '__qualname__', '?')} reads tensors laid "
                    "over this rank's positions (image blocks, chunk offsets, ...), so it cannot "
                    "be evaluated at global positions")
            mask_mod = attention_mask.overlay  # index-only: the same at global positions
    elif attention_mask is None:
        is_causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        window = kwargs.get("sliding_window")
    else:
        raise ValueError(f"context parallelism got a {type(attention_mask).__name__} "
                         "attention_mask made for this rank's positions, which cannot be made "
                         "global: pass the 2-D padding mask to shard_batch instead")
    return sharded_attention(query, key, value, shards, is_causal=causal, scale=scaling,
                             window=window, softcap=kwargs.get("softcap"), sinks=sinks,
                             mask_mod=mask_mod)
