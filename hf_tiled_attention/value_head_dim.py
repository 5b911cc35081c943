"""Values with a head dim of their own: multi-head latent attention (DeepSeek V2/V3, Kimi K2,
GLM-4.7-Flash, LongCat-Flash; queries and keys of 192 dims against values of 128) and models
whose values are wider than their keys (MiMo-V2-Flash).

The kernels take one head dim for queries, keys and values. The narrower side gets zero
columns up to the wider one's: zeros add nothing to a query-key product, and a zero value
column gives a zero output column, which is sliced off. The results are the unpadded
definition's exactly (the default scale stays ``1 / sqrt`` of the query's own head dim). The
cost is the padded copy and the wider MMA: for DeepSeek-V3's 192 / 128, values are read at
1.5x their size (transformers' FlashAttention path pads the same way).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["differs", "padded_to_one_head_dim"]


def differs(query, key, value) -> bool:
    """Whether ``value``'s head dim differs from ``query``'s and ``key``'s while every other
    dim agrees (other mismatches are left to checks.check_inputs to name)."""
    return (all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value))
            and key.shape[:-1] == value.shape[:-1] and query.shape[-1] == key.shape[-1]
            and value.shape[-1] != key.shape[-1])


def padded_to_one_head_dim(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           scale: Optional[float]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int]:
    """``(query, key, value, scale, value_dim)``: the three at the wider head dim (zero columns
    appended to the narrower side; differentiable), the score scale (``scale``, or ``1 /
    sqrt`` of the query's own head dim), and the value head dim the output is sliced to."""
    qk_dim, value_dim = key.shape[-1], value.shape[-1]
    if scale is None:
        scale = qk_dim ** -0.5
    if value_dim < qk_dim:
        value = torch.nn.functional.pad(value, (0, qk_dim - value_dim))
    else:
        query = torch.nn.functional.pad(query, (0, value_dim - qk_dim))
        key = torch.nn.functional.pad(key, (0, value_dim - qk_dim))
    return query, key, value, scale, value_dim
