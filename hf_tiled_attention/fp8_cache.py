"""An FP8 (e4m3) KV cache for transformers' ``generate()``: :class:`Fp8DynamicCache` and
:class:`Fp8StaticCache`, read by "tiled" and "tiled_fp8" (fp8_cache_attention.py).

Each cached token of each head is one row of ``D + ROW_EXTRA`` bytes: its ``D`` values in e4m3,
then its fp32 scale (the row's largest magnitude / 448), then 12 unused bytes, so a row is a
whole number of 16-byte units (0.56x bf16's bytes at D = 128). A layer's keys (and its values) are
one ``uint8`` tensor ``(B, H, S, D + ROW_EXTRA)``: transformers' own layer code (``cat``,
``index_copy_``, sliding windows, beam reordering, ``crop``) runs on it unchanged, and the
caches only quantise the new states on their way in (:func:`quantize_rows`: one kernel launch
per tensor on a GPU, the same bits in torch elsewhere).

A value is rounded as ``x * (448 / amax)`` (the reciprocal in fp32, then one product, as the
kernel computes it) and read back as ``e4m3 * scale``. Keys are multiplied first by
:func:`key_rotation` (at head dims that are powers of two), a +-1 Hadamard matrix with random
signs: ``q . k`` is unchanged once the query is multiplied by it too, and the channels that
LLM keys concentrate their magnitude in spread over all of them (SmolLM2-135M on the CPU, fp32,
lcet10 in 2k windows: the FP8 cache's perplexity cost falls from +1.2% to +0.6%). Attention
then sees the rounded keys and values of every token, the current step's included
(:func:`keys_from_rows`, :func:`dequantize_rows`).

Imports transformers (the caches subclass its own); the package imports this module only where
transformers is installed.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from .kernel_params import AMAX_FLOOR, E4M3_MAX, SCALE_PER_AMAX
from .memo import memoize

__all__ = ["Fp8DynamicCache", "Fp8StaticCache", "dequantize_rows", "is_fp8_rows",
           "key_rotation", "keys_from_rows", "quantize_keys", "quantize_rows",
           "quantize_rows_torch", "rows_like", "split_rows"]

# Bytes after a row's values: its fp32 scale and 12 unused bytes (16-byte rows, for TMA loads;
# quantize_rows_torch writes them as zeros, the kernel leaves them).
ROW_EXTRA = 16
SCALE_BYTES = 4


def is_fp8_rows(tensor) -> bool:
    """Whether ``tensor`` holds an FP8 cache's rows (``uint8``, ``(..., D + ROW_EXTRA)``)."""
    return isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8


def row_head_dim(rows: torch.Tensor) -> int:
    """The head dim ``D`` of rows ``(..., D + ROW_EXTRA)``."""
    return rows.shape[-1] - ROW_EXTRA


def check_rows(rows: torch.Tensor, name: str) -> int:
    """The head dim of an FP8 cache's rows, or a ValueError naming ``name``."""
    dim = row_head_dim(rows)
    if rows.dim() != 4 or dim < 16 or dim % 16 or rows.stride(-1) != 1:
        raise ValueError(f"{name}: an FP8 cache's rows are uint8 (B, H, S, D + {ROW_EXTRA}) "
                         f"with D a multiple of 16 and contiguous rows, got shape "
                         f"{tuple(rows.shape)}, strides {rows.stride()}")
    return dim


def rows_like(states: torch.Tensor) -> torch.Tensor:
    """Uninitialised rows ``(..., D + ROW_EXTRA)`` ``uint8`` for states ``(..., D)``."""
    return torch.empty(*states.shape[:-1], states.shape[-1] + ROW_EXTRA, dtype=torch.uint8,
                       device=states.device)


def quantize_rows(states: torch.Tensor) -> torch.Tensor:
    """``states`` ``(B, H, S, D)`` (16-bit or fp32) as rows ``(B, H, S, D + ROW_EXTRA)``
    ``uint8``: on a GPU with the kernels, one launch of fp8_cache_kernel.quantize_tokens; else
    :func:`quantize_rows_torch` (the same bits)."""
    if states.dim() != 4 or states.shape[-1] % 16 or not states.is_floating_point():
        raise ValueError(f"FP8 cache: key/value states must be floating point (B, H, S, D) with "
                         f"D a multiple of 16, got {states.dtype} {tuple(states.shape)}")
    from .fp8_cache_attention import cache_kernels_run_on
    if states.is_cuda and states.dtype != torch.float32 and cache_kernels_run_on(states.device) \
            and not torch.compiler.is_compiling():
        from .fp8_cache_attention import quantize_on_device
        return quantize_on_device(states)
    return quantize_rows_torch(states)


def quantize_rows_torch(states: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_rows` in torch ops (fp32 math), the definition the kernel is tested
    against."""
    dim = states.shape[-1]
    x = states.float()
    amax = x.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    values = (x * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    rows = torch.zeros(*states.shape[:-1], dim + ROW_EXTRA, dtype=torch.uint8,
                       device=states.device)
    rows[..., :dim] = values.view(torch.uint8)
    # the scale written through the rows' fp32 view: a bit view of the (..., 1) scale itself
    # fails under inductor, which may give its last dim a stride other than 1
    rows.view(torch.float32)[..., dim // SCALE_BYTES] = amax.squeeze(-1) * SCALE_PER_AMAX
    return rows


@memoize(64)
def key_rotation(head_dim: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16) -> Optional[torch.Tensor]:
    """The ``(D, D)`` +-1 matrix ``S`` keys are multiplied by before rounding (fp8.py's
    rotation, unnormalised: exact in every float dtype; ``S S^T = D I``) in ``dtype``, or None
    at a head dim that is not a power of two (those keys are rounded as they are). Memoised: a
    decode step's layers take it without a cast."""
    if head_dim & (head_dim - 1):
        return None
    from .fp8 import rotation_signs
    return rotation_signs(head_dim, device).to(dtype)


def quantize_keys(states: torch.Tensor) -> torch.Tensor:
    """Key states ``(B, H, S, D)`` as rows: times :func:`key_rotation` (in their own dtype),
    then :func:`quantize_rows`."""
    signs = key_rotation(states.shape[-1], states.device, states.dtype)
    if signs is not None:
        states = states @ signs
    return quantize_rows(states)


def keys_from_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The keys :func:`quantize_keys`' rows hold, rotated back: ``rows S^T / D`` in fp32, then
    ``dtype``."""
    keys = dequantize_rows(rows, torch.float32)
    signs = key_rotation(keys.shape[-1], keys.device, torch.float32)
    if signs is not None:
        keys = keys @ signs.T / keys.shape[-1]
    return keys.to(dtype)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of rows ``(..., D + ROW_EXTRA)``: the e4m3 values ``(..., D)`` and the fp32
    scales ``(...)`` (no copies: what the decode kernel reads)."""
    dim = row_head_dim(rows)
    values = rows[..., :dim].view(torch.float8_e4m3fn)
    scales = rows[..., dim:dim + SCALE_BYTES].view(torch.float32)[..., 0]
    return values, scales


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as the ``(..., D)`` tensor they hold, ``e4m3 * scale`` in ``dtype``."""
    values, scales = split_rows(rows)
    return (values.float() * scales[..., None]).to(dtype)


# ---------------------------------------------------------------------------------------------
# The caches
# ---------------------------------------------------------------------------------------------

class _Fp8Rows:
    """Mixed in before a transformers cache layer class: new states become rows on their way
    in; everything else is the layer's own code on the rows."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if not is_fp8_rows(key_states):  # early_initialization's stand-ins: states' shapes
            key_states, value_states = rows_like(key_states), rows_like(value_states)
        super().lazy_initialization(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[-1] != value_states.shape[-1]:
            raise ValueError(
                f"FP8 cache: keys and values of different head dims ({key_states.shape[-1]} "
                f"and {value_states.shape[-1]}: multi-head latent attention, e.g. DeepSeek) "
                "are not supported; use transformers' DynamicCache or StaticCache with "
                "attn_implementation='tiled'")
        return super().update(quantize_keys(key_states), quantize_rows(value_states), *args,
                              **kwargs)


@memoize(64)
def _fp8_layer_class(base: type) -> type:
    return type(f"Fp8{base.__name__}", (_Fp8Rows, base),
                {"__doc__": f"transformers' {base.__name__} holding FP8 rows (fp8_cache.py)."})


def _fp8_layers(cache) -> None:
    """Turns a freshly made cache's key/value layers into their FP8 kind (linear-attention
    states and other layers stay as they are)."""
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, (DynamicLayer, StaticLayer)) and not isinstance(layer, _Fp8Rows):
            # the same object state under the mixed class (not yet initialised: no tensors)
            fp8_layer = object.__new__(_fp8_layer_class(type(layer)))
            fp8_layer.__dict__.update(layer.__dict__)
            cache.layers[index] = fp8_layer
    replicate = getattr(cache, "layer_class_to_replicate", None)
    if replicate is not None and not issubclass(replicate, _Fp8Rows):
        cache.layer_class_to_replicate = _fp8_layer_class(replicate)


def _check_config(config, cache: str) -> None:
    """A model config whose attention cannot read FP8 rows is refused (eager or sdpa would
    multiply the raw bytes)."""
    if config is None:
        return
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config
    implementation = getattr(text_config, "_attn_implementation", None)
    if not _reads_rows(implementation):
        raise ValueError(f"{cache}: the model's attn_implementation is {implementation!r}, "
                         "which cannot read an FP8 cache; load the model with "
                         "attn_implementation='tiled' or 'tiled_fp8' (or use transformers' "
                         "DynamicCache / StaticCache)")


def _reads_rows(implementation) -> bool:
    if not isinstance(implementation, str):
        return False
    from .fp8_backend import fp8_attention_forward
    from .transformers_backend import tiled_attention_forward
    return AttentionInterface().get(implementation) in (tiled_attention_forward,
                                                        fp8_attention_forward)


class Fp8DynamicCache(DynamicCache):
    """transformers' ``DynamicCache`` (sliding windows and hybrid layers as the config says)
    storing K/V as FP8 rows (module docstring). For models loaded with
    ``attn_implementation="tiled"`` or ``"tiled_fp8"``:
    ``model.generate(..., past_key_values=Fp8DynamicCache(config=model.config))``."""

    def __init__(self, config=None, offloading: bool = False,
                 offload_only_non_sliding: bool = False, **kwargs):
        if kwargs:  # (DynamicCache's ddp_cache_data would fill it with unquantised states)
            raise TypeError(f"Fp8DynamicCache takes config, offloading and "
                            f"offload_only_non_sliding, got {sorted(kwargs)}")
        _check_config(config, "Fp8DynamicCache")
        super().__init__(config=config, offloading=offloading,
                         offload_only_non_sliding=offload_only_non_sliding)
        _fp8_layers(self)


class Fp8StaticCache(StaticCache):
    """transformers' ``StaticCache`` (``max_cache_len`` tokens, hybrid layers as the config
    says; for torch.compile) storing K/V as FP8 rows (module docstring)."""

    def __init__(self, config, max_cache_len: int, offloading: bool = False,
                 offload_only_non_sliding: bool = True, **kwargs):
        _check_config(config, "Fp8StaticCache")
        super().__init__(config=config, max_cache_len=max_cache_len, offloading=offloading,
                         offload_only_non_sliding=offload_only_non_sliding, **kwargs)
        _fp8_layers(self)
