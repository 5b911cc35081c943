"""GPU: the cuTile kernel against the fp64 definition, with poisoned outputs.

Run on a CUDA machine with cuda-tile installed: ``pytest -m gpu tests``. Skipped elsewhere.
"""

import math

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention import Schedule
from semantics import (NAN_CASES, SEMANTIC_CASES, Case, assert_matches_definition,
                       check_nan_pattern, definition, make_inputs, make_nan_inputs, op_kwargs)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Max abs error allowed vs fp64 for N(0, 1) inputs (outputs are O(1)).
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2, torch.float32: 4e-3}


@pytest.fixture(autouse=True)
def _kernel_required():
    if not hta.kernel_available(torch.device("cuda", torch.cuda.current_device())):
        pytest.fail("CUDA is present but the cuTile kernel is not available (is cuda-tile installed?)")


def poison_allocator(nbytes: int) -> None:
    """Fill the caching allocator's free blocks with NaN so unwritten outputs show up."""
    blocks = [torch.full((nbytes // 4 + 1024,), math.nan, device="cuda") for _ in range(4)]
    del blocks


def check_case(case: Case, dtype, schedule=None, seed=0):
    q, k, v, mask = make_inputs(case, "cuda", dtype, seed=seed)
    poison_allocator(q.numel() * 4)
    out, lse = hta.tiled_attention(q, k, v, mask, return_lse=True, schedule=schedule,
                                   **op_kwargs(case, "cuda"))
    torch.cuda.synchronize()
    want_out, want_lse = definition(q, k, v, mask, **op_kwargs(case, "cuda"))
    assert out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous(), "the output is laid out as (B, Sq, Hq, D)"
    assert_matches_definition(out, lse, want_out, want_lse, atol=TOLERANCE[dtype], lse_atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SEMANTIC_CASES, ids=lambda c: c.name)
def test_kernel_matches_definition(case, dtype):
    check_case(case, dtype)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_kernel_fp32_inputs_tf32(head_dim):
    check_case(Case(head_dim=head_dim, causal=True, seq_q=200, seq_kv=200), torch.float32)


@pytest.mark.parametrize("head_dim", range(16, 257, 8))
def test_every_head_dim(head_dim):
    check_case(Case(head_dim=head_dim, seq_q=130, seq_kv=130, causal=True), torch.bfloat16)


@pytest.mark.parametrize("schedule", [
    Schedule(tile_m=64, tile_n=64), Schedule(tile_m=128, tile_n=128), Schedule(tile_m=64, tile_n=32),
    Schedule(tile_m=128, tile_n=64, occupancy=2, heavy_first=False), Schedule(k_latency=6, v_latency=6),
    Schedule(tile_m=128, tile_n=128, occupancy=1, num_worker_warps=8),
    Schedule(tile_m=128, tile_n=64, occupancy=1, num_worker_warps=8),
], ids=str)
def test_schedules_agree(schedule):
    for case in (Case(causal=True, seq_q=300, seq_kv=300, mask="bool_keypad"),
                 Case(seq_q=100, seq_kv=257, window=50, softcap=10.0),
                 # plain: long unmasked interior ranges, two head dims
                 Case(seq_q=300, seq_kv=1000), Case(causal=True, seq_q=700, seq_kv=700,
                                                    head_dim=128)):
        check_case(case, torch.bfloat16, schedule=schedule)


@pytest.mark.parametrize("split", [True, False], ids=["split", "padded"])
@pytest.mark.parametrize("head_dim", [48, 80, 96, 160, 192])
def test_head_dim_split_and_padded_agree(head_dim, split):
    schedule = Schedule(split_head_dim=split)
    for case in (Case(causal=True, seq_q=300, seq_kv=300, mask="bool_keypad", head_dim=head_dim),
                 Case(seq_q=100, seq_kv=257, window=50, softcap=10.0, head_dim=head_dim),
                 Case(seq_q=1, seq_kv=1000, causal=True, head_dim=head_dim)):
        for dtype in (torch.float16, torch.bfloat16):
            check_case(case, dtype, schedule=schedule)


DECODE_CASES = [
    # a kv head's query heads packed as the rows of one tile, keys split to fill the GPU (the
    # default for at most 16 queries); left padding; a query as transformers hands it over
    Case(batch=1, heads_q=32, heads_kv=8, seq_q=1, seq_kv=5000, head_dim=128, causal=True,
         mask="bool_keypad"),
    Case(batch=2, heads_q=32, heads_kv=8, seq_q=1, seq_kv=3000, head_dim=128, causal=True,
         strided=True),
    # sliding window (Mistral): split boundaries fall inside the window
    Case(batch=3, heads_q=12, heads_kv=4, seq_q=1, seq_kv=3001, window=700, causal=True),
    Case(batch=2, heads_q=32, heads_kv=1, seq_q=1, seq_kv=4000, head_dim=64, causal=True),  # MQA
    # GQA 32/4 at D=256 with softcap (Gemma 2)
    Case(batch=2, heads_q=32, heads_kv=4, seq_q=1, seq_kv=4000, head_dim=256, causal=True,
         softcap=30.0),
    Case(batch=2, heads_q=8, heads_kv=8, seq_q=1, seq_kv=3000, causal=True),   # MHA: split only
    # several queries (speculative / assisted decoding): 16 x 4 heads, 5 x 8 heads in 128 rows
    Case(batch=1, heads_q=8, heads_kv=2, seq_q=16, seq_kv=4000, causal=True, softcap=20.0),
    Case(batch=2, heads_q=32, heads_kv=4, seq_q=5, seq_kv=2000, causal=True, window=300,
         head_dim=80),
    Case(batch=1, heads_q=4, heads_kv=2, seq_q=1, seq_kv=4000, mask="additive"),
    # masks with rows or heads keep one head per tile (not packed), still split
    Case(batch=1, heads_q=8, heads_kv=1, seq_q=1, seq_kv=4000, mask="bool_empty_rows"),
    Case(batch=1, heads_q=4, heads_kv=2, seq_q=1, seq_kv=4000, mask="additive_heads"),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_packed_and_split(case, dtype):
    check_case(case, dtype)


@pytest.mark.parametrize("schedule", [
    Schedule(kv_splits=8), Schedule(kv_splits=1), Schedule(pack_gqa=False, kv_splits=5),
], ids=str)
def test_decode_forced_splits(schedule):
    """8 splits of 3000 keys: the first splits of the left-padded batch row see no key at all;
    one split; no packing."""
    for case in (Case(batch=2, heads_q=16, heads_kv=4, seq_q=1, seq_kv=3000, causal=True,
                      mask="bool_keypad"),
                 Case(batch=2, heads_q=16, heads_kv=4, seq_q=7, seq_kv=3000, causal=True,
                      window=500)):
        check_case(case, torch.bfloat16, schedule=schedule)


def test_decode_key_mask_without_table():
    """A key-vector mask applied on every visited tile (traced calls build no tile table), a
    batch row with no visible key at all (exactly 0), and a static cache's unwritten tail."""
    from hf_tiled_attention.op import attention
    case = Case(batch=3, heads_q=32, heads_kv=8, seq_q=1, seq_kv=4096, head_dim=128)
    q, k, v, _ = make_inputs(case, "cuda", torch.bfloat16)
    keys = torch.arange(4096, device="cuda")
    mask = torch.stack([keys < 3000, torch.zeros_like(keys, dtype=torch.bool),
                        (keys >= 100) & (keys < 2500)])[:, None, None, :]
    for table in (False, True):
        poison_allocator(q.numel() * 4)
        out, lse = attention(q, k, v, mask, causal=False, scale=None, window=None, softcap=None,
                             diag_offset=4095, return_lse=True, key_mask_table=table)
        want_out, want_lse = definition(q, k, v, mask)
        assert (out[1] == 0).all() and lse[1].isinf().all()
        keep = ~want_lse.isinf()
        assert (out.double()[keep] - want_out[keep]).abs().max().item() <= TOLERANCE[torch.bfloat16]
        assert (lse[keep].double() - want_lse[keep]).abs().max().item() <= 1e-2


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_forced_key_splits_agree(splits):
    """Key splits (short queries only: at most 16 rows) with masks, windows, softcap and a
    negative scale; a longer query ignores the request and runs unsplit."""
    for case in (Case(causal=True, seq_q=16, seq_kv=900, mask="bool_keypad"),
                 Case(seq_q=13, seq_kv=1000, mask="bool_empty_rows", window=200),
                 Case(seq_q=9, seq_kv=700, softcap=5.0, scale=-0.1),
                 Case(causal=True, seq_q=130, seq_kv=1000, mask="bool_keypad")):
        check_case(case, torch.bfloat16, schedule=Schedule(kv_splits=splits))


@pytest.mark.parametrize("seq_kv", [8192, 1000])
def test_split_merge_call_after_call(seq_kv):
    """The last block of a query tile to finish merges its slices (an atomic count per tile,
    set back to zero by that block; launch.py keeps the counts and partials for the next call):
    300 eager calls in a row, each bitwise equal to the first (the merge reads the slices in
    order, whichever block arrives last), which matches the definition; at 8k keys the table
    splits B=1's 8 kv heads 16 ways or more; at 1000 keys, 7 forced splits, two of which see
    no key in batch row 1."""
    short = seq_kv < 4096  # (batch row 1 of the key-padding mask hides its first third)
    case = Case(batch=2 if short else 1, heads_q=32, heads_kv=8, seq_q=1, seq_kv=seq_kv,
                head_dim=128, causal=True, mask="bool_keypad" if short else None)
    schedule = Schedule(kv_splits=7) if short else None
    q, k, v, mask = make_inputs(case, "cuda", torch.bfloat16)
    kwargs = dict(return_lse=True, schedule=schedule, **op_kwargs(case, "cuda"))
    first, first_lse = hta.tiled_attention(q, k, v, mask, **kwargs)
    want_out, want_lse = definition(q, k, v, mask, **op_kwargs(case, "cuda"))
    assert_matches_definition(first, first_lse, want_out, want_lse,
                              atol=TOLERANCE[torch.bfloat16], lse_atol=1e-2)
    outs = [hta.tiled_attention(q, k, v, mask, **kwargs) for _ in range(300)]
    torch.cuda.synchronize()
    for out, lse in outs:
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


def test_long_sequence_gqa_causal_window():
    check_case(Case(batch=1, heads_q=8, heads_kv=2, seq_q=2048, seq_kv=2048, head_dim=128,
                    causal=True, window=300), torch.bfloat16)


def test_fresh_random_inputs_each_run():
    for seed in range(3):
        check_case(Case(causal=True, mask="bool", seq_q=129, seq_kv=129), torch.float16, seed=seed)


@pytest.mark.parametrize("schedule", [None, Schedule(kv_splits=3)], ids=["default", "split3"])
@pytest.mark.parametrize("nan_case", NAN_CASES, ids=lambda c: c.name)
def test_nan_reaches_the_rows_that_see_it(nan_case, schedule):
    q, k, v, mask = make_nan_inputs(nan_case, "cuda", torch.bfloat16)
    out, lse = hta.tiled_attention(q, k, v, mask, return_lse=True, schedule=schedule,
                                   **op_kwargs(nan_case.case, "cuda"))
    want_out, want_lse = definition(q, k, v, mask, **op_kwargs(nan_case.case, "cuda"))
    check_nan_pattern(out, lse, want_out, want_lse, TOLERANCE[torch.bfloat16],
                      nan_case.spreads)


@pytest.mark.parametrize("seed", range(6))
def test_visibility_rule_is_the_same_on_the_gpu(seed):
    """visibility.py is compiled into the kernels by cuTile and run by the host in Python and
    torch: on random shapes, what the GPU computes with it (key-tile walks, query-row spans of
    key tiles, element masks) equals the host's evaluation of the same functions."""
    import cuda.tile as ct

    from hf_tiled_attention.visibility import clip_tiles, key_tiles, query_span, visible
    from visibility_probe import visibility_probe

    g = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    tile_m, tile_n = pick(16, 64, 128), pick(16, 32, 64)
    seq_q, seq_kv = int(torch.randint(1, 700, (1,), generator=g)), \
        int(torch.randint(1, 900, (1,), generator=g))
    diag = pick(seq_kv - seq_q, 0, int(torch.randint(-300, 300, (1,), generator=g)))
    causal, window = pick(False, True), pick(0, 1, 37, 300)
    splits = pick(1, 3)
    m_tiles, n_tiles = -(-seq_q // tile_m), -(-seq_kv // tile_n)
    ranges = torch.full((m_tiles + n_tiles, 16), -99, dtype=torch.int32, device="cuda")
    seen = torch.full((m_tiles * tile_m, n_tiles * tile_n), -1, dtype=torch.int8, device="cuda")
    ct.launch(torch.cuda.current_stream().cuda_stream, (m_tiles, n_tiles, 1), visibility_probe,
              (ranges, seen, seq_q, seq_kv, diag, window, splits,
               (tile_m, tile_n, causal, window > 0)))
    torch.cuda.synchronize()
    for m in range(m_tiles):
        row_lo = m * tile_m
        tiles = key_tiles(row_lo, min(row_lo + tile_m, seq_q) - 1, diag, seq_kv, window, tile_n,
                          causal, window > 0)
        walk = clip_tiles(*tiles, (0,) * 6, False, 0, splits)
        assert ranges[m, :10].tolist() == list(tiles + walk), (m, tiles, walk)
    for j in range(n_tiles):
        span = query_span(j * tile_n, min(j * tile_n + tile_n, seq_kv) - 1, seq_q, diag, window,
                          causal, window > 0)
        assert ranges[m_tiles + j, 10:14].tolist() == list(span), (j, span)
    rows = torch.arange(m_tiles * tile_m)[:, None] + diag
    cols = torch.arange(n_tiles * tile_n)[None, :]
    want = torch.broadcast_to(visible(rows, cols, seq_kv, window, causal, window > 0),
                              seen.shape)
    assert torch.equal(seen.cpu().bool(), want)
