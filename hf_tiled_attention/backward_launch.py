"""Host side of the backward kernels (backward_kernel.py): from the op's saved tensors to the
two launches.

:func:`backward_plan` (memoised on shapes-free properties) turns a call's options
(:class:`~hf_tiled_attention.call_options.CallOptions`) into the two kernels' constants, as
:class:`~hf_tiled_attention.kernel_params.AttentionConstants` tuples (the forward's declaration,
made by launch.kernel_constants: TILE_M the query tile, TILE_N the key tile), and the score
scalars;
:func:`backward_arrays` builds what each launch passes (it works on meta tensors too, which is
how the CPU tests compile every backward variant); :func:`run_backward` launches them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .call_options import CallOptions
from .determinism import deterministic
from .kernel_params import (MASK_GRAD_ROW_SUMS, MASK_GRAD_ROWS, NO_MASK, NO_MASK_GRAD,
                            AttentionConstants)
from .launch import (array_constraint, current_stream, kernel_constants, kernel_copy_with_mods,
                     launch_device, placeholders, score_scalars)
from .masks import NO_MASK_LAYOUT, CompactMask, ModMask, kernel_mask_dtype
from .memo import memoize
from .mods import CompiledMods
from .reference import empty_output
from .schedule import BackwardSchedule, backward_schedule, head_dim_tile

@dataclass(frozen=True)
class BackwardPlan:
    kv: AttentionConstants      # the dK/dV kernel's constants
    q: AttentionConstants       # the dQ kernel's (not launched when kv.DQ_ADD)
    schedule: BackwardSchedule
    score_scale: float
    softcap_out: float
    grad_scale: float
    mods: Optional[CompiledMods]
    deterministic: bool         # mask gradients summed by torch, not by reduce-adds

    @property
    def score_unit(self) -> float:
        return self.kv.SCORE_UNIT

    @functools.cached_property
    def kernels(self) -> tuple:
        """(rows kernel, dK/dV kernel, dQ kernel) with this plan's compiler hints and mods."""
        s = self.schedule
        return backward_kernels((s.rows_occupancy, s.rows_warps), (s.kv_occupancy, s.kv_warps),
                                (s.q_occupancy, s.q_warps),
                                None if self.mods is None else self.mods.module)

    @functools.cached_property
    def constant_values(self) -> tuple[tuple, tuple]:
        """The constants as plain tuples (cuTile's launch takes no NamedTuple)."""
        return tuple(self.kv), tuple(self.q)


@memoize(1024)
def backward_plan(dtype: torch.dtype, group: int, head_dim: int, options: CallOptions,
                  schedule: Optional[BackwardSchedule] = None, mask_grad: bool = False,
                  deterministic: bool = True, capture_grads: int = 0) -> BackwardPlan:
    """The plan of every call with these options and properties (the forward's scalars and
    constants); run_backward passes :meth:`CallOptions.without_diagonal` (the diagonal is a
    scalar of the launch).
    ``mask_grad``: the dK/dV kernel also writes the additive mask's gradient; ``deterministic``:
    dQ by its own kernel (bitwise reproducible), else as the schedule says; ``capture_grads``:
    a bit per captured tensor of the score_mod whose gradient the dK/dV kernel adds."""
    schedule = schedule or backward_schedule(head_dim)
    layout = options.mask_layout or NO_MASK_LAYOUT
    masked = layout.kind != NO_MASK
    unit, score_scale, softcap_out = score_scalars(options)
    mods = options.mods
    score_mod_grad = options.has_score_mod and hasattr(mods.module, "score_mod_grad")

    dq_add = schedule.dq_add and not deterministic
    mask_grad_mode = NO_MASK_GRAD
    if mask_grad:
        mask_grad_mode = MASK_GRAD_ROWS if layout.per_row else MASK_GRAD_ROW_SUMS

    def constants(tile_m: int, tile_n: int, in_kv_kernel: bool) -> AttentionConstants:
        return kernel_constants(
            options, dtype, head_dim, schedule.split_head_dim,
            GROUP=group, G_TILE=1, TILE_M=tile_m, TILE_N=tile_n, SCORE_MOD_GRAD=score_mod_grad,
            MASK_TABLE=masked, FOLD_SCALE=False, WRITE_LSE=False,
            HEAVY_FIRST=options.causal, K_LATENCY=2, V_LATENCY=4,
            LOAD_TRANSPOSED=schedule.load_transposed,
            MASK_GRAD=mask_grad_mode if in_kv_kernel else NO_MASK_GRAD,
            DQ_ADD=dq_add and in_kv_kernel, CAPTURE_GRADS=capture_grads if in_kv_kernel else 0,
            CAPTURE_PARTIALS=bool(deterministic and capture_grads and in_kv_kernel),
            TABLE_ORDER=schedule.table_order and masked and layout.per_row,
            EDGE_STATES=schedule.edge_states, PDL=schedule.pdl,
            UNCHECKED=schedule.unchecked_loads)

    return BackwardPlan(constants(schedule.kv_queries, schedule.kv_keys, True),
                        constants(schedule.q_rows, schedule.q_keys, False), schedule,
                        float(score_scale), float(softcap_out), options.scale, mods,
                        deterministic)


@memoize(64)
def backward_kernels(rows_hints: tuple, kv_hints: tuple, q_hints: tuple,
                     mods_module=None) -> tuple:
    """(rows kernel, dK/dV kernel, dQ kernel), each with its (occupancy, worker warps), and
    with a mods module copies of the last two that call its mods."""
    import cuda.tile as ct

    from . import backward_kernel as source

    if mods_module is None:
        kernels = (source.attention_backward_kv_kernel, source.attention_backward_q_kernel)
    else:
        kernels = tuple(ct.kernel(kernel_copy_with_mods(mods_module, entry)) for entry in
                        (source.attention_backward_kv, source.attention_backward_q))
    return tuple(kernel.replace_hints(occupancy=occupancy, num_worker_warps=warps)
                 for kernel, (occupancy, warps) in zip(
                     (source.attention_backward_rows_kernel,) + kernels,
                     (rows_hints, kv_hints, q_hints)))


def backward_arrays(plan: BackwardPlan, grad_out: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, grad_lse: Optional[torch.Tensor],
                    mask: Optional[CompactMask | ModMask], diag_offset: int, window: int,
                    keep: bool = False):
    """``(rows kernel arguments, kv arrays + scalars, q arrays + scalars, grids (rows, kv, q),
    (dq, dk, dv, d_mask, d_captures))`` of one backward (``out`` and ``grad_out`` with unit
    stride along D, any other strides). With ``plan.kv.DQ_ADD`` ``dq`` is the fp32 array the
    dK/dV kernel adds into; with ``plan.kv.MASK_GRAD`` ``d_mask`` is the fp32 array it adds the
    mask's gradient into (see :func:`mask_grad_buffer`), else None; with
    ``plan.kv.CAPTURE_GRADS`` ``d_captures`` has per captured tensor of the score_mod the
    zeroed fp32 array the kernel adds its gradient into (its bit set; with
    ``plan.kv.CAPTURE_PARTIALS`` a row of the tensor's shape per block of the dK/dV grid, to be
    summed over dim 0), else a placeholder it never reads (without, it is empty).
    ``keep``: the mask's block tables may be kept for later calls (its forward table for the
    dQ kernel is the forward's when the tiles agree)."""
    device = query.device
    batch, heads_q, seq_q, head_dim = query.shape
    rows = padded_rows(seq_q, plan.schedule)
    delta = torch.empty((batch, heads_q, rows), dtype=torch.float32, device=device)
    lse_b = torch.empty((batch, heads_q, rows), dtype=torch.float32, device=device)
    d_lse = lse if grad_lse is None else grad_lse.float().contiguous()  # (not read: no dLse)
    rows_tile = plan.schedule.rows_tile
    rows_args = (out, grad_out, lse, d_lse, delta, lse_b, float(plan.score_unit), rows_tile,
                 head_dim_tile(head_dim), grad_lse is not None, plan.schedule.pdl)
    unused = placeholders(device, 3, keep)
    unused_4d = placeholders(device, 4, keep).lse  # (fp32)
    if plan.kv.DQ_ADD:  # added into by every key tile's block
        dq = torch.zeros(query.shape, dtype=torch.float32, device=device)
    else:
        dq = torch.empty(query.shape, dtype=query.dtype, device=device)
    dk = torch.empty(key.shape, dtype=key.dtype, device=device)
    dv = torch.empty(value.shape, dtype=value.dtype, device=device)
    d_mask = None
    if plan.kv.MASK_GRAD != NO_MASK_GRAD:
        d_mask = mask_grad_buffer(mask.tensor.shape, query.shape, plan.kv.TILE_M,
                                  plan.deterministic, device)
    kv_mask = q_mask = (unused.mask, unused.states, unused.ranges)
    if mask is not None:
        tensor = unused.mask
        if isinstance(mask, CompactMask):
            tensor = mask.tensor.view(kernel_mask_dtype(mask.tensor.dtype))
        sched = plan.schedule
        kv_mask = (tensor,) + tuple(mask.block_table(sched.kv_queries, sched.kv_keys, keep,
                                                     transposed=True))
        q_mask = (tensor,) + tuple(mask.block_table(sched.q_rows, sched.q_keys, keep))
    captures = () if plan.mods is None else plan.mods.kernel_captures()
    kv_grid = kv_kernel_grid(key, plan.kv.TILE_N)
    rows_per_block = (math.prod(kv_grid),) if plan.kv.CAPTURE_PARTIALS else ()
    d_captures = () if not plan.kv.CAPTURE_GRADS else tuple(
        torch.zeros(rows_per_block + t.shape, dtype=torch.float32, device=device)
        if plan.kv.CAPTURE_GRADS >> slot & 1 else unused_4d for slot, t in enumerate(captures))
    scalars = (plan.score_scale, plan.softcap_out, plan.grad_scale, int(diag_offset),
               int(window))
    kv_args = ((query, key, value, grad_out, lse_b, delta, dk, dv,
                dq if plan.kv.DQ_ADD else unused_4d, unused_4d if d_mask is None else d_mask)
               + kv_mask + (captures + d_captures,) + scalars)
    q_args = (query, key, value, grad_out, lse_b, delta, dq) + q_mask + (captures,) + scalars
    grids = ((math.ceil(rows / rows_tile), heads_q, batch),
             kv_grid,
             (math.ceil(seq_q / plan.q.TILE_M), heads_q, batch))
    return rows_args, kv_args, q_args, grids, (dq, dk, dv, d_mask, d_captures)


def kv_kernel_grid(key: torch.Tensor, keys_per_tile: int) -> tuple[int, int, int]:
    """The dK/dV kernel's grid: (key tiles, kv heads, batch)."""
    batch, heads_kv, seq_kv, _ = key.shape
    return math.ceil(seq_kv / keys_per_tile), heads_kv, batch


def padded_rows(seq_q: int, schedule: BackwardSchedule) -> int:
    """The rows of the Delta kernel's two arrays: ``seq_q``, or with ``unchecked_loads``
    ``seq_q`` rounded up to whole tiles of the three kernels (powers of two: the largest tile's
    multiple), which the other two kernels then read without bounds checks."""
    if not schedule.unchecked_loads:
        return seq_q
    tile = max(schedule.rows_tile, schedule.kv_queries, schedule.q_rows)
    return math.ceil(seq_q / tile) * tile


def mask_grad_buffer(mask_shape: tuple, query_shape: tuple, tile_m: int, deterministic: bool,
                     device: torch.device) -> torch.Tensor:
    """The zeroed fp32 array the dK/dV kernel adds an additive mask's gradient into. Its key
    dim is the mask's; its rows the mask's (Sq or 1), or with one mask row and
    ``deterministic`` one per query tile of the kernel. ``deterministic``: full batch and
    head dims, so that each element gets one add (exact: 0 + x) and torch sums the rest in a
    fixed order; else the mask's own batch and head dims, where blocks that share an element
    add in any order (the last bits vary run to run). :func:`summed_mask_grad` reduces it to
    the mask's shape."""
    if not deterministic:
        return torch.zeros(mask_shape, dtype=torch.float32, device=device)
    batch, heads_q, seq_q, _ = query_shape
    mask_rows, seq_kv = mask_shape[2:]
    rows = mask_rows if mask_rows > 1 else math.ceil(seq_q / tile_m)
    return torch.zeros((batch, heads_q, rows, seq_kv), dtype=torch.float32, device=device)


# Deterministic mode's per-block rows of the learnable captures' gradients (CAPTURE_PARTIALS)
# take up to this much memory; beyond (a captured tensor as large as the scores, say) the
# backward runs the reference path (op.backward).
CAPTURE_PARTIALS_MAX_BYTES = 256 << 20


def capture_partials_fit(query: torch.Tensor, key: torch.Tensor, captures: Sequence,
                         learnable: Sequence[bool]) -> bool:
    """Whether deterministic mode's per-block gradient rows (a row of each learnable capture's
    shape per block of the dK/dV grid, fp32) fit CAPTURE_PARTIALS_MAX_BYTES."""
    blocks = math.prod(kv_kernel_grid(key, backward_schedule(query.shape[-1]).kv_keys))
    values = sum(t.numel() for t, flag in zip(captures, learnable) if flag)
    return 4 * blocks * values <= CAPTURE_PARTIALS_MAX_BYTES


def summed_mask_grad(buffer: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mask's gradient, in its dtype, from :func:`mask_grad_buffer`'s array."""
    return buffer.sum_to_size(mask.shape).to(mask.dtype)


def run_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 grad_lse: Optional[torch.Tensor], mask: Optional[CompactMask | ModMask],
                 options: CallOptions, *, schedule: Optional[BackwardSchedule] = None,
                 mask_grad: bool = False, learnable: Sequence[bool] = (),
                 keep: bool = False) -> list[torch.Tensor]:
    """``[dq, dk, dv]``, then with ``mask_grad`` the additive mask's gradient, then the
    gradient of each captured tensor of ``options.mods`` flagged in ``learnable`` (in its dtype;
    the slots must be in ``mods.capture_grad_slots``), from the backward kernels, launched on
    the current stream (``keep``: see :func:`backward_arrays`). ``options``: the forward call's;
    ``mask``: the mask its kernels read. Q, K and V are the forward's, which op.attention gave
    unit stride along D."""
    import cuda.tile as ct

    capture_grads = sum(1 << slot for slot, flag in enumerate(learnable) if flag)
    plan = backward_plan(query.dtype, query.shape[1] // key.shape[1], query.shape[-1],
                         options.without_diagonal(),
                         schedule or backward_schedule(query.shape[-1]), mask_grad,
                         deterministic(), capture_grads)
    rows_args, kv_args, q_args, grids, grads = backward_arrays(
        plan, grad_out, query, key, value, out, lse, grad_lse, mask, options.diag_offset,
        options.window or 0, keep)
    rows_kernel, kv_kernel, q_kernel = plan.kernels
    kv_constants, q_constants = plan.constant_values
    stream = current_stream(query.device)
    pdl = plan.schedule.pdl  # (the dK/dV and dQ launches start before their predecessor ends)
    with launch_device(query.device):
        ct.launch(stream, grids[0], rows_kernel, rows_args)
        ct.launch(stream, grids[1], kv_kernel, kv_args + (kv_constants,),
                  programmatic_dependent_launch=pdl)
        if not plan.kv.DQ_ADD:
            ct.launch(stream, grids[2], q_kernel, q_args + (q_constants,),
                      programmatic_dependent_launch=pdl)
    dq, dk, dv, d_mask, d_captures = grads
    if plan.kv.DQ_ADD:
        dq = dq.to(query.dtype)
    # (CAPTURE_PARTIALS: the blocks' rows, summed by torch in a fixed order)
    learned = [(grad.sum(0) if plan.kv.CAPTURE_PARTIALS else grad).to(t.dtype)
               for grad, t, flag in zip(d_captures, () if options.mods is None
                                        else options.mods.captures, learnable) if flag]
    return ([dq, dk, dv] + ([] if d_mask is None else [summed_mask_grad(d_mask, mask.tensor)])
            + learned)


def export_backward_cubins(plan: BackwardPlan, query: torch.Tensor, key: torch.Tensor,
                           mask: Optional[CompactMask | ModMask] = None, *, arch: str,
                           diag_offset: int = 0, window: int = 0) -> tuple[bytes, bytes, bytes]:
    """The cubins of the three backward kernels (rows, dK/dV, dQ) as a launch on these tensors
    compiles them for ``arch`` (meta tensors are fine), built without a GPU by cuTile's
    exporter."""
    import io

    import cuda.tile as ct
    from cuda.tile.compilation import (CallingConvention, KernelSignature, ScalarConstraint,
                                       TupleConstraint, export_kernel)

    out = empty_output(query)
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    rows_args, kv_args, q_args, _, _ = backward_arrays(plan, out, query, key, key, out, lse,
                                                       lse, mask, diag_offset, window)
    scalars = [ScalarConstraint(ct.float32)] * 3 + [ScalarConstraint(ct.int32)] * 2
    rows_signature = KernelSignature([array_constraint(a) for a in rows_args[:6]]
                                     + [ScalarConstraint(ct.float32)] + list(rows_args[7:]),
                                     CallingConvention.cutile_python_v2())
    buffer = io.BytesIO()
    export_kernel(plan.kernels[0], [rows_signature], buffer, gpu_code=arch,
                  output_format="cubin")
    cubins = [buffer.getvalue()]
    for args, kernel, constants in zip((kv_args, q_args), plan.kernels[1:],
                                       plan.constant_values):
        # arrays, then the tuple of captured arrays
        signature = KernelSignature(
            [TupleConstraint([array_constraint(t) for t in a]) if isinstance(a, tuple)
             else array_constraint(a) for a in args[:-5]] + scalars + [constants],
            CallingConvention.cutile_python_v2())
        buffer = io.BytesIO()
        export_kernel(kernel, [signature], buffer, gpu_code=arch, output_format="cubin")
        cubins.append(buffer.getvalue())
    return tuple(cubins)
