"""CPU: the reference path (what CI can run) against the fp64 definition on random data."""

import warnings

import pytest
import torch

import hf_tiled_attention as hta
from semantics import (NAN_CASES, SEMANTIC_CASES, assert_matches_definition, check_nan_pattern,
                       definition, make_inputs, make_nan_inputs, op_kwargs)

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def _no_reference_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SEMANTIC_CASES, ids=lambda c: c.name)
def test_reference_matches_definition(case, dtype):
    q, k, v, mask = make_inputs(case, "cpu", dtype)
    out, lse = hta.tiled_attention(q, k, v, mask, return_lse=True, **op_kwargs(case))
    want_out, want_lse = definition(q, k, v, mask, **op_kwargs(case))
    # laid out as (B, Sq, Hq, D), as SDPA's fused kernels lay theirs out
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    assert_matches_definition(out, lse, want_out, want_lse, atol=TOLERANCE[dtype], lse_atol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nan_case", NAN_CASES, ids=lambda c: c.name)
def test_nan_reaches_the_rows_that_see_it(nan_case, dtype):
    q, k, v, mask = make_nan_inputs(nan_case, "cpu", dtype)
    out, lse = hta.tiled_attention(q, k, v, mask, return_lse=True, **op_kwargs(nan_case.case))
    want_out, want_lse = definition(q, k, v, mask, **op_kwargs(nan_case.case))
    check_nan_pattern(out, lse, want_out, want_lse, TOLERANCE[dtype], nan_case.spreads)


def test_fully_masked_rows_give_zero_not_nan():
    q, k, v = (torch.randn(1, 2, 8, 32) for _ in range(3))
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    mask[..., 3, :] = False
    out, lse = hta.tiled_attention(q, k, v, mask, return_lse=True)
    assert (out[:, :, 3] == 0).all() and torch.isinf(lse[:, :, 3]).all()
    assert torch.isfinite(out).all()


def test_memory_stays_chunked():
    """A 4k x 4k causal call must not allocate an O(Sq x Skv) score matrix."""
    q, k, v = (torch.randn(1, 1, 4096, 64) for _ in range(3))
    from hf_tiled_attention import reference
    seen = []
    original = torch.matmul

    def spy(a, b, *args, **kwargs):
        result = original(a, b, *args, **kwargs)
        seen.append(result.numel())
        return result

    torch.matmul = spy
    try:
        reference.torch.matmul = spy
        hta.tiled_attention(q, k, v, is_causal=True)
    finally:
        torch.matmul = original
    assert seen and max(seen) <= reference.QUERY_CHUNK * max(reference.KEY_CHUNK, 64)


def test_sinks_keep_empty_rows_exactly_zero():
    """A row that sees no key puts all its weight on the sink: output exactly 0, LSE the
    sink's logit; the other rows shrink by sigmoid(lse - sink)."""
    q, k, v = torch.randn(1, 4, 12, 32), torch.randn(1, 2, 6, 32), torch.randn(1, 2, 6, 32)
    sinks = torch.tensor([-1.0, 0.0, 2.0, 5.0])
    out, lse = hta.tiled_attention(q, k, v, is_causal=True, sinks=sinks, return_lse=True)
    plain, plain_lse = hta.tiled_attention(q, k, v, is_causal=True, return_lse=True)
    empty = plain_lse.isinf()
    assert empty[..., :6].all() and not empty[..., 6:].any()  # Sq > Skv: bottom-right causal
    assert (out[empty] == 0).all()
    assert torch.equal(lse[empty], sinks[:, None].expand(1, 4, 12)[empty])
    shrink = torch.sigmoid(plain_lse - sinks[:, None])[..., None]
    torch.testing.assert_close(out[:, :, 6:], (plain * shrink)[:, :, 6:])


def test_default_scale_and_gqa_against_torch_sdpa():
    q = torch.randn(2, 8, 33, 48)
    k, v = torch.randn(2, 2, 45, 48), torch.randn(2, 2, 45, 48)
    got = hta.tiled_attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_strided_inputs_are_not_copied():
    base = torch.randn(2, 40, 4, 32)
    q = base.transpose(1, 2)
    assert not q.is_contiguous()
    out = hta.tiled_attention(q, q[:, :2], q[:, :2], is_causal=True)
    want, _ = definition(q, q[:, :2], q[:, :2], is_causal=True)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_warns_once_on_reference_path():
    hta.clear_caches()
    q = torch.randn(1, 1, 4, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            hta.tiled_attention(q, q, q)
    messages = [w for w in caught if "reference path" in str(w.message)]
    assert len(messages) == 1


def test_torch_compile_fullgraph():
    def f(q, k, v, mask):
        return hta.tiled_attention(q, k, v, mask, is_causal=True, window=8) * 2

    q, k, v = torch.randn(1, 4, 24, 32), torch.randn(1, 2, 24, 32), torch.randn(1, 2, 24, 32)
    mask = torch.rand(1, 1, 1, 24) < 0.8
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, mask), f(q, k, v, mask))


def test_empty_key_sequence_gives_zero():
    q = torch.randn(1, 2, 3, 16)
    kv = torch.randn(1, 2, 0, 16)
    out, lse = hta.tiled_attention(q, kv, kv, return_lse=True)
    assert (out == 0).all() and torch.isinf(lse).all()
