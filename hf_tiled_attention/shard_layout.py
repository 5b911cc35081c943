"""Which positions of a sequence each rank of a context-parallel group holds.

The sequence (``S`` positions) is cut into ``world_size * chunks_per_rank`` equal chunks and
each rank holds ``chunks_per_rank`` of them, in ascending order: its local rows. A rank's
consecutive chunks form a *run*, the query rows of one attention call.

Causal attention gives a late position more keys than an early one, so contiguous slices leave
the last rank most of the work. :meth:`SequenceLayout.head_tail` pairs chunk ``r`` with chunk
``2N - 1 - r`` (every rank then has exactly the same number of visible pairs);
:meth:`SequenceLayout.balanced` assigns chunks by their visible pairs (:func:`position_work`),
for packed documents, whose work per position follows the documents, not the position.
Pure Python and small CPU tensors: every rank computes the same layout from the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .documents import document_bounds
from .memo import memoize
from .visibility import key_span


class Run(NamedTuple):
    """Consecutive global positions ``start .. end - 1`` held at local rows from
    ``local_start``."""
    start: int
    end: int
    local_start: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SequenceLayout:
    """``chunks[r]``: the chunk indices rank ``r`` holds, ascending; every rank holds as many,
    and together they hold each chunk once."""
    seq_len: int
    chunks: tuple

    def __post_init__(self):
        counts = {len(held) for held in self.chunks}
        total = sum(len(held) for held in self.chunks)
        if not self.chunks or len(counts) != 1 or 0 in counts:
            raise ValueError(f"SequenceLayout: every rank must hold the same number (>= 1) of "
                             f"chunks, got {[len(held) for held in self.chunks]}")
        if sorted(c for held in self.chunks for c in held) != list(range(total)):
            raise ValueError(f"SequenceLayout: the ranks' chunks must be 0 .. {total - 1}, each "
                             f"once, got {self.chunks}")
        if any(list(held) != sorted(held) for held in self.chunks):
            raise ValueError(f"SequenceLayout: each rank's chunks must be ascending, got "
                             f"{self.chunks}")
        if self.seq_len % total:
            raise ValueError(f"SequenceLayout: {total} chunks do not divide the sequence length "
                             f"{self.seq_len}")

    @classmethod
    def head_tail(cls, seq_len: int, world_size: int) -> "SequenceLayout":
        """Rank ``r`` holds chunks ``r`` and ``2N - 1 - r`` of ``2N``."""
        check_divisible(seq_len, world_size, 2)
        return cls(seq_len, tuple((r, 2 * world_size - 1 - r) for r in range(world_size)))

    @classmethod
    def contiguous(cls, seq_len: int, world_size: int) -> "SequenceLayout":
        """Rank ``r`` holds the ``r``-th of ``N`` equal slices (balanced for a sliding window
        alone; causal attention gives the last rank most of the work)."""
        check_divisible(seq_len, world_size, 1)
        return cls(seq_len, tuple((r,) for r in range(world_size)))

    @classmethod
    def balanced(cls, work: torch.Tensor, world_size: int,
                 chunks_per_rank: int) -> "SequenceLayout":
        """Chunks assigned by their work (``work``: ``(S,)`` visible pairs per position, see
        :func:`position_work`): heaviest chunk first, each to the rank with the least work
        that still has room (ties: the lower rank). With causal work and two chunks per rank
        this is :meth:`head_tail`."""
        seq_len = work.shape[0]
        check_divisible(seq_len, world_size, chunks_per_rank)
        chunk_work = work.to(torch.float64).reshape(world_size * chunks_per_rank, -1).sum(1)
        order = sorted(range(len(chunk_work)), key=lambda c: (-float(chunk_work[c]), c))
        load, held = [0.0] * world_size, [[] for _ in range(world_size)]
        for chunk in order:
            rank = min((r for r in range(world_size) if len(held[r]) < chunks_per_rank),
                       key=lambda r: (load[r], r))
            held[rank].append(chunk)
            load[rank] += float(chunk_work[chunk])
        return cls(seq_len, tuple(tuple(sorted(h)) for h in held))

    @property
    def world_size(self) -> int:
        return len(self.chunks)

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (self.world_size * len(self.chunks[0]))

    @property
    def local_len(self) -> int:
        return self.chunk_len * len(self.chunks[0])

    def runs(self, rank: int) -> tuple:
        """Rank ``rank``'s runs of consecutive chunks, in local order."""
        runs, size = [], self.chunk_len
        for i, chunk in enumerate(self.chunks[rank]):
            if runs and runs[-1].end == chunk * size:
                runs[-1] = runs[-1]._replace(end=(chunk + 1) * size)
            else:
                runs.append(Run(chunk * size, (chunk + 1) * size, i * size))
        return tuple(runs)

    def positions(self, rank: int) -> torch.Tensor:
        """The global position of each of rank ``rank``'s local rows, ``(local_len,)`` int64."""
        return torch.cat([torch.arange(run.start, run.end) for run in self.runs(rank)])

    def owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per global position: the rank that holds it and its local row there."""
        rank_of = torch.empty(self.seq_len, dtype=torch.int64)
        row_of = torch.empty(self.seq_len, dtype=torch.int64)
        for rank in range(self.world_size):
            held = self.positions(rank)
            rank_of[held] = rank
            row_of[held] = torch.arange(len(held))
        return rank_of, row_of

    def shard(self, tensor: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        """Rank ``rank``'s rows of a tensor over the whole sequence along ``dim``
        (differentiable: views of each run, concatenated)."""
        if tensor.shape[dim] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} positions along dim {dim}, got shape "
                             f"{tuple(tensor.shape)}")
        parts = [tensor.narrow(dim, run.start, run.length) for run in self.runs(rank)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def imbalance(self, work: torch.Tensor) -> float:
        """The busiest rank's work over the mean (``work``: ``(S,)`` per position)."""
        per_rank = [float(work[self.positions(r)].sum()) for r in range(self.world_size)]
        mean = sum(per_rank) / len(per_rank)
        return max(per_rank) / mean if mean else 1.0

    def digest(self) -> tuple:
        """What two ranks must agree on (compared across the group by the batch sharding)."""
        return (self.seq_len, self.chunks)


# Chunks per rank tried by least_chunks_layout, and the smallest chunk worth a call of its own
# (a kernel tile is 64-128 query rows).
CHUNKS_PER_RANK_CHOICES = (2, 4, 8, 16)
MIN_CHUNK_LEN = 128
# Busiest rank's visible pairs over the mean that least_chunks_layout settles for: more chunks
# buy balance with more keys to exchange and keep (eval/context_parallel_balance.py counts
# both; at 32k tokens with a 4096 window, 1.07 -> 1.03 took 1.6x the keys).
BALANCE_TARGET = 1.10


def least_chunks_layout(work: torch.Tensor, world_size: int, *,
                        target: float = BALANCE_TARGET) -> SequenceLayout:
    """The balanced layout (:meth:`SequenceLayout.balanced`) with the fewest chunks per rank
    (fewest attention calls, smallest key buffers) whose busiest rank has at most ``target``
    times the mean work; else the most even one tried. Two chunks per rank (head-and-tail for
    causal work) always qualify for trying; more only while the chunks stay at least
    :data:`MIN_CHUNK_LEN` long and divide the sequence."""
    seq_len = work.shape[0]
    check_divisible(seq_len, world_size, 2)
    best = None
    for per_rank in CHUNKS_PER_RANK_CHOICES:
        chunks = world_size * per_rank
        if seq_len % chunks or (per_rank > 2 and seq_len // chunks < MIN_CHUNK_LEN):
            continue
        layout = SequenceLayout.balanced(work, world_size, per_rank)
        ratio = layout.imbalance(work)
        if ratio <= target:
            return layout
        if best is None or ratio < best[0]:
            best = (ratio, layout)
    return best[1]


def check_divisible(seq_len: int, world_size: int, chunks_per_rank: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(chunks_per_rank, int) or chunks_per_rank < 1:
        raise ValueError(f"chunks_per_rank must be an int >= 1, got {chunks_per_rank!r}")
    multiple = world_size * chunks_per_rank
    if seq_len < multiple or seq_len % multiple:
        raise ValueError(
            f"the sequence length must be a multiple of {multiple} ({world_size} ranks x "
            f"{chunks_per_rank} chunks per rank), got {seq_len}: pad the batch to a multiple "
            f"of {multiple} (e.g. the collator's pad_to_multiple_of={multiple})")


@dataclass(frozen=True, eq=False)
class KeyRule:
    """What bounds the keys a position sees: the causal rule, a window (the op's convention),
    and the earliest document start / latest document end per position (None without
    documents; :func:`~hf_tiled_attention.documents.document_bounds`)."""
    causal: bool
    window: Optional[int]
    doc_start: Optional[torch.Tensor] = None
    doc_end: Optional[torch.Tensor] = None

    def position_spans(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` ``(seq_len,)`` int64: position ``p`` may see keys ``lo[p] .. hi[p] - 1``
        (:func:`~hf_tiled_attention.visibility.key_span`'s keys, narrowed to its documents).
        Both grow with ``p``."""
        lo, hi = _rule_spans(seq_len, self.causal, self.window)
        if self.doc_start is not None:
            lo = torch.maximum(lo, self.doc_start.cpu())
            if not self.causal:
                hi = torch.minimum(hi, self.doc_end.cpu())
        return lo, hi

    def span(self, start: int, end: int, seq_len: int) -> tuple[int, int]:
        """Global key positions ``lo .. hi - 1`` that queries ``start .. end - 1`` may see
        (the spans grow with the position: the first one's start, the last one's end)."""
        lo, hi = self._spans(seq_len)
        return int(lo[start]), int(hi[end - 1])

    def _spans(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.__dict__.setdefault("_cache", {})  # (frozen: the spans, once per length)
        if seq_len not in cache:
            cache[seq_len] = self.position_spans(seq_len)
        return cache[seq_len]


@memoize(16)
def _rule_spans(seq_len: int, causal: bool, window: Optional[int]) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    """Each position's key span under the causal / window rule alone (host Python: once per
    length and rule)."""
    spans = [key_span(p, p, seq_len, window or 0, causal, window is not None)[:2]
             for p in range(seq_len)]
    both = torch.tensor(spans, dtype=torch.int64).reshape(seq_len, 2)
    return both[:, 0].contiguous(), both[:, 1].contiguous()


def position_work(seq_len: int, document_ids: Optional[torch.Tensor] = None, *,
                  causal: bool = True, window: Optional[int] = None) -> torch.Tensor:
    """Visible (query, key) pairs per query position, summed over the batch rows of
    ``document_ids`` ``(B, S)`` (None: one document per row, one row): the keys of its own
    document that the causal rule (or both ways) and the window let it see (each row's
    :meth:`KeyRule.position_spans`). Padding is not subtracted (its rows still run)."""
    if document_ids is None:
        document_ids = torch.zeros((1, seq_len), dtype=torch.int32)
    work = torch.zeros(seq_len, dtype=torch.int64)
    for row in document_ids.cpu():
        lo, hi = KeyRule(causal, window, *document_bounds(row[None])).position_spans(seq_len)
        work += hi - lo
    return work
