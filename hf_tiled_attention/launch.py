"""Host side of the cuTile kernels: from a validated call to a launch.

:func:`plan_launch` turns a call into a :class:`LaunchPlan`: the grid, the key splits and a
cached :class:`KernelVariant` (the compile-time constants and compiler hints). It reads only
shapes and dtypes, so the CPU tests plan on meta tensors and compile every variant the op can
dispatch without a GPU. :func:`launch_arrays` builds the arrays a launch passes and
:func:`run_kernel` launches the attention kernel (one launch: with split keys, the kernel's
last block per query tile merges the slices).
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from .call_options import CallOptions
from .kernel_params import (ADDITIVE_MASK, LOG2E, NO_MASK, NO_MASK_GRAD, AttentionConstants,
                            MergeConstants)
from .masks import NO_MASK_LAYOUT, CompactMask, MaskLayout, ModMask, kernel_mask_dtype
from .memo import Memo, may_keep_device_memory, memoize
from .mods import CompiledMods, ModError
from .reference import empty_output, output_strides
from .schedule import DECODE_QUERY_ROWS, PACKED_TILE_ROWS, Schedule, head_dim_parts
from .visibility import key_span

# A packed tile holds at most this many query heads of a group (MQA's 32 or more heads take
# several tiles, each reading the K/V tiles).
PACKED_MAX_GROUP = 16
# Key splits (Schedule.kv_splits = 0): each split streams at least this many key tiles, and
# there are at most MAX_SPLITS.
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 64
# A call whose launches the host makes every time (eager, not replayed from a CUDA graph) splits
# its keys only when each unsplit block would stream at least this many bytes of K and V: below
# that the GPU time a split saves (a few us) is less than the host time its three more arrays,
# workspace and merge cost (perf-notes step 31 measured it with the merge a launch of its own),
# and a decode step at batch 1 is bound by the host.
EAGER_SPLIT_MIN_BYTES = 2 << 20
# The merge reads at most this many fp32 partial outputs per load, in column chunks of at most
# MERGE_CHUNK_D, narrowed so a chunk of its rows holds at most MERGE_ROW_CHUNK_ELEMENTS: with
# more, the split entry's sm_90 cubin spills registers in its merge (packed tiles of 16-128
# rows).
MERGE_TILE_ELEMENTS = 4096
MERGE_CHUNK_D = 64
MERGE_ROW_CHUNK_ELEMENTS = 1024


@dataclass(frozen=True)
class KernelVariant:
    """Everything about a launch that does not depend on sequence lengths or batch size: the
    kernel's Constant parameters, compiler hints and the score scalars. Cached, so a call whose
    shape repeats (every layer, every decode step) skips the planning work."""
    constants: AttentionConstants
    occupancy: int
    num_ctas: int
    num_worker_warps: Optional[int]            # None: the compiler chooses
    dtype: torch.dtype
    mask_dtype: Optional[torch.dtype]          # as the kernel reads it: bool masks as uint8
    score_scale: float
    softcap_out: float
    mods: Optional[CompiledMods]               # the call's score_mod / mask_mod, translated

    @functools.cached_property
    def constant_values(self) -> tuple:
        """The constants as the kernel's C parameter takes them: cuTile's launch accepts a
        plain tuple only (not a NamedTuple)."""
        return tuple(self.constants)

    @property
    def g_tile(self) -> int:
        return self.constants.G_TILE

    @property
    def tile_m(self) -> int:
        return self.constants.TILE_M

    @property
    def tile_n(self) -> int:
        return self.constants.TILE_N


@dataclass(frozen=True)
class LaunchPlan:
    variant: KernelVariant
    grid: tuple[int, int, int]
    diag_offset: int
    window: int
    kv_splits: int
    return_lse: bool
    merge: Optional[MergeConstants]            # set when kv_splits > 1
    views: "BufferViews"

    @functools.cached_property
    def scalars(self) -> tuple[float, float, int, int, int]:
        """The attention kernel's runtime scalar parameters, in order."""
        return (self.variant.score_scale, self.variant.softcap_out, self.diag_offset,
                self.window, self.kv_splits)

    @functools.cached_property
    def trailing_args(self) -> tuple:
        """What the attention kernel's launch passes after its arrays: the scalars and the
        constants (and a split launch's merge constants)."""
        merge = () if self.merge is None else (tuple(self.merge),)  # (a plain tuple: see above)
        return self.scalars + (self.variant.constant_values,) + merge

    @functools.cached_property
    def lean(self) -> bool:
        """Whether the launch passes the kernel's four-array entry (Q, K, V, Out): no mask, no
        mods, no LSE, keys not split, so the other arrays would never be read (kernel.py)."""
        c = self.variant.constants
        return (self.variant.mods is None and c.MASK_KIND == NO_MASK and not c.WRITE_LSE
                and self.kv_splits == 1)

    @functools.cached_property
    def entry(self) -> str:
        """Which of the kernel's entries the launch takes (kernel.py): "lean", "split" (keys
        split, merged in the same launch) or "full"."""
        return "lean" if self.lean else "split" if self.kv_splits > 1 else "full"

    # The kernel object, looked up once per plan (plans are memoised: per-call host time).
    @functools.cached_property
    def kernel(self):
        v = self.variant
        return kernel_with_hints(v.occupancy, v.num_ctas, v.num_worker_warps,
                                 None if v.mods is None else v.mods.module, self.entry)


def plan_launch(query: torch.Tensor, key: torch.Tensor, options: CallOptions,
                schedule: Schedule, *, sm_count: int = 0,
                host_launched: bool = False) -> LaunchPlan:
    """The launch of a call with these options (``schedule``: resolved, every field set) on
    tensors of these shapes and dtypes (meta tensors are fine).
    ``sm_count`` (the GPU's SM count; 0 = unknown) lets a call with too few query tiles to
    fill the GPU split its keys over several blocks (``Schedule.kv_splits`` = 0);
    ``host_launched`` (an eager call outside CUDA graph capture) limits that to calls whose
    blocks would stream at least EAGER_SPLIT_MIN_BYTES each.
    ``options.key_mask_table``: a key-vector mask gets a per-tile state table, so empty key
    tiles are skipped (a mask with rows or heads always does); traced calls (CUDA graphs) set
    it False: there the table would be rebuilt by every layer of every step."""
    batch, heads_q, seq_q, head_dim = query.shape
    heads_kv, seq_kv = key.shape[1], key.shape[2]
    group = heads_q // heads_kv
    # A mod sees one query head per tile row block (its h is the grid head): no packing.
    g_tile = (1 if options.mods is not None
              else packed_group_tile(schedule, seq_q, group, options.mask_layout))
    if g_tile > 1:  # the smallest packed tile that holds the group's heads x positions
        tile_m = min(max(PACKED_TILE_ROWS[0], g_tile * next_power_of_two(seq_q)),
                     schedule.pack_tile_m)
    else:
        tile_m = schedule.tile_m
    rows = tile_m // g_tile
    m_tiles = math.ceil(seq_q / rows)
    pack = min(group, g_tile)  # query heads per tile row group
    heads_grid = heads_q // pack
    # Keys the first query tile sees (decode has one query tile): what its splits share.
    diag_offset, window = options.diag_offset, options.window
    lo, hi, _, _ = key_span(diag_offset, diag_offset + min(rows, seq_q) - 1, seq_kv,
                            window or 0, options.causal, window is not None)
    visible = max(hi - lo, 0)
    splits = 1
    if seq_q <= DECODE_QUERY_ROWS:  # key splits serve short queries only (Schedule.kv_splits)
        short_stream = 2 * visible * head_dim * query.element_size() < EAGER_SPLIT_MIN_BYTES
        splits = kv_splits(schedule, m_tiles * heads_grid * batch,
                            math.ceil(visible / schedule.tile_n), sm_count,
                            compiler_hints(schedule, g_tile, tile_m)[1],
                            host_launched and short_stream)
    # Split blocks always write their LSE: the merge weighs the slices with it.
    variant = kernel_variant(query.dtype, group, head_dim, options.without_diagonal(), schedule,
                             options.return_lse or splits > 1, g_tile, tile_m)
    grid = (m_tiles * splits, heads_grid, batch)
    merge = None
    if splits > 1:  # the merge takes the query's own rows: at most 16 (DECODE_QUERY_ROWS)
        merge = merge_constants(g_tile, min(rows, next_power_of_two(seq_q)), splits, head_dim,
                                options.return_lse)
    return LaunchPlan(variant=variant, grid=grid, diag_offset=diag_offset,
                      window=window or 0, kv_splits=splits, return_lse=options.return_lse,
                      merge=merge,
                      views=buffer_views(batch, heads_q, heads_grid, seq_q, head_dim, g_tile,
                                         splits, m_tiles))


def packed_group_tile(schedule: Schedule, seq_q: int, group: int,
                      mask_layout: Optional[MaskLayout]) -> int:
    """1, or for a short query with GQA/MQA (``Schedule.pack_gqa``) the group size rounded up to
    a power of two: the tile's rows are then the group's query heads at a few positions, and
    each K/V tile is read once per group. A group of more than PACKED_MAX_GROUP heads is packed
    by that many when it divides the group (MQA's 32 heads: two tiles per K/V head), else not
    at all. A mask with a head or a row dim keeps one head per tile."""
    if (not schedule.pack_gqa or seq_q > DECODE_QUERY_ROWS or group == 1
            or (mask_layout is not None and (mask_layout.headed or mask_layout.per_row))):
        return 1
    if group > PACKED_MAX_GROUP:
        return PACKED_MAX_GROUP if group % PACKED_MAX_GROUP == 0 else 1
    return next_power_of_two(group)


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def kv_splits(schedule: Schedule, blocks: int, key_tiles: int, sm_count: int,
              occupancy: int, launch_bound: bool) -> int:
    """How many blocks share a query tile's keys: the schedule's ``kv_splits``, or (0) enough
    to fill one wave of ``sm_count * occupancy`` blocks, each streaming at least
    MIN_TILES_PER_SPLIT key tiles (1 when the GPU is full or the call is bound by the host)."""
    if schedule.kv_splits:
        return schedule.kv_splits
    if not sm_count or blocks >= sm_count or launch_bound:
        return 1
    # At most one wave of blocks (a second, partial one would run alone at the end), each
    # streaming at least MIN_TILES_PER_SPLIT key tiles.
    slots = sm_count * occupancy
    return max(1, min(slots // blocks, key_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def score_scalars(options: CallOptions) -> tuple[float, float, float]:
    """``(score unit, score_scale, softcap_out)`` of the forward and backward kernels alike.
    Additive masks may hold huge finite values (finfo.min); natural units keep s - max finite.
    A score_mod sees natural-unit scores, as in FlexAttention. Otherwise log2 units."""
    additive = options.mask_layout is not None and options.mask_layout.kind == ADDITIVE_MASK
    unit = 1.0 if additive or options.has_score_mod else LOG2E
    return (unit,) + scaled_scores(options.scale, options.softcap, unit)


def scaled_scores(scale: float, softcap: Optional[float], unit: float) -> tuple[float, float]:
    """``(score_scale, softcap_out)``: what a kernel multiplies ``q . k`` by, and with a softcap
    its ``softcap * tanh(...)`` factor, both in ``unit``s (LOG2E: scores for exp2)."""
    if softcap is not None:
        return scale / softcap, softcap * unit
    return scale * unit, 0.0


def kernel_constants(options: CallOptions, dtype: torch.dtype, head_dim: int,
                     split_head_dim: bool, **kernel_own) -> AttentionConstants:
    """The constants of a forward or backward kernel: those the call's options decide, alike
    in every kernel (the head dim's tiles, causal / window / softcap, the mods, the mask's
    layout, the score unit), with ``kernel_own``: the fields each kernel sets itself (its
    tiles and groups, what it writes, its schedule's hints)."""
    layout = options.mask_layout or NO_MASK_LAYOUT
    tile_d, tail_d = head_dim_parts(head_dim, split_head_dim)
    softcapped = options.softcap is not None
    return AttentionConstants(
        TILE_D=tile_d, TAIL_D=tail_d, CAUSAL=options.causal, WINDOWED=options.window is not None,
        SOFTCAP=softcapped, APPROX_TANH=softcapped and dtype != torch.float32,
        SCORE_MOD=options.has_score_mod, MASK_KIND=layout.kind, MASK_BATCHED=layout.batched,
        MASK_HEADED=layout.headed, MASK_ROWS=layout.per_row, SCORE_UNIT=score_scalars(options)[0],
        **kernel_own)


@memoize(4096)
def kernel_variant(dtype: torch.dtype, group: int, head_dim: int, options: CallOptions,
                   schedule: Schedule, write_lse: bool, g_tile: int,
                   tile_m: int) -> KernelVariant:
    """The variant of a call with these options (:meth:`CallOptions.without_diagonal`) and
    these properties of its shape; memoised."""
    score_unit, score_scale, softcap_out = score_scalars(options)
    num_worker_warps, occupancy = compiler_hints(schedule, g_tile, tile_m)
    layout = options.mask_layout
    constants = kernel_constants(
        options, dtype, head_dim, schedule.split_head_dim,
        # grid heads per kv head: query heads, or packed tiles (MQA's 32 heads: 2 of 16)
        GROUP=group // min(group, g_tile), G_TILE=g_tile, TILE_M=tile_m, TILE_N=schedule.tile_n,
        SCORE_MOD_GRAD=False,
        # A key-vector mask has a table where asked; one with heads or rows (or a mask_mod's,
        # one per row) always.
        MASK_TABLE=layout is not None and (layout.headed or layout.per_row
                                           or options.key_mask_table),
        # Additive masks and softcap need scaled scores; a scale <= 0 would not commute with max.
        FOLD_SCALE=options.softcap is None and score_unit == LOG2E and score_scale > 0,
        WRITE_LSE=write_lse, HEAVY_FIRST=bool(options.causal and schedule.heavy_first),
        K_LATENCY=schedule.k_latency, V_LATENCY=schedule.v_latency, LOAD_TRANSPOSED=False,
        MASK_GRAD=NO_MASK_GRAD, DQ_ADD=False, CAPTURE_GRADS=0, CAPTURE_PARTIALS=False,
        TABLE_ORDER=False,
        EDGE_STATES=True, PDL=False, UNCHECKED=False)
    return KernelVariant(
        constants=constants, occupancy=occupancy, num_ctas=schedule.num_ctas,
        num_worker_warps=num_worker_warps, dtype=dtype,
        mask_dtype=None if layout is None else kernel_mask_dtype(layout.dtype),
        score_scale=float(score_scale), softcap_out=float(softcap_out), mods=options.mods)


def compiler_hints(schedule: Schedule, g_tile: int, tile_m: int) -> tuple[Optional[int], int]:
    """(num_worker_warps, occupancy): the schedule's, or for a packed tile one warpgroup per 64
    rows, at ``pack_occupancy`` (a 128-row tile's two warpgroups take an SM's registers)."""
    if g_tile > 1:
        if tile_m <= PACKED_TILE_ROWS[0]:
            return 4, schedule.pack_occupancy
        return 8, 1
    return schedule.num_worker_warps, schedule.occupancy


@memoize(256)
def merge_constants(g_tile: int, rows: int, splits: int, head_dim: int,
                    write_lse: bool) -> MergeConstants:
    """The merge's tiling: ``rows`` query positions x ``g_tile`` heads x CHUNK_D columns at a
    time, and as many slices per load as MERGE_TILE_ELEMENTS allows."""
    width = max(16, next_power_of_two(head_dim))
    chunk = min(width, MERGE_CHUNK_D, max(16, MERGE_ROW_CHUNK_ELEMENTS // (rows * g_tile)))
    split_tile = min(next_power_of_two(splits),
                     max(1, MERGE_TILE_ELEMENTS // (rows * g_tile * chunk)))
    return MergeConstants(MERGE_ROWS=rows, SPLIT_TILE=split_tile, CHUNK_D=chunk,
                          D_CHUNKS=width // chunk, MERGE_LSE=write_lse)


@memoize(256)
def kernel_with_hints(occupancy: int, num_ctas: int, num_worker_warps: Optional[int],
                      mods_module=None, entry: str = "full"):
    """The kernel object for one set of compiler hints (each keeps its own JIT cache), and with
    a mods module (mods.py) the kernel's copy that calls its score_mod / mask_mod; ``entry``:
    which of the kernel's entries (LaunchPlan.entry)."""
    if entry == "lean" and mods_module is not None:
        raise ValueError("kernel_with_hints: the four-array entry has no mods")
    if entry == "lean":
        from .kernel import attention_forward_lean_kernel as kernel
    else:
        kernel = _attention_kernel(mods_module, entry == "split")
    hints = dict(occupancy=occupancy, num_ctas=num_ctas)
    if num_worker_warps is not None:
        hints["num_worker_warps"] = num_worker_warps
    return kernel.replace_hints(**hints)


# The kernel's stand-ins for the mods (kernel.py), which a copy of the kernel replaces.
_MOD_NAMES = ("_score_mod", "_mask_mod", "_score_mod_grad", "_score_mod_capture_grad")


@memoize(256)
def _attention_kernel(mods_module=None, split: bool = False):
    """The attention kernel's full entry (``split``: its split entry), or with a mods module
    that entry's kernel made from :func:`kernel_copy_with_mods`."""
    import cuda.tile as ct

    from . import kernel as source

    if mods_module is None:
        return source.attention_forward_split_kernel if split else source.attention_forward_kernel
    entry = source.attention_forward_split if split else source.attention_forward
    return ct.kernel(kernel_copy_with_mods(mods_module, entry))


def kernel_copy_with_mods(mods_module, entry: Optional[types.FunctionType] = None
                          ) -> types.FunctionType:
    """A copy of a kernel function (``entry``: the attention forward unless given) whose
    ``_score_mod`` / ``_mask_mod`` are the generated ones: it and every function of its module
    that reaches a mod (found by walking the calls, so a new helper is covered) are copied with
    new globals (cuTile resolves a callee through its caller's globals)."""
    if entry is None:
        from . import kernel as source
        entry = source.attention_forward
    scope = dict(entry.__globals__)
    for name in _MOD_NAMES:
        if hasattr(mods_module, name[1:]):
            scope[name] = getattr(mods_module, name[1:])
    for fn in mod_callers(entry):
        scope[fn.__name__] = _copy_function(fn, scope)
    return scope[entry.__name__]


def mod_callers(entry: types.FunctionType) -> list:
    """The functions reachable from ``entry`` through its globals that call a mod stand-in,
    directly or through others (``entry`` first when it does). They must all live in
    ``entry``'s module: a copy with new mods replaces them there."""
    reached: dict = {}

    def visit(fn) -> bool:
        if fn in reached:
            return reached[fn]
        reached[fn] = False  # (recursion guard)
        calls_mod = False
        for name in fn.__code__.co_names:
            if name in _MOD_NAMES:
                calls_mod = True
            callee = fn.__globals__.get(name)
            if isinstance(callee, types.FunctionType) and visit(callee):
                calls_mod = True
        reached[fn] = calls_mod
        return calls_mod

    visit(entry)
    callers = [fn for fn, calls in reached.items() if calls]
    stray = [fn.__qualname__ for fn in callers if fn.__module__ != entry.__module__]
    if stray:
        raise RuntimeError(f"{stray} call a mod but live outside {entry.__module__}: kernel "
                           "copies with user mods would still run the stand-ins there")
    return callers


def _copy_function(fn: types.FunctionType, scope: dict) -> types.FunctionType:
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__qualname__, clone.__module__ = fn.__qualname__, fn.__module__
    # cuTile reads which parameters are constants from the annotations.
    clone.__annotations__ = dict(fn.__annotations__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    return clone


class Placeholders(NamedTuple):
    """Tiny arrays for the kernel parameters a variant never reads (no LSE, mask or table)."""
    lse: torch.Tensor
    mask: torch.Tensor
    states: torch.Tensor
    ranges: torch.Tensor


def placeholders(device: torch.device, lse_ndim: int, keep: bool) -> Placeholders:
    """Never read, so left uninitialised; reused across calls (allocations are a large part of
    a short call's host time) when the call may keep device memory (memo.py)."""
    if keep:
        kept = _kept_placeholders.get((device, lse_ndim))
        if kept is not None:
            return kept
    made = Placeholders(*(torch.empty((1,) * ndim, dtype=dtype, device=device) for dtype, ndim in
                          ((torch.float32, lse_ndim), (torch.uint8, 4), (torch.int8, 4),
                           (torch.int32, 4))))
    return _kept_placeholders.put((device, lse_ndim), made) if keep else made


_kept_placeholders = Memo("launch placeholders", 16)
# Key-split workspaces kept for reuse (see split_buffers), and the most bytes they may hold.
_split_workspaces = Memo("key-split workspaces", 256)
_MAX_KEPT_WORKSPACE_BYTES = 64 << 20


def split_buffers(views: "BufferViews", device: torch.device,
                   stream: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partial outputs, partial LSEs, arrival counts) of a launch that splits its keys: fp32
    views into one workspace, and the zeroed int32 counts (the kernel leaves them zero). With a
    ``stream`` (raw handle; given when the call may keep device memory) the workspace of a
    (views, device, stream) is kept and reused (a decode call then allocates and views four
    tensors fewer): launches on one stream run in order, so a call's merge has read it before
    the next call's kernel writes it."""
    key = None
    if stream is not None:
        key = (views, device, stream)
        buffers = _split_workspaces.get(key)
        if buffers is not None:
            return buffers
    workspace = torch.empty(views.workspace, dtype=torch.float32, device=device)
    buffers = (workspace.as_strided(*views.part_out, views.part_offset),
               workspace.as_strided(*views.part_lse),
               torch.zeros(views.arrivals, dtype=torch.int32, device=device))
    if key is not None:
        kept = sum(out.untyped_storage().nbytes() for out, *_ in _split_workspaces.values())
        if kept + views.workspace * 4 > _MAX_KEPT_WORKSPACE_BYTES:
            _split_workspaces.clear()  # (a workspace still in use stays alive with its call)
        _split_workspaces.put(key, buffers)
    return buffers


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


class BufferViews(NamedTuple):
    """How a launch views its own buffers, worked out once per plan (per-call host time):
    the shape of the packed ``(B, heads, Sq, pack, D)`` views of the queries and the output, and
    ``(shape, strides)`` of the output's (its layout is :func:`empty_output`'s) and the LSE's
    (None unless packed), and of the key splits' ``(S, B * heads, ...)`` LSEs and outputs in
    one fp32 workspace of ``workspace`` elements (outputs from ``part_offset``) and the shape of
    their ``(B, heads, query tiles)`` arrival counts (None unless split)."""
    group_rows: Optional[tuple]
    out_rows: Optional[tuple]
    lse_rows: Optional[tuple]
    part_lse: Optional[tuple]
    part_out: Optional[tuple]
    part_offset: int
    workspace: int
    arrivals: Optional[tuple]


@memoize(1024)
def buffer_views(batch: int, heads_q: int, heads_grid: int, seq_q: int, head_dim: int,
                 g_tile: int, splits: int, m_tiles: int) -> BufferViews:
    group_rows = out_rows = lse_rows = part_lse = part_out = arrivals = None
    rows_shape = (heads_q, seq_q, head_dim)
    if g_tile > 1:
        pack = heads_q // heads_grid
        rows_shape = (heads_grid, seq_q, pack, head_dim)
        group_rows = (batch,) + rows_shape
        out_rows = (group_rows, _grouped_strides(
            output_strides(batch, heads_q, seq_q, head_dim), pack))
        lse_rows = ((batch,) + rows_shape[:-1], (heads_q * seq_q, pack * seq_q, 1, seq_q))
    offset = workspace = 0
    if splits > 1:  # (splits, B * heads, ...): a slice's rows for all heads and batch rows
        out_shape = (splits, batch * rows_shape[0]) + rows_shape[1:]
        lse_size = math.prod(out_shape[:-1])
        offset = -(-lse_size // 4) * 4  # 16-byte aligned
        workspace = offset + lse_size * head_dim
        part_lse = (out_shape[:-1], _contiguous_strides(out_shape[:-1]))
        part_out = (out_shape, _contiguous_strides(out_shape))
        arrivals = (batch, heads_grid, m_tiles)
    return BufferViews(group_rows, out_rows, lse_rows, part_lse, part_out, offset, workspace,
                       arrivals)


class LaunchArrays(NamedTuple):
    attention: tuple             # Q, K, V, Out, Lse, Mask, TileState, TileRange, Captures (and
                                 # with split keys PartOut, PartLse, Arrivals)
    out: torch.Tensor            # (B, Hq, Sq, D)
    lse: Optional[torch.Tensor]  # (B, Hq, Sq) fp32, or None when not asked for


def launch_arrays(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, mask: Optional[CompactMask | ModMask],
                  keep_for_stream: Optional[int] = None) -> LaunchArrays:
    """The arrays of one launch. Works on meta tensors too, which is how
    :func:`export_signature` sees exactly the arrays a real launch passes.
    ``keep_for_stream``: set (the stream's raw handle) when the call may keep device memory
    (memo.may_keep_device_memory): its placeholders, block tables and key-split workspace are
    then kept for the next calls on that stream; None: everything is made for this call."""
    variant, views = plan.variant, plan.views
    device = query.device
    keep = keep_for_stream is not None
    out = empty_output(query)
    lse = (torch.empty(query.shape[:3], dtype=torch.float32, device=device)
           if plan.return_lse else None)
    q_rows, out_rows, lse_rows = query, out, lse
    if views.group_rows is not None:  # packed: (B, Hkv, Sq, group, ...) views, no copies
        q_rows, out_rows = group_rows(query, views.group_rows), out.as_strided(*views.out_rows)
        if lse is not None:
            lse_rows = lse.as_strided(*views.lse_rows)
    if plan.lean:
        return LaunchArrays((q_rows, key, value, out_rows), out, None)
    unused = placeholders(device, 4 if variant.g_tile > 1 else 3, keep)
    if lse_rows is None:
        lse_rows = unused.lse
    # fp32 partial results per key slice, and the counts that find each query tile's last block
    split = () if views.part_out is None else split_buffers(views, device, keep_for_stream)
    mask_arg, states, ranges = unused.mask, unused.states, unused.ranges
    if isinstance(mask, CompactMask):
        # The kernel reads bool masks as uint8 (same bytes); this runs inside the custom op, so
        # the reinterpretation never reaches a traced graph.
        mask_arg = mask.tensor.view(variant.mask_dtype)
    if mask is not None and variant.constants.MASK_TABLE:
        states, ranges = mask.block_table(variant.tile_m, variant.tile_n, keep)
    captures = () if variant.mods is None else variant.mods.kernel_captures()
    return LaunchArrays((q_rows, key, value, out_rows, lse_rows, mask_arg, states, ranges,
                         captures) + split, out, lse)


def group_rows(tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``(B, Hq, Sq, D)`` seen as ``(B, Hkv, Sq, group, D)``: each kv head's query heads side
    by side in a row, whatever the tensor's strides (a view, no copy; as_strided keeps the
    tensor's storage offset)."""
    return tensor.as_strided(shape, _grouped_strides(tensor.stride(), shape[3]))


def _grouped_strides(stride: tuple, pack: int) -> tuple:
    """The strides of :func:`group_rows`'s view of a tensor with these strides."""
    return (stride[0], pack * stride[1], stride[2], stride[1], stride[3])


def run_kernel(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Optional[CompactMask | ModMask], *, eager: bool = True,
               keep: Optional[bool] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launches the attention kernel on the current stream; returns ``(out, lse)``, ``lse``
    None unless the plan asks for it. ``eager=False`` for the registered op's calls, which keep
    no device memory (memo.may_keep_device_memory: torch.compile's CUDA graphs warm up and
    record them with allocations routed to a graph's memory pool); ``keep``: that answer, when
    the caller has it already."""
    import cuda.tile as ct

    device = query.device
    stream = current_stream(device)
    if keep is None:
        keep = may_keep_device_memory(eager, device)
    arrays = launch_arrays(plan, query, key, value, mask, stream if keep else None)

    with launch_device(device):
        _launch(ct, stream, plan, arrays.attention)
    return arrays.out, arrays.lse


class Relaunch(NamedTuple):
    """A launch made again on other queries, keys and values with the first one's shapes,
    strides, dtypes and device, from the same device and stream (a decode step's later layers).
    Its other arrays (placeholders, mask, tile tables, key-split workspace) are the first
    launch's, kept (see :func:`launch_arrays`), so a call only allocates its output and views
    it and the queries as the kernel reads them. The output comes as ``(B, Sq, Hq, D)``
    contiguous: the layout the op gives it, viewed as a model's layer wants it."""
    plan: LaunchPlan
    stream: int
    device_index: Optional[int]
    attention_tail: tuple          # the launch's arrays after its output
    query_rows: Optional[tuple]    # (shape, strides) of the packed query view; None: unpacked
    out_rows: tuple                # (shape, strides) of the kernel's view of the output
    out_shape: tuple               # (B, Sq, Hq, D)

    def launch(self, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> Optional[torch.Tensor]:
        """The output, or None (nothing launched) when the current device or stream is not
        the first launch's."""
        index = self.device_index
        if torch._C._cuda_getDevice() != index or \
                torch._C._cuda_getCurrentRawStream(index) != self.stream:
            return None
        import cuda.tile as ct

        out = torch.empty(self.out_shape, dtype=query.dtype, device=query.device)
        out_rows = out.as_strided(*self.out_rows)
        q_rows = query if self.query_rows is None else query.as_strided(*self.query_rows)
        _launch(ct, self.stream, self.plan, (q_rows, key, value, out_rows) + self.attention_tail)
        return out


def repeatable_launch(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, mask: Optional[CompactMask | ModMask]) -> Relaunch:
    """The :class:`Relaunch` of an eager call that may keep device memory
    (memo.may_keep_device_memory) and asks for no LSE, its kept arrays made now; it does not
    launch."""
    if plan.return_lse:
        raise ValueError("repeatable_launch: the plan returns an LSE, which a Relaunch does not")
    device = query.device
    stream = current_stream(device)
    arrays = launch_arrays(plan, query, key, value, mask, stream)
    batch, heads, seq, head_dim = query.shape
    rows = plan.views.group_rows
    query_rows = None if rows is None else (rows, _grouped_strides(query.stride(), rows[3]))
    out_rows = plan.views.out_rows or ((batch, heads, seq, head_dim),
                                       output_strides(batch, heads, seq, head_dim))
    # (The first call's own tensors are not kept: its output may be large, in a prefill.)
    return Relaunch(plan, stream, device.index, arrays.attention[4:], query_rows, out_rows,
                    (batch, seq, heads, head_dim))


_SAME_DEVICE = contextlib.nullcontext()  # (reusable: one object, not one per call)


def current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream, which every launch goes on (a
    torch.cuda.Stream object costs several microseconds per call to make)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def launch_device(device: torch.device):
    """The context a launch on ``device`` runs in: cuTile launches into the current device's
    context, so another device is made current for it; nothing when ``device`` already is
    (entering ``torch.cuda.device`` costs host time on every call)."""
    if device.index == torch._C._cuda_getDevice():
        return _SAME_DEVICE
    return torch.cuda.device(device)


def _launch(ct, stream: int, plan: LaunchPlan, attention: tuple) -> None:
    """The attention kernel's launch on its arrays."""
    _naming_the_mods(plan, ct.launch, stream, plan.grid, plan.kernel,  # compiles once
                     attention + plan.trailing_args)


def _naming_the_mods(plan: LaunchPlan, compiles: Callable, *args, **kwargs):
    """``compiles(*args, **kwargs)``, where a cuTile error in a kernel copy with user mods
    becomes one that names the mods and the generated module it came from (else it points into
    kernel.py). A plain call, not a context manager: this runs on every launch."""
    try:
        return compiles(*args, **kwargs)
    except Exception as exc:
        mods = plan.variant.mods
        if mods is None or not type(exc).__module__.startswith("cuda.tile"):
            raise
        raise ModError(f"{mods.names} did not compile in the cuTile kernel (generated code: "
                       f"{mods.path}): {type(exc).__name__}: {exc}") from exc


def array_constraint(tensor: torch.Tensor):
    """What the JIT assumes at launch time about one array: 16-byte aligned (what torch's
    allocator returns), each stride's and extent's divisibility read from the tensor."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint

    ct_dtypes = {torch.float16: ct.float16, torch.bfloat16: ct.bfloat16,
                 torch.float32: ct.float32, torch.uint8: ct.uint8, torch.int8: ct.int8,
                 torch.int16: ct.int16, torch.int32: ct.int32, torch.int64: ct.int64,
                 torch.float8_e4m3fn: ct.float8_e4m3fn, torch.float8_e5m2: ct.float8_e5m2}
    size = tensor.element_size()
    return ArrayConstraint(
        ct_dtypes[tensor.dtype], tensor.dim(), index_dtype=ct.int32,
        stride_lower_bound_incl=0, alias_groups=(), may_alias_internally=False,
        stride_constant=[1 if stride == 1 else None for stride in tensor.stride()],
        stride_divisible_by=[16 // size if stride * size % 16 == 0 else 1
                             for stride in tensor.stride()],
        shape_divisible_by=[16 if extent % 16 == 0 else 1 for extent in tensor.shape],
        base_addr_divisible_by=16)


def export_signature(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor,
                     mask: Optional[CompactMask | ModMask] = None):
    """The :class:`cuda.tile.compilation.KernelSignature` of the attention kernel's entry, as a
    launch of ``plan`` on these tensors compiles it (meta tensors are fine): an export compiles
    the same code (TMA loads and all) that runs."""
    import cuda.tile as ct
    from cuda.tile.compilation import (CallingConvention, KernelSignature, ScalarConstraint,
                                       TupleConstraint)

    arrays = launch_arrays(plan, query, key, key, mask).attention
    if plan.lean:  # four arrays, no captures
        params = [array_constraint(a) for a in arrays]
    else:  # the arrays, the captures tuple (calling convention v2 has tuple parameters), then
        # a split launch's partial results and counts
        params = [array_constraint(a) for a in arrays[:8]]
        params.append(TupleConstraint([array_constraint(a) for a in arrays[8]]))
        params += [array_constraint(a) for a in arrays[9:]]
    scalars = [ScalarConstraint(ct.float32), ScalarConstraint(ct.float32),
               ScalarConstraint(ct.int32), ScalarConstraint(ct.int32), ScalarConstraint(ct.int32)]
    return KernelSignature(params + scalars + list(plan.trailing_args[len(scalars):]),
                           CallingConvention.cutile_python_v2())


def export_cubin(plan: LaunchPlan, query: torch.Tensor, key: torch.Tensor,
                 mask: Optional[CompactMask | ModMask] = None, *, arch: str) -> bytes:
    """The cubin a launch of ``plan`` on these tensors compiles for ``arch`` (e.g. "sm_90"),
    built without a GPU by cuTile's exporter."""
    import io

    from cuda.tile.compilation import export_kernel

    signature = export_signature(plan, query, key, mask)
    buffer = io.BytesIO()
    _naming_the_mods(plan, export_kernel, plan.kernel, [signature], buffer, gpu_code=arch,
                     output_format="cubin")
    return buffer.getvalue()
