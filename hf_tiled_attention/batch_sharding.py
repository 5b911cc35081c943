"""One rank's share of a batch for context parallelism, and the loss accounting that makes the
ranks' losses and gradients the one-process ones.

:func:`shard_batch` picks the positions each rank holds (balanced by visible query-key pairs),
pads the sequence to a length the layout can cut (positions in no document, labels ignored),
shifts the labels over the whole sequence before cutting it, reads packed documents from
``position_ids`` / ``cu_seq_lens_q`` and padding from ``attention_mask``, and hands the model
this rank's ``input_ids``, global ``position_ids`` and ``shift_labels``.

The loss: each rank's ``num_items_in_batch`` is the whole batch's label count divided by the
number of ranks, so the ranks' losses average to the one-process loss and DDP's or FSDP's
gradient average over the ranks is the one-process gradient. (Each rank's backward computes
the gradient of the sum of the ranks' losses, world times the one-process loss: the parameters
get their share of that, which the average over the ranks divides back; the gradient of
``inputs_embeds`` is scaled back by shard_batch; a tensor outside the model that the loss
reaches otherwise gets world times its one-process gradient.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from .documents import documents_from_cu_seq_lens, documents_from_positions
from .shard_layout import SequenceLayout, least_chunks_layout, position_work
from .sharded_attention import SequenceShards

__all__ = ["ShardedBatch", "label_count", "shard_batch"]

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
    the attention, ``global_tokens``, the labelled positions of the whole batch, and
    ``seq_len``, the batch's own length (the layout's, ``shards.layout.seq_len``, is longer
    when shard_batch padded it)."""
    inputs: dict
    shards: SequenceShards
    global_tokens: int
    seq_len: int

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The one-process loss (detached): the average of the ranks' losses (a collective:
        every rank calls it)."""
        import torch.distributed as dist
        if not self.shards.calls:
            raise RuntimeError(
                "ShardedBatch.global_loss: no attention over the sharded sequence ran for this "
                "batch, so each rank's loss saw only its own positions. Run a model whose "
                "attention is attn_implementation='tiled' on sharded.inputs inside "
                "`with hf_tiled_attention.context_parallel(sharded):`")
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.shards.group)
        return total / self.shards.layout.world_size

    @property
    def positions(self) -> torch.Tensor:
        """The global position of each of this rank's rows, ``(local_len,)``; those from
        ``seq_len`` on are padding."""
        return self.shards.layout.positions(self.shards.rank)

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's rows of a tensor over the whole batch's ``seq_len`` positions along
        ``dim`` (zeros at the padding's rows)."""
        extra = self.shards.layout.seq_len - self.seq_len
        if extra and tensor.shape[dim] == self.seq_len:
            tensor = _pad(tensor, extra, 0, dim)
        return self.shards.shard(tensor, dim)


def shard_batch(batch: Mapping, group=None, *, balance: str = "pairs",
                window: Optional[int] = None, layout: Optional[SequenceLayout] = None,
                global_tokens: Optional[int] = None, ignore_index: int = -100) -> ShardedBatch:
    """This rank's share of ``batch`` (every rank of ``group``, default the world, passes the
    same whole batch: ``input_ids`` or ``inputs_embeds`` ``(B, S, ...)``, and optionally
    ``labels``, ``shift_labels``, ``position_ids``, ``attention_mask`` (2-D padding),
    ``cu_seq_lens_q/k`` (one packed row)). Any length ``S``: a batch the layout cannot cut
    evenly is padded at the end with positions that belong to no document and no label.

    ``balance``: ``"pairs"`` (the default) balances the visible query-key pairs of causal
    attention: head-and-tail chunks for unpacked rows (exact), for packed documents chunks
    assigned by their pairs, as few per rank as bring the busiest rank within 10% of the mean
    (:func:`~hf_tiled_attention.shard_layout.least_chunks_layout`); ``"head_tail"`` and
    ``"contiguous"`` ignore the documents; or pass a ``layout`` (of at least ``S`` positions;
    a longer one pads the batch to its length). ``window``: balance the pairs of this sliding
    window instead (a model whose every layer has it, e.g. Mistral-7B's 4096; it changes the
    layout only, never the attention). ``global_tokens``: the label count the loss divides by
    (default: this batch's; the count over accumulated batches for gradient accumulation).

    A batch one rank refuses is refused on every rank, with that rank's reason."""
    import torch.distributed as dist
    group = dist.group.WORLD if group is None else group
    try:
        cut = _Cut.read(batch, group, balance, window, layout, global_tokens, ignore_index)
    except (ValueError, TypeError) as exc:
        _agree(group, exc, None)
        raise  # (_agree raised it already, once the peers had learnt why)
    _agree(group, None, cut.fingerprint)
    shards = SequenceShards.for_group(cut.layout, group, document_ids=cut.document_ids,
                                      key_padding=cut.key_padding)
    return ShardedBatch(cut.local_inputs(shards), shards, cut.global_tokens, cut.seq_len)


def label_count(batch: Mapping, ignore_index: int = -100) -> int:
    """The labelled positions of a batch, as the causal-LM loss counts them (after the shift
    over each whole row)."""
    labels = _shift_labels(batch, ignore_index)
    return 0 if labels is None else int((labels != ignore_index).sum())


@dataclass(eq=False)
class _Cut:
    """What shard_batch reads from a batch before any collective (every error a rank can
    raise on its own batch is raised here): the whole sequence's tensors, padded to the
    layout's length, the layout and what the ranks compare."""
    batch: Mapping
    seq_len: int
    layout: SequenceLayout
    position_ids: torch.Tensor
    document_ids: Optional[torch.Tensor]
    key_padding: Optional[torch.Tensor]
    shift_labels: Optional[torch.Tensor]
    global_tokens: int
    fingerprint: tuple

    @classmethod
    def read(cls, batch: Mapping, group, balance: str, window: Optional[int],
             layout: Optional[SequenceLayout], global_tokens: Optional[int],
             ignore_index: int) -> "_Cut":
        unknown = [k for k in batch if k not in _SEQUENCE_KEYS + _CONSUMED_KEYS]
        if unknown:
            raise ValueError(f"shard_batch does not know how to split {unknown} over the "
                             f"sequence; it takes {list(_SEQUENCE_KEYS + _CONSUMED_KEYS[:2])}")
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        first = batch.get("input_ids", batch.get("inputs_embeds"))
        if not isinstance(first, torch.Tensor) or first.dim() < 2:
            raise ValueError("shard_batch needs input_ids (B, S) or inputs_embeds (B, S, hidden)")
        rows, seq_len = first.shape[:2]
        for name in _SEQUENCE_KEYS:
            value = batch.get(name)
            if value is not None and (value.dim() < 2 or value.shape[1] != seq_len
                                      or value.shape[0] not in (1, rows)):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({rows}, "
                                 f"{seq_len}, ...) like input_ids")
        import torch.distributed as dist
        world = dist.get_world_size(group)
        padded_len = _padded_len(seq_len, world, balance, layout)
        extra = padded_len - seq_len
        padding = batch.get("attention_mask")
        key_padding = None if padding is None or bool(padding.all()) else padding.to(torch.bool)
        if extra:  # the padding's keys are seen by no query
            real = torch.ones((rows, seq_len), dtype=torch.bool, device=first.device)
            key_padding = _pad(real if key_padding is None else key_padding, extra, False, 1)
        position_ids, document_ids = _positions_and_documents(batch, rows, seq_len,
                                                              first.device)
        if extra:
            after = torch.arange(seq_len, padded_len, device=position_ids.device)
            position_ids = torch.cat([position_ids.expand(rows, -1),
                                      after.expand(rows, -1).to(position_ids.dtype)], dim=1)
            if document_ids is not None:
                document_ids = _pad(document_ids, extra, -1, 1)  # in no document
        shift_labels = _shift_labels(batch, ignore_index)
        if global_tokens is None:
            global_tokens = label_count(batch, ignore_index)
        if shift_labels is not None and extra:
            shift_labels = _pad(shift_labels, extra, ignore_index, 1)
        if layout is None:
            layout = _balanced_layout(balance, padded_len, world, document_ids, window)
        fingerprint = (layout.digest(), global_tokens,
                       *[_fingerprint(batch.get(name)) for name in _SEQUENCE_KEYS],
                       _fingerprint(batch.get("cu_seq_lens_q")))
        return cls(batch, seq_len, layout, position_ids, document_ids, key_padding,
                   shift_labels, global_tokens, fingerprint)

    def local_inputs(self, shards: SequenceShards) -> dict:
        """The model's inputs on this rank: its rows of the padded sequence."""
        extra = self.layout.seq_len - self.seq_len
        batch, world = self.batch, self.layout.world_size

        def local(tensor: torch.Tensor) -> torch.Tensor:
            if extra:  # (zeros: token 0, embeddings 0, padding 0 in attention_mask)
                tensor = _pad(tensor, extra, 0, 1)
            return shards.shard(tensor, 1).contiguous()  # (transformers .view()s some)

        first = batch.get("input_ids", batch.get("inputs_embeds"))
        rows = first.shape[0]
        padding = batch.get("attention_mask")
        if padding is None and extra:
            padding = torch.ones((rows, self.seq_len), dtype=torch.long, device=first.device)
        position_ids = shards.shard(self.position_ids.expand(rows, -1), 1).contiguous()
        inputs = {"position_ids": position_ids,
                  "attention_mask": (local(padding) if padding is not None else
                                     torch.ones((rows, self.layout.local_len), dtype=torch.long,
                                                device=first.device)),
                  "use_cache": False}
        # (an attention_mask, even all ones, also stops transformers from reading this rank's
        # position_ids as packed rows: the documents are the shards' own)
        shards.lay_out(position_ids)  # a "tiled" call that gets them must be inside the context
        if batch.get("input_ids") is not None:
            inputs["input_ids"] = local(batch["input_ids"])
        if batch.get("inputs_embeds") is not None:
            # The loss counts each rank's tokens world times (see the module docstring): DDP's
            # and FSDP's average take that back from the parameters' gradients; the embeddings'
            # own gradient (nobody averages it) is scaled back here.
            inputs["inputs_embeds"] = _GradientScale.apply(local(batch["inputs_embeds"]),
                                                           1 / world)
        if self.shift_labels is not None:
            local_labels = shards.shard(self.shift_labels, 1).contiguous()
            # transformers' causal-LM loss takes shift_labels as they are (labels must be given
            # for a loss at all) and divides the sum by num_items_in_batch.
            inputs.update(labels=local_labels, shift_labels=local_labels,
                          num_items_in_batch=torch.tensor(self.global_tokens / world,
                                                          device=first.device))
        return inputs


def _padded_len(seq_len: int, world: int, balance: str,
                layout: Optional[SequenceLayout]) -> int:
    """The length the layout cuts: the given layout's, else the next multiple of the chunks
    the balance needs at least (2 per rank; 1 for contiguous slices)."""
    if layout is not None:
        if layout.world_size != world or layout.seq_len < seq_len:
            raise ValueError(f"layout is for {layout.seq_len} positions over "
                             f"{layout.world_size} ranks; the batch has {seq_len} positions "
                             f"(at most the layout's: shard_batch pads up to it) and the group "
                             f"{world} ranks")
        return layout.seq_len
    multiple = world * (1 if balance == "contiguous" else 2)
    return -(-seq_len // multiple) * multiple


def _pad(tensor: torch.Tensor, extra: int, value, dim: int) -> torch.Tensor:
    """``tensor`` with ``extra`` more rows of ``value`` at the end of ``dim``."""
    shape = list(tensor.shape)
    shape[dim] = extra
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


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
        document_ids, starts = documents_from_cu_seq_lens(cu, seq_len)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=cu.device)[None] - starts
        return position_ids.to(device), document_ids.to(device)
    if position_ids is None:
        return torch.arange(seq_len, device=device)[None], None
    if batch.get("attention_mask") is not None:
        return position_ids, None
    return position_ids, documents_from_positions(position_ids.expand(rows, -1))


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
    return least_chunks_layout(position_work(seq_len, document_ids, window=window), world)


def _fingerprint(tensor: Optional[torch.Tensor]):
    """Shape and two sums of a tensor (what a different batch on another rank would change)."""
    if tensor is None:
        return None
    flat = tensor.detach().flatten().to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
    return tuple(tensor.shape), float(flat.sum()), float((flat * weights.remainder(997)).sum())


_FINGERPRINT_FIELDS = ("the layout", "the label count", *_SEQUENCE_KEYS, "cu_seq_lens_q")


def _agree(group, problem: Optional[Exception], fingerprint: Optional[tuple]) -> None:
    """Every rank learns whether any rank refused its batch (this rank's ``problem``) or the
    ranks were given different batches, and raises alike: a rank that raised alone would leave
    its peers waiting in the next collective."""
    import torch.distributed as dist
    if problem is not None and not dist.is_initialized():
        raise problem  # (no process group: no peer waits)
    mine = dist.get_rank(group)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (None if problem is None else str(problem), fingerprint),
                           group=group)
    if problem is not None:
        raise problem
    for rank, (their_problem, _) in enumerate(everyone):
        if their_problem is not None:
            raise ValueError(f"shard_batch: rank {rank} of the group refused its batch, so "
                             f"every rank stops: {their_problem}")
    for rank, (_, theirs) in enumerate(everyone):
        for name, ours, other in zip(_FINGERPRINT_FIELDS, fingerprint, theirs):
            if ours != other:
                raise ValueError(
                    f"shard_batch: ranks {mine} and {rank} of the group were given different "
                    f"batches ({name} differ): every rank passes the same whole batch and "
                    "shard_batch cuts it (e.g. the same seed for every rank's sampler)")
