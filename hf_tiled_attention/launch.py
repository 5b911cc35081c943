"""Host side of the cuTile kernel: from a validated call to a launch.

:func:`plan_launch` turns a call into a :class:`LaunchPlan` (grid, runtime scalars and the
compile-time constants that pick a kernel variant). It reads only shapes and dtypes, so the CPU
tests use it on meta tensors to compile every variant the op can dispatch, without a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .masks import ADDITIVE, CompactMask, tile_states
from .schedule import Schedule, head_dim_tile

LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class LaunchPlan:
    grid: tuple[int, int, int]
    scalars: tuple[float, float, int, int]   # score_scale, softcap_out, diag_offset, window
    constants: tuple                          # the kernel's Constant parameters, in order
    occupancy: int
    num_ctas: int
    num_worker_warps: Optional[int]            # None: the compiler chooses
    dtype: torch.dtype
    mask_dtype: Optional[torch.dtype]          # as the kernel reads it: bool masks as uint8
    tile_m: int
    tile_n: int
    write_lse: bool


def plan_launch(query: torch.Tensor, key: torch.Tensor, mask: Optional[CompactMask], *,
                causal: bool, scale: float, window: Optional[int], softcap: Optional[float],
                diag_offset: int, schedule: Schedule, return_lse: bool) -> LaunchPlan:
    batch, heads_q, seq_q, head_dim = query.shape
    group = heads_q // key.shape[1]
    # Additive masks may hold huge finite values (finfo.min); natural units keep s - max finite.
    score_unit = 1.0 if mask is not None and mask.kind == ADDITIVE else LOG2E
    if softcap is not None:
        score_scale, softcap_out = scale / softcap, softcap * score_unit
    else:
        score_scale, softcap_out = scale * score_unit, 0.0
    constants = (
        group, schedule.tile_m, schedule.tile_n, head_dim_tile(head_dim),
        bool(causal), window is not None, softcap is not None,
        0 if mask is None else mask.kind,
        mask is not None and mask.batched,
        mask is not None and mask.headed,
        mask is not None and mask.per_row,
        score_unit,
        # Additive masks and softcap need scaled scores; a scale <= 0 would not commute with max.
        softcap is None and score_unit == LOG2E and score_scale > 0,
        bool(return_lse), bool(causal and schedule.heavy_first),
        schedule.k_latency, schedule.v_latency,
    )
    return LaunchPlan(
        grid=(math.ceil(seq_q / schedule.tile_m), heads_q, batch),
        scalars=(float(score_scale), float(softcap_out), int(diag_offset), int(window or 0)),
        constants=constants, occupancy=schedule.occupancy, num_ctas=schedule.num_ctas,
        num_worker_warps=schedule.num_worker_warps,
        dtype=query.dtype, mask_dtype=None if mask is None else _kernel_mask_dtype(mask.tensor),
        tile_m=schedule.tile_m, tile_n=schedule.tile_n, write_lse=bool(return_lse),
    )


def _kernel_mask_dtype(mask: torch.Tensor) -> torch.dtype:
    return torch.uint8 if mask.dtype == torch.bool else mask.dtype


@functools.lru_cache(maxsize=None)
def kernel_with_hints(occupancy: int, num_ctas: int, num_worker_warps: Optional[int]):
    """The kernel object for one set of compiler hints (each keeps its own JIT cache)."""
    from .kernel import attention_forward
    hints = dict(occupancy=occupancy, num_ctas=num_ctas)
    if num_worker_warps is not None:
        hints["num_worker_warps"] = num_worker_warps
    return attention_forward.replace_hints(**hints)


def plan_kernel(plan: LaunchPlan):
    return kernel_with_hints(plan.occupancy, plan.num_ctas, plan.num_worker_warps)


def _placeholder(device: torch.device, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """A tiny array for kernel parameters a variant never reads (no mask, no LSE). Allocated per
    call, not cached: a cached one first made during CUDA-graph capture would live in the
    graph's private memory pool."""
    return torch.zeros((1,) * ndim, dtype=dtype, device=device)


def run_kernel(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Optional[CompactMask]) -> tuple[torch.Tensor, torch.Tensor]:
    import cuda.tile as ct

    device = query.device
    batch, heads_q, seq_q, _ = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=device)
    if plan.write_lse:
        lse = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=device)
    else:
        lse = torch.empty((0,), dtype=torch.float32, device=device)
    lse_arg = lse if plan.write_lse else _placeholder(device, torch.float32, 3)
    if mask is not None:
        # The kernel reads bool masks as uint8 (same bytes); this runs inside the custom op, so
        # the reinterpretation never reaches a traced graph.
        mask_arg = mask.tensor.view(plan.mask_dtype)
        states = tile_states(mask, plan.tile_m, plan.tile_n)
    else:
        mask_arg = _placeholder(device, torch.uint8, 4)
        states = _placeholder(device, torch.int8, 4)
    kernel = plan_kernel(plan)
    with torch.cuda.device(device):
        ct.launch(torch.cuda.current_stream(device), plan.grid, kernel,
                  (query, key, value, out, lse_arg, mask_arg, states) + plan.scalars + plan.constants)
    return out, lse


def export_signature(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor,
                     mask: Optional[CompactMask] = None):
    """The :class:`cuda.tile.compilation.KernelSignature` that a launch of ``plan`` on these
    tensors compiles (meta tensors are fine).

    It mirrors what the JIT assumes at launch time, so an export compiles the same code (TMA
    loads and all) that runs: 16-byte aligned base addresses (what torch's allocator returns),
    unit stride on the last dim, and each stride / extent's divisibility read from the tensors.
    """
    import cuda.tile as ct
    from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature,
                                       ScalarConstraint)

    ct_dtypes = {torch.float16: ct.float16, torch.bfloat16: ct.bfloat16,
                 torch.float32: ct.float32, torch.uint8: ct.uint8, torch.int8: ct.int8}

    def array(dtype: torch.dtype, shape, strides) -> ArrayConstraint:
        size = torch.empty((), dtype=dtype).element_size()
        return ArrayConstraint(
            ct_dtypes[dtype], len(shape), index_dtype=ct.int32, stride_lower_bound_incl=0,
            alias_groups=(), may_alias_internally=False,
            stride_constant=[1 if stride == 1 else None for stride in strides],
            stride_divisible_by=[16 // size if stride * size % 16 == 0 else 1
                                 for stride in strides],
            shape_divisible_by=[16 if extent % 16 == 0 else 1 for extent in shape],
            base_addr_divisible_by=16)

    def like(tensor: torch.Tensor, dtype: torch.dtype) -> ArrayConstraint:
        return array(dtype, tensor.shape, tensor.stride())

    def placeholder(dtype: torch.dtype, ndim: int) -> ArrayConstraint:
        return array(dtype, (1,) * ndim, (1,) * ndim)

    batch, heads_q, seq_q, head_dim = query.shape
    out_shape = (batch, heads_q, seq_q, head_dim)
    out_strides = (heads_q * seq_q * head_dim, seq_q * head_dim, head_dim, 1)
    arrays = [like(query, plan.dtype), like(key, plan.dtype), like(key, plan.dtype),
              array(plan.dtype, out_shape, out_strides)]
    if plan.write_lse:
        arrays.append(array(torch.float32, out_shape[:3], (heads_q * seq_q, seq_q, 1)))
    else:
        arrays.append(placeholder(torch.float32, 3))
    if mask is not None:
        states = tile_states(mask, plan.tile_m, plan.tile_n)
        arrays += [like(mask.tensor, plan.mask_dtype), like(states, torch.int8)]
    else:
        arrays += [placeholder(torch.uint8, 4), placeholder(torch.int8, 4)]
    scalars = [ScalarConstraint(ct.float32), ScalarConstraint(ct.float32),
               ScalarConstraint(ct.int32), ScalarConstraint(ct.int32)]
    return KernelSignature(arrays + scalars + list(plan.constants),
                           CallingConvention.cutile_python_v1())
