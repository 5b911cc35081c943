"""Argument checks for the op: every bad input gets an error naming the argument."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .schedule import Schedule

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


# Input signatures (shapes, dtypes, devices) already checked: a decode step's 32 layers, and a
# model's next forward, repeat them, and the checks cost more host time than a short kernel.
_checked: set = set()
_MAX_CHECKED = 4096


def check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    # Plain tensors in eager code only: a subclass (DTensor) always takes the full checks, and
    # traced code too (dynamo would guard on the set and recompile when it grows).
    plain = (type(query) is type(key) is type(value) is torch.Tensor
             and not torch.compiler.is_compiling())
    if plain:
        signature = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
                     query.device, key.device, value.device)
        if signature in _checked:
            return
    _check_inputs(query, key, value)
    if plain:
        if len(_checked) >= _MAX_CHECKED:
            _checked.clear()
        _checked.add(signature)


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            layout = "(B, Hq, Sq, D)" if name == "query" else "(B, Hkv, Skv, D)"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(tensor.shape)}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError("query, key and value must share one dtype, got "
                        f"{query.dtype}, {key.dtype}, {value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError("query, key and value must be on one device, got "
                         f"{query.device}, {key.device}, {value.device}")
    batch, heads_q, _, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape (B, Hkv, Skv, D), got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[0] != batch:
        raise ValueError(f"key/value batch size {key.shape[0]} does not match query's {batch}")
    if key.shape[3] != head_dim:
        raise ValueError(f"key/value head dim {key.shape[3]} does not match query's {head_dim}")
    heads_kv = key.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads "
                         f"({heads_kv}) for GQA/MQA")
    if head_dim % 8 != 0 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be a multiple of 8 from {MIN_HEAD_DIM} to "
                         f"{MAX_HEAD_DIM}, got {head_dim}")


def check_options(is_causal: bool, scale: Optional[float], window: Optional[int],
                  softcap: Optional[float], schedule: Optional[Schedule],
                  return_lse: bool) -> None:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {scale!r}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int or None, got {window!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {softcap!r}")
        if not (softcap > 0 and math.isfinite(softcap)):
            raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    if schedule is not None and not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a hf_tiled_attention.Schedule or None, got "
                        f"{type(schedule).__name__}")


def check_sinks(sinks: Optional[torch.Tensor], query: torch.Tensor) -> None:
    """Attention-sink logits: one per query head, floating point, on the query's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (Hq,) or None, got "
                        f"{type(sinks).__name__}")
    heads_q = query.shape[1]
    if sinks.shape != (heads_q,):
        raise ValueError(f"sinks must have shape (Hq,) = ({heads_q},), one logit per query "
                         f"head, got {tuple(sinks.shape)}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.device != query.device:
        raise ValueError(f"sinks must be on the query's device ({query.device}), got "
                         f"{sinks.device}")
