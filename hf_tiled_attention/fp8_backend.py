"""transformers integration of FP8 attention: ``attn_implementation="tiled_fp8"``.

Registered on import beside "tiled" (same mask function, so the adapter sees what masks each
call). A call is read as "tiled" reads it (layer_call.read_call); FP8 attention computes the
rule (causal, window, bottom-right aligned), softcap and sinks; a call that needs more (padded
or packed rows, a static cache's offset, a mask tensor, mods) is refused with the reason,
never computed without it. An FP8 cache's rows (fp8_cache.py) are read as "tiled" reads them.
Inference only: under autograd the call is an error that names
"tiled" for training.
"""

from __future__ import annotations

from typing import Optional

import torch

from .fp8 import fp8_attention
from .fp8_cache import is_fp8_rows
from .fp8_cache_attention import attend_cache_rows
from .layer_call import read_call

FP8_NAME = "tiled_fp8"


def register_fp8(name: str = FP8_NAME) -> str:
    """Register FP8 attention and "tiled"'s mask function under ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .transformers_mask import tiled_mask
    AttentionInterface.register(name, fp8_attention_forward)
    AttentionMaskInterface.register(name, tiled_mask)
    return name


def fp8_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask, scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: ``(out (B, Sq, Hq, D), None)``; ``key`` / ``value`` may be
    an FP8 cache's rows (fp8_cache_attention.py)."""
    if is_fp8_rows(key):
        return attend_cache_rows(fp8_attention_forward, module, query, key, value,
                                 attention_mask, scaling, dropout, kwargs)
    call = read_call(module, query, key, attention_mask, scaling, kwargs)
    needs = [what for what, present in (
        ("padded rows (a key padding mask)", call.mask is not None and not call.dense),
        ("a mask tensor", call.dense),
        ("packed documents (cu_seq_lens or restarting position_ids)",
         call.documents is not None),
        ("mask overlays (mask_mod)", call.mods is not None),
        ("a position bias", call.position_bias is not None),
        ("a static cache's offset (keys past the queries' positions)",
         call.diag_offset != key.shape[2] - query.shape[2]),
        ("attention weights (output_attentions)", bool(kwargs.get("output_attentions"))),
        ("dropout in training", bool(dropout) and module.training),
    ) if present]
    if needs:
        raise ValueError(f"attn_implementation='{FP8_NAME}' does not compute "
                         f"{', '.join(needs)}; use attn_implementation='tiled' (bf16) for "
                         "this call")
    out = fp8_attention(query, key, value, is_causal=call.causal, scale=call.scale,
                        window=call.window, softcap=call.softcap, sinks=call.sinks)
    return out.transpose(1, 2), None
