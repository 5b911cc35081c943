"""Dense ``attn_mask`` handling shared by the kernel launcher and the reference path.

A mask broadcastable to ``(B, Hq, Sq, Skv)`` is kept in its compact form: a 4-D view whose batch,
head and query dims are either full or of size 1 (dims that were broadcast by ``expand`` have
stride 0 and are narrowed to size 1, without copying).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

BOOL = 1
ADDITIVE = 2

_FLOAT_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class CompactMask:
    """``tensor`` has shape ``(B or 1, Hq or 1, Sq or 1, Skv)``, bool or floating."""

    tensor: torch.Tensor
    kind: int  # BOOL or ADDITIVE
    # Tile-state tables made for this mask, by (tile_m, tile_n): a CompactMask that every layer
    # of a forward shares (the transformers adapter keeps one) builds each table once.
    state_tables: dict = field(default_factory=dict, compare=False, repr=False)

    def states(self, tile_m: int, tile_n: int) -> torch.Tensor:
        """:func:`tile_states` for these tiles, memoised (except while a CUDA graph is being
        captured: a table made then lives in the graph's private memory pool)."""
        table = self.state_tables.get((tile_m, tile_n))
        if table is None:
            table = tile_states(self, tile_m, tile_n)
            if not (table.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.state_tables[(tile_m, tile_n)] = table
        return table

    @property
    def layout(self) -> tuple:
        """What a kernel plan depends on: kind, dtype and which dims are full."""
        return (self.kind, self.tensor.dtype, self.batched, self.headed, self.per_row)

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
        kind = BOOL
    elif attn_mask.dtype in _FLOAT_MASK_DTYPES:
        kind = ADDITIVE
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


def tile_states(mask: CompactMask, tile_m: int, tile_n: int) -> torch.Tensor:
    """Per-(query tile, key tile) state for the kernel: 0 empty, 1 partial, 2 full.

    Shape ``(B or 1, Hq or 1, n_m or 1, n_n)`` int8. "Full" means every key is visible with a
    zero bias, so the kernel need not load that mask tile at all.
    """
    t = mask.tensor
    if mask.kind == BOOL:
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

    any_visible = pool(visible, False, "any").bool()
    all_full = pool(zero_bias, True, "all").bool()
    states = torch.where(all_full, 2, torch.where(any_visible, 1, 0))
    return states.to(torch.int8).contiguous()
