"""``python -m hf_tiled_attention.hub_kernel``: the ``LOCAL_KERNELS`` entry that makes the
`kernels` package load this folder as ``hf-tiled-attention/flash2-tiled``, for a process that
does not import hf_tiled_attention itself (``transformers serve``)."""

from hf_tiled_attention.serving import FLASH_KERNEL, FLASH_KERNEL_DIR

print(f"{FLASH_KERNEL}={FLASH_KERNEL_DIR}")
