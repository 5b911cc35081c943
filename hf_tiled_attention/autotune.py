"""Opt-in autotuner: times candidate schedules on the call's own inputs and remembers the winner.

Enable with ``HF_TILED_ATTENTION_AUTOTUNE=1``. The first kernel call for a key
(GPU arch, dtype, head-dim tile, causal, key-length bucket, short query) runs every candidate in
:data:`CANDIDATES` (each compiles once, so expect seconds per candidate), keeps the fastest and
writes it to a JSON cache in the package's cache folder (memo.cache_dir:
``HF_TILED_ATTENTION_CACHE_DIR``, default ``~/.cache/hf_tiled_attention``), so later processes skip the search. The tuned schedule replaces
the default table's entry; ``use_schedule`` and ``schedule=`` still apply on top of it. Calls made
while a CUDA graph is being captured never tune: they use a cached winner or the default table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .memo import CACHE_DIR_ENV, cache_dir
from .schedule import TABLE, Schedule
from .timing import back_to_back_ms, median_ms

ENABLE_ENV = "HF_TILED_ATTENTION_AUTOTUNE"
CACHE_FILE = "autotune.json"



def _candidates() -> tuple[Schedule, ...]:
    """The default table's tile shapes (schedule.TABLE), each also with half the key tile and
    with the other occupancy of a one-warpgroup tile: the neighbourhood the H200 sweeps found
    competitive (perf-notes steps 1 and 5; eval/results/nvidia-h200/archive/kernel-tiles-occupancy-*
    and kernel-two-warpgroups-*)."""
    found: dict = {}
    for row in TABLE:
        s = row.schedule
        shape = Schedule(tile_m=s.tile_m, tile_n=s.tile_n, occupancy=s.occupancy,
                         num_worker_warps=s.num_worker_warps)
        found[shape] = None
        found[dataclasses.replace(shape, tile_n=shape.tile_n // 2)] = None
        if shape.num_worker_warps == 4:
            found[dataclasses.replace(shape, occupancy=3 - shape.occupancy)] = None
    return tuple(found)


CANDIDATES: tuple[Schedule, ...] = _candidates()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "") not in ("", "0")


def state() -> Optional[str]:
    """None when tuning is off, else the cache folder setting: what the tuned schedules a call
    gets depend on (callers that memoise plans key them with it)."""
    return os.environ.get(CACHE_DIR_ENV, "") if enabled() else None


@dataclass(frozen=True)
class TuneKey:
    arch_major: int
    dtype: str
    tile_d: int
    causal: bool
    seq_bucket: int
    short_query: bool = False   # at most SHORT_QUERY_ROWS query rows (decode): its own entry

    def __str__(self) -> str:
        return (f"sm{self.arch_major}x/{self.dtype}/d{self.tile_d}/"
                f"{'causal' if self.causal else 'full'}/kv{self.seq_bucket}"
                + ("/short-q" if self.short_query else ""))


def seq_bucket(seq_kv: int) -> int:
    """Key lengths share a tuning result within a power-of-two bucket (128 at the least)."""
    return 1 << max(7, math.ceil(math.log2(max(seq_kv, 1))))


class ScheduleCache:
    """The on-disk JSON cache: ``{key: {"schedule": {...}, "ms": {candidate: ms}}}``."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / CACHE_FILE
        self._entries: Optional[dict] = None

    def _load(self) -> dict:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._entries = {}
        return self._entries

    def get(self, key: TuneKey) -> Optional[Schedule]:
        entry = self._load().get(str(key))
        return None if entry is None else Schedule(**entry["schedule"])

    def put(self, key: TuneKey, schedule: Schedule, timings: dict[str, float]) -> None:
        entries = self._load()
        entries[str(key)] = {"schedule": dataclasses.asdict(schedule), "ms": timings}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a concurrent reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def throughput_ms(fn: Callable[[], object], *, cuda: bool, warmup: int, reps: int) -> float:
    """A candidate's time per call with calls queued back to back on the GPU (in a model the
    attention kernel runs behind other queued work, and every candidate pays the same host
    time); the host clock's median on the CPU. Single idle-GPU calls picked losers on the H200
    (perf-notes step 17)."""
    if not cuda:
        return median_ms(fn, cuda=False, warmup=warmup, reps=reps)
    return back_to_back_ms(fn, warmup=warmup, reps=reps, rounds=5)


def tune(run: Callable[[Schedule], object], candidates: Sequence[Schedule], *, cuda: bool,
         timer: Callable[..., float] = throughput_ms, warmup: int = 3,
         reps: int = 10) -> tuple[Schedule, dict[str, float]]:
    """Time ``run(candidate)`` for each candidate; return the fastest and every timing.
    A candidate that fails (e.g. does not compile for this shape) is recorded as ``inf``."""
    timings = {}
    for candidate in candidates:
        try:
            timings[candidate.label()] = timer(lambda: run(candidate), cuda=cuda,
                                               warmup=warmup, reps=reps)
        except Exception:  # noqa: BLE001 - a failing candidate just loses
            timings[candidate.label()] = math.inf
    best = min(candidates, key=lambda c: timings[c.label()])
    if math.isinf(timings[best.label()]):
        raise RuntimeError(f"autotune: every candidate schedule failed ({list(timings)})")
    return best, timings


_cache: Optional[ScheduleCache] = None


def tuned_schedule(key: TuneKey, run: Callable[[Schedule], object], *,
                   cuda: bool) -> Optional[Schedule]:
    """The cached winner for ``key``, tuning it first when allowed; None when disabled."""
    global _cache
    if not enabled():
        return None
    directory = cache_dir()
    if _cache is None or _cache.directory != directory:
        _cache = ScheduleCache(directory)
    cached = _cache.get(key)
    if cached is not None or (cuda and torch.cuda.is_current_stream_capturing()):
        return cached
    best, timings = tune(run, CANDIDATES, cuda=cuda)
    _cache.put(key, best, timings)
    return best
