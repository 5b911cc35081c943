"""GPU: the FP8 cache's kernels (fp8_cache_kernel.py). The quantisation against its torch
definition, the decode step against the fp64 definition on the dequantised rows (poisoned
outputs). generate() on the kernels: integration_tests/test_fp8_cache_generate.py."""

from __future__ import annotations

import pytest
import torch

from hf_tiled_attention import fp8_cache_attention
from hf_tiled_attention.fp8_cache import dequantize_rows, quantize_rows, quantize_rows_torch, \
    split_rows
from semantics import definition
from test_fp8 import rel_rms
from test_kernel_gpu import _kernel_required, poison_allocator  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _fp8_gpu():
    if not fp8_cache_attention.cache_kernels_run_on(torch.device("cuda")):
        pytest.skip("needs e4m3 conversion (sm_89+) and cuda-tile")


def _states(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 30.0  # an outlier channel
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_quantisation_kernel_matches_torch(dim, dtype):
    _fp8_gpu()
    x = _states((2, 4, 333, dim), dtype)
    poison_allocator(x.numel() * 4)
    rows = quantize_rows(x)
    want = quantize_rows_torch(x)
    values, scales = split_rows(rows)
    want_values, want_scales = split_rows(want)
    assert torch.equal(scales, want_scales)  # both amax * SCALE_PER_AMAX, one rounding
    differ = values.view(torch.uint8) != want_values.view(torch.uint8)
    # x * (448 / amax) may land an ulp away from torch's product and round to the other e4m3
    # neighbour where that ulp crosses a midpoint
    assert differ.float().mean().item() < 1e-3
    step = (values.float() - want_values.float()).abs()[differ]
    assert (step <= want_values.float().abs()[differ] / 8 + 2.0 ** -9).all()


# (B, Hq, Hkv, Sq, Skv, D), options, key padding (left-padded rows), split keys
CASES = {
    "gqa-long-split": ((2, 32, 8, 1, 5000, 128), dict(is_causal=True), False, True),
    "gqa-unsplit": ((4, 32, 8, 1, 700, 128), dict(is_causal=True), False, False),
    "mha-padded": ((3, 8, 8, 1, 900, 64), dict(is_causal=True), True, True),
    "window-softcap": ((2, 16, 4, 1, 3000, 128), dict(is_causal=True, window=512, softcap=30.0),
                       False, True),
    "sinks": ((2, 16, 4, 1, 2000, 64), dict(is_causal=True, sinks=True), True, True),
    "speculative-4": ((2, 28, 4, 4, 1500, 128), dict(is_causal=True), False, True),
    "mqa-16-queries": ((1, 32, 1, 16, 2500, 256), dict(is_causal=True), False, True),
    "d96-not-causal": ((2, 12, 4, 1, 1000, 96), {}, True, False),
    # five queries whose windows start and end in different key tiles: masked tiles at both
    # ends of a run of whole ones, and a split's share starting inside either
    "speculative-window": ((2, 16, 4, 5, 2600, 128), dict(is_causal=True, window=300), False,
                           True),
    # one block sums every key: 8k (128 tiles) with the PV MMAs' fast accumulation, 64k
    # without it (its truncation at every tile grew the error there: perf-notes step 61)
    "fast-acc-8k-unsplit": ((2, 32, 8, 1, 8192, 128), dict(is_causal=True), False, False),
    "exact-64k-unsplit": ((1, 8, 2, 1, 65536, 128), dict(is_causal=True), False, False),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_the_definition(case, dtype):
    _fp8_gpu()
    (batch, heads_q, heads_kv, seq_q, seq_kv, dim), options, padded, split = CASES[case]
    options = dict(options)
    q = _states((batch, heads_q, seq_q, dim), dtype, 1)
    k_rows = quantize_rows(_states((batch, heads_kv, seq_kv, dim), dtype, 2))
    v_rows = quantize_rows(_states((batch, heads_kv, seq_kv, dim), dtype, 3))
    mask = None
    if padded:  # left padding: row b hides its first 37 * b keys
        mask = torch.ones(batch, 1, 1, seq_kv, dtype=torch.bool, device="cuda")
        for b in range(batch):
            mask[b, ..., :37 * b] = False
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(heads_q, device="cuda")
    sms = 132 if split else 0
    plan = fp8_cache_attention.decode_plan(batch, heads_q, heads_kv, seq_q, seq_kv, dim,
                                           options.get("is_causal", False),
                                           "window" in options, "softcap" in options,
                                           mask is not None, sms)
    assert (plan.splits > 1) == split
    poison_allocator(q.numel() * 64)
    import hf_tiled_attention.op as op
    keep = op.sm_count
    op.sm_count = lambda device: sms  # the split the case names
    try:
        out = fp8_cache_attention.decode(q, k_rows, v_rows, mask,
                                         causal=options.get("is_causal", False),
                                         window=options.get("window"),
                                         softcap=options.get("softcap"),
                                         sinks=options.get("sinks"))
    finally:
        op.sm_count = keep
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == q.shape
    assert out.transpose(1, 2).is_contiguous(), "laid out as (B, Sq, Hq, D)"
    assert torch.isfinite(out).all()
    k, v = (dequantize_rows(r, torch.float32) for r in (k_rows, v_rows))
    want = definition(q.double(), k.double(), v.double(), mask, **options)[0]
    # the probabilities (times V's scales) enter PV's e4m3 MMA as two e4m3 parts, ~8
    # significant bits as bf16's, whatever the query's dtype (fast accumulation below D=256
    # over short key ranges: schedule.fp8_cache_pv_fast_acc); the outlier channel (_states) is
    # what an e4m3 QK^T fails: 1.0-2.0e-2 on the H200
    assert rel_rms(out, want) < 1e-2


def test_empty_rows_give_zero():
    _fp8_gpu()
    q = _states((1, 8, 1, 64))
    rows = quantize_rows(_states((1, 2, 300, 64), seed=4))
    mask = torch.zeros(1, 1, 1, 300, dtype=torch.bool, device="cuda")
    out = fp8_cache_attention.decode(q, rows, rows, mask, causal=True)
    assert torch.equal(out, torch.zeros_like(out))


def test_unwritten_rows_stay_hidden():
    """A static cache's rows past the written keys are zeros (scale 0); the mask hides them, and
    whole key tiles of them must give no NaN (V's tile scale is floored)."""
    _fp8_gpu()
    q = _states((2, 16, 1, 128), seed=5)
    k_rows = quantize_rows(_states((2, 4, 1000, 128), seed=6))
    v_rows = quantize_rows(_states((2, 4, 1000, 128), seed=7))
    k_rows[:, :, 600:] = 0
    v_rows[:, :, 600:] = 0
    mask = torch.zeros(2, 1, 1, 1000, dtype=torch.bool, device="cuda")
    mask[..., :600] = True
    out = fp8_cache_attention.decode(q, k_rows, v_rows, mask, causal=False)
    k, v = (dequantize_rows(r[:, :, :600], torch.float32) for r in (k_rows, v_rows))
    want = definition(q.double(), k.double(), v.double(), None)[0]
    assert torch.isfinite(out).all()
    assert rel_rms(out, want) < 1e-2
