"""Host side of the cuTile kernel: from a validated call to a launch.

:func:`plan_launch` turns a call into a :class:`LaunchPlan`: the grid and runtime scalars, plus
a cached :class:`KernelVariant` (the compile-time constants and compiler hints).
:func:`kernel_arguments` builds the arrays a launch passes, and :func:`run_kernel` launches.
Planning reads only shapes and dtypes, so the CPU tests run it on meta tensors to compile every
variant the op can dispatch, without a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .masks import ADDITIVE, CompactMask
from .schedule import Schedule, head_dim_parts

LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class KernelVariant:
    """Everything about a launch that does not depend on sequence lengths or batch size: the
    kernel's Constant parameters, compiler hints and the score scalars. Cached, so a call whose
    shape repeats (every layer, every decode step) skips the planning work."""
    constants: tuple                          # the kernel's Constant parameters, in order
    occupancy: int
    num_ctas: int
    num_worker_warps: Optional[int]            # None: the compiler chooses
    dtype: torch.dtype
    mask_dtype: Optional[torch.dtype]          # as the kernel reads it: bool masks as uint8
    tile_m: int
    tile_n: int
    write_lse: bool
    packed_rows: bool                          # decode: a kv head's query heads are the rows
    score_scale: float
    softcap_out: float


@dataclass(frozen=True)
class LaunchPlan:
    variant: KernelVariant
    grid: tuple[int, int, int]
    diag_offset: int
    window: int
    kv_splits: int

    @property
    def scalars(self) -> tuple[float, float, int, int, int]:
        """The kernel's runtime scalar parameters, in order."""
        return (self.variant.score_scale, self.variant.softcap_out, self.diag_offset,
                self.window, self.kv_splits)


def plan_launch(query: torch.Tensor, key: torch.Tensor, mask: Optional[CompactMask], *,
                causal: bool, scale: float, window: Optional[int], softcap: Optional[float],
                diag_offset: int, schedule: Schedule, return_lse: bool,
                sm_count: int = 0) -> LaunchPlan:
    """``sm_count`` (the GPU's SM count; 0 = unknown) lets a call with too few query tiles to
    fill the GPU split its keys over several blocks (``Schedule.kv_splits`` = 0)."""
    batch, heads_q, seq_q, head_dim = query.shape
    heads_kv, seq_kv = key.shape[1], key.shape[2]
    group = heads_q // heads_kv
    # Decode with GQA (Schedule.pack_gqa): the group's query heads become the rows of one
    # tile, so K/V are read once per kv head (needs a mask without a head dim; one query
    # means one position for every row).
    packed = (schedule.pack_gqa and seq_q == 1 and group > 1
              and (mask is None or not mask.headed))
    rows = group if packed else seq_q
    tile_m = _row_tile(rows, schedule.tile_m) if packed else schedule.tile_m
    m_tiles = math.ceil(rows / tile_m)
    heads_grid = heads_kv if packed else heads_q
    visible = seq_kv if window is None else min(seq_kv, (1 if causal else 2) * window + rows)
    splits = _kv_splits(schedule, m_tiles * heads_grid * batch,
                        math.ceil(visible / schedule.tile_n), sm_count)
    mask_layout = None if mask is None else (
        mask.kind, _kernel_mask_dtype(mask.tensor), mask.batched, mask.headed, mask.per_row)
    # Split blocks always write their LSE: the partial results are merged with it.
    variant = kernel_variant(query.dtype, group, head_dim, mask_layout, bool(causal),
                             float(scale), window is not None, softcap, schedule,
                             bool(return_lse or splits > 1), packed, tile_m)
    grid = (m_tiles * splits, heads_grid, batch)
    if schedule.persistent:  # about one wave of blocks; each loops over the tiles
        blocks = math.prod(grid)
        grid = (min(blocks, sm_count * schedule.occupancy) if sm_count else blocks, 1, 1)
    return LaunchPlan(variant=variant, grid=grid, diag_offset=int(diag_offset),
                      window=int(window or 0), kv_splits=splits)


def _row_tile(rows: int, tile_m: int) -> int:
    """Packed decode rows (a GQA group): the smallest power-of-two tile that holds them."""
    return min(tile_m, max(16, 1 << (rows - 1).bit_length()))


def _kv_splits(schedule: Schedule, blocks: int, key_tiles: int, sm_count: int) -> int:
    if schedule.kv_splits:
        return schedule.kv_splits
    if not sm_count or blocks >= sm_count:
        return 1
    # About two waves of blocks, each with at least four key tiles to stream.
    return max(1, min(2 * sm_count // blocks, key_tiles // 4))


@functools.lru_cache(maxsize=4096)
def kernel_variant(dtype: torch.dtype, group: int, head_dim: int, mask_layout: Optional[tuple],
                   causal: bool, scale: float, windowed: bool, softcap: Optional[float],
                   schedule: Schedule, return_lse: bool, packed: bool,
                   tile_m: int) -> KernelVariant:
    """The variant for one combination of (hashable) call properties; memoised."""
    mask_kind, mask_dtype, batched, headed, per_row = mask_layout or (0, None, False, False, False)
    # Additive masks may hold huge finite values (finfo.min); natural units keep s - max finite.
    score_unit = 1.0 if mask_kind == ADDITIVE else LOG2E
    if softcap is not None:
        score_scale, softcap_out = scale / softcap, softcap * score_unit
    else:
        score_scale, softcap_out = scale * score_unit, 0.0
    num_worker_warps = schedule.num_worker_warps
    if tile_m < schedule.tile_m:  # shrunk for few rows: one warpgroup is plenty
        num_worker_warps = min(num_worker_warps or 4, 4)
    constants = (
        1 if packed else group, packed, tile_m, schedule.tile_n,
        *head_dim_parts(head_dim, schedule.split_head_dim),
        causal, windowed, softcap is not None, mask_kind, batched, headed, per_row,
        score_unit,
        # Additive masks and softcap need scaled scores; a scale <= 0 would not commute with max.
        softcap is None and score_unit == LOG2E and score_scale > 0,
        return_lse, bool(causal and schedule.heavy_first),
        schedule.k_latency, schedule.v_latency, schedule.persistent,
    )
    return KernelVariant(
        constants=constants, occupancy=schedule.occupancy, num_ctas=schedule.num_ctas,
        num_worker_warps=num_worker_warps, dtype=dtype, mask_dtype=mask_dtype,
        tile_m=tile_m, tile_n=schedule.tile_n, write_lse=return_lse, packed_rows=packed,
        score_scale=float(score_scale), softcap_out=float(softcap_out))


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
    v = plan.variant
    return kernel_with_hints(v.occupancy, v.num_ctas, v.num_worker_warps)


def _placeholder(device: torch.device, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """A tiny array for kernel parameters a variant never reads (no mask, no LSE): never read,
    so left uninitialised. Reused across calls (allocations are a large part of a short call's
    host time), except while a CUDA graph is being captured: one first made then would live in
    the graph's private memory pool."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty((1,) * ndim, dtype=dtype, device=device)
    return _reused_placeholder(device, dtype, ndim)


@functools.lru_cache(maxsize=None)
def _reused_placeholder(device: torch.device, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    return torch.empty((1,) * ndim, dtype=dtype, device=device)


def kernel_arguments(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, mask: Optional[CompactMask]):
    """The arrays one launch passes (Q, K, V, Out, Lse, Mask, TileState) and a ``finish()``
    that returns ``(out, lse)`` once the kernel has run (``lse`` is None for a variant that
    writes none). Works on meta tensors too, which is how
    :func:`export_signature` sees exactly the arrays a real launch passes."""
    variant = plan.variant
    device = query.device
    batch, heads_q, seq_q, head_dim = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=device)
    lse = (torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=device)
           if variant.write_lse else None)
    q_rows, out_rows, lse_rows = query, out, lse
    if variant.packed_rows:  # (B, Hq, 1, D) seen as (B, Hkv, group, D): views, no copies
        heads_kv = key.shape[1]
        group = heads_q // heads_kv
        q_rows = query.as_strided((batch, heads_kv, group, head_dim),
                                  (query.stride(0), group * query.stride(1), query.stride(1),
                                   query.stride(3)), query.storage_offset())
        out_rows = out.view(batch, heads_kv, group, head_dim)
        lse_rows = lse.view(batch, heads_kv, group) if variant.write_lse else None
    splits = plan.kv_splits
    if splits > 1:  # fp32 partial results per key slice, merged by finish()
        out_arg = torch.empty((splits * batch,) + out_rows.shape[1:], dtype=torch.float32,
                              device=device)
        lse_arg = torch.empty((splits * batch,) + lse_rows.shape[1:], dtype=torch.float32,
                              device=device)
    else:
        out_arg = out_rows
        lse_arg = lse_rows if variant.write_lse else _placeholder(device, torch.float32, 3)
    if mask is not None:
        # The kernel reads bool masks as uint8 (same bytes); this runs inside the custom op, so
        # the reinterpretation never reaches a traced graph.
        mask_arg = mask.tensor.view(variant.mask_dtype)
        states = mask.states(variant.tile_m, variant.tile_n)
    else:
        mask_arg = _placeholder(device, torch.uint8, 4)
        states = _placeholder(device, torch.int8, 4)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        if splits > 1:
            _merge_splits(out_arg.view((splits,) + out_rows.shape),
                          lse_arg.view((splits,) + lse_rows.shape), out_rows, lse_rows)
        return out, lse

    return (q_rows, key, value, out_arg, lse_arg, mask_arg, states), finish


def _merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor) -> None:
    """Combine per-slice softmax results: weights exp(lse_s - lse) with lse = logsumexp_s."""
    total = torch.logsumexp(part_lse, dim=0)
    # Rows no slice saw: every lse_s is -inf; shifting by 0 gives weight 0 and output 0.
    weight = torch.exp(part_lse - total.masked_fill(total == float("-inf"), 0.0))
    out.copy_((weight.unsqueeze(-1) * part_out).sum(dim=0))
    lse.copy_(total)


def run_kernel(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Optional[CompactMask]) -> tuple[torch.Tensor, torch.Tensor]:
    import cuda.tile as ct

    arrays, finish = kernel_arguments(plan, query, key, value, mask)
    device = query.device
    launch_args = (torch.cuda.current_stream(device), plan.grid, plan_kernel(plan),
                   arrays + plan.scalars + plan.variant.constants)
    if device.index == torch.cuda.current_device():
        ct.launch(*launch_args)
    else:  # the launch goes to the current device's context
        with torch.cuda.device(device):
            ct.launch(*launch_args)
    return finish()


def export_signature(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor,
                     mask: Optional[CompactMask] = None):
    """The :class:`cuda.tile.compilation.KernelSignature` that a launch of ``plan`` on these
    tensors compiles (meta tensors are fine).

    It mirrors what the JIT assumes at launch time, so an export compiles the same code (TMA
    loads and all) that runs: the arrays of :func:`kernel_arguments`, 16-byte aligned (what
    torch's allocator returns), with each stride's and extent's divisibility read from them.
    """
    import cuda.tile as ct
    from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature,
                                       ScalarConstraint)

    ct_dtypes = {torch.float16: ct.float16, torch.bfloat16: ct.bfloat16,
                 torch.float32: ct.float32, torch.uint8: ct.uint8, torch.int8: ct.int8}

    def constraint(tensor: torch.Tensor) -> ArrayConstraint:
        size = tensor.element_size()
        return ArrayConstraint(
            ct_dtypes[tensor.dtype], tensor.dim(), index_dtype=ct.int32,
            stride_lower_bound_incl=0, alias_groups=(), may_alias_internally=False,
            stride_constant=[1 if stride == 1 else None for stride in tensor.stride()],
            stride_divisible_by=[16 // size if stride * size % 16 == 0 else 1
                                 for stride in tensor.stride()],
            shape_divisible_by=[16 if extent % 16 == 0 else 1 for extent in tensor.shape],
            base_addr_divisible_by=16)

    arrays, _ = kernel_arguments(plan, query, key, key, mask)
    scalars = [ScalarConstraint(ct.float32), ScalarConstraint(ct.float32),
               ScalarConstraint(ct.int32), ScalarConstraint(ct.int32), ScalarConstraint(ct.int32)]
    return KernelSignature([constraint(a) for a in arrays] + scalars + list(plan.variant.constants),
                           CallingConvention.cutile_python_v1())


def export_cubin(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor,
                 mask: Optional[CompactMask] = None, *, arch: str) -> bytes:
    """The cubin a launch of ``plan`` on these tensors compiles, for ``arch`` (e.g. "sm_90"),
    built without a GPU by cuTile's exporter."""
    import io

    from cuda.tile.compilation import export_kernel

    buffer = io.BytesIO()
    export_kernel(plan_kernel(plan), [export_signature(plan, query, key, mask)], buffer,
                  gpu_code=arch, output_format="cubin")
    return buffer.getvalue()
