"""The kernel's schedule: every tuning knob in one frozen dataclass, plus the default table.

A researcher changes how the kernel runs by editing a :class:`Schedule` in Python, never the
kernel: pass ``schedule=`` to :func:`hf_tiled_attention.tiled_attention`, or wrap code in
``with use_schedule(...)``. Fields left as ``None`` in an override keep the default table's value
for the call's (arch, dtype, head dim, causal).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .memo import memoize

_POWERS_OF_TWO = (16, 32, 64, 128, 256)
_BOOL_FIELDS = ("heavy_first", "pack_gqa", "split_head_dim")
# A packed tile (decode) has at least the warpgroup MMA's 64 rows and at most two warpgroups'.
PACKED_TILE_ROWS = (64, 128)


@dataclass(frozen=True)
class Schedule:
    """How the cuTile kernel tiles and schedules one attention call.

    Attributes:
        tile_m: query rows per block (power of two, 16..256).
        tile_n: keys per inner-loop step (power of two, 16..256).
        occupancy: blocks the compiler should plan to fit on one SM (1..32).
        num_ctas: CTAs per cluster (1, 2, 4, ...; 1 = no clusters).
        num_worker_warps: warps that do the math in the compiler's warp-specialised kernel
            (4 = one warpgroup, 8 = two; the compiler adds its own load warps). With 8, a
            128-row tile runs as two 64-row warpgroups that share each K/V tile.
        k_latency: load latency hint for K tiles (1 low .. 10 high DRAM traffic).
        v_latency: load latency hint for V tiles.
        heavy_first: with causal masking, launch the query tiles with the most keys first.
        kv_splits: blocks that share one query tile's keys, merged by their LSE by the last
            of them to finish, in the same launch (1 = never; 0 = automatic: split only when
            the query tiles cannot fill the GPU).
            Applies to queries of at most DECODE_QUERY_ROWS (16) rows; longer ones never split
            (their merge faulted on the H200 for some shapes; perf-notes step 18).
        pack_gqa: short queries (at most 16 rows, decode) with GQA/MQA: a tile's rows are the
            query heads of one kv head (up to 16 of them) at a few positions, 64 or 128 rows,
            so K/V are read once per group and the MMA stays the warpgroup MMA.
        split_head_dim: a head dim that is a power of two plus a smaller one (80 = 64 + 16,
            96 = 64 + 32, 160 = 128 + 32) runs as two tiles instead of one zero-padded to the
            next power of two (which does 1.6x the MMA work at 80). Other head dims are padded.
        pack_tile_m: the most rows of a packed tile (64 or 128): a packed call takes the
            smaller of 64 and this that holds its group's heads x positions (fewer real rows
            are zero padding: decode is bound by reading K/V, not by the MMA). A packed tile
            runs one warpgroup (4 worker warps) per 64 rows.
        pack_occupancy: blocks per SM for a 64-row packed tile (a 128-row one, two
            warpgroups, takes an SM's registers and runs at occupancy 1).
    """

    tile_m: Optional[int] = None
    tile_n: Optional[int] = None
    occupancy: Optional[int] = None
    num_ctas: Optional[int] = None
    num_worker_warps: Optional[int] = None
    k_latency: Optional[int] = None
    v_latency: Optional[int] = None
    heavy_first: Optional[bool] = None
    kv_splits: Optional[int] = None
    pack_gqa: Optional[bool] = None
    split_head_dim: Optional[bool] = None
    pack_tile_m: Optional[int] = None
    pack_occupancy: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("tile_m", "tile_n"):
            value = getattr(self, name)
            if value is not None and value not in _POWERS_OF_TWO:
                raise ValueError(f"Schedule.{name} must be one of {_POWERS_OF_TWO}, got {value!r}")
        _check_range("occupancy", self.occupancy, 1, 32)
        _check_range("k_latency", self.k_latency, 1, 10)
        _check_range("v_latency", self.v_latency, 1, 10)
        _check_range("kv_splits", self.kv_splits, 0, 256)
        _check_range("pack_occupancy", self.pack_occupancy, 1, 32)
        if self.pack_tile_m is not None and self.pack_tile_m not in PACKED_TILE_ROWS:
            raise ValueError(f"Schedule.pack_tile_m must be one of {PACKED_TILE_ROWS}, got "
                             f"{self.pack_tile_m!r}")
        if self.num_ctas is not None and self.num_ctas not in (1, 2, 4, 8, 16):
            raise ValueError(f"Schedule.num_ctas must be one of 1, 2, 4, 8, 16, got "
                             f"{self.num_ctas!r}")
        if self.num_worker_warps is not None and self.num_worker_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError("Schedule.num_worker_warps must be a power of two from 1 to 32 "
                             f"(4 or 8 with tileiras 13.4), got {self.num_worker_warps!r}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"Schedule.{name} must be a bool, got {value!r}")

    def merged_over(self, base: "Schedule") -> "Schedule":
        """This schedule's set fields on top of ``base``'s."""
        changes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) is not None}
        return dataclasses.replace(base, **changes)

    def label(self) -> str:
        """The set fields as ``name=value`` pairs, e.g. ``tile_m=64;occupancy=2`` ("default"
        when nothing is set)."""
        return ";".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) is not None) or "default"

    def as_list(self) -> list[int]:
        """Integer encoding (-1 = unset) to pass a schedule through the torch custom op."""
        return [-1 if getattr(self, f.name) is None else int(getattr(self, f.name))
                for f in dataclasses.fields(self)]

    @classmethod
    def parse_field(cls, name: str, text: str):
        """One field's value from text (``tile_m`` "64" -> 64, ``heavy_first`` "true" -> True)."""
        if name not in {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"Schedule has no field {name!r}")
        if name in _BOOL_FIELDS:
            if text.lower() not in ("0", "1", "false", "true"):
                raise ValueError(f"Schedule.{name} expects true/false/1/0, got {text!r}")
            return text.lower() in ("1", "true")
        return int(text)

    @classmethod
    def from_list(cls, values: list[int]) -> "Schedule":
        """The schedule :meth:`as_list` encoded (the registered op decodes one per call, so a
        decoded list is remembered)."""
        return _decoded(cls, tuple(values))


@memoize(256)
def _decoded(cls: type, values: tuple) -> Schedule:
    fields = dataclasses.fields(cls)
    if len(values) != len(fields):
        raise ValueError(f"expected {len(fields)} schedule values, got {len(values)}")
    decoded = {}
    for f, v in zip(fields, values):
        if v != -1:
            decoded[f.name] = bool(v) if f.name in _BOOL_FIELDS else int(v)
    return cls(**decoded)


def _check_range(name: str, value: Optional[int], low: int, high: int,
                 owner: str = "Schedule") -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{owner}.{name} must be an int in [{low}, {high}], got {value!r}")


# Queries of at most DECODE_QUERY_ROWS rows (decode, speculative decoding) pack the query heads of
# a kv head into one tile and split the keys to fill the GPU (the launcher's decode path).
DECODE_QUERY_ROWS = 16
# "short" calls: at most SHORT_QUERY_ROWS query rows (half of a 128-row tile at most: perf-notes
# step 15) or at most SHORT_KEYS keys (two 64-row CTAs per SM hide each other's prologue and
# epilogue, which a short key loop exposes: steps 5 and 17).
SHORT_QUERY_ROWS = 64
SHORT_KEYS = 2048
CALL_KINDS = ("long", "short", "decode")


@dataclass(frozen=True)
class TableRow:
    """One row of the default table: the schedule for calls on ``arch`` (major) whose head-dim
    class (:func:`head_dim_class`) is in ``head_dims``, whose causal flag is in ``causal`` and
    whose call kind is in ``kinds`` (None: any), and why (the measurement behind it)."""
    arch: int
    head_dims: Optional[tuple]
    causal: Optional[tuple]
    kinds: Optional[tuple]
    schedule: Schedule
    why: str

    def matches(self, arch: int, head_dim: str, causal: bool, kind: str) -> bool:
        return (self.arch == arch and (self.head_dims is None or head_dim in self.head_dims)
                and (self.causal is None or causal in self.causal)
                and (self.kinds is None or kind in self.kinds))


# Every field set: the tiles of the rows below replace a few.
_BASE = Schedule(tile_m=128, tile_n=64, occupancy=1, num_ctas=1, num_worker_warps=4,
                 k_latency=2, v_latency=4, heavy_first=True, kv_splits=1, pack_gqa=False,
                 split_head_dim=True, pack_tile_m=128, pack_occupancy=1)
ONE_WARPGROUP = dataclasses.replace(_BASE, tile_m=64, tile_n=128, occupancy=2, pack_occupancy=2)
TWO_WARPGROUPS = dataclasses.replace(_BASE, tile_m=128, tile_n=128, num_worker_warps=8)
WIDE_HEAD = dataclasses.replace(_BASE, tile_m=128, tile_n=64, num_worker_warps=8)

# The default table, first matching row wins (H200 measurements: eval/results/nvidia-h200/,
# perf-notes.md by step). Other archs take the sm_90 rows.
TABLE: tuple[TableRow, ...] = (
    TableRow(9, ("64", "128", "32+"), (False,), ("long",), TWO_WARPGROUPS,
             "two 64-row warpgroups sharing each K/V tile win without causal masking and lose "
             "with it (step 5); 48 = 32 + 16 is in the 64 tile's class"),
    TableRow(9, ("256",), None, None, WIDE_HEAD,
             "D=256: 128x64 tiles with two warpgroups; 64x64 with one is slower (step 5)"),
    TableRow(9, ("128+",), None, None, TWO_WARPGROUPS,
             "128 + a smaller tile (144, 160, 192): 128x128 with two warpgroups, even for "
             "short calls, where a 64-row tile is short of registers (step 16)"),
    TableRow(9, None, None, None, ONE_WARPGROUP,
             "one warpgroup per 64-row tile, two tiles per SM (step 1): causal "
             "masking (step 5), short calls (steps 15, 17), 64 + a smaller tile (step 9)"),
)
# On top of the row, per call kind.
KIND_OVERRIDES = {
    "decode": (Schedule(pack_gqa=True, kv_splits=0),
               "decode packs a kv head's query heads into one tile and splits the keys over "
               "about one wave of blocks (step 18)"),
}
# Key splits and GQA packing for long queries lost on the H200 (step 7); the head-dim split won
# (step 9): _BASE keeps kv_splits=1, pack_gqa=False, split_head_dim=True.


def head_dim_tile(head_dim: int) -> int:
    """The next power of two: a head dim's padded tile (zero-padded on load, clipped on store)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def head_dim_parts(head_dim: int, split: bool) -> tuple[int, int]:
    """The kernel's (TILE_D, TAIL_D): with ``split``, a head dim that is a power of two plus a
    smaller power of two >= 16 (the MMA's depth) runs as those two tiles; otherwise one padded
    tile and no tail."""
    lead = 1 << (head_dim.bit_length() - 1)
    tail = head_dim - lead
    if split and tail >= 16 and tail & (tail - 1) == 0:
        return lead, tail
    return head_dim_tile(head_dim), 0


def head_dim_class(head_dim: int) -> str:
    """The table's head-dim key: the padded tile ("16" .. "256"), or "64+" / "128+" for a head
    dim that runs as that power of two plus a smaller tile (80, 96; 144, 160, 192)."""
    lead, tail = head_dim_parts(head_dim, split=True)
    return f"{lead}+" if tail else str(lead)


def call_kind(seq_q: Optional[int], seq_kv: Optional[int]) -> str:
    """"decode" (at most DECODE_QUERY_ROWS queries), "short" (at most SHORT_QUERY_ROWS queries or
    SHORT_KEYS keys) or "long"; unknown lengths count as long."""
    if seq_q is not None and seq_q <= DECODE_QUERY_ROWS:
        return "decode"
    if (seq_q is not None and seq_q <= SHORT_QUERY_ROWS) or (
            seq_kv is not None and seq_kv <= SHORT_KEYS):
        return "short"
    return "long"


def table_row(arch_major: int, head_dim: int, causal: bool, kind: str) -> TableRow:
    """The default table's row for one call (sm_90's rows for archs without their own)."""
    key = (head_dim_class(head_dim), bool(causal), kind)
    for arch in (arch_major, 9):
        for row in TABLE:
            if row.matches(arch, *key):
                return row
    raise LookupError(f"no default schedule for head dim {head_dim}")  # (TABLE's last row)


def default_schedule(arch_major: int, dtype: torch.dtype, head_dim: int, causal: bool,
                     seq_q: Optional[int] = None, seq_kv: Optional[int] = None) -> Schedule:
    """The default table's schedule for one call (``dtype`` is not part of the key yet: fp16
    and bf16 share one instruction path). ``seq_q`` / ``seq_kv``, when known, pick the call
    kind (:func:`call_kind`)."""
    del dtype
    return _table_entry(arch_major, head_dim, causal, call_kind(seq_q, seq_kv))


def _table_entry(arch_major: int, head_dim: int, causal: bool, kind: str) -> Schedule:
    schedule = table_row(arch_major, head_dim, causal, kind).schedule
    if kind in KIND_OVERRIDES:
        schedule = KIND_OVERRIDES[kind][0].merged_over(schedule)
    return schedule


_override: contextvars.ContextVar[Optional[Schedule]] = contextvars.ContextVar(
    "hf_tiled_attention_schedule", default=None)


def active_override() -> Optional[Schedule]:
    """The schedule set by the innermost ``use_schedule`` block, if any."""
    return _override.get()


@contextlib.contextmanager
def use_schedule(schedule: Schedule) -> Iterator[Schedule]:
    """Use ``schedule`` (on top of the defaults) for every call inside the block."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"use_schedule expects a Schedule, got {type(schedule).__name__}")
    token = _override.set(schedule)
    try:
        yield schedule
    finally:
        _override.reset(token)


def resolve_schedule(explicit: Optional[Schedule], arch_major: int, dtype: torch.dtype,
                     head_dim: int, causal: bool, tuned: Optional[Schedule] = None,
                     seq_q: Optional[int] = None, seq_kv: Optional[int] = None) -> Schedule:
    """Complete schedule for a call: default table (or the autotuner's ``tuned`` entry on top of
    it), then ``use_schedule``, then ``schedule=``. Memoised: it runs on every kernel call."""
    return _layered(explicit, _override.get(), tuned, arch_major, head_dim, causal,
                    call_kind(seq_q, seq_kv))


@memoize(1024)
def _layered(explicit: Optional[Schedule], override: Optional[Schedule],
             tuned: Optional[Schedule], arch_major: int, head_dim: int, causal: bool,
             kind: str) -> Schedule:
    schedule = _table_entry(arch_major, head_dim, causal, kind)
    for layer in (tuned, override, explicit):
        if layer is not None:
            schedule = layer.merged_over(schedule)
    return schedule


# ---------------------------------------------------------------------------------------------
# The backward's tiles
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BackwardSchedule:
    """How the backward kernels (backward_kernel.py) tile one call.

    Attributes:
        kv_keys: keys per dK/dV block (its accumulators: kv_keys x D for dK and for dV).
        kv_queries: query rows per step of the dK/dV block's loop.
        q_rows: query rows per dQ block (its accumulator: q_rows x D).
        q_keys: keys per step of the dQ block's loop.
        kv_warps / q_warps: warps doing the math in a block of each kernel (8: two
            warpgroups).
        kv_occupancy / q_occupancy: blocks per SM the compiler plans for.
        load_transposed: a tile needed as a transposed MMA operand (Q and dOut in the dK/dV
            kernel, K and V in the dQ kernel) is loaded a second time, transposed, instead of
            transposed in registers.
        dq_add: the dK/dV kernel also makes dQ (one more MMA per step, ``(K^T dS^T)^T``) and
            adds it into an fp32 array with TMA reduce-adds, and the dQ kernel is not launched
            (the fast mode: the order of the adds, and so dQ's last bits, vary run to run);
            taken only when the backward need not be deterministic
            (determinism.deterministic()), else the dQ kernel runs as without it.
        table_order: with a mask that has a row per query, the blocks of both kernels take
            their tiles (key tiles in dK/dV, query tiles in dQ) in the order of the block
            table's walk lengths, longest first (kernel_params.RANGE_ORDER), instead of grid
            order: a mask's long walks (a long document's first key tiles) then do not start
            last and run alone at the end of the launch.
        split_head_dim: a head dim that is a power of two plus a smaller one (80, 96, 144,
            160, 192) runs as those two tiles in both kernels (head_dim_parts, as the forward's
            Schedule.split_head_dim), instead of zero-padded to the next power of two.
        edge_states: with a mask that has a row per query (a mask_mod, a per-row bool or
            additive mask), each step outside a tile's run of full tiles reads the tile's state
            from the block table and skips an empty tile (True), or applies the mask to every
            such step without reading the state (False: no load in the step's critical path and
            no data-dependent branch around its loads and MMAs; an empty tile inside the walked
            range, which the table's jumped gap does not cover, is then computed and contributes
            exactly 0). False in the table's D=128 row, where it measured faster with
            documents and windows (perf-notes step 46).
        pdl: the dK/dV and dQ kernels are launched as programmatic dependents (cuTile's
            ``programmatic_dependent_launch``): their blocks start as the kernel before them
            ends, load their K/V (Q/dOut) tiles and wait for it (``grid_dependency_control_wait``)
            only before reading the rows it wrote; the Delta and dK/dV kernels let them start
            (``grid_dependency_control_launch_dependents``) once each of their blocks began.
            The same gradients, bitwise.
        unchecked_loads: the steps of both kernels load their query rows' LSE and Delta and
            their block-table states without bounds checks (cuTile's ``check_bounds=False``:
            no per-element index compares and selects in the loop), which needs the Delta
            kernel to write those rows padded to whole tiles of every kernel
            (backward_launch.padded_rows; a padded row has LSE +inf and Delta 0, so its
            recomputed probabilities are 0, as a checked load's padding gave). The same
            gradients, bitwise; 1.08x faster over the standard bf16 sweep on the H200
            (perf-notes step 43): on by default.
        rows_tile / rows_warps / rows_occupancy: query rows per block of the Delta kernel
            (rowsum(dOut * Out) and the LSE in score units), its warps, and its blocks per SM.
            Without hints the compiler gave it 255 registers and one block per SM: 121 us at
            B=4, S=4k, 32 heads, D=128 on the H200; four blocks of four warps (64 registers):
            78 us (perf-notes step 29).
    """
    kv_keys: int
    kv_queries: int
    q_rows: int
    q_keys: int
    kv_warps: int = 8
    q_warps: int = 8
    kv_occupancy: int = 1
    q_occupancy: int = 1
    load_transposed: bool = False
    dq_add: bool = False
    table_order: bool = False
    edge_states: bool = True
    split_head_dim: bool = True
    pdl: bool = False
    unchecked_loads: bool = True
    rows_tile: int = 64
    rows_warps: int = 4
    rows_occupancy: int = 4

    def __post_init__(self) -> None:
        for name in ("kv_keys", "kv_queries", "q_rows", "q_keys", "rows_tile"):
            if getattr(self, name) not in _POWERS_OF_TWO:
                raise ValueError(f"BackwardSchedule.{name} must be one of {_POWERS_OF_TWO}, got "
                                 f"{getattr(self, name)!r}")
        for name in ("kv_warps", "q_warps", "rows_warps"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"BackwardSchedule.{name} must be 4 or 8, got "
                                 f"{getattr(self, name)!r}")
        for name in ("kv_occupancy", "q_occupancy", "rows_occupancy"):
            _check_range(name, getattr(self, name), 1, 32, "BackwardSchedule")


# By head dim (16..256), first row whose limit is at least it. Measured on the H200 (bf16, B=4,
# 32 query heads; perf-notes step 27): a dK/dV block keeps two fp32 accumulators of its keys x
# D, and its loop's transposed score tile is keys x queries: at D=128 a 32-row query step beats
# a 64-row one 2.3x (4.8 vs 11.2 ms at S=4k), the 64-row step spilled then (it no longer
# spills and is 1.10-1.18x slower: step 47). dq_add (dQ in the dK/dV block as (K^T dS^T)^T,
# TMA reduce-adds; the fast mode, not taken when the backward must be deterministic) is on
# where it measured faster: D <= 64, 1.03-1.19x (perf-notes step 46); at D=128 it measured
# 0.86-1.03x at its best tiles (128 keys x 64 rows; as dS K there, the same: step 47) and
# 0.70-0.81x at the table's, so the two-kernel dQ pass stays there.
BACKWARD_TABLE: tuple[tuple[int, BackwardSchedule, str], ...] = (
    (64, BackwardSchedule(kv_keys=64, kv_queries=64, q_rows=64, q_keys=64, kv_warps=4,
                          q_warps=4, kv_occupancy=2, q_occupancy=2, dq_add=True),
     "one warpgroup, two blocks per SM for both kernels: 276 / 268 TF/s (causal / not) at "
     "D=64, S=4k; 128-key dK/dV blocks lose 10-20%. dQ added by the dK/dV kernel (fast "
     "mode): 2.39 / 4.29 ms at B=4, S=4k, 32/32 against 2.58 / 5.03 (perf-notes step 46)"),
    (128, BackwardSchedule(kv_keys=128, kv_queries=32, q_rows=128, q_keys=64,
                           edge_states=False),
     "dK/dV 128 keys x 32-row query steps, dQ 128 rows x 64 keys, two warpgroups each: 381 / "
     "374 TF/s at S=4k; 64-row dK/dV steps spilled then (203 TF/s; no spill now, 1.10-1.18x "
     "slower: perf-notes step 47), loading Q transposed instead of transposing it costs "
     "5-20%. A mask's edge steps without their tile states: documents 1.49 against 1.86 ms, a "
     "1024-key window 2.03 against 2.18 (B=4, S=4k, 32/8; perf-notes step 46)"),
    (160, BackwardSchedule(kv_keys=64, kv_queries=32, q_rows=128, q_keys=32, rows_tile=32),
     "D=129..160 (128 + 32): the D=256 row with 32-row dK/dV query steps, which do not spill "
     "(64-row ones spill 352 B): 14.9 / 7.9 ms at B=4, S=4k, 32/8 (not causal / causal) "
     "against 17.2 / 9.3 (perf-notes step 43)"),
    (192, BackwardSchedule(kv_keys=64, kv_queries=64, q_rows=128, q_keys=32, rows_tile=32,
                           unchecked_loads=False),
     "D=161..192: the D=256 row with checked loads: its step loops reload 14-18 spilled values "
     "instead of 22-26 (perf-notes step 43): 16.2 / 10.1 ms at B=4, S=4k, 32/8 (not causal / "
     "causal) against 22.3 / 9.1 with unchecked loads"),
    (256, BackwardSchedule(kv_keys=64, kv_queries=64, q_rows=128, q_keys=32, rows_tile=32),
     "D=193..256: dK/dV 64 x 64 and dQ 128 x 32, two warpgroups: 1.99 / 1.24 ms at B=4, S=2k, "
     "16 heads against 2.44 / 1.46 with 64 x 64 dQ blocks; 32-row dK/dV query steps spill "
     "less (24 B at D=192, none at 256, against 472 / 544) but ran 1.05-1.30x slower (step 43); "
     "32-row Delta blocks fit its hints' 64 registers (64 rows took 255)"),
)

# A schedule that replaces the table's for every backward (set_backward_schedule). A plain
# global, not a context variable: autograd runs a CUDA backward on its own thread.
_backward_override: Optional[BackwardSchedule] = None


def set_backward_schedule(schedule: Optional[BackwardSchedule]) -> None:
    """Run every backward with ``schedule`` instead of ``BACKWARD_TABLE``'s row (None: the
    table again); for measuring schedules (the dev scripts beside their results in
    eval/results/nvidia-h200/backward/)."""
    global _backward_override
    if schedule is not None and not isinstance(schedule, BackwardSchedule):
        raise TypeError(f"set_backward_schedule expects a BackwardSchedule or None, got "
                        f"{type(schedule).__name__}")
    _backward_override = schedule


def backward_schedule(head_dim: int) -> BackwardSchedule:
    """The backward's tiles for a head dim (16..256): set_backward_schedule's, else the
    table's."""
    if _backward_override is not None:
        return _backward_override
    for limit, schedule, _ in BACKWARD_TABLE:
        if head_dim <= limit:
            return schedule
    raise LookupError(f"no backward schedule for head dim {head_dim}")


# The paged launch that reads whole-block requests (varlen_kernel BLOCKS) loads the first slots
# of the next 0, 1 or 2 tiles while tile j computes (decode-shaped tiles, prefill-shaped ones),
# so a block load's address need not wait on a slot load (a global load's latency is about a
# 64-key tile's read time per SM at the copy rate). One tile ahead in decode: at 128-key tiles
# 2.49 / 2.55 TB/s against 2.50 / 2.54 without, at 64 keys 2.21 / 2.28 against 2.08 / 2.07
# (H100, R=32 x 16k and R=256 x 4k keys, perf-notes step 57). Prompt chunks through the cache
# ran 1.11-1.12x faster without it under the compiler's load hints (step 67); with the hints
# now used, 0, 1 and 2 tiles ahead are the next run's variants (.pending/README.md).
VARLEN_PREFETCH_TILES = (1, 1)

# Blocks per SM for the decode-shaped tiles that stream keys (the packed kernel, and the paged
# launch that reads whole blocks): left to the compiler they take 211 KB of shared memory, one
# block per SM, whose start and drain a request of a few key tiles cannot hide. With 2, paged
# steps read 0.78-0.95x the copy rate from 268 MB to 8.6 GB against 0.61-0.91x (H100, graph
# replay, perf-notes step 63). The row-gathering launch keeps the compiler's choice (at 2 it
# spills 632 B and did not compile within 100 s). Head dims up to 128 only: at D=256 both entries
# spill already with one block per SM (sm_90 cubins: 552 / 160 B of stack, 760 / 320 at two).
VARLEN_DECODE_OCCUPANCY = 2
VARLEN_DECODE_OCCUPANCY_MAX_D = 128

# Worker warps for the varlen kernel's prefill-shaped tiles (128 x 64, a prompt chunk in a
# serving step). Left to the compiler they run one warpgroup and spill 264-1800 B at D=128; with
# two warpgroups (as the forward's 128-row tiles run) 16-640 B, and chunks of 128-2048 queries
# over 4k-16k keys ran 1.34-1.59x faster through the cache's slots and 2.08-2.09x over packed
# keys (183-224 -> 246-467 TF/s; H200, graph replay, perf-notes step 64).
VARLEN_PREFILL_WORKER_WARPS = 8

# Load latency hints (1 low .. 10 high DRAM traffic) for the K and V tiles of the varlen
# kernel's prefill-shaped tiles; None leaves one to the compiler. The forward kernel's 2 and 4
# (Schedule.k_latency / v_latency) won at every point tried, chunks of 128-512 queries over 4k
# keys: 1.36-1.43x through the cache's pages, 1.10-1.17x over packed keys against the
# compiler's choice (H100, perf-notes step 67; 1/1, 4/4, 3/6, 2/8, 4/8, 8/8 lost on a mode).
VARLEN_PREFILL_LATENCY = (2, 4)


def varlen_tiles(max_seqlen_q: int, g_tile: int) -> tuple[int, int]:
    """(rows, keys) per tile of the packed-requests kernel (varlen_kernel.py): a decode step's
    tile holds one position of a head group and streams key tiles (its time is reading K/V):
    128 keys, from packed keys or a paged cache (the paged block launch at 128 keys read 2.49 /
    2.55 TB/s, 0.82-0.84x the copy rate, against 2.21 / 2.28 at 64, H100, R=32 x 16k and
    R=256 x 4k keys, perf-notes step 57); a prefill chunk's takes the forward's 128 x 64 tiles
    (at D=128 and 256, 64 x 64 and 64 x 32 tiles reading a paged cache fail in tileiras 13.x,
    128 x 64 compiles)."""
    if max_seqlen_q * g_tile <= 16:
        return 16, 128
    return 128, 64


# The FP8 forward (fp8_kernel.py). Compiler hints, measured on the H200 (B=2, S=8k, 32/8 heads,
# D=128; perf-notes step 53): one block per SM with 8 worker warps, 459 / 422 TF/s (not causal /
# causal) against 183 / 171 with the compiler's warps and 400 / 347 at two blocks per SM with 4.
# No clusters: with num_ctas=2 the kernel stops with "misaligned address" (cuTile 1.7).
FP8_HINTS = {"occupancy": 1, "num_ctas": 1, "num_worker_warps": 8}


def fp8_quant_tokens(head_dim: int) -> int:
    """Tokens per block of the FP8 quantisation kernels (fp8_quant_kernel.py): 128 at head dims
    up to 64, else 64 (a block holds its tile in fp32 beside the rotated copy; sm_90 cubins: K's
    block spills them at 128 x 128, and some at 64 x 256; 32 tokens leave the warpgroup MMA,
    whose tiles start at 64 rows, and spill far more)."""
    return 128 if head_dim <= 64 else 64


def fp8_tiles(head_dim: int) -> tuple[int, int]:
    """(query rows, keys) per tile of the FP8 forward; the keys per tile also set where its CPU
    twin (fp8.reference) rounds the probabilities, so both read this."""
    return (128, 128) if head_dim <= 128 else (128, 64)


# The FP8 KV cache's decode kernel (fp8_cache_kernel.py): keys per step, rows per tile (the
# warpgroup MMA's 64; 128-row tiles spill at D = 128 in sm_90 cubins), blocks per SM, and the
# tokens per block of its quantisation kernel, and its MMAs' operands. QK^T in 16 bits: in e4m3
# (two query parts) the H200's suite measured 1.0-2.0e-2 of error where a channel of the query
# and the key is 30x the rest (sm_90's e4m3 MMA sums its products aligned to the largest with
# ~13 bits: perf-notes step 55); PV in e4m3, two parts (one part: 2.7e-2 of error, session 33).
FP8_CACHE_KEYS = 64
FP8_CACHE_ROWS = 64
FP8_CACHE_OCCUPANCY = 2
FP8_CACHE_LATENCY = (2, 4)  # K's and V's load latency hints, as the bf16 kernel's
FP8_CACHE_QK_PARTS = 0      # QK^T: 0 in 16 bits (K converted); 1 or 2 e4m3 query parts
FP8_CACHE_PV_PARTS = 2      # PV: 0 in 16 bits (V converted); 1 or 2 e4m3 probability parts
FP8_CACHE_QUANT_TOKENS = 64
# Fast accumulation truncates the running PV sum at every MMA, so its error grows with the key
# tiles one block sums: against fp64, 3.8e-2 (the e4m3 cache's rounding) became 3.9e-2 at 256
# unsplit tiles and 4.7e-2 at 1024 (perf-notes step 61). Past this many tiles a block
# accumulates exactly; at 128 the growth, if linear in tiles, adds under 1% to the error.
FP8_CACHE_FAST_ACC_TILES = 128


def fp8_cache_pv_fast_acc(head_dim: int, tiles_per_block: int) -> bool:
    """Whether the decode kernel's e4m3 PV MMAs use fast accumulation (no fp32 add of each
    MMA's result into the accumulator: 128 FADD fewer per 64-key step in the sm_90 cubin at
    D=128): only where each block sums at most FP8_CACHE_FAST_ACC_TILES key tiles, and not at
    D=256, where it spills more (sm_90 cubin: 1136 B of stack against 904)."""
    return head_dim_tile(head_dim) <= 128 and tiles_per_block <= FP8_CACHE_FAST_ACC_TILES
