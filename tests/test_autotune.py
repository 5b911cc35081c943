"""CPU: the autotuner's search, its on-disk cache and how the op uses it (launch stubbed)."""

import json
import math

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention import autotune, op
from hf_tiled_attention.autotune import CANDIDATES, ScheduleCache, TuneKey, seq_bucket, tune

KEY = TuneKey(9, "bfloat16", 128, True, 4096)


def _candidate(tile_m, tile_n, occupancy=None):
    return next(c for c in CANDIDATES if (c.tile_m, c.tile_n) == (tile_m, tile_n)
                and occupancy in (None, c.occupancy))


def test_candidates_derive_from_the_default_table():
    """Every tile shape of the default table is a candidate, with its half-width key tile."""
    from hf_tiled_attention.schedule import TABLE
    for row in TABLE:
        s = row.schedule
        assert _candidate(s.tile_m, s.tile_n, s.occupancy).num_worker_warps == \
            s.num_worker_warps
        assert _candidate(s.tile_m, s.tile_n // 2, s.occupancy)
    assert len(set(CANDIDATES)) == len(CANDIDATES)


def test_tune_picks_fastest_and_survives_failing_candidates():
    times = {(c.tile_m, c.tile_n, c.occupancy): 5.0 + i for i, c in enumerate(CANDIDATES)}
    times[(64, 64, 2)] = 1.0

    def run(schedule):
        if schedule.tile_n == 128 and schedule.tile_m == 128:
            raise RuntimeError("does not compile")
        return times[(schedule.tile_m, schedule.tile_n, schedule.occupancy)]

    best, timings = tune(run, CANDIDATES, cuda=False,
                         timer=lambda fn, *, cuda, warmup, reps: fn())
    assert (best.tile_m, best.tile_n, best.occupancy) == (64, 64, 2)
    assert math.isinf(timings["tile_m=128;tile_n=128;occupancy=1;num_worker_warps=8"])
    assert len(timings) == len(CANDIDATES)


def test_tune_raises_when_everything_fails():
    def run(schedule):
        raise RuntimeError("nope")
    with pytest.raises(RuntimeError, match="every candidate schedule failed"):
        tune(run, CANDIDATES, cuda=False, timer=lambda fn, *, cuda, warmup, reps: fn())


def test_cache_round_trip(tmp_path):
    cache = ScheduleCache(tmp_path)
    assert cache.get(KEY) is None
    cache.put(KEY, CANDIDATES[2], {"x": 1.0})
    again = ScheduleCache(tmp_path)
    assert again.get(KEY) == CANDIDATES[2]
    data = json.loads((tmp_path / "autotune.json").read_text())
    assert data[str(KEY)]["ms"] == {"x": 1.0}


def test_seq_bucket():
    assert [seq_bucket(n) for n in (1, 100, 128, 129, 4096, 5000)] == [128, 128, 128, 256, 4096, 8192]


def test_disabled_by_default(monkeypatch):
    monkeypatch.delenv(autotune.ENABLE_ENV, raising=False)
    assert autotune.tuned_schedule(KEY, lambda s: 0, cuda=False) is None


def test_tunes_once_then_reads_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.ENABLE_ENV, "1")
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
    calls = []

    def run(schedule):
        calls.append(schedule)
        return 1.0 if schedule == CANDIDATES[3] else 2.0

    monkeypatch.setattr(autotune, "tune", lambda run, candidates, cuda: tune(
        run, candidates, cuda=cuda, timer=lambda fn, *, cuda, warmup, reps: fn()))
    assert autotune.tuned_schedule(KEY, run, cuda=False) == CANDIDATES[3]
    assert len(calls) == len(CANDIDATES)
    assert autotune.tuned_schedule(KEY, run, cuda=False) == CANDIDATES[3]
    assert len(calls) == len(CANDIDATES), "a cached key must not be tuned again"


@pytest.fixture
def stubbed_kernel(monkeypatch, tmp_path):
    """Make the op take its kernel path on CPU, recording each launch plan instead."""
    plans = []
    monkeypatch.setattr(op, "kernel_available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(op, "sm_count", lambda device: 132)

    def fake_run(plan, q, k, v, mask, eager=True, keep=None):
        plans.append(plan)
        return torch.zeros_like(q), q.new_zeros(q.shape[:3], dtype=torch.float32)

    monkeypatch.setattr(op, "run_kernel", fake_run)
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
    return plans


def test_op_uses_tuned_schedule_unless_overridden(stubbed_kernel, monkeypatch, tmp_path):
    q = torch.randn(1, 4, 300, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 300, 128, dtype=torch.bfloat16)
    ScheduleCache(tmp_path).put(TuneKey(9, "bfloat16", 128, True, 512), _candidate(128, 128),
                                {})
    monkeypatch.setenv(autotune.ENABLE_ENV, "1")
    hta.tiled_attention(q, k, k, is_causal=True)
    assert (stubbed_kernel[-1].variant.tile_m, stubbed_kernel[-1].variant.tile_n) == (128, 128)
    hta.tiled_attention(q, k, k, is_causal=True, schedule=hta.Schedule(tile_m=64))
    assert stubbed_kernel[-1].variant.tile_m == 64 and stubbed_kernel[-1].variant.tile_n == 128  # table value
    with hta.use_schedule(hta.Schedule(tile_n=64)):
        hta.tiled_attention(q, k, k, is_causal=True)
    assert (stubbed_kernel[-1].variant.tile_m, stubbed_kernel[-1].variant.tile_n) == (64, 64)
    monkeypatch.setenv(autotune.ENABLE_ENV, "0")
    hta.tiled_attention(q, k, k, is_causal=True)
    assert (stubbed_kernel[-1].variant.tile_m, stubbed_kernel[-1].variant.tile_n) == (64, 128)


def test_short_queries_have_their_own_tuning_entry(stubbed_kernel, monkeypatch, tmp_path):
    k = torch.randn(1, 2, 300, 128, dtype=torch.bfloat16)
    ScheduleCache(tmp_path).put(TuneKey(9, "bfloat16", 128, False, 512), _candidate(128, 128),
                                {})
    ScheduleCache(tmp_path).put(TuneKey(9, "bfloat16", 128, False, 512, short_query=True),
                                _candidate(64, 64), {})
    monkeypatch.setenv(autotune.ENABLE_ENV, "1")
    hta.tiled_attention(torch.randn(1, 4, 300, 128, dtype=torch.bfloat16), k, k)
    assert (stubbed_kernel[-1].variant.tile_m, stubbed_kernel[-1].variant.tile_n) == (128, 128)
    hta.tiled_attention(torch.randn(1, 4, 1, 128, dtype=torch.bfloat16), k, k)
    assert (stubbed_kernel[-1].variant.tile_m, stubbed_kernel[-1].variant.tile_n) == (64, 64)
    monkeypatch.setenv(autotune.ENABLE_ENV, "0")   # the default table's short-query entry
    hta.tiled_attention(torch.randn(1, 4, 1, 128, dtype=torch.bfloat16), k, k)
    assert (stubbed_kernel[-1].variant.tile_m, stubbed_kernel[-1].variant.tile_n) == (64, 128)


def test_throughput_timer_on_cpu_is_the_host_median():
    calls = []
    assert autotune.throughput_ms(lambda: calls.append(1), cuda=False, warmup=2, reps=3) >= 0
    assert len(calls) == 5


@pytest.mark.parametrize("options", [dict(warmup=-1), dict(reps=0), dict(rounds=0)])
def test_back_to_back_timer_rejects_bad_counts(options):
    from hf_tiled_attention.timing import back_to_back_ms
    with pytest.raises(ValueError, match="back_to_back_ms needs"):
        back_to_back_ms(lambda: None, **options)


@pytest.mark.parametrize("options", [dict(warmup=-1), dict(calls=0), dict(rounds=0)])
def test_graph_replay_timer_rejects_bad_counts(options):
    from hf_tiled_attention.timing import graph_replay_ms
    with pytest.raises(ValueError, match="graph_replay_ms needs"):
        graph_replay_ms(lambda: None, **options)
