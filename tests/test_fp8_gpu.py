"""GPU: the FP8 kernel (fp8_kernel.py) against its CPU twin's roundings on the same e4m3
inputs and against the fp64 definition, with poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from hf_tiled_attention import fp8, fp8_attention
from test_fp8 import FEATURES, definition, inputs, rel_rms
from test_kernel_gpu import _kernel_required, poison_allocator  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (sm_89+)")


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_kernel_matches_its_twin_and_the_definition(features, dim):
    _fp8_gpu()
    q, k, v = (t.cuda() for t in inputs(batch=2, heads=(8, 2), seq=(300, 700), dim=dim))
    kwargs = dict(FEATURES[features])
    if "sinks" in kwargs:
        kwargs["sinks"] = torch.randn(8, device="cuda")
    poison_allocator(q.numel() * 8)
    out = fp8_attention(q, k, v, **kwargs)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert out.transpose(1, 2).is_contiguous(), "the output is laid out as (B, Sq, Hq, D)"
    scale = dim ** -0.5
    twin = fp8.reference(fp8.quantize(q, k, v), dim, kwargs.get("is_causal", False), scale,
                         kwargs.get("window"), kwargs.get("softcap"), kwargs.get("sinks"))
    # the same roundings; fp32 sums in another order and the MMA's fast accumulation (its
    # partial sums kept in fewer bits: 4-5e-3 on the H200, a probability rounded to the next
    # e4m3 value where a score moved)
    assert rel_rms(out, twin.double()) < 1e-2
    want = definition(q.cpu(), k.cpu(), v.cpu(), **{
        key: (val.cpu() if isinstance(val, torch.Tensor) else val) for key, val in kwargs.items()})
    assert rel_rms(out.cpu(), want) < 0.06


@pytest.mark.parametrize("heads", [(32, 8), (28, 4), (16, 16)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_heads_dtypes_and_odd_lengths(heads, dtype):
    _fp8_gpu()
    q, k, v = (t.cuda() for t in inputs(batch=1, heads=heads, seq=(777, 777), dim=128,
                                        dtype=dtype))
    out = fp8_attention(q, k, v, is_causal=True)
    assert out.dtype == dtype
    assert rel_rms(out.cpu(), definition(q.cpu(), k.cpu(), v.cpu(), is_causal=True)) < 0.06


@pytest.mark.parametrize("dim, heads, seq", [(64, (8, 2), (300, 700)), (80, (4, 4), (129, 129)),
                                             (128, (28, 4), (1000, 1000)),
                                             (256, (8, 1), (77, 513))], ids=str)
def test_quantisation_kernels_match_the_torch_definition(dim, heads, seq):
    """fp8_quant_kernel.py against fp8.quantize_torch on the same inputs (Q a strided view, as
    transformers passes it), poisoned outputs: scales and the bias to about fp32 rounding, e4m3
    values equal but for a rare neighbour (the kernel multiplies by a reciprocal where torch
    divides, and rotates two bf16 parts of each value)."""
    _fp8_gpu()
    q, k, v = (t.cuda() for t in inputs(batch=2, heads=heads, seq=seq, dim=dim))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, D) memory
    want = fp8.quantize_torch(q, k, v)
    poison_allocator(q.numel() * 8)
    got = fp8.quantize(q, k, v)
    torch.cuda.synchronize()
    for name in ("q_scale", "k_scale", "k_bias", "v_scale"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        # the rotation's two bf16 parts hold each value to about 2**-18
        torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-5, msg=name)
    for name in ("q8", "k8", "vt8"):
        a, b = getattr(got, name).float(), getattr(want, name).float()
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        differ = a != b
        assert differ.float().mean() < 1e-3, (name, differ.float().mean().item())
        # a neighbour: one e4m3 step (1/8 of the value's binade) at most
        assert ((a - b).abs() <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2 ** -9)[differ].all()
