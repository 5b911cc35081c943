"""The FP8 KV cache's rows (fp8_cache.py) and its decode step (fp8_cache_attention.py) on the
CPU: the rounding, the row layout, bad input, the launch plan, the registered op's fake, and
the kernels' cubins for sm_90 / sm_100 / sm_120."""

from __future__ import annotations

import pytest
import torch

from hf_tiled_attention import fp8_cache, fp8_cache_attention
from hf_tiled_attention.fp8_cache import (ROW_EXTRA, dequantize_rows, key_rotation,
                                          keys_from_rows, quantize_keys, quantize_rows,
                                          quantize_rows_torch, split_rows)
from hf_tiled_attention.kernel_params import E4M3_MAX, SCALE_PER_AMAX

E4M3_STEP = 2.0 ** -3  # e4m3's relative spacing (3 mantissa bits)


def _states(shape=(2, 3, 37, 64), seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 5] *= 40.0  # an outlier channel, as LLM keys have
    return x.to(dtype)


def test_rows_hold_values_scale_and_padding():
    x = _states()
    rows = quantize_rows_torch(x)
    assert rows.dtype == torch.uint8 and rows.shape == (2, 3, 37, 64 + ROW_EXTRA)
    values, scales = split_rows(rows)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (2, 3, 37, 64)
    assert scales.dtype == torch.float32 and scales.shape == (2, 3, 37)
    assert values.data_ptr() == rows.data_ptr(), "views, not copies"
    amax = x.float().abs().amax(-1)
    torch.testing.assert_close(scales, amax * SCALE_PER_AMAX, rtol=0, atol=0)
    assert rows[..., 64 + 4:].eq(0).all()
    # every row's largest value is 448 exactly: the scale uses e4m3's whole range
    assert values.float().abs().amax(-1).eq(E4M3_MAX).all()


def test_rounding_error_is_half_an_e4m3_step_of_the_row():
    x = _states(dtype=torch.float32)
    back = dequantize_rows(quantize_rows_torch(x), torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # relative to each value where it is a normal e4m3 number, absolute below
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * E4M3_STEP / 2, amax / E4M3_MAX * 2.0 ** -9) * 1.001
    assert (err <= bound).all()


def test_keys_are_rotated_and_read_back():
    """Keys: times the +-1 Hadamard matrix S, rounded; read back rotated by S^T / D. A query
    rotated by S scores the rows as the keys (S S^T = D I)."""
    k = _states(dtype=torch.float32)
    signs = key_rotation(64, k.device).float()
    assert torch.equal(signs @ signs.T, 64 * torch.eye(64))
    rows = quantize_keys(k)
    assert torch.equal(dequantize_rows(rows, torch.float32),
                       dequantize_rows(quantize_rows(k @ signs), torch.float32))
    back = keys_from_rows(rows, torch.float32)
    assert (back - k).pow(2).mean().sqrt() < 0.05 * k.pow(2).mean().sqrt()  # e4m3's rounding
    q = torch.randn(2, 3, 5, 64)
    torch.testing.assert_close((q @ signs) @ dequantize_rows(rows, torch.float32).transpose(2, 3)
                               / 64, q @ back.transpose(2, 3), rtol=1e-5, atol=1e-4)


def test_keys_of_other_head_dims_are_not_rotated():
    k = _states((1, 2, 9, 96), dtype=torch.float32)
    assert key_rotation(96, k.device) is None
    assert torch.equal(quantize_keys(k), quantize_rows(k))
    assert torch.equal(keys_from_rows(quantize_keys(k), torch.float32),
                       dequantize_rows(quantize_rows(k), torch.float32))


def test_zero_rows_and_dtypes():
    x = torch.zeros(1, 1, 4, 32, dtype=torch.float16)
    x[0, 0, 2] = 3.0
    rows = quantize_rows(x)
    back = dequantize_rows(rows, torch.float16)
    assert back.dtype == torch.float16
    assert torch.equal(back, x)
    assert torch.isfinite(split_rows(rows)[1]).all()


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(1, 1, 4, 24), "multiple of 16"),
    (torch.zeros(1, 4, 32), r"\(B, H, S, D\)"),
    (torch.zeros(1, 1, 4, 32, dtype=torch.int32), "floating point"),
])
def test_quantize_refuses_bad_states(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize_rows(bad)


def test_rows_check_names_the_argument():
    with pytest.raises(ValueError, match="key: an FP8 cache's rows"):
        fp8_cache.check_rows(torch.zeros(1, 1, 4, 40, dtype=torch.uint8), "key")


def _layer_call(query, key, value, mask=None, **kwargs):
    from hf_tiled_attention.transformers_backend import tiled_attention_forward

    class Layer(torch.nn.Module):
        is_causal = True
    return tiled_attention_forward(Layer().eval(), query, key, value, mask, **kwargs)


def test_adapter_reads_rows_as_the_dequantised_states():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 3, 64)
    k, v = _states((2, 2, 20, 64), 1, torch.float32), _states((2, 2, 20, 64), 2, torch.float32)
    kr, vr = quantize_keys(k), quantize_rows(v)
    out, _ = _layer_call(q, kr, vr, scaling=0.125)
    want, _ = _layer_call(q, keys_from_rows(kr, q.dtype), dequantize_rows(vr, q.dtype),
                          scaling=0.125)
    assert out.shape == (2, 3, 8, 64)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_adapter_refuses_mixed_rows():
    q = torch.randn(1, 2, 1, 32)
    rows = quantize_rows(torch.randn(1, 2, 5, 32))
    with pytest.raises(ValueError, match="value is torch.float32"):
        _layer_call(q, rows, torch.randn(1, 2, 5, 32))
    with pytest.raises(ValueError, match="head dim 32, the query has 48"):
        _layer_call(torch.randn(1, 2, 1, 48), rows, rows)


def test_fp8_backend_reads_rows_too():
    from hf_tiled_attention.fp8 import fp8_attention
    from hf_tiled_attention.fp8_backend import fp8_attention_forward

    class Layer(torch.nn.Module):
        is_causal = True
    torch.manual_seed(1)
    q = torch.randn(1, 4, 8, 64, dtype=torch.bfloat16)
    k = quantize_keys(torch.randn(1, 2, 8, 64, dtype=torch.bfloat16))
    v = quantize_rows(torch.randn(1, 2, 8, 64, dtype=torch.bfloat16))
    out, _ = fp8_attention_forward(Layer().eval(), q, k, v, None, scaling=0.125)
    want = fp8_attention(q, keys_from_rows(k, q.dtype), dequantize_rows(v, q.dtype),
                         is_causal=True, scale=0.125)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The decode step's plan, fake and cubins
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads, seq_q, g_tile, grid_heads", [
    ((32, 8), 1, 4, 8), ((28, 4), 1, 8, 4), ((8, 8), 1, 1, 8), ((64, 2), 2, 16, 4),
    ((24, 8), 16, 4, 8)])
def test_plan_packs_a_group_into_the_tile(heads, seq_q, g_tile, grid_heads):
    from hf_tiled_attention import fp8_cache_kernel as K
    plan = fp8_cache_attention.decode_plan(1, heads[0], heads[1], seq_q, 4096, 128, True, False,
                                           False, False, 132)
    assert plan.constants[K.G_TILE] == g_tile
    assert plan.constants[K.ROWS] * g_tile == 64
    assert plan.grid[1] == grid_heads
    m_tiles = -(-seq_q // plan.constants[K.ROWS])
    assert plan.grid[0] == m_tiles * plan.splits


def test_plan_splits_keys_to_fill_the_gpu_only():
    small = fp8_cache_attention.decode_plan(1, 32, 8, 1, 32768, 128, True, False, False, False,
                                            132)
    assert small.splits > 1 and small.merge is not None
    assert small.grid[0] * small.grid[1] <= 132 * 2
    full = fp8_cache_attention.decode_plan(64, 32, 8, 1, 32768, 128, True, False, False, False,
                                           132)
    assert full.splits == 1 and full.merge is None
    short = fp8_cache_attention.decode_plan(1, 32, 8, 1, 100, 128, True, False, False, False, 132)
    assert short.splits == 1, "too few key tiles to share"


def test_fast_accumulation_only_over_short_key_ranges():
    """The PV MMAs' fast accumulation loses bits at every tile, so a block summing more than
    FP8_CACHE_FAST_ACC_TILES key tiles accumulates exactly (the constant the kernel reads)."""
    from hf_tiled_attention import fp8_cache_kernel as K
    from hf_tiled_attention.schedule import FP8_CACHE_FAST_ACC_TILES, FP8_CACHE_KEYS

    def fast(batch, seq_kv, dim=128):
        plan = fp8_cache_attention.decode_plan(batch, 32, 8, 1, seq_kv, dim, True, False, False,
                                               False, 132)
        tiles = -(-seq_kv // FP8_CACHE_KEYS)
        assert (-(-tiles // plan.splits) <= FP8_CACHE_FAST_ACC_TILES) == plan.constants[
            K.PV_FAST_ACC] or dim > 128
        return plan.constants[K.PV_FAST_ACC]

    longest = FP8_CACHE_FAST_ACC_TILES * FP8_CACHE_KEYS
    assert fast(64, longest) and not fast(64, longest + 1), "a full GPU: the keys are not split"
    assert fast(1, 16 * longest), "one row: its keys split over the GPU"
    assert not fast(32, 65536), "the run whose error grew (perf-notes step 61)"
    assert not fast(1, 100, dim=256), "D=256 spills with it"


def test_registered_op_fake_gives_the_output_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 8, 1, 64, dtype=torch.bfloat16)
        rows = torch.empty(2, 2, 50, 64 + ROW_EXTRA, dtype=torch.uint8)
        out, lse = torch.ops.hf_tiled_attention.fp8_cache_decode(q, rows, rows, None, True,
                                                                   0.125, 0, 0.0, 49)
        assert out.shape == (2, 8, 1, 64) and out.dtype == torch.bfloat16
        assert out.transpose(1, 2).is_contiguous()
        assert lse.shape == (2, 8, 1) and lse.dtype == torch.float32


CUBIN_CASES = {  # (B, Hq, Hkv, Sq, Skv, D), options, key mask, SMs (0: no split)
    "gqa-decode-split": ((2, 32, 8, 1, 4096, 128), {}, False, 132),
    "mha-window-softcap-padded": ((1, 8, 8, 1, 300, 64), dict(window=100, softcap=30.0), True,
                                  132),
    "d96-speculative-unsplit": ((2, 16, 16, 4, 1000, 96), {}, True, 0),
    "d256-mqa-16-queries": ((1, 64, 8, 16, 2000, 256), dict(softcap=20.0), False, 132),
    "static-mask-not-causal": ((3, 12, 4, 1, 777, 128), dict(causal=False), True, 132),
    "speculative-window": ((2, 16, 4, 5, 2600, 128), dict(window=300), False, 132),
}


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120"])
@pytest.mark.parametrize("case", list(CUBIN_CASES))
def test_decode_kernels_compile(case, arch):
    pytest.importorskip("cuda.tile")
    (batch, heads_q, heads_kv, seq_q, seq_kv, dim), options, masked, sms = CUBIN_CASES[case]
    q = torch.empty(batch, heads_q, seq_q, dim, dtype=torch.bfloat16, device="meta")
    rows = torch.empty(batch, heads_kv, seq_kv, dim + ROW_EXTRA, dtype=torch.uint8,
                       device="meta")
    mask = torch.empty(batch, 1, 1, seq_kv, dtype=torch.bool, device="meta") if masked else None
    cubins = fp8_cache_attention.export_cubins(q, rows, rows, mask, arch=arch, sm_count=sms,
                                               **options)
    plan_splits = len(cubins) > 1
    assert plan_splits == (sms > 0 and case != "d96-speculative-unsplit")
    assert all(c[:4] == b"\x7fELF" for c in cubins)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120"])
@pytest.mark.parametrize("dim, dtype", [(64, torch.bfloat16), (128, torch.float16),
                                        (96, torch.bfloat16), (256, torch.bfloat16)])
def test_quantise_kernel_compiles(dim, dtype, arch):
    pytest.importorskip("cuda.tile")
    states = torch.empty(2, 8, 100, dim, dtype=dtype, device="meta")
    assert fp8_cache_attention.export_quantize_cubin(states, arch=arch)[:4] == b"\x7fELF"


def test_hopper_decode_kernel_has_no_spills():
    pytest.importorskip("cuda.tile")
    inspect = pytest.importorskip("eval.inspect_cubin")
    for dim in (64, 128):
        q = torch.empty(2, 32, 1, dim, dtype=torch.bfloat16, device="meta")
        rows = torch.empty(2, 8, 4096, dim + ROW_EXTRA, dtype=torch.uint8, device="meta")
        decode_cubin = fp8_cache_attention.export_cubins(q, rows, rows, arch="sm_90")[0]
        try:
            info = inspect.report(decode_cubin)
        except FileNotFoundError:
            pytest.skip("no nvdisasm")
        assert info["stack"] == 0 and info["local"] == 0, info
        assert info["ops"].get("QGMMA", 0) > 0, "the e4m3 warpgroup MMA"
