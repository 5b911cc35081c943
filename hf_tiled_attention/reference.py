"""Pure-PyTorch path: the kernels' tiled algorithms (forward online softmax, and the backward
that recomputes the probabilities from the saved LSE) with identical semantics.

Runs wherever the cuTile kernels cannot (CPU, GPUs without cuTile). Works chunk by chunk over
queries and keys in fp32, so memory stays O(chunk), never O(Sq x Skv); GQA is handled by grouping
query heads, never by repeating K/V. Chunks outside the causal/window range are skipped.
:func:`chunk_scores` is the one statement of what a score is (scale, softcap, score_mod, the
visibility rule and the mask); the forward and the backward both call it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .kernel_params import ADDITIVE_MASK
from .masks import CompactMask, ModMask
from .mods import index_grid
from .visibility import key_span, visible

QUERY_CHUNK = 256
KEY_CHUNK = 512


class _Call:
    """What every chunk of one call reads: shapes, options, the mask as grouped views."""

    def __init__(self, query, key, mask, causal, scale, window, softcap, diag_offset,
                 score_mod):
        self.batch, self.heads_q, self.seq_q, _ = query.shape
        self.heads_kv, self.seq_kv = key.shape[1], key.shape[2]
        self.group = self.heads_q // self.heads_kv
        self.device = query.device
        self.mask, self.causal, self.scale = mask, causal, scale
        self.window, self.softcap, self.diag_offset = window, softcap, diag_offset
        self.score_mod = score_mod
        self.mask_t = None
        if isinstance(mask, CompactMask):
            mask_t = mask.tensor
            self.mask_t = (mask_t.unflatten(1, (self.heads_kv, self.group)) if mask.headed
                           else mask_t.unsqueeze(2))  # (Bm, Hkv or 1, G or 1, Sm, Skv)

    def key_range(self, q0: int, q1: int) -> range:
        """Starts of the key chunks some of the queries q0 .. q1-1 see."""
        k_lo, k_hi, _, _ = key_span(q0 + self.diag_offset, q1 - 1 + self.diag_offset,
                                    self.seq_kv, self.window or 0, self.causal,
                                    self.window is not None)
        return range(k_lo, k_hi, KEY_CHUNK)


def chunk_scores(call: _Call, q: torch.Tensor, k: torch.Tensor, q0: int, q1: int, k0: int,
                 k1: int, score_mod=None) -> torch.Tensor:
    """The scores of query rows q0..q1-1 (``q`` (B, Hkv, G, cq, D) fp32) against keys k0..k1-1
    (``k`` (B, Hkv, 1, ck, D) fp32) as the softmax sees them: scaled, softcapped or modded,
    then hidden (-inf) where the visibility rule or the mask says so. Differentiable in q, k
    and whatever the score_mod reads. ``score_mod``: in place of the call's."""
    device = call.device
    score_mod = score_mod or call.score_mod
    s = torch.matmul(q, k.transpose(-1, -2)) * call.scale  # (B, Hkv, G, cq, ck)
    if call.softcap is not None:
        s = call.softcap * torch.tanh(s / call.softcap)
    if score_mod is not None or isinstance(call.mask, ModMask):
        b_idx, h_idx, q_idx, kv_idx = index_grid(
            call.batch, (call.heads_kv, call.group), torch.arange(q0, q1, device=device),
            torch.arange(k0, k1, device=device))
    if score_mod is not None:
        s = torch.broadcast_to(score_mod(s, b_idx, h_idx, q_idx, kv_idx), s.shape)
    pos = torch.arange(q0, q1, device=device)[:, None] + call.diag_offset
    cols = torch.arange(k0, k1, device=device)[None, :]
    s = s.masked_fill(~visible(pos, cols, call.seq_kv, call.window or 0, call.causal,
                               call.window is not None), -math.inf)
    if isinstance(call.mask, ModMask):
        s = s.masked_fill(~call.mask.mods.mask_mod(b_idx, h_idx, q_idx, kv_idx), -math.inf)
    if call.mask_t is not None:
        m = call.mask_t[..., k0:k1]
        if call.mask.per_row:
            m = m[..., q0:q1, :]
        if call.mask.kind == ADDITIVE_MASK:  # -inf hides the key, NaN score or not
            s = (s + m.float()).masked_fill(m == float("-inf"), -math.inf)
        else:
            s = s.masked_fill(m == 0, -math.inf)
    return s


def empty_output(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised ``(B, H, S, D)`` tensor laid out as ``(B, S, H, D)`` in memory: the
    layout of every output of the op (kernels, reference and fake alike), as SDPA's fused
    kernels return theirs. transformers' ``out.transpose(1, 2)`` is then contiguous with no copy,
    so the tensor the backward keeps is the one the output projection reads, not a second one."""
    # One allocation with those strides (not empty + transpose: a second op on a decode
    # call's host path).
    return torch.empty_strided(like.shape, output_strides(*like.shape), dtype=like.dtype,
                               device=like.device)


def output_strides(batch: int, heads: int, seq: int, head_dim: int) -> tuple:
    """The strides of :func:`empty_output`'s ``(B, H, S, D)`` tensor: ``(B, S, H, D)`` in memory."""
    return (seq * heads * head_dim, head_dim, heads * head_dim, 1)


def in_output_layout(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when laid out as :func:`empty_output` lays it out, else such a copy
    (a gradient reaching the output arrives in the output's layout unless something between
    reshaped it)."""
    if tensor.transpose(1, 2).is_contiguous():
        return tensor
    return empty_output(tensor).copy_(tensor)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: Optional[CompactMask], *, causal: bool, scale: float,
                        window: Optional[int], softcap: Optional[float], diag_offset: int,
                        score_mod=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out (B, Hq, Sq, D) in query's dtype, lse (B, Hq, Sq) fp32)``. ``mask`` may be
    a :class:`ModMask` (a mask_mod); ``score_mod`` changes the scaled scores before masking."""
    call = _Call(query, key, mask, causal, scale, window, softcap, diag_offset, score_mod)
    out = empty_output(query)
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    # Views grouped by kv head: (B, Hkv, G, S, D); no copies of K/V.
    grouped = (call.heads_kv, call.group)
    q_grouped, out_grouped = query.unflatten(1, grouped), out.unflatten(1, grouped)
    lse_grouped = lse.unflatten(1, grouped)

    for q0 in range(0, call.seq_q, QUERY_CHUNK):
        q1 = min(q0 + QUERY_CHUNK, call.seq_q)
        q = q_grouped[:, :, :, q0:q1].float()
        row_max = torch.full(q.shape[:-1] + (1,), -math.inf, device=query.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(q.shape, device=query.device)
        for k0 in call.key_range(q0, q1):
            k1 = min(k0 + KEY_CHUNK, call.seq_kv)
            k = key[:, :, k0:k1].float().unsqueeze(2)    # (B, Hkv, 1, ck, D)
            v = value[:, :, k0:k1].float().unsqueeze(2)
            s = chunk_scores(call, q, k, q0, q1, k0, k1)
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


def backward_rows(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  grad_lse: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the backward needs per query row, fp32 ``(B, Hq, Sq)``: ``delta`` =
    rowsum(dOut * Out) - dLse (the softmax's Jacobian term; a gradient reaching the LSE, e.g.
    through sinks, enters here), and the LSE with -inf (a row that saw no key) made +inf, so
    that its recomputed probabilities are exactly 0."""
    delta = (grad_out.float() * out.float()).sum(dim=-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    return delta, torch.where(lse == -math.inf, math.inf, lse)


def reference_attention_backward(
        grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, grad_lse: Optional[torch.Tensor],
        mask: Optional[CompactMask], *, causal: bool, scale: float, window: Optional[int],
        softcap: Optional[float], diag_offset: int, mods=None,
        learnable: Sequence[int] = (), mask_grad: bool = False) -> tuple:
    """Gradients of :func:`reference_attention`: ``(dq, dk, dv, d_mask, d_learnable)``, the
    first three in the inputs' dtypes; ``d_mask`` with ``mask_grad`` the fp32 gradient of an
    additive mask's compact tensor (the score gradient summed over the dims it broadcasts),
    else None; ``d_learnable`` the fp32 gradients of the captured tensors of
    ``mods`` (a :class:`~hf_tiled_attention.mods.CompiledMods`) at the slots ``learnable``,
    which its score_mod reads. The probabilities are recomputed chunk by chunk from the saved
    LSE (FlashAttention-2's backward); the derivative of the score itself (scale, softcap's
    tanh, the score_mod) is a vector-Jacobian product of :func:`chunk_scores` (``torch.func``,
    which works inside a custom op, where autograd is off), so every mod is differentiated
    exactly."""
    score_mod = None if mods is None else mods.score_mod
    call = _Call(query, key, mask, causal, scale, window, softcap, diag_offset, score_mod)
    grouped = (call.heads_kv, call.group)
    delta, lse_b = backward_rows(grad_out, out, lse, grad_lse)
    q_grouped, do_grouped = query.unflatten(1, grouped), grad_out.unflatten(1, grouped)
    delta_g, lse_g = delta.unflatten(1, grouped)[..., None], lse_b.unflatten(1, grouped)[..., None]
    dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    dk = torch.zeros(key.shape, dtype=torch.float32, device=query.device)
    dv = torch.zeros(key.shape, dtype=torch.float32, device=query.device)
    dq_grouped = dq.unflatten(1, grouped)
    learned = [mods.captures[slot] for slot in learnable]
    d_learnable = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in learned]
    d_mask = d_mask_grouped = None
    if mask_grad:
        d_mask = torch.zeros(mask.tensor.shape, dtype=torch.float32, device=query.device)
        d_mask_grouped = (d_mask.unflatten(1, grouped) if mask.headed
                          else d_mask.unsqueeze(2))  # as call.mask_t

    def scores(q, k, q0, q1, k0, k1, *tensors):
        if not tensors:
            return chunk_scores(call, q, k, q0, q1, k0, k1)
        captures = list(mods.captures)
        for slot, tensor in zip(learnable, tensors):
            captures[slot] = tensor
        twin = mods.module.score_mod_torch
        return chunk_scores(call, q, k, q0, q1, k0, k1,
                            score_mod=lambda *args: twin(*args, tuple(captures)))

    for q0 in range(0, call.seq_q, QUERY_CHUNK):
        q1 = min(q0 + QUERY_CHUNK, call.seq_q)
        q = q_grouped[:, :, :, q0:q1].float()
        do = do_grouped[:, :, :, q0:q1].float()
        rows_lse, rows_delta = lse_g[:, :, :, q0:q1], delta_g[:, :, :, q0:q1]
        for k0 in call.key_range(q0, q1):
            k1 = min(k0 + KEY_CHUNK, call.seq_kv)
            k = key[:, :, k0:k1].float().unsqueeze(2)    # (B, Hkv, 1, ck, D)
            v = value[:, :, k0:k1].float().unsqueeze(2)
            s, vjp = torch.func.vjp(
                lambda q, k, *tensors: scores(q, k, q0, q1, k0, k1, *tensors),
                q, k, *[t.float() for t in learned])
            p = torch.exp(s - rows_lse)                   # (B, Hkv, G, cq, ck)
            dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), do).sum(dim=2)
            d_scores = p * (torch.matmul(do, v.transpose(-1, -2)) - rows_delta)
            if mask_grad:  # the mask is added to the final scores: its gradient is theirs
                rows = d_mask_grouped[..., q0:q1, k0:k1] if mask.per_row \
                    else d_mask_grouped[..., k0:k1]
                rows += d_scores.sum_to_size(rows.shape)
            grads = vjp(d_scores)
            dq_grouped[:, :, :, q0:q1] += grads[0]
            dk[:, :, k0:k1] += grads[1].squeeze(2)
            for total, grad in zip(d_learnable, grads[2:]):
                total += grad
    return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), d_mask, d_learnable)
