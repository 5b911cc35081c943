"""Pure-PyTorch path: the kernel's tiled online-softmax algorithm with identical semantics.

Runs wherever the cuTile kernel cannot (CPU, GPUs without cuTile). Works chunk by chunk over
queries and keys in fp32, so memory stays O(chunk), never O(Sq x Skv); GQA is handled by grouping
query heads, never by repeating K/V. Chunks outside the causal/window range are skipped.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .kernel_params import ADDITIVE_MASK
from .masks import CompactMask, ModMask
from .mods import index_grid
from .visibility import key_span, visible

QUERY_CHUNK = 256
KEY_CHUNK = 512


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: Optional[CompactMask], *, causal: bool, scale: float,
                        window: Optional[int], softcap: Optional[float], diag_offset: int,
                        score_mod=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out (B, Hq, Sq, D) in query's dtype, lse (B, Hq, Sq) fp32)``. ``mask`` may be
    a :class:`ModMask` (a mask_mod); ``score_mod`` changes the scaled scores before masking."""
    batch, heads_q, seq_q, head_dim = query.shape
    heads_kv, seq_kv = key.shape[1], key.shape[2]
    group = heads_q // heads_kv
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=query.device)
    # Views grouped by kv head: (B, Hkv, G, S, D); no copies of K/V.
    q_grouped = query.unflatten(1, (heads_kv, group))
    out_grouped = out.unflatten(1, (heads_kv, group))
    lse_grouped = lse.unflatten(1, (heads_kv, group))
    mask_t = None
    if isinstance(mask, CompactMask):
        mask_t = mask.tensor
        if mask.headed:
            mask_t = mask_t.unflatten(1, (heads_kv, group))
        else:
            mask_t = mask_t.unsqueeze(2)  # (Bm, 1, 1, Sm, Skv)

    for q0 in range(0, seq_q, QUERY_CHUNK):
        q1 = min(q0 + QUERY_CHUNK, seq_q)
        q = q_grouped[:, :, :, q0:q1].float()
        pos = torch.arange(q0, q1, device=query.device)[:, None] + diag_offset  # (cq, 1)
        k_lo, k_hi, _, _ = key_span(q0 + diag_offset, q1 - 1 + diag_offset, seq_kv,
                                    window or 0, causal, window is not None)
        row_max = torch.full(q.shape[:-1] + (1,), -math.inf, device=query.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(q.shape, device=query.device)
        for k0 in range(k_lo, k_hi, KEY_CHUNK):
            k1 = min(k0 + KEY_CHUNK, k_hi)
            k = key[:, :, k0:k1].float().unsqueeze(2)    # (B, Hkv, 1, ck, D)
            v = value[:, :, k0:k1].float().unsqueeze(2)
            s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hkv, G, cq, ck)
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if score_mod is not None or isinstance(mask, ModMask):
                b_idx, h_idx, q_idx, kv_idx = index_grid(
                    batch, (heads_kv, group), torch.arange(q0, q1, device=query.device),
                    torch.arange(k0, k1, device=query.device))
            if score_mod is not None:
                s = torch.broadcast_to(score_mod(s, b_idx, h_idx, q_idx, kv_idx), s.shape)
            cols = torch.arange(k0, k1, device=query.device)[None, :]
            s = s.masked_fill(~visible(pos, cols, seq_kv, window or 0, causal,
                                       window is not None), -math.inf)
            if isinstance(mask, ModMask):
                s = s.masked_fill(~mask.mods.mask_mod(b_idx, h_idx, q_idx, kv_idx), -math.inf)
            if mask_t is not None:
                m = mask_t[..., k0:k1]
                if mask.per_row:
                    m = m[..., q0:q1, :]
                if mask.kind == ADDITIVE_MASK:  # -inf hides the key, NaN score or not
                    s = (s + m.float()).masked_fill(m == float("-inf"), -math.inf)
                else:
                    s = s.masked_fill(m == 0, -math.inf)
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            shift = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
            p = torch.exp(s - shift)
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, v)
            row_max = new_max
        # Rows that saw no key: 0 and lse -inf. A NaN score or value (row_sum or acc NaN)
        # reaches the output, as in eager attention.
        empty = row_sum == 0
        safe_sum = torch.where(empty, torch.ones_like(row_sum), row_sum)
        out_grouped[:, :, :, q0:q1] = torch.where(empty, 0.0, acc / safe_sum).to(query.dtype)
        lse_grouped[:, :, :, q0:q1] = torch.where(
            empty, -math.inf, row_max + torch.log(safe_sum)).squeeze(-1)
    return out, lse
