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
import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

_POWERS_OF_TWO = (16, 32, 64, 128, 256)
_BOOL_FIELDS = ("heavy_first", "pack_gqa", "split_head_dim")


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
        kv_splits: blocks that share one query tile's keys, merged afterwards by their LSE
            (1 = never; 0 = automatic: split only when the query tiles cannot fill the GPU).
            Applies to queries of at most DECODE_QUERY_ROWS (16) rows; longer ones never split
            (their merge faulted on the H200 for some shapes; perf-notes step 18).
        pack_gqa: short queries (at most 16 rows, decode) with GQA/MQA: a tile's rows are the
            query heads of one kv head (up to 16 of them) at a few positions, 64 or 128 rows,
            so K/V are read once per group and the MMA stays the warpgroup MMA.
        split_head_dim: a head dim that is a power of two plus a smaller one (80 = 64 + 16,
            96 = 64 + 32, 160 = 128 + 32) runs as two tiles instead of one zero-padded to the
            next power of two (which does 1.6x the MMA work at 80). Other head dims are padded.
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

    def __post_init__(self) -> None:
        for name in ("tile_m", "tile_n"):
            value = getattr(self, name)
            if value is not None and value not in _POWERS_OF_TWO:
                raise ValueError(f"Schedule.{name} must be one of {_POWERS_OF_TWO}, got {value!r}")
        _check_range("occupancy", self.occupancy, 1, 32)
        _check_range("k_latency", self.k_latency, 1, 10)
        _check_range("v_latency", self.v_latency, 1, 10)
        _check_range("kv_splits", self.kv_splits, 0, 256)
        if self.num_ctas is not None and self.num_ctas not in (1, 2, 4, 8, 16):
            raise ValueError(f"Schedule.num_ctas must be one of 1, 2, 4, 8, 16, got {self.num_ctas!r}")
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


@functools.lru_cache(maxsize=256)
def _decoded(cls: type, values: tuple) -> Schedule:
    fields = dataclasses.fields(cls)
    if len(values) != len(fields):
        raise ValueError(f"expected {len(fields)} schedule values, got {len(values)}")
    decoded = {}
    for f, v in zip(fields, values):
        if v != -1:
            decoded[f.name] = bool(v) if f.name in _BOOL_FIELDS else int(v)
    return cls(**decoded)


def _check_range(name: str, value: Optional[int], low: int, high: int) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"Schedule.{name} must be an int in [{low}, {high}], got {value!r}")


# The default table. Keyed by (arch major, head-dim tile, causal); dtype-independent for now
# because fp16 and bf16 share one instruction path. Values measured on the H200 (sm_90) live in
# eval/results/<gpu>/; other archs use the sm_90 entries.
_BASE = Schedule(tile_m=128, tile_n=64, occupancy=1, num_ctas=1, num_worker_warps=4,
                 k_latency=2, v_latency=4, heavy_first=True,
                 # perf-notes: key splits and GQA packing for long queries (step 7) lost on the
                 # H200 and stay off; the head-dim split (step 9) won.
                 kv_splits=1, pack_gqa=False, split_head_dim=True)
# One warpgroup per 64-row tile, two tiles per SM (schedule-sweep-1).
_ONE_WARPGROUP = dataclasses.replace(_BASE, tile_m=64, tile_n=128, occupancy=2)
# Two warpgroups (64 rows each) sharing every K/V tile: FlashAttention-3's 128-row shape.
_TWO_WARPGROUPS = dataclasses.replace(_BASE, tile_m=128, tile_n=128, occupancy=1,
                                      num_worker_warps=8)
_DEFAULTS: dict[tuple[int, int, bool], Schedule] = {}
for _tile_d in (16, 32, 64, 128):
    _DEFAULTS[(9, _tile_d, True)] = _ONE_WARPGROUP
    _DEFAULTS[(9, _tile_d, False)] = _ONE_WARPGROUP
# Two warpgroups win without causal masking and lose with it (perf-notes step 5).
for _tile_d in (64, 128):
    _DEFAULTS[(9, _tile_d, False)] = _TWO_WARPGROUPS
# Head dims that run as 64 + a smaller tile (80, 96; see head_dim_parts): one warpgroup per
# 64-row tile at occupancy 2 for both masks (perf-notes step 9).
_SPLIT_AFTER_64 = _ONE_WARPGROUP
# 128 + a smaller tile (144, 160, 192): two warpgroups on 128x128 tiles for both masks (perf-notes
# step 16).
_SPLIT_AFTER_128 = _TWO_WARPGROUPS
# D=256: 128x64 with two warpgroups (64x64 with one is slower; perf-notes step 5).
for _causal in (False, True):
    _DEFAULTS[(9, 256, _causal)] = dataclasses.replace(_BASE, tile_m=128, tile_n=64,
                                                       num_worker_warps=8)
# Calls with little work per query tile take the one-warpgroup 64-row entry instead of the
# two-warpgroup 128-row one: a query of at most SHORT_QUERY_ROWS rows fills at most half of a
# 128-row tile (perf-notes step 15), and with at most SHORT_KEYS keys two 64-row CTAs per SM
# hide each other's prologue and epilogue, which the short key loop exposes (steps 5 and 17).
SHORT_QUERY_ROWS = 64
SHORT_KEYS = 2048
# Queries of at most DECODE_QUERY_ROWS rows (decode, speculative decoding) also pack the query
# heads of a kv head into one tile and split the keys to fill the GPU (the launcher's decode path;
# perf-notes step 18).
DECODE_QUERY_ROWS = 16


def head_dim_tile(head_dim: int) -> int:
    """The next power of two: a head dim's padded tile (zero-padded on load, clipped on store),
    and the head-dim key of the default table."""
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


def default_schedule(arch_major: int, dtype: torch.dtype, head_dim: int, causal: bool,
                     seq_q: Optional[int] = None, seq_kv: Optional[int] = None) -> Schedule:
    """The default table's entry for one call (``dtype`` is part of the key for future entries).
    ``seq_q`` and ``seq_kv``, when known, pick the one-warpgroup tile for short calls (at most
    :data:`SHORT_QUERY_ROWS` query rows or :data:`SHORT_KEYS` keys), and for decode (at most
    :data:`DECODE_QUERY_ROWS` query rows) GQA packing and automatic key splits."""
    return _table_entry(arch_major, dtype, head_dim, causal, _call_kind(seq_q, seq_kv))


def _call_kind(seq_q: Optional[int], seq_kv: Optional[int]) -> str:
    """"decode" (at most DECODE_QUERY_ROWS queries), "short" (at most SHORT_QUERY_ROWS queries or
    SHORT_KEYS keys) or "long"."""
    if seq_q is not None and seq_q <= DECODE_QUERY_ROWS:
        return "decode"
    if (seq_q is not None and seq_q <= SHORT_QUERY_ROWS) or (
            seq_kv is not None and seq_kv <= SHORT_KEYS):
        return "short"
    return "long"


def _table_entry(arch_major: int, dtype: torch.dtype, head_dim: int, causal: bool,
                 kind: str) -> Schedule:
    del dtype
    lead, tail = head_dim_parts(head_dim, split=True)
    tile_d = head_dim_tile(head_dim)
    if tail and lead == 64:
        entry = _SPLIT_AFTER_64
    elif tail and lead == 128:  # even for short calls: a 64-row tile is short of registers here
        entry = _SPLIT_AFTER_128
    else:
        entry = _DEFAULTS.get((arch_major, tile_d, causal)) or _DEFAULTS[(9, tile_d, causal)]
        if kind != "long" and entry is _TWO_WARPGROUPS:
            entry = _ONE_WARPGROUP
    if kind == "decode":
        entry = dataclasses.replace(entry, pack_gqa=True, kv_splits=0)
    return entry


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
    return _layered(explicit, _override.get(), tuned, arch_major, dtype, head_dim, causal,
                    _call_kind(seq_q, seq_kv))


@functools.lru_cache(maxsize=1024)
def _layered(explicit: Optional[Schedule], override: Optional[Schedule],
             tuned: Optional[Schedule], arch_major: int, dtype: torch.dtype, head_dim: int,
             causal: bool, kind: str) -> Schedule:
    schedule = _table_entry(arch_major, dtype, head_dim, causal, kind)
    for layer in (tuned, override, explicit):
        if layer is not None:
            schedule = layer.merged_over(schedule)
    return schedule
