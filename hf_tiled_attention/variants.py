"""Ready-made attention variants as FlexAttention-style mods for ``tiled_attention``.

Each returns a ``score_mod(score, b, h, q_idx, kv_idx)`` or a ``mask_mod(b, h, q_idx, kv_idx)``
(see :mod:`hf_tiled_attention.mods`); combine masks with :func:`and_masks` / :func:`or_masks`.

    out = tiled_attention(q, k, v, score_mod=alibi(alibi_slopes(32)), mask_mod=causal_mask)

``q_idx`` is the query row and ``kv_idx`` the key, both from 0: for a query that continues a
cache (decode) the causal variants need ``is_causal=True`` instead, or an offset in the mod.
"""

from __future__ import annotations

import math

import torch

from .documents import documents_from_cu_seq_lens


def causal_mask(b, h, q_idx, kv_idx):
    """Query row i sees keys 0..i."""
    return q_idx >= kv_idx


def and_masks(first, second):
    """Visible where both masks are."""
    def mask_mod(b, h, q_idx, kv_idx):
        return first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)
    return mask_mod


def or_masks(first, second):
    """Visible where either mask is."""
    def mask_mod(b, h, q_idx, kv_idx):
        return first(b, h, q_idx, kv_idx) | second(b, h, q_idx, kv_idx)
    return mask_mod


def sliding_window(window: int):
    """Causal, and at most ``window`` keys back (the query's own key included)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return mask_mod


def sliding_window_with_sinks(window: int, sinks: int):
    """StreamingLLM: a causal sliding window plus the first ``sinks`` keys, always."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx < window) | (kv_idx < sinks))
    return mask_mod


def chunked_attention(chunk: int):
    """Llama 4: causal within chunks of ``chunk`` tokens, nothing across them."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // chunk == kv_idx // chunk)
    return mask_mod


def prefix_lm(prefix_lengths):
    """Bidirectional over the prefix, causal after it: ``prefix_lengths`` is one int (the same
    prefix for every row) or a ``(B,)`` integer tensor (each row's own)."""
    if isinstance(prefix_lengths, int) and not isinstance(prefix_lengths, bool):
        if prefix_lengths < 0:
            raise ValueError(f"prefix_lengths must be >= 0, got {prefix_lengths}")
        length = prefix_lengths

        def same_prefix(b, h, q_idx, kv_idx):
            return (kv_idx < length) | (q_idx >= kv_idx)
        return same_prefix
    if not (isinstance(prefix_lengths, torch.Tensor) and prefix_lengths.dim() == 1
            and not prefix_lengths.is_floating_point() and prefix_lengths.dtype != torch.bool):
        raise TypeError("prefix_lengths must be an int or a (B,) integer tensor, got "
                        f"{type(prefix_lengths).__name__}"
                        + (f" of shape {tuple(prefix_lengths.shape)} and dtype "
                           f"{prefix_lengths.dtype}" if isinstance(prefix_lengths, torch.Tensor)
                           else ""))
    prefix = prefix_lengths.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)
    return mask_mod


def document_mask(document_ids: torch.Tensor, causal: bool = True):
    """Packed sequences: a token sees only its own document (``document_ids`` (B, S) or (S,):
    the document of each position; queries and keys share positions), causally by default."""
    ids = document_ids.to(torch.int32)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] == 1:
        def same_document(b, h, q_idx, kv_idx):
            return ids[0, q_idx] == ids[0, kv_idx]
    else:
        def same_document(b, h, q_idx, kv_idx):
            return ids[b, q_idx] == ids[b, kv_idx]
    return and_masks(causal_mask, same_document) if causal else same_document


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Document id per position from cumulative lengths ``[0, l0, l0 + l1, ...]``."""
    return documents_from_cu_seq_lens(cu_seqlens, int(cu_seqlens[-1]))[0][0]


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.): a geometric sequence, extended for heads that
    are not a power of two."""
    def powers(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]
    base = 2 ** math.floor(math.log2(heads))
    slopes = powers(base) + powers(2 * base)[0::2][:heads - base]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes: torch.Tensor):
    """ALiBi: a linear penalty on distance, ``slopes[h] * (kv_idx - q_idx)``."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return score_mod


def relative_position_buckets(seq_q: int, seq_kv: int, num_buckets: int = 32,
                              max_distance: int = 128, bidirectional: bool = True
                              ) -> torch.Tensor:
    """T5's bucket of each relative position ``kv_idx - q_idx``, as a table indexed by
    ``kv_idx - q_idx + seq_q - 1`` (int32, length ``seq_q + seq_kv - 1``)."""
    relative = torch.arange(-(seq_q - 1), seq_kv)
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    far = exact + (torch.log(distance.float().clamp(min=1) / exact)
                   / math.log(max_distance / exact) * (num_buckets - exact)).long()
    buckets += torch.where(distance < exact, distance, far.clamp(max=num_buckets - 1))
    return buckets.to(torch.int32)


def relative_position_bias(bias: torch.Tensor, buckets: torch.Tensor, seq_q: int):
    """T5-style bias: ``bias[buckets[kv_idx - q_idx + seq_q - 1], h]`` (``bias`` (num_buckets,
    H), e.g. T5's relative_attention_bias weight; ``buckets`` from
    :func:`relative_position_buckets`)."""
    offset = seq_q - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[buckets[kv_idx - q_idx + offset], h]
    return score_mod


def softcap(cap: float):
    """Gemma 2's tanh softcap, ``cap * tanh(score / cap)``, as a score_mod."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score_mod
