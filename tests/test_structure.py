"""CPU: the house rules the code review of issue 19 asked for, checked so they stay true:
one definition of visibility (shared by kernel and host, checked here against brute force),
no function with more than 20 parameters, no cache outside memo.py's."""

import ast
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_tiled_attention.visibility import (clip_tiles, edge_count, edge_tile, key_span, key_tiles,
                                           query_span, visible)

PACKAGE = Path(__file__).resolve().parent.parent / "hf_tiled_attention"
MAX_PARAMS = 20


def test_no_function_takes_more_than_20_parameters():
    long = []
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = len(node.args.posonlyargs + node.args.args + node.args.kwonlyargs)
                if count > MAX_PARAMS:
                    long.append(f"{path.name}:{node.name} ({count})")
    assert not long, long


def test_caches_are_memos():
    """functools caches are invisible to clear_caches(): the package uses memo.py's."""
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        assert "lru_cache" not in text and "functools.cache(" not in text and \
            "@functools.cache\n" not in text, path.name


def _brute(seq_q, seq_kv, diag, window, causal):
    pos = torch.arange(seq_q)[:, None] + diag
    keys = torch.arange(seq_kv)[None, :]
    return torch.broadcast_to(visible(pos, keys, seq_kv, window, causal, window > 0),
                              (seq_q, seq_kv))


SHAPES = list(itertools.product((1, 7, 40), (1, 9, 64), (-20, -3, 0, 5, 30), (0, 1, 4, 13),
                                (False, True)))


@pytest.mark.parametrize("seq_q, seq_kv, diag, window, causal", SHAPES)
def test_spans_match_the_element_rule(seq_q, seq_kv, diag, window, causal):
    """key_span / query_span give exactly the keys (rows) some row (key) sees and those every
    row (key) sees, for every contiguous block of rows (keys)."""
    seen = _brute(seq_q, seq_kv, diag, window, causal)
    windowed = window > 0
    for lo in range(seq_q):
        for hi in range(lo, seq_q):
            block = seen[lo:hi + 1]
            any_lo, any_hi, all_lo, all_hi = key_span(lo + diag, hi + diag, seq_kv, window,
                                                      causal, windowed)
            some = block.any(0).nonzero().flatten().tolist()
            assert set(some) <= set(range(any_lo, any_hi))
            if some:
                assert (some[0], some[-1] + 1) == (any_lo, any_hi)
            assert set(range(all_lo, all_hi)) <= set(block.all(0).nonzero().flatten().tolist())
    for lo in range(seq_kv):
        for hi in range(lo, seq_kv):
            block = seen[:, lo:hi + 1]
            any_lo, any_hi, all_lo, all_hi = query_span(lo, hi, seq_q, diag, window, causal,
                                                        windowed)
            some = block.any(1).nonzero().flatten().tolist()
            assert set(some) <= set(range(any_lo, any_hi))
            if some:
                assert (some[0], some[-1] + 1) == (any_lo, any_hi)
            assert set(range(all_lo, all_hi)) <= set(block.all(1).nonzero().flatten().tolist())


@pytest.mark.parametrize("tile", [1, 4, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_key_tiles_cover_exactly_what_rows_see(tile, splits):
    """The kernel's walk over key tiles (key_tiles + clip_tiles, split over blocks) visits
    every tile a row of the query tile sees, and the tiles it calls full need no rule."""
    for seq_q, seq_kv, diag, window, causal in SHAPES[::3]:
        seen = _brute(seq_q, seq_kv, diag, window, causal)
        for row_lo in range(0, seq_q, 5):
            row_hi = min(row_lo + 5, seq_q) - 1
            first, end, full_lo, full_hi = key_tiles(row_lo, row_hi, diag, seq_kv, window, tile,
                                                     causal, window > 0)
            walked, full = set(), set()
            for split in range(splits):
                f, g_lo, g_hi, u_lo, u_hi, e = clip_tiles(first, end, full_lo, full_hi,
                                                          (0,) * 6, False, split, splits)
                assert f <= g_lo <= g_hi <= u_lo <= u_hi <= e
                tiles = set(range(f, e))
                assert not tiles & walked  # the splits do not overlap
                walked |= tiles
                full |= set(range(u_lo, u_hi))
            block = seen[row_lo:row_hi + 1]
            for j in range(-(-seq_kv // tile)):
                cols = block[:, j * tile:(j + 1) * tile]
                if cols.any():
                    assert j in walked, (row_lo, j)
                if j in full:
                    assert cols.all() and cols.shape[1] == tile, (row_lo, j)


def test_edge_tiles_are_the_walk_outside_its_gap_and_full_run():
    """The backward's one loop over edge tiles (edge_count / edge_tile) visits what three
    loops over [first, gap_lo), [gap_hi, full_lo) and [full_hi, end) visit, in that order."""
    import itertools
    for bounds in itertools.combinations_with_replacement(range(7), 6):
        first, gap_lo, gap_hi, full_lo, full_hi, end = bounds
        want = (list(range(first, gap_lo)) + list(range(gap_hi, full_lo))
                + list(range(full_hi, end)))
        got = [edge_tile(t, first, gap_lo, gap_hi, full_lo, full_hi)
               for t in range(edge_count(*bounds))]
        assert got == want, bounds


def test_gpu_suite_parts_cover_every_gpu_test():
    """.ci/gpu_suite.sh's parts (the GPU suite in calls of the lent GPU) name every file that
    holds GPU tests (as pytest collects them), a file itself or its folder; the script parses."""
    root = PACKAGE.parent
    script = root / ".ci" / "gpu_suite.sh"
    parts = script.read_text().split("case $part in")[1].split("esac")[0]
    named = set(re.findall(r"\b(?:tests|integration_tests)(?:/\w+\.py)?\b", parts))
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
         "no:cacheprovider", "tests", "integration_tests"],
        cwd=root, capture_output=True, text=True, timeout=600).stdout
    gpu_files = {line.split("::")[0] for line in collected.splitlines() if "::" in line}
    assert gpu_files, "no GPU test files found"
    missing = sorted(f for f in gpu_files if f not in named and f.split("/")[0] not in named)
    assert not missing, f"GPU test files in no part of {script.name}: {missing}"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
