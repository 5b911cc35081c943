import dataclasses

import pytest
import torch

from hf_tiled_attention import Schedule, default_schedule, use_schedule
from hf_tiled_attention.schedule import head_dim_parts, head_dim_tile, resolve_schedule


@pytest.mark.parametrize("head_dim", range(16, 257, 8))
@pytest.mark.parametrize("causal", [False, True])
def test_default_table_is_complete(head_dim, causal):
    schedule = default_schedule(9, torch.bfloat16, head_dim, causal)
    assert all(getattr(schedule, f.name) is not None for f in dataclasses.fields(schedule))


def test_head_dim_tiles():
    assert [head_dim_tile(d) for d in (16, 24, 64, 80, 96, 128, 136, 256)] == \
        [16, 32, 64, 128, 128, 128, 256, 256]


@pytest.mark.parametrize("head_dim, parts", [
    (80, (64, 16)), (96, (64, 32)), (48, (32, 16)), (144, (128, 16)), (160, (128, 32)),
    (192, (128, 64)), (64, (64, 0)), (256, (256, 0)),
    # the rest is not a power of two, or below the MMA's depth of 16: one padded tile
    (112, (128, 0)), (72, (128, 0)), (40, (64, 0)), (24, (32, 0)), (200, (256, 0)),
])
def test_head_dim_parts(head_dim, parts):
    assert head_dim_parts(head_dim, split=True) == parts
    assert head_dim_parts(head_dim, split=False) == (head_dim_tile(head_dim), 0)


def test_override_layers():
    base = default_schedule(9, torch.float16, 128, True)
    with use_schedule(Schedule(tile_n=32, occupancy=2)):
        got = resolve_schedule(Schedule(tile_n=128), 9, torch.float16, 128, True)
        assert got == dataclasses.replace(base, tile_n=128, occupancy=2)
    assert resolve_schedule(None, 9, torch.float16, 128, True) == base


def test_list_round_trip():
    for schedule in (Schedule(), Schedule(tile_m=64, heavy_first=False, k_latency=3),
                     Schedule(split_head_dim=False, pack_gqa=True)):
        assert Schedule.from_list(schedule.as_list()) == schedule


def test_use_schedule_type_error():
    with pytest.raises(TypeError, match="use_schedule expects a Schedule"):
        with use_schedule({"tile_m": 64}):
            pass


@pytest.mark.parametrize("head_dim", [64, 128])
def test_short_calls_never_take_the_two_warpgroup_tile(head_dim):
    long = default_schedule(9, torch.bfloat16, head_dim, False)
    assert (long.tile_m, long.num_worker_warps) == (128, 8)
    assert default_schedule(9, torch.bfloat16, head_dim, False, 4096, 4096) == long
    one_warpgroup = default_schedule(9, torch.bfloat16, head_dim, True)
    assert (one_warpgroup.tile_m, one_warpgroup.num_worker_warps) == (64, 4)
    # few query rows, or a short key loop
    for seq_q, seq_kv in ((17, 16384), (64, 4096), (2048, 2048), (1024, 1024), (None, 100)):
        short = resolve_schedule(None, 9, torch.bfloat16, head_dim, False, seq_q=seq_q,
                                 seq_kv=seq_kv)
        assert short == one_warpgroup, (seq_q, seq_kv)
    # decode (at most 16 query rows): the same tile, with GQA packing and automatic key splits
    for seq_q in (1, 16):
        decode = resolve_schedule(None, 9, torch.bfloat16, head_dim, False, seq_q=seq_q,
                                  seq_kv=16384)
        assert decode == dataclasses.replace(one_warpgroup, pack_gqa=True, kv_splits=0)
    assert resolve_schedule(None, 9, torch.bfloat16, head_dim, False, seq_q=65,
                            seq_kv=2049) == long
    # an explicit choice still wins
    forced = resolve_schedule(Schedule(tile_m=128, num_worker_warps=8, occupancy=1), 9,
                              torch.bfloat16, head_dim, False, seq_q=1, seq_kv=1024)
    assert (forced.tile_m, forced.num_worker_warps, forced.occupancy) == (128, 8, 1)


@pytest.mark.parametrize("head_dim", [144, 160, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_past_128_take_two_warpgroups_on_128x128(head_dim, causal):
    for seq_q in (None, 1, 1024, 4096):
        schedule = resolve_schedule(None, 9, torch.bfloat16, head_dim, causal, seq_q=seq_q,
                                    seq_kv=seq_q)
        assert (schedule.tile_m, schedule.tile_n, schedule.num_worker_warps) == (128, 128, 8)


@pytest.mark.parametrize("head_dim, row", [(16, 64), (48, 64), (64, 64), (80, 128), (96, 128),
                                           (128, 128), (144, 160), (160, 160), (176, 192),
                                           (192, 192), (224, 256), (256, 256)])
def test_backward_table_rows_by_head_dim(head_dim, row):
    """The backward's table is keyed by the head dim itself (not its padded tile): 128 + 32
    takes the 32-row dK/dV steps that did not spill, 192 and 256 the 64-row steps measured
    faster (perf-notes step 43); every row but 192's loads without bounds checks (at 192 the
    unchecked loads spill more inside the step loops)."""
    from hf_tiled_attention.schedule import BACKWARD_TABLE, backward_schedule

    want = {limit: schedule for limit, schedule, _ in BACKWARD_TABLE}[row]
    assert backward_schedule(head_dim) is want
    assert want.unchecked_loads is (row != 192)
    if row in (160, 192, 256):
        assert want.kv_queries == (32 if row == 160 else 64)
    with pytest.raises(LookupError):
        backward_schedule(257)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dq_added_by_the_kv_kernel_only_in_the_fast_mode_up_to_d64(head_dim, deterministic):
    """The table's rows up to D=64 make dQ in the dK/dV kernel (measured faster there,
    perf-notes step 46), but only when the backward need not be deterministic; the deterministic
    mode and the larger head dims launch the dQ kernel."""
    from hf_tiled_attention.backward_launch import backward_plan
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.schedule import backward_schedule

    schedule = backward_schedule(head_dim)
    assert schedule.dq_add is (head_dim <= 64)
    plan = backward_plan(torch.bfloat16, 4, head_dim,
                         call_options(None, causal=True, scale=head_dim ** -0.5), schedule,
                         False, deterministic)
    assert plan.kv.DQ_ADD is (head_dim <= 64 and not deterministic)
    assert not plan.q.DQ_ADD
