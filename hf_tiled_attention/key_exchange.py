"""The keys and values each rank of a context-parallel group needs from the others, and the
collective that moves them (forward) and returns their gradients (backward).

Each run of query rows (:class:`~hf_tiled_attention.shard_layout.Run`) needs one contiguous span
of global key positions (:class:`~hf_tiled_attention.shard_layout.KeyRule`): up to its end under the causal rule, from ``W - 1`` before it with a
window ``W``, from the start of the earliest document it holds with packed documents (both ways
when not causal). A rank's *key buffer* is the union of its runs' spans, in global order, so
each run's keys are one slice of it. The rows a rank does not hold come from their owners in
one ``all_to_all_single`` (torch's functional collective: autograd runs the same exchange in
reverse for dK/dV, summing them at their owners, and it traces under torch.compile). Under the
causal rule the busiest rank needs every key, as an all-gather would give it; a window or
packed documents shrink every rank's exchange to the spans its rows can see.

Every rank computes every rank's needs from the same layout, so the send and receive counts
agree without a round of messages, and when no rank needs a remote key no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .shard_layout import KeyRule, SequenceLayout


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's part of the exchange.

    ``send_rows``: the local rows it sends, grouped by destination rank (``send_splits`` rows
    each); ``recv_splits``: rows it receives from each rank. ``buffer_rows``: per key-buffer row,
    its row in ``cat(local rows, received rows)``; ``buffer_positions``: its global position.
    ``run_keys``: per run, ``(first buffer row, key count, global position of the first key)``.
    ``exchanged``: whether any rank of the group receives anything (all ranks agree)."""
    send_rows: torch.Tensor
    send_splits: list
    recv_splits: list
    buffer_rows: torch.Tensor
    buffer_positions: torch.Tensor
    run_keys: tuple
    exchanged: bool

    def to(self, device: torch.device) -> "ExchangePlan":
        return ExchangePlan(self.send_rows.to(device), self.send_splits, self.recv_splits,
                            self.buffer_rows.to(device), self.buffer_positions,
                            self.run_keys, self.exchanged)


def plan_exchange(layout: SequenceLayout, rank: int, rule: KeyRule) -> ExchangePlan:
    """Rank ``rank``'s plan (CPU tensors)."""
    rank_of, row_of = layout.owners()
    needed = [_needed_positions(layout, r, rule) for r in range(layout.world_size)]
    mine = needed[rank]
    # Received rows come grouped by source rank, in global order within each group.
    remote = (rank_of[mine] != rank).nonzero().flatten()
    order = torch.sort(rank_of[mine[remote]], stable=True).indices
    recv_slot = torch.empty_like(order)
    recv_slot[order] = torch.arange(len(order))
    buffer_rows = row_of[mine].clone()
    buffer_rows[remote] = layout.local_len + recv_slot
    recv_splits = torch.bincount(rank_of[mine[remote]],
                                 minlength=layout.world_size).tolist()
    send_rows, send_splits = [], []
    for other in range(layout.world_size):
        wanted = needed[other]
        held = wanted[rank_of[wanted] == rank] if other != rank else wanted[:0]
        send_rows.append(row_of[held])
        send_splits.append(len(held))
    exchanged = any(bool((rank_of[n] != r).any()) for r, n in enumerate(needed))
    run_keys = []
    for run in layout.runs(rank):
        lo, hi = rule.span(run.start, run.end, layout.seq_len)
        run_keys.append((int(torch.searchsorted(mine, lo)), hi - lo, lo))
    return ExchangePlan(torch.cat(send_rows), send_splits, recv_splits, buffer_rows, mine,
                        tuple(run_keys), exchanged)


def _needed_positions(layout: SequenceLayout, rank: int, rule: KeyRule) -> torch.Tensor:
    """The union of the rank's runs' key spans, ascending."""
    spans = sorted(rule.span(run.start, run.end, layout.seq_len) for run in layout.runs(rank))
    merged = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return torch.cat([torch.arange(lo, hi) for lo, hi in merged])


def exchange_keys(key: torch.Tensor, value: torch.Tensor, plan: ExchangePlan,
                  group) -> tuple[torch.Tensor, torch.Tensor]:
    """The key buffer's keys and values, ``(B, Hkv, buffer rows, D)`` each (views of one
    tensor), from this rank's ``key`` / ``value`` ``(B, Hkv, local rows, D)``; differentiable,
    the backward returning the gradients of the rows sent to their owners."""
    rows = _packed_rows(key, value)
    if plan.exchanged:
        if group is None:
            raise ValueError("these shards need keys from other ranks, but no process group "
                             "was given")
        from torch.distributed import _functional_collectives as collectives
        received = collectives.all_to_all_single_autograd(
            rows.index_select(0, plan.send_rows), plan.recv_splits, plan.send_splits, group)
        rows = torch.cat((rows, received))
    return _unpacked(rows.index_select(0, plan.buffer_rows), key.shape)


def gathered_keys(key: torch.Tensor, value: torch.Tensor,
                  plan: ExchangePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The key buffer taken from the whole sequence's ``key`` / ``value``: what
    :func:`exchange_keys` assembles from the ranks, in the same memory layout, for one process
    that plays every rank."""
    positions = plan.buffer_positions.to(key.device)
    return _unpacked(_packed_rows(key, value).index_select(0, positions), key.shape)


def _packed_rows(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``(positions, 2 * B * Hkv * D)``: K and V of a position in one row, so that they travel
    in one collective."""
    return torch.stack((key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)), dim=1).flatten(1)


def _unpacked(rows: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``(B, Hkv, positions, D)``, views of :func:`_packed_rows`' rows."""
    batch, heads, _, head_dim = shape
    buffer = rows.view(-1, 2, batch, heads, head_dim)
    return buffer[:, 0].permute(1, 2, 0, 3), buffer[:, 1].permute(1, 2, 0, 3)
