"""CPU: the per-tile state table the kernel uses to skip or trust mask tiles."""

import pytest
import torch

import hf_tiled_attention as hta

from hf_tiled_attention.masks import (compact_mask, mod_mask, reused_compact_mask, tile_ranges,
                                      tile_states)
from hf_tiled_attention.mods import compile_mods, index_grid

EMPTY, PARTIAL, FULL = 0, 1, 2


def expected_states(visible: torch.Tensor, zero_bias: torch.Tensor, tile_m: int, tile_n: int):
    """Per-tile state by direct slicing. Rows and keys past the edge do not count: the kernel
    hides them by its bounds check, so an edge tile can be full."""
    b, h, sq, skv = visible.shape
    rows = tile_m if sq > 1 else 1
    n_m, n_n = -(-sq // rows), -(-skv // tile_n)
    out = torch.empty(b, h, n_m, n_n, dtype=torch.int8)
    for i in range(n_m):
        for j in range(n_n):
            vis = visible[:, :, i * rows:(i + 1) * rows, j * tile_n:(j + 1) * tile_n]
            zero = zero_bias[:, :, i * rows:(i + 1) * rows, j * tile_n:(j + 1) * tile_n]
            full = zero.flatten(2).all(-1)
            out[:, :, i, j] = torch.where(full, FULL, torch.where(vis.flatten(2).any(-1),
                                                                  PARTIAL, EMPTY))
    return out


@pytest.mark.parametrize("tile_m, tile_n", [(64, 128), (16, 32)])
@pytest.mark.parametrize("shape", [(2, 3, 70, 300), (2, 1, 1, 300)])
def test_tile_states_bool(shape, tile_m, tile_n):
    g = torch.Generator().manual_seed(0)
    visible = torch.rand(shape, generator=g) < 0.97
    visible[..., :tile_n] = True                       # a full tile (when the rows fill it)
    visible[..., tile_n:2 * tile_n] = False            # an empty tile
    compact = compact_mask(visible, shape[0], 3, 70 if shape[2] > 1 else 1, shape[3])
    got = tile_states(compact, tile_m, tile_n)
    assert torch.equal(got, expected_states(visible, visible, tile_m, tile_n))
    assert {EMPTY, PARTIAL} <= set(got.unique().tolist())


def test_tile_states_additive_full_needs_zero_bias():
    bias = torch.zeros(1, 1, 64, 256)
    bias[..., 128:] = 0.5                              # visible, but the tile must be loaded
    bias[..., 200] = float("-inf")
    compact = compact_mask(bias, 1, 1, 64, 256)
    got = tile_states(compact, 64, 128)
    assert got.flatten().tolist() == [FULL, PARTIAL]


def test_compact_mask_memoises_its_tables():
    compact = compact_mask(torch.rand(2, 1, 1, 300) < 0.5, 2, 4, 16, 300)
    first = compact.block_table(64, 128)
    assert compact.block_table(64, 128) is first       # built once for every layer
    other = compact.block_table(64, 64)
    assert other is not first and other.states.shape[-1] == 5


def test_tile_ranges_give_the_non_empty_span_the_longest_full_run_and_the_gap_before_it():
    """...and in the last slot the rows longest walk first (span less gap: 4 0 7 6 3 3 4 7)."""
    states = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0], [2, 2, 2, 2, 2, 2, 2],
                           [2, 2, 1, 2, 2, 2, 0], [2, 1, 2, 0, 0, 0, 0], [1, 0, 1, 1, 0, 0, 0],
                           [1, 0, 0, 0, 1, 2, 2], [2, 0, 1, 0, 0, 1, 2]],
                          dtype=torch.int8)[None, None]
    assert tile_ranges(states).tolist() == [[[
        [1, 1, 1, 2, 3, 5, 2], [7, 7, 7, 0, 0, 0, 7], [0, 0, 0, 0, 7, 7, 3],
        [0, 0, 0, 3, 6, 6, 0], [0, 0, 0, 0, 1, 3, 6], [0, 1, 2, 4, 4, 4, 4],
        [0, 1, 4, 5, 7, 7, 5], [0, 0, 0, 0, 1, 7, 1]]]]


def _ranges_by_loops(row: list) -> list:
    def longest(member, lo, hi, none):
        best = (none, none)
        for start in range(lo, hi):
            stop = start
            while stop < hi and member(row[stop]):
                stop += 1
            if stop - start > best[1] - best[0]:
                best = (start, stop)
        return best

    nonempty = [j for j, s in enumerate(row) if s != 0]
    first, end = (nonempty[0], nonempty[-1] + 1) if nonempty else (len(row), 0)
    run = longest(lambda s: s == 2, 0, len(row), end)
    gap = longest(lambda s: s == 0, first, run[0], first)
    return [first, *gap, *run, end]


def test_tile_ranges_equal_plain_loops_on_random_tables():
    states = torch.randint(0, 3, (2, 3, 40, 9), generator=torch.Generator().manual_seed(1),
                           dtype=torch.int8)
    states[0, 0, :20] = torch.randint(0, 2, (20, 9), dtype=torch.int8) * 2  # long gaps, runs
    expected = [[[_ranges_by_loops(row) for row in head] for head in batch]
                for batch in states.tolist()]
    ranges = tile_ranges(states)
    assert ranges[..., :6].tolist() == expected
    walked = [[[max(r[5] - r[0], 0) - (r[2] - r[1]) for r in head] for head in batch]
              for batch in expected]
    for b, batch in enumerate(walked):  # a permutation of the rows, longest walk first
        for h, head in enumerate(batch):
            order = ranges[b, h, :, 6].tolist()
            assert sorted(order) == list(range(len(head)))
            assert [head[r] for r in order] == sorted(head, reverse=True)


@pytest.mark.parametrize("tile_m, tile_n", [(64, 128), (128, 64), (16, 32), (32, 32),
                                            (128, 128), (32, 128), (256, 64)])
def test_mask_mod_table_equals_the_dense_masks(tile_m, tile_n):
    """A mask_mod's block table, built from the mod a few tiles at a time, is the table of the
    dense mask it describes (per batch row and head where the mod depends on them)."""
    ids = torch.sort(torch.randint(0, 4, (2, 300), generator=torch.Generator().manual_seed(0)),
                     dim=1).values

    def mod(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & ((h == 0) | (q_idx >= kv_idx))

    mods = compile_mods(None, mod)
    table = mod_mask(mods, 2, 3, 200, 300, torch.device("cpu")).block_table(tile_m, tile_n)
    b, h, q, kv = index_grid(2, (3,), torch.arange(200), torch.arange(300))
    dense = compact_mask(mod(b, h, q, kv), 2, 3, 200, 300)
    assert torch.equal(table.states, tile_states(dense, tile_m, tile_n))
    assert torch.equal(table.ranges, tile_ranges(table.states))


@pytest.mark.parametrize("tile_m, tile_n", [(64, 128), (128, 64), (16, 32), (32, 32), (48, 80)])
def test_packed_documents_table_from_id_bounds(tile_m, tile_n, monkeypatch):
    """The same-document rule's table comes from each tile's smallest and largest ids
    (documents.document_cells), never from the rule on every (query, key), and equals the dense
    rule's table for packed rows: per batch row, with queries in no document (-1), keys hidden
    by padding, and more keys than queries."""
    from hf_tiled_attention import masks
    from hf_tiled_attention.documents import key_documents, same_document, same_document_key
    from hf_tiled_attention.mods import mods_from_key

    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.repeat_interleave(torch.arange(5), torch.randint(
        1, 150, (5,), generator=gen))[:300] for _ in range(2)]).to(torch.int32)
    ids[1, 280:] = -1                      # past the last document
    padding = torch.rand(2, 300, generator=gen) > 0.2
    query_ids, key_ids = ids[:, 100:].contiguous(), key_documents(ids, padding)
    mods = mods_from_key(same_document_key(), (query_ids, key_ids))
    monkeypatch.setattr(masks.ModMask, "evaluate", lambda self, rows, cols: pytest.fail(
        "the document rule was evaluated per element") if len(rows) > 2 else
        masks.index_grid(self.batch, (1,), rows, cols)[0].expand(-1, 1, len(rows), len(cols)) > 0)
    table = mod_mask(mods, 2, 3, 200, 300, torch.device("cpu"), keep=False).block_table(
        tile_m, tile_n, keep=False)
    b, h, q, kv = index_grid(2, (1,), torch.arange(200), torch.arange(300))
    dense = compact_mask(same_document(query_ids, key_ids)(b, h, q, kv), 2, 1, 200, 300)
    assert torch.equal(table.states, tile_states(dense, tile_m, tile_n))


def test_mask_mod_is_evaluated_once_for_every_table_of_whole_cells(monkeypatch):
    """The tables of a training step (forward, dK/dV, dQ tiles: multiples of MOD_CELL) pool
    one evaluation of the mod into cells; a tile that is not a multiple evaluates it again."""
    from hf_tiled_attention import masks

    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([40, 7, 150, 90, 113]))
    mods = compile_mods(None, lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx])
                        & (q_idx >= kv_idx))
    evaluated = []
    cells = masks.ModMask.cells
    monkeypatch.setattr(masks.ModMask, "cells", lambda self, rows, keys: evaluated.append(
        (rows, keys)) or cells(self, rows, keys))
    mask = masks.ModMask(mods, 1, 2, 400, 400, torch.device("cpu"))
    b, h, q, kv = index_grid(1, (2,), torch.arange(400), torch.arange(400))
    dense = compact_mask(mods.mask_mod(b, h, q, kv), 1, 2, 400, 400)
    for tiles in ((128, 128), (32, 128), (128, 64), (64, 64), (16, 64)):
        assert torch.equal(mask.block_table(*tiles).states, tile_states(dense, *tiles)), tiles
    assert evaluated == [(masks.MOD_CELL, masks.MOD_CELL), (16, 64)]


def test_a_mask_tensor_passed_again_reuses_its_compact_form_until_it_changes():
    import gc

    mask = torch.rand(2, 1, 1, 300) > 0.3
    first = reused_compact_mask(mask, 2, 4, 50, 300)
    assert reused_compact_mask(mask, 2, 4, 50, 300) is first
    assert reused_compact_mask(mask, 2, 4, 60, 300) is not first       # another call shape
    mask[0, 0, 0, :10] = False                                           # changed in place
    changed = reused_compact_mask(mask, 2, 4, 50, 300)
    assert changed is not first and not changed.tensor[0, 0, 0, :10].any()
    entries = hta.cache_sizes()["compact masks"]
    del mask, first, changed
    gc.collect()
    assert hta.cache_sizes()["compact masks"] == entries - 1            # not kept alive
    with pytest.raises(ValueError, match="not broadcastable"):
        reused_compact_mask(torch.ones(3, 1, 1, 300, dtype=torch.bool), 2, 4, 50, 300)
