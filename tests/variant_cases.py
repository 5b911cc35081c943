"""The variants library's cases, shared by the CPU tests (reference path) and the GPU tests
(kernel): each builds its mods for a shape, on a device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hf_tiled_attention import variants


@dataclass(frozen=True)
class VariantCase:
    name: str
    build: Callable  # (batch, heads_q, seq_q, seq_kv, device) -> dict of op kwargs
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 2
    seq_q: int = 200
    seq_kv: int = 200
    head_dim: int = 64


def _alibi(batch, heads, seq_q, seq_kv, device):
    return dict(score_mod=variants.alibi(variants.alibi_slopes(heads).to(device)),
                mask_mod=variants.causal_mask)


def _t5_bias(batch, heads, seq_q, seq_kv, device):
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(32, heads, generator=g).to(device)
    buckets = variants.relative_position_buckets(seq_q, seq_kv).to(device)
    return dict(score_mod=variants.relative_position_bias(bias, buckets, seq_q))


def _documents_packed(batch, heads, seq_q, seq_kv, device):
    cu = torch.tensor([0, 37, 38, 120, seq_kv], device=device)  # a 1-token document too
    return dict(mask_mod=variants.document_mask(variants.document_ids_from_cu_seqlens(cu)))


def _documents_per_row(batch, heads, seq_q, seq_kv, device):
    g = torch.Generator().manual_seed(2)
    ids = torch.sort(torch.randint(0, 5, (batch, seq_kv), generator=g), dim=1).values
    return dict(mask_mod=variants.document_mask(ids.to(device), causal=False))


def _prefix_lm(batch, heads, seq_q, seq_kv, device):
    return dict(mask_mod=variants.prefix_lm(torch.tensor([70, 3][:batch], device=device)))


def _sinks(batch, heads, seq_q, seq_kv, device):
    return dict(mask_mod=variants.sliding_window_with_sinks(48, 4))


def _chunked(batch, heads, seq_q, seq_kv, device):
    return dict(mask_mod=variants.chunked_attention(64))


def _softcap_causal(batch, heads, seq_q, seq_kv, device):
    return dict(score_mod=variants.softcap(5.0), is_causal=True)


def _hide_rows(b, h, q_idx, kv_idx):
    return q_idx % 7 != 3


def _empty_rows(batch, heads, seq_q, seq_kv, device):
    return dict(mask_mod=variants.and_masks(variants.causal_mask, _hide_rows))


def _head_dependent(batch, heads, seq_q, seq_kv, device):
    # Even heads causal, odd heads a window: a block table per head.
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((h % 2 == 0) | (q_idx - kv_idx < 16))
    return dict(mask_mod=mask_mod)


VARIANT_CASES = [
    VariantCase("alibi-causal", _alibi),
    VariantCase("t5-bias", _t5_bias, seq_q=130, seq_kv=200),
    VariantCase("documents-packed", _documents_packed, batch=1),
    VariantCase("documents-per-row", _documents_per_row),
    VariantCase("prefix-lm", _prefix_lm),
    VariantCase("sinks-window", _sinks, seq_q=300, seq_kv=300),
    VariantCase("chunked", _chunked, seq_q=300, seq_kv=300, heads_kv=1),
    VariantCase("softcap-causal", _softcap_causal, seq_q=90),
    VariantCase("empty-rows", _empty_rows),
    VariantCase("head-dependent", _head_dependent, heads_kv=4),
]


def make_variant_inputs(case: VariantCase, device, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rand(heads, seq):
        return torch.randn(case.batch, heads, seq, case.head_dim, generator=g).to(device, dtype)

    q, k, v = rand(case.heads_q, case.seq_q), rand(case.heads_kv, case.seq_kv), \
        rand(case.heads_kv, case.seq_kv)
    return q, k, v, case.build(case.batch, case.heads_q, case.seq_q, case.seq_kv, device)
