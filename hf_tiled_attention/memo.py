"""The package's caches: one bounded memo type, one switch that clears them all, one rule for
caches that hold GPU memory.

Every process-wide cache of the package is a :class:`Memo` (or a function wrapped by
:func:`memoize`, which uses one) and registers itself here, so :func:`clear_caches` empties all
of them (tests and benchmarks call it; nothing outside this module reaches into a cache).
When a memo is full its oldest entry goes: no cache grows without bound.

Keyed by value (shapes, dtypes, schedules, the generated text of a mod) unless listed here.
Keyed by identity, because the object's value cannot be hashed or compared cheaply:

* ``masks.reused_compact_mask``: per mask tensor, weakly, with its ``_version`` (a caller that
  passes the same unchanged mask to every layer shares one block table);
* ``masks.mod_mask``: per mask_mod function object and captured tensors (``id`` and
  ``_version``), so the layers of a forward share one block table;
* ``mods.compile_mods``: per function object, while the values its closure captures are the
  same objects;
* the transformers adapter's per-forward memo (on the mask object every layer receives).

Caches that keep GPU memory (block tables, the key splits' workspace, placeholder arrays) fill
only when :func:`may_keep_device_memory` allows: an eager call outside CUDA graph capture. A
call from a compiled graph (the registered op) may run inside the private memory pool of a CUDA
graph (torch.compile's CUDA graph trees warm up and record with allocations routed there, with
no flag a callee can read), and a tensor kept from it would live in that pool.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Hashable, Optional

import torch

_MISSING = object()
_caches: dict = {}  # name -> a cache with clear() and len(): every Memo, and registered others


def register(name: str, cache) -> None:
    """Make another kind of cache (a weak dict, say) part of :func:`clear_caches` and
    :func:`cache_sizes`."""
    _caches[name] = cache


class Memo:
    """A bounded dict: ``get`` / ``put`` / ``get_or_make``; the oldest entry goes when full."""

    def __init__(self, name: str, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"Memo {name!r}: maxsize must be >= 1, got {maxsize}")
        self.name = name
        self.maxsize = maxsize
        self._entries: dict = {}
        # get(key, default=None): the dict's own method, one C call (hot paths use it).
        self.get: Callable[..., Any] = self._entries.get
        register(name, self)

    def put(self, key: Hashable, value: Any) -> Any:
        entries = self._entries
        if key not in entries and len(entries) >= self.maxsize:
            del entries[next(iter(entries))]
        entries[key] = value
        return value

    def get_or_make(self, key: Hashable, make: Callable[[], Any], keep: bool = True) -> Any:
        """The value under ``key``, made (and kept when ``keep``) when missing."""
        value = self._entries.get(key, _MISSING)
        if value is _MISSING:
            value = make()
            if keep:
                self.put(key, value)
        return value

    def values(self):
        return self._entries.values()

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries


def memoize(maxsize: int, name: Optional[str] = None):
    """Decorator: memoise a function of hashable positional arguments in a :class:`Memo` (a
    hit is one dict lookup: several of these run on every kernel call)."""
    def wrap(fn):
        memo = Memo(name or fn.__qualname__, maxsize)
        lookup = memo.get

        @functools.wraps(fn)
        def cached(*args):
            value = lookup(args, _MISSING)
            if value is _MISSING:
                value = memo.put(args, fn(*args))
            return value

        cached.memo = memo
        return cached
    return wrap


def clear_caches() -> None:
    """Empty every cache of the package (plans, translated mods, block tables, workspaces,
    kernel variants). Kernels compiled before stay compiled: cuTile keeps them per kernel
    object, and a kernel object made again compiles again."""
    for cache in list(_caches.values()):
        cache.clear()


def cache_sizes() -> dict[str, int]:
    """Entries per cache, by name: what tests and benchmarks read instead of private state."""
    return {name: len(cache) for name, cache in _caches.items()}


def remembered(memo: Optional[dict], key, sources: tuple, build: Callable):
    """``build()``, kept in a per-forward ``memo`` dict (when there is one and nothing is
    traced) under ``key`` with the objects it was built from, and rebuilt when any of them is
    not the one passed now (the transformers adapter: what a forward's layers share)."""
    entry = None if memo is None else memo.get(key)
    if entry is None or any(old is not new for old, new in zip(entry[0], sources)):
        entry = (sources, build())
        if memo is not None and not torch.compiler.is_compiling():
            memo[key] = entry
    return entry[1]


def may_keep_device_memory(eager: bool, device: torch.device) -> bool:
    """Whether a GPU tensor made by this call may be kept for later calls: only in an eager
    call (not the registered op, which compiled graphs call) outside CUDA graph capture."""
    if not eager:
        return False
    # (torch's C check itself: torch.cuda.is_current_stream_capturing adds a Python layer that
    # runs on every decode call)
    return device.type != "cuda" or not torch._C._cuda_isCurrentStreamCapturing()


CACHE_DIR_ENV = "HF_TILED_ATTENTION_CACHE_DIR"


def cache_dir() -> Path:
    """Where the package writes its files (translated mods, autotuner results):
    ``$HF_TILED_ATTENTION_CACHE_DIR``, else ``$XDG_CACHE_HOME/hf_tiled_attention``, else
    ``~/.cache/hf_tiled_attention``. (cuTile keeps its compiled kernels in its own cache.)"""
    folder = os.environ.get(CACHE_DIR_ENV, "")
    if folder:
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME", "") or Path.home() / ".cache") / \
        "hf_tiled_attention"
