"""hf-tiled-attention: a cuTile (CUDA Tile) scaled-dot-product-attention forward kernel for
PyTorch, with a schedule you edit from Python."""

from .op import kernel_available, tiled_attention
from .schedule import Schedule, default_schedule, use_schedule

__all__ = ["Schedule", "default_schedule", "kernel_available", "tiled_attention", "use_schedule"]
__version__ = "0.1.0"
