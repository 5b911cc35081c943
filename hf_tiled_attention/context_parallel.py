"""Context parallelism for transformers models on "tiled": one long sequence over the ranks of a
process group, each rank holding a share of its positions.

    from hf_tiled_attention.context_parallel import context_parallel, shard_batch

    sharded = shard_batch(batch, group)          # every rank passes the same whole batch
    with context_parallel(sharded):              # "tiled" attends over the whole sequence
        loss = model(**sharded.inputs).loss      # this rank's positions only
        loss.backward()                          # inside too: checkpointing recomputes attention
    print(sharded.global_loss(loss))             # the one-process loss

:func:`shard_batch` picks the positions each rank holds (balanced by visible query-key pairs),
shifts the labels over the whole sequence before cutting it, reads packed documents from
``position_ids`` / ``cu_seq_lens_q`` and padding from ``attention_mask``, and hands the model
this rank's ``input_ids``, global ``position_ids`` and ``shift_labels``. Inside
:func:`context_parallel` the model's "tiled" attention calls run
:func:`~hf_tiled_attention.sharded_attention.sharded_attention` with the rule transformers'
mask function describes (causal, sliding window, bidirectional, index-only overlays), the
documents and padding of the whole batch, softcap and sinks.

The loss: each rank's ``num_items_in_batch`` is the whole batch's label count divided by the
number of ranks, so the ranks' losses average to the one-process loss and DDP's or FSDP's
gradient average over the ranks is the one-process gradient. (Each rank's backward computes
the gradient of the sum of the ranks' losses, world times the one-process loss: the parameters
get their share of that, which the average over the ranks divides back; the gradient of
``inputs_embeds`` is scaled back by shard_batch; a tensor outside the model that the loss
reaches otherwise gets world times its one-process gradient.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from .mods import compile_mods
from .shard_layout import SequenceLayout, least_chunks_layout, position_work
from .sharded_attention import SequenceShards, sharded_attention

__all__ = ["ShardedBatch", "context_parallel", "shard_batch"]

BALANCES = ("pairs", "head_tail", "contiguous")
# Batch entries shard_batch reads; the flash-attention kwargs describe the whole row, and are
# turned into document ids instead of being handed on.
_SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "position_ids",
                  "attention_mask")
_CONSUMED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
                  "num_items_in_batch", "use_cache")


@dataclass(eq=False)
class ShardedBatch:
    """This rank's share of a batch: ``inputs`` for the model (its positions), ``shards`` for
    the attention, and ``global_tokens``, the labelled positions of the whole batch."""
    inputs: dict
    shards: SequenceShards
    global_tokens: int

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The one-process loss (detached): the average of the ranks' losses."""
        import torch.distributed as dist
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.shards.group)
        return total / self.shards.layout.world_size


def shard_batch(batch: Mapping, group=None, *, balance: str = "pairs",
                window: Optional[int] = None, layout: Optional[SequenceLayout] = None,
                global_tokens: Optional[int] = None, ignore_index: int = -100) -> ShardedBatch:
    """This rank's share of ``batch`` (every rank of ``group``, default the world, passes the
    same whole batch: ``input_ids`` or ``inputs_embeds`` ``(B, S, ...)``, and optionally
    ``labels``, ``shift_labels``, ``position_ids``, ``attention_mask`` (2-D padding),
    ``cu_seq_lens_q/k`` (one packed row)).

    ``balance``: ``"pairs"`` (the default) balances the visible query-key pairs of causal
    attention: head-and-tail chunks for unpacked rows (exact), for packed documents chunks
    assigned by their pairs, as few per rank as bring the busiest rank within 10% of the mean
    (:func:`~hf_tiled_attention.shard_layout.least_chunks_layout`); ``"head_tail"`` and
    ``"contiguous"`` ignore the documents; or pass a ``layout``. ``window``: balance the pairs
    of this sliding window instead (a model whose every layer has it, e.g. Mistral-7B's 4096;
    it changes the layout only, never the attention). ``global_tokens``: the label
    count the loss divides by (default: this batch's; the count over accumulated batches for
    gradient accumulation)."""
    import torch.distributed as dist
    group = dist.group.WORLD if group is None else group
    unknown = [k for k in batch if k not in _SEQUENCE_KEYS + _CONSUMED_KEYS]
    if unknown:
        raise ValueError(f"shard_batch does not know how to split {unknown} over the sequence; "
                         f"it takes {list(_SEQUENCE_KEYS + _CONSUMED_KEYS[:2])}")
    first = batch.get("input_ids", batch.get("inputs_embeds"))
    if not isinstance(first, torch.Tensor) or first.dim() < 2:
        raise ValueError("shard_batch needs input_ids (B, S) or inputs_embeds (B, S, hidden)")
    rows, seq_len = first.shape[:2]
    device = first.device
    world = dist.get_world_size(group)
    for name in _SEQUENCE_KEYS:
        value = batch.get(name)
        if value is not None and (value.dim() < 2 or value.shape[1] != seq_len
                                  or value.shape[0] not in (1, rows)):
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({rows}, "
                             f"{seq_len}, ...) like input_ids")
    padding = batch.get("attention_mask")
    key_padding = None if padding is None or bool(padding.all()) else padding.to(torch.bool)
    position_ids, document_ids = _positions_and_documents(batch, rows, seq_len, device)
    shift_labels = _shift_labels(batch, ignore_index)
    if global_tokens is None:
        global_tokens = 0 if shift_labels is None else int((shift_labels != ignore_index).sum())
    if layout is None:
        layout = _balanced_layout(balance, seq_len, world, document_ids, window)
    elif layout.seq_len != seq_len or layout.world_size != world:
        raise ValueError(f"layout is for {layout.seq_len} positions over {layout.world_size} "
                         f"ranks; the batch has {seq_len} positions and the group {world} ranks")
    _check_same_batch(group, (layout.digest(), global_tokens,
                              *[_fingerprint(batch.get(name)) for name in _SEQUENCE_KEYS],
                              _fingerprint(batch.get("cu_seq_lens_q"))))
    shards = SequenceShards(layout, dist.get_rank(group), group, document_ids, key_padding)

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return shards.shard(tensor, 1).contiguous()  # (transformers .view()s some of them)

    inputs = {"position_ids": local(position_ids.expand(rows, -1)),
              "attention_mask": (local(padding) if padding is not None else
                                 torch.ones((rows, layout.local_len), dtype=torch.long,
                                            device=device)),
              "use_cache": False}
    # (an attention_mask, even all ones, also stops transformers from reading this rank's
    # position_ids as packed rows: the documents are the shards' own)
    if batch.get("input_ids") is not None:
        inputs["input_ids"] = local(batch["input_ids"])
    if batch.get("inputs_embeds") is not None:
        # The loss counts each rank's tokens world times (see the module docstring): DDP's and
        # FSDP's average take that back from the parameters' gradients; the embeddings' own
        # gradient (nobody averages it) is scaled back here.
        inputs["inputs_embeds"] = _GradientScale.apply(local(batch["inputs_embeds"]), 1 / world)
    if shift_labels is not None:
        local_labels = local(shift_labels)
        # transformers' causal-LM loss takes shift_labels as they are (labels must be given
        # for a loss at all) and divides the sum by num_items_in_batch.
        inputs.update(labels=local_labels, shift_labels=local_labels,
                      num_items_in_batch=torch.tensor(global_tokens / world, device=device))
    return ShardedBatch(inputs, shards, global_tokens)


class _GradientScale(torch.autograd.Function):
    """The identity, with its gradient multiplied by ``factor``."""

    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _positions_and_documents(batch: Mapping, rows: int, seq_len: int, device):
    """Global ``position_ids`` ``(B or 1, S)`` and the document ids of packed rows (None: one
    document per row), as transformers reads them: from ``cu_seq_lens_q/k``, else from
    restarting ``position_ids`` when no ``attention_mask`` is given."""
    cu = batch.get("cu_seq_lens_q", batch.get("cu_seq_lens_k"))
    position_ids = batch.get("position_ids")
    if cu is not None:
        if rows != 1 or int(cu[-1]) > seq_len:
            raise ValueError(f"cu_seq_lens_q/k describe one packed row of at most {seq_len} "
                             f"positions; got {rows} rows and a last boundary of {int(cu[-1])}")
        positions = torch.arange(seq_len, device=cu.device)
        document = torch.bucketize(positions, cu[1:].to(positions.dtype), right=True)
        document_ids = torch.where(positions < cu[-1], document, -1)[None].to(torch.int32)
        if position_ids is None:
            starts = cu.to(positions.dtype)[document.clamp(max=len(cu) - 2)]
            position_ids = (positions - starts)[None]
        return position_ids.to(device), document_ids.to(device)
    if position_ids is None:
        return torch.arange(seq_len, device=device)[None], None
    if batch.get("attention_mask") is not None:
        return position_ids, None
    expanded = position_ids.expand(rows, -1)
    restarts = torch.diff(expanded, prepend=expanded[:, :1] - 1, dim=-1) != 1
    ids = restarts.cumsum(-1).to(torch.int32)
    return position_ids, (ids if bool(ids[:, -1].any()) else None)


def _shift_labels(batch: Mapping, ignore_index: int) -> Optional[torch.Tensor]:
    """Labels shifted over the whole sequence (position t predicts t + 1), before sharding."""
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    labels = batch.get("labels")
    if labels is None:
        return None
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)


def _balanced_layout(balance: str, seq_len: int, world: int,
                     document_ids: Optional[torch.Tensor], window: Optional[int]) -> SequenceLayout:
    if balance == "head_tail" or (balance == "pairs" and document_ids is None and window is None):
        return SequenceLayout.head_tail(seq_len, world)
    if balance == "contiguous":
        return SequenceLayout.contiguous(seq_len, world)
    if balance == "pairs":
        return least_chunks_layout(position_work(seq_len, document_ids, window=window), world)
    raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")


def _fingerprint(tensor: Optional[torch.Tensor]):
    """Shape and two sums of a tensor (what a different batch on another rank would change)."""
    if tensor is None:
        return None
    flat = tensor.detach().flatten().to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
    return tuple(tensor.shape), float(flat.sum()), float((flat * weights.remainder(997)).sum())


_FINGERPRINT_FIELDS = ("the layout", "the label count", *_SEQUENCE_KEYS, "cu_seq_lens_q")


def _check_same_batch(group, fingerprint: tuple) -> None:
    import torch.distributed as dist
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, fingerprint, group=group)
    for rank, theirs in enumerate(everyone):
        for name, mine, other in zip(_FINGERPRINT_FIELDS, fingerprint, theirs):
            if mine != other:
                raise ValueError(
                    f"shard_batch: ranks {dist.get_rank(group)} and {rank} of the group were "
                    f"given different batches ({name} differ): every rank passes the same whole "
                    "batch and shard_batch cuts it (e.g. the same seed for every rank's sampler)")


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
