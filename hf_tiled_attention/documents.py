"""Packed documents: several sequences in one row, each attending only within itself.

The one home of their rules, used by the transformers adapter, context parallelism and the
sharded op: a row's documents as per-token ids (from ``cu_seq_lens`` or from restarting
``position_ids``), the ids keys carry (padding and positions in no document seen by no query),
the same-document rule as a mask_mod and as a dense mask, and each position's document bounds.
An id below 0 is a position in no document (past the last ``cu_seq_lens`` boundary, or padding
added by context parallelism): it sees nothing and nothing sees it.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .memo import memoize

__all__ = ["document_bounds", "document_cells", "documents_from_cu_seq_lens",
           "documents_from_positions", "key_documents", "same_document", "same_document_dense",
           "same_document_key"]

# A key's id that no query's equals (queries in no document have -1).
_UNSEEN = -2


def documents_from_cu_seq_lens(cu: torch.Tensor, seq_len: int) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """``(ids (1, seq_len) int32, starts (seq_len,))`` of one packed row whose documents end at
    ``cu[1:]`` (``cu_seq_lens_q/k``, ``[0, l0, l0 + l1, ...]``): each position's document (-1
    past ``cu[-1]``) and the start of that document."""
    positions = torch.arange(seq_len, device=cu.device)
    document = torch.bucketize(positions, cu[1:].to(positions.dtype), right=True)
    ids = torch.where(positions < cu[-1], document, -1).to(torch.int32)[None]
    starts = cu.to(positions.dtype)[document.clamp(max=len(cu) - 2)]
    return ids, starts


def documents_from_positions(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Per-token document ids ``(B, S)`` int32 of rows whose ``position_ids`` ``(B, S)`` restart
    (a document begins wherever a position is not its predecessor's plus one), or None where
    no row restarts (one document per row)."""
    first = position_ids[:, :1] - 1
    ids = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1).to(torch.int32)
    return ids if bool((ids[:, -1] != 0).any()) else None


def key_documents(ids: torch.Tensor, key_padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ids keys carry: a key in no document (id < 0), or hidden by ``key_padding`` (bool,
    broadcastable to ``ids``; False = hidden), gets an id no query has."""
    keys = torch.where(ids < 0, _UNSEEN, ids)
    return keys if key_padding is None else torch.where(key_padding, keys, _UNSEEN)


def same_document(query_ids: torch.Tensor, key_ids: torch.Tensor,
                  offsets: Optional[torch.Tensor] = None) -> Callable:
    """The rule as a mask_mod: query ``q_idx`` sees key ``kv_idx`` iff
    ``query_ids[b, q_idx] == key_ids[b, kv_idx]`` (``(B, S)`` tensors, keys' from
    :func:`key_documents`). ``offsets``: an int tensor ``[query, key]`` added to the indices
    (a run of rows of a longer sequence); a tensor, so one translation serves every run."""
    if offsets is None:
        def same_document(b, h, q_idx, kv_idx):
            return query_ids[b, q_idx] == key_ids[b, kv_idx]
    else:
        def same_document(b, h, q_idx, kv_idx):
            return query_ids[b, q_idx + offsets[0]] == key_ids[b, kv_idx + offsets[1]]
    return same_document


@torch.compiler.assume_constant_result
@memoize(1)
def same_document_key() -> str:
    """The generated key of :func:`same_document` without offsets (translated once, outside any
    trace, and kept: the mask function, the adapter and every block table ask for it): a
    call's mods with this key are that rule on their two captures, the query ids and the key
    ids. (Two tensors: the translation gives one tensor captured twice one slot, and the key
    ids would then never be read.)"""
    from .mods import compile_mods
    query_ids, key_ids = torch.zeros((2, 1, 1), dtype=torch.int32)
    return compile_mods(None, same_document(query_ids, key_ids)).key


def document_cells(query_ids: torch.Tensor, key_ids: torch.Tensor, rows_per: int,
                   keys_per: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any visible, all visible) of :func:`same_document` per cell of ``rows_per`` queries x
    ``keys_per`` keys, bool ``(B, 1, cells down, cells across)``, from each cell's smallest and
    largest id of a document (``query_ids`` ``(B, Sq)``, ``key_ids`` ``(B, Skv)``; ids below 0
    see nothing and are seen by nothing): O(Sq + Skv + cells) instead of evaluating the rule
    on every (query, key). All is visible only where every query and key of the cell has one
    id; none where their ranges of ids do not meet; otherwise the cell counts as partly
    visible, which is exact for packed rows (ids rising by one at each new document) and safe
    for any ids (the kernel then evaluates the rule in that tile). A cell past the ends is
    padded with the last row's or key's id, as a tile's padding counts."""
    def bounds(ids: torch.Tensor, per: int) -> tuple:
        padded = F.pad(ids[:, None].float(), (0, -ids.shape[1] % per), mode="replicate")
        cells = padded[:, 0].view(ids.shape[0], -1, per)
        inside = cells >= 0
        low = torch.where(inside, cells, math.inf).amin(dim=2)   # inf: no document in the cell
        high = torch.where(inside, cells, -math.inf).amax(dim=2)
        return low, high, inside.all(dim=2) & (low == high)

    q_low, q_high, q_one = bounds(query_ids, rows_per)
    k_low, k_high, k_one = bounds(key_ids, keys_per)
    meet = (q_low[:, :, None] <= k_high[:, None, :]) & (k_low[:, None, :] <= q_high[:, :, None])
    one = q_one[:, :, None] & k_one[:, None, :] & (q_low[:, :, None] == k_low[:, None, :])
    return meet[:, None], one[:, None]


def same_document_dense(ids: torch.Tensor) -> torch.Tensor:
    """The rule as a ``(B, 1, S, S)`` bool mask over one row's queries and keys."""
    return (ids[:, :, None] == key_documents(ids)[:, None, :])[:, None]


def document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, over the rows of ``document_ids`` ``(B, S)``: the earliest start and the
    latest end (exclusive) of the documents that hold it. Documents are runs of equal ids."""
    ids = document_ids
    seq_len = ids.shape[-1]
    pos = torch.arange(seq_len, device=ids.device).expand_as(ids)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(new, pos, 0).cummax(dim=1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    end = torch.where(last, pos + 1, seq_len).flip(1).cummin(dim=1).values.flip(1)
    return start.min(dim=0).values, end.max(dim=0).values
