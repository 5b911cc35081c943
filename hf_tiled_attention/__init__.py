"""hf-tiled-attention: scaled-dot-product attention in cuTile (CUDA Tile) kernels, forward and
backward, for PyTorch and transformers (``attn_implementation="tiled"``), with a schedule and
the attention itself (score_mod / mask_mod) edited from Python."""

import importlib.util as _importlib_util

from .batch_sharding import ShardedBatch, shard_batch
from .context_parallel import context_parallel  # (the function, over its module's name)
from .determinism import deterministic, set_deterministic
from .fp8 import fp8_attention
from .memo import cache_sizes, clear_caches
from .op import kernel_available, tiled_attention
from .schedule import Schedule, default_schedule, use_schedule
from .shard_layout import SequenceLayout
from .varlen import varlen_attention
from .sharded_attention import SequenceShards, sharded_attention

if _importlib_util.find_spec("transformers") is not None:
    # Registers attn_implementation="tiled" (attention + mask function) on import.
    from .fp8_backend import register_fp8
    from .fp8_cache import Fp8DynamicCache, Fp8StaticCache
    from .serving import check_serving, flash_kernel
    from .transformers_backend import register

    try:
        register()
        register_fp8()
    except Exception as _exc:  # an incompatible transformers must not break `import`
        import warnings as _warnings

        _warnings.warn(f"hf_tiled_attention: could not register the transformers backend: "
                       f"{_exc!r}", RuntimeWarning, stacklevel=2)
else:
    def register(name: str = "tiled") -> str:
        """Register the transformers backend (needs transformers >= 5.17)."""
        raise ImportError("hf_tiled_attention.register needs the `transformers` package")

__all__ = ["Schedule", "SequenceLayout", "SequenceShards", "ShardedBatch", "cache_sizes",
           "clear_caches", "context_parallel", "default_schedule", "deterministic", "fp8_attention",
           "kernel_available", "register", "set_deterministic", "shard_batch",
           "sharded_attention", "tiled_attention", "use_schedule", "varlen_attention"]
if _importlib_util.find_spec("transformers") is not None:
    __all__ += ["Fp8DynamicCache", "Fp8StaticCache", "check_serving", "flash_kernel"]
__version__ = "0.1.0"
