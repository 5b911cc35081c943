"""Every bad input gets a clear error naming the argument."""

import pytest
import torch

import hf_tiled_attention as hta


def qkv(b=1, hq=4, hkv=2, sq=8, skv=8, d=32, dtype=torch.float32):
    return (torch.randn(b, hq, sq, d, dtype=dtype), torch.randn(b, hkv, skv, d, dtype=dtype),
            torch.randn(b, hkv, skv, d, dtype=dtype))


@pytest.mark.parametrize("mutate, error, pattern", [
    (lambda q, k, v: (q.float(), k.half(), v.half()), TypeError, "share one dtype"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "query must be float16"),
    (lambda q, k, v: (q[0], k, v), ValueError, r"query must be 4-D \(B, Hq, Sq, D\)"),
    (lambda q, k, v: (q, k[0], v), ValueError, r"key must be 4-D"),
    (lambda q, k, v: (q, k, v[:, :, :-1]), ValueError, "key and value must have the same shape"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, r"query heads \(3\) must be a multiple"),
    (lambda q, k, v: (q[..., :20], k[..., :20], v[..., :20]), ValueError, "head dim must be a multiple of 8"),
    (lambda q, k, v: (q, k[..., :16], v[..., :16]), ValueError, "head dim 16 does not match"),
    (lambda q, k, v: (q.repeat(2, 1, 1, 1), k, v), ValueError, "batch size 1 does not match"),
    (lambda q, k, v: ("q", k, v), TypeError, "query must be a torch.Tensor"),
    (lambda q, k, v: (q.to("meta"), k, v), ValueError, "must be on one device"),
])
def test_bad_tensors(mutate, error, pattern):
    with pytest.raises(error, match=pattern):
        hta.tiled_attention(*mutate(*qkv()))


@pytest.mark.parametrize("d", [8, 264, 512])
def test_unsupported_head_dims(d):
    with pytest.raises(ValueError, match="head dim"):
        hta.tiled_attention(*qkv(d=d))


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(window=0), ValueError, "window must be >= 1"),
    (dict(window=2.5), TypeError, "window must be an int"),
    (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=-1.0), ValueError, "softcap must be"),
    (dict(softcap="x"), TypeError, "softcap must be a float"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    (dict(schedule={"tile_m": 64}), TypeError, "schedule must be a hf_tiled_attention.Schedule"),
])
def test_bad_options(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        hta.tiled_attention(*qkv(), **kwargs)


@pytest.mark.parametrize("sinks, error, pattern", [
    ([0.5] * 4, TypeError, r"sinks must be a torch.Tensor of shape \(Hq,\)"),
    (torch.zeros(2), ValueError, r"sinks must have shape \(Hq,\) = \(4,\).*got \(2,\)"),
    (torch.zeros(1, 4, 8, 1), ValueError, r"one logit per query head, got \(1, 4, 8, 1\)"),
    (torch.zeros(4, dtype=torch.int64), TypeError, "sinks must be a floating-point tensor"),
    (torch.zeros(4, device="meta"), ValueError, "sinks must be on the query's device"),
])
def test_bad_sinks(sinks, error, pattern):
    with pytest.raises(error, match=pattern):
        hta.tiled_attention(*qkv(), sinks=sinks)


@pytest.mark.parametrize("mask, error, pattern", [
    (torch.ones(1, 4, 8, 9, dtype=torch.bool), ValueError, "not broadcastable"),
    (torch.ones(2, 4, 8, 8, dtype=torch.bool), ValueError, "not broadcastable"),
    (torch.ones(1, 3, 8, 8, dtype=torch.bool), ValueError, "not broadcastable"),
    (torch.ones(1, 1, 1, 4, 8, 8, dtype=torch.bool), ValueError, "1 to 4 dims"),
    (torch.ones(1, 1, 8, 8, dtype=torch.int64), TypeError, "attn_mask must be bool"),
    ([[True]], TypeError, "attn_mask must be a torch.Tensor"),
    (torch.ones(1, 1, 8, 8, dtype=torch.bool, device="meta"), ValueError, "query's device"),
])
def test_bad_masks(mask, error, pattern):
    with pytest.raises(error, match=pattern):
        hta.tiled_attention(*qkv(), mask)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(tile_m=48), "tile_m must be one of"),
    (dict(tile_n=512), "tile_n must be one of"),
    (dict(occupancy=0), "occupancy must be an int in"),
    (dict(k_latency=11), "k_latency must be an int in"),
    (dict(num_ctas=3), "num_ctas must be one of"),
    (dict(num_worker_warps=6), "num_worker_warps must be a power of two"),
    (dict(kv_splits=-1), "kv_splits must be an int in"),
    (dict(kv_splits=1000), "kv_splits must be an int in"),
])
def test_bad_schedules(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        hta.Schedule(**kwargs)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(rows_tile=48), r"BackwardSchedule\.rows_tile must be one of"),
    (dict(rows_warps=2), r"BackwardSchedule\.rows_warps must be 4 or 8"),
    (dict(rows_occupancy=0), r"BackwardSchedule\.rows_occupancy must be an int in"),
    (dict(kv_occupancy=33), r"BackwardSchedule\.kv_occupancy must be an int in"),
])
def test_bad_backward_schedules(kwargs, pattern):
    from hf_tiled_attention.schedule import BackwardSchedule

    with pytest.raises(ValueError, match=pattern):
        BackwardSchedule(**dict(dict(kv_keys=64, kv_queries=64, q_rows=64, q_keys=64), **kwargs))


@pytest.mark.parametrize("field", ["heavy_first", "pack_gqa", "split_head_dim"])
def test_schedule_flags_must_be_bool(field):
    with pytest.raises(TypeError, match=f"{field} must be a bool"):
        hta.Schedule(**{field: 1})


def test_schedule_field_parsing():
    assert hta.Schedule.parse_field("pack_gqa", "true") is True
    assert hta.Schedule.parse_field("tile_m", "64") == 64
    with pytest.raises(ValueError, match="no field"):
        hta.Schedule.parse_field("tile_q", "64")
    with pytest.raises(ValueError, match="expects true/false"):
        hta.Schedule.parse_field("heavy_first", "maybe")
