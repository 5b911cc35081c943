"""Masks as the kernel reads them: a dense ``attn_mask`` or a ``mask_mod``, each with a block
table (per query tile x key tile: empty, partial, full; and per query tile the range of key
tiles that are not empty), shared by the kernel launcher and the reference path.

A dense mask broadcastable to ``(B, Hq, Sq, Skv)`` is kept in its compact form: a 4-D view whose
batch, head and query dims are either full or of size 1 (dims that were broadcast by ``expand``
have stride 0 and are narrowed to size 1, without copying). A mask_mod's table is computed on
the call's device from the mod itself, a few query tiles at a time: memory O(tiles), never
O(Sq x Skv).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from .documents import document_cells, same_document_key
from .kernel_params import (ADDITIVE_MASK, BOOL_MASK, MASK_MOD, NO_MASK, TILE_EMPTY, TILE_FULL,
                            TILE_PARTIAL)
from .memo import Memo, register as memo_register
from .mods import CompiledMods, index_grid

# A mask_mod's table is evaluated for this many query/key elements at a time.
MOD_TABLE_CHUNK = 1 << 22
# A mask_mod is evaluated once per shape, into cells of this many rows and keys (whether any
# of a cell is visible, whether all of it is); each block table whose tiles are multiples of
# the cell is pooled from them (a training step's forward and backward tables: one evaluation
# of the S x S mod instead of one per table).
MOD_CELL = 32


class BlockTable(NamedTuple):
    """``states`` (Bm, Hm, n_m, n_n) int8 TILE_EMPTY / TILE_PARTIAL / TILE_FULL; ``ranges``
    (Bm, Hm, n_m, 7) int32, per query tile (kernel_params.RANGE_* slots): its first non-empty
    key tile; the longest gap of empty tiles [start, end) after it and before the full run; the
    longest run of full tiles [start, end); one past its last non-empty tile. An empty gap or
    run has start == end (a run then sits at the end). The last slot is not the tile's own: in
    row r it is the row with the r-th longest walk (non-empty span less the gap).
    FlexAttention's BlockMask keeps the same in both directions; :meth:`transposed` gives the
    other one (per key tile, its query tiles), which a backward pass over key tiles walks."""
    states: torch.Tensor
    ranges: torch.Tensor

    def transposed(self) -> "BlockTable":
        """The table per key tile: ``states`` (Bm, Hm, n_n, n_m) and each key tile's ranges of
        query tiles."""
        states = self.states.transpose(-1, -2).contiguous()
        return BlockTable(states, tile_ranges(states))


def tile_ranges(states: torch.Tensor) -> torch.Tensor:
    """The :class:`BlockTable` ranges of a state table (kernel_params.RANGE_* slots)."""
    n = states.shape[-1]
    index = torch.arange(n, device=states.device, dtype=torch.int64)
    nonempty = states != TILE_EMPTY
    first = torch.where(nonempty, index, n).amin(dim=-1, keepdim=True)
    end = torch.where(nonempty, index + 1, 0).amax(dim=-1, keepdim=True)
    run_lo, run_hi = _longest_run(states == TILE_FULL, index, end)
    gap = (states == TILE_EMPTY) & (index >= first) & (index < run_lo)
    gap_lo, gap_hi = _longest_run(gap, index, first)
    walked = (end - first).clamp_min(0) - (gap_hi - gap_lo)
    longest_first = torch.sort(walked, dim=-2, descending=True, stable=True).indices
    return torch.cat([first, gap_lo, gap_hi, run_lo, run_hi, end, longest_first],
                     dim=-1).to(torch.int32).contiguous()


def _longest_run(member: torch.Tensor, index: torch.Tensor, where_none: torch.Tensor) -> tuple:
    """[start, end) of each row's longest run of True (the first on ties), or ``where_none``
    twice for a row without one."""
    # Length of the run ending at each position: distance to the last non-member before it.
    run = index - torch.where(member, -1, index).cummax(dim=-1).values
    longest, last = run.max(dim=-1, keepdim=True)
    hi = torch.where(longest > 0, last + 1, where_none)
    return hi - longest, hi


_FLOAT_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class CompactMask:
    """``tensor`` has shape ``(B or 1, Hq or 1, Sq or 1, Skv)``, bool or floating."""

    tensor: torch.Tensor
    kind: int  # BOOL_MASK or ADDITIVE_MASK
    # Tile-state tables made for this mask, by (tile_m, tile_n): a CompactMask that every layer
    # of a forward shares (the transformers adapter keeps one) builds each table once.
    state_tables: dict = field(default_factory=dict, compare=False, repr=False)

    def block_table(self, tile_m: int, tile_n: int, keep: bool = True,
                    transposed: bool = False) -> BlockTable:
        """The :class:`BlockTable` for these tiles (``transposed``: per key tile), kept for the
        next call when ``keep`` (the call may keep device memory:
        memo.may_keep_device_memory)."""
        return _memo_table(self.state_tables, (tile_m, tile_n),
                           lambda: _with_ranges(tile_states(self, tile_m, tile_n)), keep,
                           transposed)

    @property
    def trains(self) -> bool:
        """An additive mask whose tensor autograd tracks: the backward computes its gradient."""
        return (self.kind == ADDITIVE_MASK and self.tensor.requires_grad
                and torch.is_grad_enabled())

    @property
    def batched(self) -> bool:
        return self.tensor.shape[0] > 1

    @property
    def headed(self) -> bool:
        return self.tensor.shape[1] > 1

    @property
    def per_row(self) -> bool:
        return self.tensor.shape[2] > 1


def compact_mask(attn_mask: torch.Tensor, batch: int, heads_q: int, seq_q: int,
                 seq_kv: int) -> CompactMask:
    """Validate ``attn_mask`` against the call's shape and return its compact form."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype == torch.bool:
        kind = BOOL_MASK
    elif attn_mask.dtype in _FLOAT_MASK_DTYPES:
        kind = ADDITIVE_MASK
    else:
        raise TypeError("attn_mask must be bool (True = may attend) or an additive float mask "
                        f"(float16, bfloat16, float32), got {attn_mask.dtype}")
    if not 1 <= attn_mask.dim() <= 4:
        raise ValueError(f"attn_mask must have 1 to 4 dims broadcastable to (B, Hq, Sq, Skv) = "
                         f"{(batch, heads_q, seq_q, seq_kv)}, got shape {tuple(attn_mask.shape)}")
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)) \
        if attn_mask.dim() < 4 else attn_mask
    target = (batch, heads_q, seq_q, seq_kv)
    for dim, (have, want) in enumerate(zip(mask.shape, target)):
        if have not in (1, want):
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable "
                             f"to (B, Hq, Sq, Skv) = {target} (dim {dim - 4} is {have})")
    # Dims broadcast by expand(): keep one slice, no copy.
    for dim in range(3):
        if mask.shape[dim] > 1 and mask.stride(dim) == 0:
            mask = mask.narrow(dim, 0, 1)
    if mask.shape[3] != seq_kv or mask.stride(3) != 1:
        # Keys must be contiguous for tile loads; a key dim of size 1 is expanded (rare).
        mask = mask.expand(*mask.shape[:3], seq_kv).contiguous()
    return CompactMask(mask, kind)


# The CompactMask of each mask tensor passed to the op, held weakly by the tensor, with its
# version and the call's shape: a caller that passes the same unchanged mask again (every layer
# of a model) reuses its block tables. The entry is made from a detached alias, so it does not
# keep its key alive.
_compact_masks = WeakTensorKeyDictionary()
memo_register("compact masks", _compact_masks)


def reused_compact_mask(attn_mask: torch.Tensor, batch: int, heads_q: int, seq_q: int,
                        seq_kv: int) -> CompactMask:
    """:func:`compact_mask`, memoised per mask tensor while it is unchanged (eager calls). A
    mask that requires grad (and grad mode on) gets its compact view recorded by autograd, so
    its gradient reaches it, with the memoised one's tables."""
    if not isinstance(attn_mask, torch.Tensor) or torch.compiler.is_compiling():
        return compact_mask(attn_mask, batch, heads_q, seq_q, seq_kv)
    key = (attn_mask._version, batch, heads_q, seq_q, seq_kv)
    found = _compact_masks.get(attn_mask)
    if found is not None and found[0] == key:
        compact = found[1]
    else:
        compact = compact_mask(attn_mask.detach(), batch, heads_q, seq_q, seq_kv)
        _compact_masks[attn_mask] = (key, compact)
    if attn_mask.requires_grad and torch.is_grad_enabled():
        tracked = compact_mask(attn_mask, batch, heads_q, seq_q, seq_kv).tensor
        return replace(compact, tensor=tracked)  # (the same dict of tables)
    return compact


def tile_states(mask: CompactMask, tile_m: int, tile_n: int) -> torch.Tensor:
    """Per-(query tile, key tile) state for the kernel: 0 empty, 1 partial, 2 full.

    Shape ``(B or 1, Hq or 1, n_m or 1, n_n)`` int8. "Full" means every key is visible with a
    zero bias, so the kernel need not load that mask tile at all.
    """
    t = mask.tensor
    if mask.kind == BOOL_MASK:
        visible = t != 0
        zero_bias = visible
    else:
        visible = t != float("-inf")
        zero_bias = t == 0
    rows = tile_m if mask.per_row else 1
    pad_m = -t.shape[2] % rows
    pad_n = -t.shape[3] % tile_n

    def pool(x: torch.Tensor, pad_value: bool, reduce: str) -> torch.Tensor:
        x = F.pad(x.to(torch.int8), (0, pad_n, 0, pad_m), value=int(pad_value))
        b, h, s, k = x.shape
        x = x.view(b, h, s // rows, rows, k // tile_n, tile_n)
        return x.amax(dim=(3, 5)) if reduce == "any" else x.amin(dim=(3, 5))

    return _states(pool(visible, False, "any").bool(), pool(zero_bias, True, "all").bool())


def _states(any_visible: torch.Tensor, all_full: torch.Tensor) -> torch.Tensor:
    """Per-tile TILE_FULL / TILE_PARTIAL / TILE_EMPTY from whether all / any of it is visible."""
    states = torch.where(all_full, TILE_FULL, torch.where(any_visible, TILE_PARTIAL, TILE_EMPTY))
    return states.to(torch.int8).contiguous()


def _with_ranges(states: torch.Tensor) -> BlockTable:
    return BlockTable(states, tile_ranges(states))


def _memo_table(tables: dict, key, build, keep: bool, transposed: bool = False) -> BlockTable:
    """The table under ``key`` in ``tables``, or its transpose (kept under its own key)."""
    if transposed:
        return _memo_table(tables, key + ("transposed",),
                           lambda: _memo_table(tables, key, build, keep).transposed(), keep)
    table = tables.get(key)
    if table is None:
        table = build()
        if keep:
            tables[key] = table
    return table


@dataclass(eq=False)
class ModMask:
    """A call's mask_mod for one (B, Hq, Sq, Skv): its dependence on the batch and head (found
    by evaluating it once on a few indices) and its block tables by tile shape, memoised, so
    every layer of a forward with the same mod and shape shares them (see :func:`mod_mask`)."""
    mods: CompiledMods
    batch: int
    heads: int
    seq_q: int
    seq_kv: int
    device: torch.device
    batched: bool = False
    headed: bool = False
    state_tables: dict = field(default_factory=dict, repr=False)
    kind: int = MASK_MOD
    per_row: bool = True

    def __post_init__(self):
        rows = torch.arange(min(self.seq_q, 2), device=self.device)
        cols = torch.arange(min(self.seq_kv, 2), device=self.device)
        probe = self.evaluate(rows, cols)
        self.batched = probe.shape[0] > 1
        self.headed = probe.shape[1] > 1

    def evaluate(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The mask_mod on these query rows and keys: bool ``(B or 1, H or 1, rows, cols)``."""
        b, h, q_idx, kv_idx = index_grid(self.batch, (self.heads,), rows, cols)
        visible = torch.as_tensor(self.mods.mask_mod(b, h, q_idx, kv_idx), device=self.device)
        if visible.dtype != torch.bool:
            raise TypeError(f"mask_mod must return a bool tensor, got {visible.dtype}")
        visible = visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))
        shape = [visible.shape[0], visible.shape[1], len(rows), len(cols)]
        return visible.expand(shape)

    def block_table(self, tile_m: int, tile_n: int, keep: bool = True,
                    transposed: bool = False) -> BlockTable:
        return _memo_table(self.state_tables, (tile_m, tile_n),
                           lambda: self._table(tile_m, tile_n, keep), keep, transposed)

    def _table(self, tile_m: int, tile_n: int, keep: bool) -> BlockTable:
        if tile_m % MOD_CELL or tile_n % MOD_CELL:
            cells = self.cells(tile_m, tile_n)
        else:
            cells = _pooled(_memo_table(self.state_tables, ("cells",),
                                        lambda: self.cells(MOD_CELL, MOD_CELL), keep),
                            tile_m // MOD_CELL, tile_n // MOD_CELL)
        return _with_ranges(_states(*cells))

    def cells(self, rows_per: int, keys_per: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(any visible, all visible) per cell of ``rows_per`` x ``keys_per``, bool ``(B or 1,
        H or 1, cells down, cells across)``, from the mask_mod on every element (packed
        documents' rule, from its ids' bounds per cell: documents.document_cells)."""
        if self.mods.key == same_document_key():
            query_ids, key_ids = self.mods.captures
            return document_cells(query_ids[:, :self.seq_q], key_ids[:, :self.seq_kv],
                                  rows_per, keys_per)
        n_m, n_n = -(-self.seq_q // rows_per), -(-self.seq_kv // keys_per)
        cols = torch.arange(n_n * keys_per, device=self.device)
        cells_per_chunk = max(1, MOD_TABLE_CHUNK // (rows_per * n_n * keys_per))
        any_parts, all_parts = [], []
        for m0 in range(0, n_m, cells_per_chunk):
            m1 = min(m0 + cells_per_chunk, n_m)
            rows = torch.arange(m0 * rows_per, m1 * rows_per, device=self.device)
            # Rows and keys past the ends (tile padding) are evaluated at the last ones, so a
            # mod's indexing stays in bounds, and count as visible for "full", hidden for "any".
            visible = self.evaluate(rows.clamp(max=self.seq_q - 1),
                                    cols.clamp(max=self.seq_kv - 1))
            inside = (rows < self.seq_q)[:, None] & (cols < self.seq_kv)[None, :]
            cells = (visible.shape[0], visible.shape[1], m1 - m0, rows_per, n_n, keys_per)
            any_parts.append((visible & inside).reshape(cells).any(dim=5).any(dim=3))
            all_parts.append((visible | ~inside).reshape(cells).all(dim=5).all(dim=3))
        return torch.cat(any_parts, dim=2), torch.cat(all_parts, dim=2)


def _pooled(cells: tuple[torch.Tensor, torch.Tensor], down: int, across: int) -> tuple:
    """:meth:`ModMask.cells`' (any, all) merged ``down`` x ``across`` cells at a time, the last
    ones padded as a tile's padding counts (hidden for "any", visible for "all")."""
    merged = []
    for values, reduce, pad in ((cells[0], torch.Tensor.any, False),
                                (cells[1], torch.Tensor.all, True)):
        values = F.pad(values, (0, -values.shape[3] % across, 0, -values.shape[2] % down),
                       value=pad)
        b, h, m, n = values.shape
        merged.append(reduce(reduce(values.view(b, h, m // down, down, n // across, across),
                                    dim=5), dim=3))
    return tuple(merged)


# ModMasks by (mods, captured tensors' identity and version, shape, device): the layers of a
# forward (and repeated forwards) share one and its tables. Each holds its mods (and so its
# function and captured tensors), which keeps the ids in its key unique.
_mod_masks = Memo("mask_mod block tables", 64)


def mod_mask(mods: CompiledMods, batch: int, heads: int, seq_q: int, seq_kv: int,
             device: torch.device, keep: bool = True) -> ModMask:
    """The :class:`ModMask` of these mods and shape; shared while ``keep`` (the call may keep
    device memory: memo.may_keep_device_memory)."""
    # (Not the mod function: ``mods.mask_mod`` is a fresh twin per access, and the registered
    # ops rebuild their CompiledMods per call; the generated code and what it reads decide.)
    key = (mods.key, tuple((id(t), t._version) for t in mods.captures), batch, heads, seq_q,
           seq_kv, device)
    return _mod_masks.get_or_make(key, lambda: ModMask(mods, batch, heads, seq_q, seq_kv,
                                                       device), keep)


class MaskLayout(NamedTuple):
    """What the kernels' constants (and so a launch plan) depend on of a call's mask: its kind,
    its tensor's dtype (None for a mask_mod), and which of its batch, head and query dims are
    full."""
    kind: int
    dtype: Optional[torch.dtype]
    batched: bool
    headed: bool
    per_row: bool


NO_MASK_LAYOUT = MaskLayout(NO_MASK, None, False, False, False)


def mask_layout(mask: Union[CompactMask, ModMask, None]) -> Optional[MaskLayout]:
    """The :class:`MaskLayout` of the mask the kernels read, or None."""
    if mask is None:
        return None
    dtype = None if isinstance(mask, ModMask) else mask.tensor.dtype
    # (tuple.__new__: the NamedTuple's own constructor is a Python function, and this runs on
    # every call)
    return tuple.__new__(MaskLayout, (mask.kind, dtype, mask.batched, mask.headed, mask.per_row))


def kernel_mask_dtype(dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype the kernels read a mask tensor of ``dtype`` as: bool as uint8 (the same
    bytes)."""
    return torch.uint8 if dtype == torch.bool else dtype
