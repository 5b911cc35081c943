"""Continuous batching (``generate_batch``, ``ContinuousBatchingManager``) on the tiled kernels.

transformers 5.17 and 5.18 serve a model whose attention is ``X`` through the function registered
as ``"paged|X"`` (``switch_to_cb_friendly_attn`` renames it; a name with "paged|" already in it
is kept). So registering ``"paged|tiled"`` is the whole route there: a model loaded with
``attn_implementation="tiled"`` runs its continuous batching on :func:`paged_tiled_attention`.
That function gets the batch as one packed row (``cu_seq_lens_q/k``, a request's queries being
the last tokens of its keys), the new tokens' keys and values, and the paged cache with the
slots to write and read; it writes the new tokens into the cache and runs
:func:`hf_tiled_attention.varlen.varlen_attention` reading the cache in place (full-attention
layers) or the window of it that the cache gathers (sliding layers, whose ring buffer the new
tokens may overwrite).

transformers 5.19 and later (read in 5.19-5.25) admit only ``"paged|eager"``, ``"sdpa"`` and
names containing "flash" that load as FlashAttention or as a Hub kernel (the ``kernels``
package). The tiled kernels take that last door: :func:`flash_kernel` points ``kernels`` at
hub_kernel/ (``LOCAL_KERNELS``) and returns its name, ``"hf-tiled-attention/flash2-tiled"``,
which a model loads as its ``attn_implementation``; transformers then calls FlashAttention's
functions on it (flash_interface.py): decode-only steps of models whose layers are all full
attention through ``flash_attn_with_kvcache`` with its block table (the kernel reads the cache
in place), other steps through ``flash_attn_varlen_func`` with the cache gathered for the
call. A model class that
lists its own FlashAttention kernels (``_compatible_flash_implementations``: gpt-oss) is given
the first of those instead of any other flash name, so it has no such route.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

PAGED_PREFIX = "paged|"
# The Hub-kernel name of the tiled kernels, and the folder the `kernels` package loads for it.
# "flash" in it: transformers 5.19+'s continuous batching admits only such names; a "2" after
# it: 5.25 hands the block table of decode steps (flash_attn_with_kvcache) only to names that
# match r".*flash.*2" or 3, FlashAttention 2's and 3's (read in its continuous_batching/
# initialization.py), else it gathers the cache for every call.
FLASH_KERNEL = "hf-tiled-attention/flash2-tiled"
FLASH_KERNEL_DIR = Path(__file__).resolve().parent / "hub_kernel"
# The first transformers release whose continuous batching no longer looks up "paged|<name>".
FIRST_WITHOUT_PAGED_NAMES = (5, 19)


def transformers_version() -> tuple[int, int]:
    import transformers
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def serves_custom_attention() -> bool:
    """Whether the installed transformers' continuous batching looks up "paged|<name>"."""
    return transformers_version() < FIRST_WITHOUT_PAGED_NAMES


def flash_kernel() -> str:
    """``attn_implementation`` of the tiled kernels as a Hub kernel (transformers 5.19 and later
    serve continuous batching through it): adds ``FLASH_KERNEL=<hub_kernel/>`` to the
    ``LOCAL_KERNELS`` environment variable the ``kernels`` package reads, and returns the name.
    A process that does not import this package (``transformers serve``) gets the same from
    ``LOCAL_KERNELS="$(python -m hf_tiled_attention.hub_kernel)"``."""
    import importlib.util
    if importlib.util.find_spec("kernels") is None:
        raise ImportError("the tiled kernels load into transformers' FlashAttention route "
                          "through the `kernels` package: pip install kernels")
    entry = f"{FLASH_KERNEL}={FLASH_KERNEL_DIR}"
    entries = [e for e in os.environ.get("LOCAL_KERNELS", "").split(":") if e]
    if entry not in entries:
        os.environ["LOCAL_KERNELS"] = ":".join(entries + [entry])
    return FLASH_KERNEL


def register_paged(name: str) -> Optional[str]:
    """Registers :func:`paged_tiled_attention` as ``"paged|<name>"`` (no mask function: the
    packed row carries the requests' bounds). Returns the name, or None where the installed
    transformers has no such route."""
    if not serves_custom_attention():
        return None
    from transformers import AttentionInterface
    paged_name = PAGED_PREFIX + name
    AttentionInterface.register(paged_name, paged_tiled_attention)
    return paged_name


def check_serving(model) -> None:
    """Raises where continuous batching cannot run ``model`` on the tiled kernels: a
    transformers without the route, or a model whose attention needs what the packed-requests
    kernel does not compute. Call it before serving; :func:`paged_tiled_attention` calls it on
    its first layer too."""
    config = model.config if hasattr(model, "config") else model
    own_kernels = getattr(model, "_compatible_flash_implementations", None)
    if not serves_custom_attention() and own_kernels and FLASH_KERNEL not in own_kernels:
        import transformers
        raise RuntimeError(
            f"transformers {transformers.__version__} serves continuous batching only through "
            f"FlashAttention names, and gives {type(model).__name__} its own kernels "
            f"({own_kernels}) for any such name, so the tiled kernels cannot serve it here; "
            f"transformers 5.17 and 5.18 can (attn_implementation='tiled').")
    if not serves_custom_attention() and \
            getattr(config, "_attn_implementation", None) != FLASH_KERNEL:
        import transformers
        raise RuntimeError(
            f"transformers {transformers.__version__}'s continuous batching (generate_batch, "
            f"ContinuousBatchingManager, transformers serve) admits only 'paged|eager', 'sdpa' "
            f"and FlashAttention names, so it cannot run attn_implementation='tiled'. Load the "
            f"model with attn_implementation=hf_tiled_attention.flash_kernel() (the tiled "
            f"kernels as a Hub kernel, {FLASH_KERNEL!r}; needs `pip install kernels`), or use "
            f"transformers 5.17 or 5.18, which serve 'tiled' itself.")
    check_served_features(model)


def check_served_features(model) -> None:
    """Raises where ``model``'s attention (a model or its config) needs what the
    packed-requests kernel does not compute."""
    config = model.config if hasattr(model, "config") else model
    config = config.get_text_config()
    for attribute, feature in _UNSERVED_FEATURES:
        if getattr(config, attribute, None):
            raise ValueError(
                f"attn_implementation='tiled' cannot serve this model with continuous batching: "
                f"its attention uses {feature} (config.{attribute}), which the packed-requests "
                f"kernel does not compute. Serve it with attn_implementation='sdpa', or use "
                f"model.generate() with 'tiled'.")


# Config attributes naming an attention feature the packed-requests kernel lacks (the ordinary
# "tiled" path computes them all).
_UNSERVED_FEATURES = (
    ("attention_chunk_size", "chunked attention (Llama 4)"),
    ("use_bidirectional_attention", "bidirectional attention"),
    ("relative_attention_num_buckets", "a learned relative position bias (T5)"),
)


def _check_cache_head_dims(cache, key: torch.Tensor, value: torch.Tensor) -> None:
    """transformers 5.17-5.18's paged cache stores one head dim for keys and values; a model
    whose keys or values have their own (multi-head latent attention) cannot be cached there,
    whatever the attention (eager's requests fail too)."""
    cache_dim = cache.key_cache[0].shape[-1]
    if key.shape[-1] != cache_dim or value.shape[-1] != cache_dim:
        import transformers
        raise ValueError(
            f"transformers {transformers.__version__}'s continuous-batching cache holds "
            f"head_dim={cache_dim} per head for keys and values, but this model's keys have "
            f"{key.shape[-1]} and its values {value.shape[-1]} (multi-head latent attention), "
            f"so no attention implementation can be served here. Use model.generate() with "
            f"attn_implementation='tiled', or a newer transformers with "
            f"attn_implementation=hf_tiled_attention.flash_kernel().")


def paged_tiled_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask, scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry under ``"paged|tiled"`` (transformers 5.17-5.18's continuous
    batching): ``query`` ``(1, Hq, Tq, D)``, ``key``/``value`` ``(1, Hkv, Tq, D)`` the new
    tokens', ``cache`` the ``PagedAttentionCache``. Returns ``(out (1, Tq, Hq, D), None)``."""
    from .varlen import varlen_attention_on_pages

    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError("attn_implementation='paged|tiled' is continuous batching's name for "
                         "'tiled' and needs its paged cache; load the model with "
                         "attn_implementation='tiled' (generate_batch switches it).")
    if not getattr(module, "_tiled_serving_checked", False):  # once per layer
        check_serving(module.config)
        _check_cache_head_dims(cache, key, value)
        module._tiled_serving_checked = True
    if attention_mask is not None:
        raise ValueError("attn_implementation='tiled' serves continuous batching without a "
                         "mask (the packed row's cu_seq_lens carry the requests); got a "
                         f"{type(attention_mask).__name__} attention_mask")
    if kwargs.get("block_table") is not None:
        raise ValueError("attn_implementation='tiled' got a block table, which transformers "
                         "builds for FlashAttention's decode only")
    # The cache decides which layers slide (1: full attention) and keeps their keys apart.
    window = cache.sliding_windows[module.layer_idx]
    window = None if window == 1 else window
    cu_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):
        cu_k = cu_k["sliding_attention" if window else "full_attention"]
    cu_q = kwargs["cu_seq_lens_q"]
    max_q = kwargs["max_seqlen_q"]
    read_index, write_index = kwargs["read_index"], kwargs["write_index"]
    group, in_group = cache.layer_index_to_group_indices[module.layer_idx]

    if read_index[group].numel() and window is None:
        # A full-attention layer with cached keys: write the new tokens into their slots, then
        # read every key of the batch where it lies in the cache.
        k_cache, v_cache = cache.key_cache[in_group], cache.value_cache[in_group]
        k_cache.index_copy_(0, write_index[group], key[0].transpose(0, 1))
        v_cache.index_copy_(0, write_index[group], value[0].transpose(0, 1))
        keys, values, slots = k_cache, v_cache, read_index[group]
        # A full-attention layer's read indices are its requests' whole blocks, in order from
        # each request's first key (and only those: padding requests have no keys), so pages
        # of whole key tiles are read in one launch (varlen_attention_on_pages' key_pages).
        pages = cache.block_size
    else:
        # Nothing cached yet (the keys are the new tokens'), or a sliding layer (the cache
        # gathers its window with the new tokens before overwriting the oldest).
        keys, values = cache.update(key_states=key, value_states=value,
                                    layer_idx=module.layer_idx, read_index=read_index,
                                    write_index=write_index)
        slots = pages = None
    out = varlen_attention_on_pages(
        query[0].transpose(0, 1), keys, values, cu_q.to(torch.int32), cu_k.to(torch.int32),
        int(max_q), scale=scaling, window=window, softcap=kwargs.get("softcap") or None,
        sinks=kwargs.get("s_aux"), key_slots=slots, key_pages=pages)
    return out.unsqueeze(0), None
