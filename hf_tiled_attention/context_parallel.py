"""Context parallelism for transformers models on "tiled": one long sequence over the ranks of a
process group, each rank holding a share of its positions.

    import hf_tiled_attention as hta

    sharded = hta.shard_batch(batch, group)      # every rank passes the same whole batch
    with hta.context_parallel(sharded):          # "tiled" attends over the whole sequence
        loss = model(**sharded.inputs).loss      # this rank's positions only
        loss.backward()                          # inside too: checkpointing recomputes attention
    print(sharded.global_loss(loss))             # the one-process loss

:func:`~hf_tiled_attention.batch_sharding.shard_batch` cuts the batch (and says how the loss is
accounted for). Inside :func:`context_parallel` the model's "tiled" attention calls are routed
to :func:`attend_layer`: the rule transformers' mask function describes (causal, sliding
window, bidirectional, index-only overlays), the documents and padding of the whole batch,
softcap and sinks, over the whole sequence
(:func:`~hf_tiled_attention.sharded_attention.sharded_attention`).

Used otherwise, it refuses rather than compute a wrong loss: a "tiled" call given shard_batch's
inputs outside the context (or inside another batch's), and a context in which no attention
over the sharded sequence ran (a model on another attention implementation attends only within
each rank's positions), are errors.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .batch_sharding import ShardedBatch, shard_batch  # noqa: F401  (importable from here too)
from .layer_call import LayerCall, active_owner, routed
from .mods import compile_mods
from .sharded_attention import SequenceShards, sharded_attention

__all__ = ["active_shards", "attend_layer", "context_parallel", "shard_batch"]


@contextlib.contextmanager
def context_parallel(sharded):
    """Inside, every "tiled" attention call of a transformers model attends over the whole
    sequence of ``sharded`` (a :class:`ShardedBatch` or
    :class:`~hf_tiled_attention.sharded_attention.SequenceShards`), from this rank's share of
    its positions. Run the backward inside too when layers are checkpointed. Raises when the
    block ends without any such call (the model's attention is not "tiled")."""
    shards = sharded.shards if isinstance(sharded, ShardedBatch) else sharded
    if not isinstance(shards, SequenceShards):
        raise TypeError(f"context_parallel takes a ShardedBatch or SequenceShards, got "
                        f"{type(sharded).__name__}")

    def route(call: LayerCall, query, key, value) -> torch.Tensor:
        return attend_layer(call, query, key, value, shards)

    with routed(shards, route):
        yield shards
    if not shards.calls:  # (not reached when the block raised)
        raise RuntimeError(
            "context_parallel: no attention over the sharded sequence ran inside this block, "
            "so the model attended only within each rank's positions (a wrong loss). Run a "
            "model whose attention is attn_implementation='tiled' (hf_tiled_attention."
            "register()) on sharded.inputs inside it; 'sdpa', 'eager' and FlashAttention do "
            "not see the other ranks' positions.")


def active_shards() -> Optional[SequenceShards]:
    """The shards of the innermost active :func:`context_parallel` block, or None."""
    owner = active_owner()
    return owner if isinstance(owner, SequenceShards) else None


def attend_layer(call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 shards: SequenceShards) -> torch.Tensor:
    """A transformers layer's call inside :func:`context_parallel`: the record's rule
    (transformers made its masks for this rank's positions) read back in global terms, over the
    whole sequence. What cannot be read back is refused. Returns ``(B, Hq, L, D)``."""
    if call.documents is not None:  # (only cu_seq_lens give documents here: see read_call)
        raise ValueError("context parallelism got cu_seq_lens_q/k in the model's kwargs: pass "
                         "the batch through shard_batch, which reads them as document ids of "
                         "the whole sequence")
    if call.given:
        raise ValueError(f"context parallelism got a {type(call.mask).__name__} "
                         "attention_mask made for this rank's positions, which cannot be made "
                         "global: pass the 2-D padding mask to shard_batch instead")
    if call.dense:
        raise ValueError(
            "context parallelism: transformers' mask reached 'tiled' as a dense mask over "
            "this rank's positions (traced by torch.compile, or a mask function the "
            "translator refuses), which cannot be made global; run the model eagerly")
    if call.diag_offset != 0 or key.shape[2] != query.shape[2]:
        raise ValueError("context parallelism runs without a cache: pass use_cache=False "
                         "(shard_batch's inputs do)")
    if call.position_bias is not None:
        raise ValueError("context parallelism does not take a position_bias (T5's relative "
                         "bias is made for this rank's positions); use one process")
    mask_mod = None
    if call.overlay is not None:
        if compile_mods(None, call.overlay).captures:
            raise ValueError(
                f"context parallelism: the model's mask function "
                f"{getattr(call.overlay, '__qualname__', '?')} reads tensors laid over this "
                "rank's positions (image blocks, chunk offsets, ...), so it cannot be evaluated "
                "at global positions")
        mask_mod = call.overlay  # index-only: the same at global positions
    # (the key padding of transformers' mask is local: the shards carry the whole batch's)
    return sharded_attention(query, key, value, shards, is_causal=call.causal, scale=call.scale,
                             window=call.window, softcap=call.softcap, sinks=call.sinks,
                             mask_mod=mask_mod)
