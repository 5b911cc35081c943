"""The tiled kernels as a transformers Hub kernel: the `kernels` package loads this folder (its
``metadata.json`` names it) when ``LOCAL_KERNELS`` maps ``hf-tiled-attention/flash2-tiled``
here (serving.flash_kernel), and transformers calls FlashAttention's functions on it."""

from hf_tiled_attention.flash_interface import (flash_attn_func, flash_attn_varlen_func,
                                                flash_attn_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
