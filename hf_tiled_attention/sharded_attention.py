"""Attention over a sequence whose positions are sharded over the ranks of a process group.

Each rank holds some of the sequence's query, key and value rows (a
:class:`~hf_tiled_attention.shard_layout.SequenceLayout`); :func:`sharded_attention` gives it
its rows of the attention over the whole sequence. The keys and values its rows may see arrive
from their owners (:mod:`~hf_tiled_attention.key_exchange`), then every run of consecutive
query rows is one call of the op, with its diagonal placed at the run's global position: the
kernel's own causal / window rule and its tile skipping work in global coordinates unchanged.
Packed documents, key padding and the caller's mods are evaluated at global positions too: the
mods are wrapped to add the run's global offsets (a captured int tensor, so every run, rank and
layer shares one translation and kernel), and the document ids are the whole sequence's.

Differentiable through the output and the LSE: autograd runs the op's backward per run and the
key exchange in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .checks import check_inputs, check_options, check_sinks
from .documents import document_bounds, key_documents, same_document
from .key_exchange import ExchangePlan, KeyRule, exchange_keys, plan_exchange
from .layer_call import claim
from .op import checked_mods, attention
from .shard_layout import SequenceLayout
from .variants import and_masks


@dataclass(eq=False)
class SequenceShards:
    """This rank's share of a sequence: the ``layout``, its ``rank`` in it and the process
    ``group`` that holds the other shards (None: one process playing a rank, see
    :func:`attend_runs`); the whole sequence's ``document_ids`` ``(B or 1, S)`` (packed
    documents: runs of equal ids; a negative id is in no document and sees nothing) and
    ``key_padding`` ``(B, S)`` bool (False: no query sees that key), or None. ``calls``: the
    attention calls made over these shards so far."""
    layout: SequenceLayout
    rank: int
    group: object = None
    document_ids: Optional[torch.Tensor] = None
    key_padding: Optional[torch.Tensor] = None
    calls: int = field(default=0, init=False)
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        seq_len = self.layout.seq_len
        if not 0 <= self.rank < self.layout.world_size:
            raise ValueError(f"rank {self.rank} is not in the layout's {self.layout.world_size} "
                             "ranks")
        for name, ids in (("document_ids", self.document_ids),
                          ("key_padding", self.key_padding)):
            if ids is not None and (not isinstance(ids, torch.Tensor) or ids.dim() != 2
                                    or ids.shape[1] != seq_len):
                raise ValueError(f"{name} must be a (B, S) tensor over the whole sequence, "
                                 f"S = {seq_len}, got "
                                 f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else ids!r}")
        if self.document_ids is not None and (self.document_ids.is_floating_point()
                                              or self.document_ids.dtype == torch.bool):
            raise TypeError(f"document_ids must be an integer tensor, got "
                            f"{self.document_ids.dtype}")
        if self.key_padding is not None and self.key_padding.dtype != torch.bool:
            raise TypeError(f"key_padding must be a bool tensor (True = a real token), got "
                            f"{self.key_padding.dtype}")

    @classmethod
    def for_group(cls, layout: SequenceLayout, group=None, **masks) -> "SequenceShards":
        """This process's shards in ``group`` (default: the whole world)."""
        import torch.distributed as dist
        group = dist.group.WORLD if group is None else group
        world = dist.get_world_size(group)
        if world != layout.world_size:
            raise ValueError(f"the layout is for {layout.world_size} ranks, but the process "
                             f"group has {world}")
        return cls(layout, dist.get_rank(group), group, **masks)

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's rows of a whole-sequence tensor along ``dim``."""
        return self.layout.shard(tensor, self.rank, dim)

    def lay_out(self, tensor: torch.Tensor) -> None:
        """Claim ``tensor`` (a model input made of this rank's rows, e.g. its
        ``position_ids``) for these shards: a "tiled" call given it must attend over them
        (:func:`~hf_tiled_attention.layer_call.route_for`)."""
        claim(tensor, self)

    @torch.compiler.disable  # host work on ints: run eagerly, outside a compiled region
    def plan(self, causal: bool, window: Optional[int], device: torch.device) -> ExchangePlan:
        """The key exchange of a call with this rule (every layer with it shares one); counts
        the call in ``calls``."""
        self.calls += 1
        key = ("plan", causal, window, device)
        if key not in self._memo:
            doc_start = doc_end = None
            if self.document_ids is not None:
                doc_start, doc_end = document_bounds(self.document_ids.cpu())
            rule = KeyRule(causal, window, doc_start, doc_end)
            self._memo[key] = plan_exchange(self.layout, self.rank, rule).to(device)
        return self._memo[key]


def sharded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      shards: SequenceShards, *, is_causal: bool = False,
                      scale: Optional[float] = None, window: Optional[int] = None,
                      softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                      score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None,
                      return_lse: bool = False):
    """This rank's rows of attention over the whole sequence.

    ``query`` ``(B, Hq, L, D)``, ``key`` / ``value`` ``(B, Hkv, L, D)``: the rank's local rows
    (``L = shards.layout.local_len``, in the layout's local order, e.g. ``shards.shard(q, 2)``).
    The options are :func:`~hf_tiled_attention.tiled_attention`'s, in global coordinates:
    ``is_causal`` / ``window`` by global position, and the mods get global ``q_idx`` /
    ``kv_idx`` (0 .. S-1). Returns this rank's rows of the output ``(B, Hq, L, D)`` (and the
    fp32 LSE ``(B, Hq, L)`` with ``return_lse``). Every rank of the group must call it with the
    same options: it runs a collective."""
    check_inputs(query, key, value)
    check_options(is_causal, scale, window, softcap, None, return_lse)
    check_sinks(sinks, query)
    _check_local_rows(query, key, shards)
    plan = shards.plan(is_causal, window, query.device)
    keys, values = exchange_keys(key, value, plan, shards.group)
    out, lse = attend_runs(query, keys, values, shards, plan, is_causal=is_causal, scale=scale,
                           window=window, softcap=softcap, sinks=sinks, score_mod=score_mod,
                           mask_mod=mask_mod, return_lse=return_lse)
    return (out, lse) if return_lse else out


def _check_local_rows(query: torch.Tensor, key: torch.Tensor, shards: SequenceShards) -> None:
    if not isinstance(shards, SequenceShards):
        raise TypeError(f"shards must be a SequenceShards, got {type(shards).__name__}")
    local = shards.layout.local_len
    for name, tensor in (("query", query), ("key", key)):
        if tensor.shape[2] != local:
            raise ValueError(
                f"{name} has {tensor.shape[2]} positions, but rank {shards.rank}'s shard of the "
                f"{shards.layout.seq_len}-position sequence holds {local}: pass this rank's "
                "rows (shards.shard(tensor, dim=2))")
    for name, ids in (("document_ids", shards.document_ids),
                      ("key_padding", shards.key_padding)):
        if ids is not None and ids.shape[0] not in (1, query.shape[0]):
            raise ValueError(f"shards.{name} has {ids.shape[0]} rows, the query batch "
                             f"{query.shape[0]}")


def attend_runs(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                shards: SequenceShards, plan: ExchangePlan, *, is_causal: bool,
                scale: Optional[float], window: Optional[int], softcap: Optional[float],
                sinks: Optional[torch.Tensor], score_mod: Optional[Callable],
                mask_mod: Optional[Callable], return_lse: bool):
    """The attention of this rank's query rows over its key buffer (``keys`` / ``values``
    ``(B, Hkv, buffer rows, D)``, as :func:`~hf_tiled_attention.key_exchange.exchange_keys`
    or, in one process playing the rank, ``gathered_keys`` make it): one op call per run.
    Returns ``(out, lse or None)``."""
    outs, lses = [], []
    for index, (run, (first, count, key_lo)) in enumerate(zip(shards.layout.runs(shards.rank),
                                                             plan.run_keys)):
        mask, mods = _run_masks(shards, index, run.start, key_lo, count, query, score_mod,
                                mask_mod, softcap)
        out, lse = attention(query.narrow(2, run.local_start, run.length),
                             keys.narrow(2, first, count), values.narrow(2, first, count), mask,
                             causal=is_causal, scale=scale, window=window, softcap=softcap,
                             diag_offset=run.start - key_lo, return_lse=return_lse, mods=mods,
                             sinks=sinks)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    # (B, S, H, D) in memory, as the op lays its output out (transformers' transpose is a view).
    out = torch.cat([o.transpose(1, 2) for o in outs], dim=1).transpose(1, 2)
    return out, (torch.cat(lses, dim=2) if return_lse else None)


@torch.compiler.disable  # translates mods: run eagerly, outside a compiled region
def _run_masks(shards: SequenceShards, index: int, query_start: int, key_start: int,
               key_count: int, query: torch.Tensor, score_mod, mask_mod, softcap):
    """A run's ``(attn_mask, mods)`` in global coordinates, made once per run and mods (the
    layers share them, and with them the op's block tables)."""
    memo_key = ("masks", index, key_start, key_count, query.shape[0], query.device,
                query.dtype == torch.float32, id(score_mod), id(mask_mod), softcap is None)
    entry = shards._memo.get(memo_key)
    if entry is None:
        # (the entry keeps the mods alive, so their ids in the key stay theirs)
        made = _global_masks(shards, query_start, key_start, key_count, query, score_mod,
                             mask_mod, softcap)
        entry = shards._memo[memo_key] = (made, score_mod, mask_mod)
    return entry[0]


def _global_masks(shards: SequenceShards, query_start: int, key_start: int, key_count: int,
                  query: torch.Tensor, score_mod, mask_mod, softcap):
    device, batch = query.device, query.shape[0]
    offsets = torch.tensor([query_start, key_start], dtype=torch.int32, device=device)
    parts = []
    if mask_mod is not None:
        user_mask = mask_mod

        def at_global_positions(b, h, q_idx, kv_idx):
            return user_mask(b, h, q_idx + offsets[0], kv_idx + offsets[1])
        parts.append(at_global_positions)
    padding = _batched(shards.key_padding, batch, device)
    if shards.document_ids is not None:
        query_docs = _batched(shards.document_ids, batch, device).to(torch.int32)
        key_docs = key_documents(query_docs, padding)
        parts.append(same_document(query_docs.contiguous(), key_docs.contiguous(), offsets))
    elif padding is not None and parts:
        padding = padding.contiguous()

        def real_key(b, h, q_idx, kv_idx):
            return padding[b, kv_idx + offsets[1]]
        parts.append(real_key)
    attn_mask = None
    if padding is not None and not parts:  # the kernel's key-vector mask
        attn_mask = padding[:, None, None, key_start:key_start + key_count]
    global_score = None
    if score_mod is not None:
        user_score = score_mod

        def global_score(score, b, h, q_idx, kv_idx):
            return user_score(score, b, h, q_idx + offsets[0], kv_idx + offsets[1])
    combined = None
    for part in parts:
        combined = part if combined is None else and_masks(combined, part)
    mods = None
    if global_score is not None or combined is not None:
        mods = checked_mods(global_score, combined, None, softcap, query)
    return attn_mask, mods


def _batched(tensor: Optional[torch.Tensor], batch: int, device) -> Optional[torch.Tensor]:
    if tensor is None:
        return None
    return tensor.to(device).expand(batch, -1)
