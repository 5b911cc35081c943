"""The tiled kernels behind FlashAttention's function interface (``flash_attn_func``,
``flash_attn_varlen_func``), for transformers' Hub-kernel route (hub_kernel/, serving.py):
transformers 5.19 and later serve continuous batching only through FlashAttention names, and
call a kernel loaded that way through these two functions.

What FlashAttention computes and these do not (dropout, bidirectional packed rows, a right
window that differs from the left one under causal) is an error naming the argument."""

from __future__ import annotations

from typing import Optional

import torch

from . import varlen
from .op import tiled_attention


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    s_aux: Optional[torch.Tensor] = None, deterministic: bool = False
                    ) -> torch.Tensor:
    """Batched attention: q ``(B, Sq, Hq, D)``, k/v ``(B, Skv, Hkv, D)``; returns ``(B, Sq,
    Hq, D)``. Causal is aligned at the end (query ``i`` sees keys up to ``i + Skv - Sq``)."""
    _no_dropout(dropout_p)
    out = tiled_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          is_causal=causal, scale=softmax_scale,
                          window=_window(window_size, causal), softcap=softcap or None,
                          sinks=s_aux)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q, max_seqlen_k=None, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           s_aux: Optional[torch.Tensor] = None, deterministic: bool = False
                           ) -> torch.Tensor:
    """Packed requests: q ``(Tq, Hq, D)``, k/v ``(Tk, Hkv, D)``, cumulative lengths ``(R + 1,)``;
    returns ``(Tq, Hq, D)`` (:func:`hf_tiled_attention.varlen_attention`, forward only)."""
    _no_dropout(dropout_p)
    if not causal:
        raise ValueError("flash_attn_varlen_func on the tiled kernels is causal only (causal="
                         "False: bidirectional packed rows); use attn_implementation='tiled' "
                         "for such a model")
    if isinstance(max_seqlen_q, torch.Tensor):
        max_seqlen_q = int(max_seqlen_q)
    return varlen.varlen_attention(
        q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_seqlen_q),
        scale=softmax_scale, window=_window(window_size, causal), softcap=softcap or None,
        sinks=s_aux)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise ValueError(f"the tiled kernels have no attention dropout (dropout_p={dropout_p}); "
                         "set the model's attention dropout to 0 or call model.eval()")


def _window(window_size, causal: bool) -> Optional[int]:
    """FlashAttention's (left, right) window as the kernels' ``window`` (keys seen back from a
    query, itself included); -1 is unbounded."""
    left, right = (int(w) for w in window_size)
    if left < 0 and right < 0:
        return None
    if causal or left == right:  # under causal the right side sees nothing anyway
        if left < 0:
            return None
        return left + 1
    raise ValueError(f"window_size={tuple(window_size)}: the tiled kernels take one window for "
                     "both sides (or causal with any right side)")
