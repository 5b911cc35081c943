"""The one definition of which keys a query sees (causal, sliding window, bounds), at the level
of elements, of query tiles and of key tiles.

Pure Python on purpose: the cuTile kernels call these functions (cuTile compiles them as
helpers: ``CAUSAL`` / ``WINDOWED`` are then compile-time constants and the scalars tile
indices), and the host calls the very same functions on Python ints (launch planning, the
reference path's chunk ranges, block tables) and on torch tensors (element masks). A query row
``i`` sits at key position ``pos = i + diag_offset``; key ``j`` is visible iff

* ``j < seq_kv``;
* ``CAUSAL``: ``j <= pos``;
* ``WINDOWED``: ``j > pos - window``, and when not causal also ``j < pos + window``.

Only integer arithmetic, comparisons, ``&``, ``min`` / ``max`` and floor division of
non-negative numbers appear here: each has the same meaning in Python, in torch and in cuTile.
"""

from __future__ import annotations


def visible(pos, key, seq_kv, window, CAUSAL, WINDOWED):
    """Whether ``key`` is visible from query position ``pos`` (broadcasting tiles or tensors)."""
    seen = key < seq_kv
    if CAUSAL:
        seen = seen & (key <= pos)
    if WINDOWED:
        seen = seen & (key > pos - window)
        if not CAUSAL:
            seen = seen & (key < pos + window)
    return seen


def key_span(pos_lo, pos_hi, seq_kv, window, CAUSAL, WINDOWED):
    """Keys of the query positions ``pos_lo .. pos_hi`` (inclusive): ``(lo_any, hi_any,
    lo_all, hi_all)``, some of them see the keys in ``[lo_any, hi_any)`` and every one sees
    those in ``[lo_all, hi_all)`` (an empty range may have hi < lo)."""
    lo_any = 0
    lo_all = 0
    hi_any = seq_kv
    hi_all = seq_kv
    if WINDOWED:
        lo_any = max(pos_lo - window + 1, 0)
        lo_all = max(pos_hi - window + 1, 0)
        if not CAUSAL:
            hi_any = min(pos_hi + window, seq_kv)
            hi_all = min(pos_lo + window, seq_kv)
    if CAUSAL:
        hi_any = min(pos_hi + 1, seq_kv)
        hi_all = min(pos_lo + 1, seq_kv)
    return lo_any, hi_any, lo_all, hi_all


def query_span(key_lo, key_hi, seq_q, diag_offset, window, CAUSAL, WINDOWED):
    """The transpose of :func:`key_span`: query rows of the keys ``key_lo .. key_hi``
    (inclusive, all ``< seq_kv``): ``(lo_any, hi_any, lo_all, hi_all)``, rows in
    ``[lo_any, hi_any)`` see some of the keys and rows in ``[lo_all, hi_all)`` see all of them
    (an empty range may have hi < lo)."""
    lo_any = 0
    lo_all = 0
    hi_any = seq_q
    hi_all = seq_q
    if CAUSAL:
        lo_any = max(key_lo - diag_offset, 0)
        lo_all = max(key_hi - diag_offset, 0)
    if WINDOWED:
        hi_any = min(key_hi + window - diag_offset, seq_q)
        hi_all = min(key_lo + window - diag_offset, seq_q)
        if not CAUSAL:
            lo_any = max(key_lo - window + 1 - diag_offset, 0)
            lo_all = max(key_hi - window + 1 - diag_offset, 0)
    return lo_any, hi_any, lo_all, hi_all


def key_tiles(row_lo, row_hi, diag_offset, seq_kv, window, TILE_N, CAUSAL, WINDOWED):
    """Key tiles of the query rows ``row_lo .. row_hi``: ``(first, end, full_lo, full_hi)``,
    the tiles ``[first, end)`` hold every key some row may see and the tiles
    ``[full_lo, full_hi)`` only keys that every row sees (no per-element rule needed there;
    the range may be empty or reversed: callers clip it to ``[first, end)``)."""
    lo_any, hi_any, lo_all, hi_all = key_span(row_lo + diag_offset, row_hi + diag_offset,
                                              seq_kv, window, CAUSAL, WINDOWED)
    first = lo_any // TILE_N
    end = max((hi_any + TILE_N - 1) // TILE_N, first)
    return first, end, (lo_all + TILE_N - 1) // TILE_N, hi_all // TILE_N


def query_tiles(key_lo, key_hi, seq_q, diag_offset, window, TILE_M, CAUSAL, WINDOWED):
    """The transpose of :func:`key_tiles`: query tiles of the keys ``key_lo .. key_hi``
    (all ``< seq_kv``): ``(first, end, full_lo, full_hi)``, the tiles ``[first, end)`` hold
    every row that sees some of the keys and the tiles ``[full_lo, full_hi)`` only rows that
    see all of them (callers clip the latter to ``[first, end)``)."""
    lo_any, hi_any, lo_all, hi_all = query_span(key_lo, key_hi, seq_q, diag_offset, window,
                                                CAUSAL, WINDOWED)
    first = lo_any // TILE_M
    end = max((max(hi_any, 0) + TILE_M - 1) // TILE_M, first)
    return first, end, (lo_all + TILE_M - 1) // TILE_M, max(hi_all, 0) // TILE_M


def clip_tiles(first, end, full_lo, full_hi, table, TABLE, split, splits):
    """A query tile's key-tile ranges as the kernel walks them: ``(first, gap_lo, gap_hi,
    full_lo, full_hi, end)`` with ``first <= gap_lo <= gap_hi <= full_lo <= full_hi <= end``.

    With ``TABLE``, ``table`` holds the mask's block-table ranges of this query tile
    (``kernel_params.RANGE_*`` order): only its non-empty tiles are walked, its longest gap of
    empty tiles is jumped and its longest run of full tiles needs no mask (without, ``table``
    is not read). ``split`` of ``splits``: this
    block's slice of the walk (``splits`` blocks share one query tile's keys)."""
    gap_lo = first
    gap_hi = first
    if TABLE:
        t_first, t_gap_lo, t_gap_hi, t_full_lo, t_full_hi, t_end = table
        first = max(first, t_first)
        gap_lo = t_gap_lo
        gap_hi = t_gap_hi
        full_lo = max(full_lo, t_full_lo)
        full_hi = min(full_hi, t_full_hi)
        end = max(min(end, t_end), first)
    per_split = (end - first + splits - 1) // splits
    first = min(first + split * per_split, end)
    end = min(first + per_split, end)
    full_lo = min(max(full_lo, first), end)
    full_hi = max(min(full_hi, end), full_lo)
    gap_lo = min(max(gap_lo, first), full_lo)
    gap_hi = min(max(gap_hi, gap_lo), full_lo)
    return first, gap_lo, gap_hi, full_lo, full_hi, end


def edge_count(first, gap_lo, gap_hi, full_lo, full_hi, end):
    """How many tiles of :func:`clip_tiles`' walk lie outside its gap and its full run: the
    ``[first, gap_lo)``, ``[gap_hi, full_lo)`` and ``[full_hi, end)`` a kernel walks with the
    per-element rules (one loop over them: :func:`edge_tile`)."""
    return (gap_lo - first) + (full_lo - gap_hi) + (end - full_hi)


def edge_tile(t, first, gap_lo, gap_hi, full_lo, full_hi):
    """The ``t``-th of those tiles (``0 <= t <`` :func:`edge_count`), in increasing order: one
    loop instead of three keeps one copy of the step's code in the kernel (three copies made
    the compiler spill). Branch-free: ``min(max(x, 0), 1)`` is 1 once ``t`` is past a range."""
    before_gap = gap_lo - first
    before_full = before_gap + full_lo - gap_hi
    return (first + t + (gap_hi - gap_lo) * min(max(t - before_gap + 1, 0), 1)
            + (full_hi - full_lo) * min(max(t - before_full + 1, 0), 1))
