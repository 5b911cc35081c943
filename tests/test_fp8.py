"""FP8 attention without a GPU: the quantisation, the CPU twin of the kernel's roundings
against the fp64 definition, argument errors, and the kernel's cubins (sm_90, 100, 120)."""

from __future__ import annotations

import pytest
import torch

from hf_tiled_attention import fp8, fp8_attention
from semantics import definition as semantic_definition


def definition(q, k, v, **kwargs):
    """The fp64 definition's output (semantics.py: bottom-right causal, windows, softcap,
    sinks)."""
    return semantic_definition(q, k, v, **kwargs)[0]


def inputs(batch=2, heads=(4, 2), seq=(200, 300), dim=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads[0], seq[0], dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, heads[1], seq[1], dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def rel_rms(out, want):
    return ((out.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


FEATURES = {
    "plain": {}, "causal": dict(is_causal=True), "window": dict(window=40),
    "causal-window": dict(is_causal=True, window=64), "softcap": dict(softcap=0.5),
    "sinks": dict(is_causal=True, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
}


@pytest.mark.parametrize("features", list(FEATURES))
def test_cpu_twin_within_fp8_error_of_the_definition(features):
    """FP8 rounding only: a few percent of the output's rms (a wrong rule would be O(1)), and
    the same call with the rule dropped is far off."""
    q, k, v = inputs()
    kwargs = FEATURES[features]
    out = fp8_attention(q, k, v, **kwargs)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert rel_rms(out, definition(q, k, v, **kwargs)) < 0.06
    if kwargs:
        assert rel_rms(out, definition(q, k, v)) > 0.2


@pytest.mark.parametrize("dim", [16, 80, 128, 256])
def test_head_dims_and_gqa(dim):
    q, k, v = inputs(batch=1, heads=(8, 2), seq=(130, 130), dim=dim, dtype=torch.float16)
    out = fp8_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.float16
    assert rel_rms(out, definition(q, k, v, is_causal=True)) < 0.06


def test_quantisation():
    q, k, v = inputs(dim=80)
    k = k + 3.0  # a common offset: smoothing takes it away
    x = fp8.quantize(q, k, v)
    assert x.q8.dtype == x.k8.dtype == x.vt8.dtype == torch.float8_e4m3fn
    assert x.q8.shape == (2, 4, 200, 128) and x.k8.shape == (2, 2, 300, 128)
    assert x.vt8.shape == (2, 2, 80, 304) and x.v_scale.shape == (2, 2, 80)
    # every token's largest entry is 448 (the scale is its amax / 448)
    assert torch.equal(x.q8.float().abs().amax(-1), torch.full((2, 4, 200), 448.0))
    rot = fp8.rotation(128, torch.device("cpu"))
    torch.testing.assert_close(rot @ rot.T, torch.eye(128), atol=1e-6, rtol=0)
    keys = (x.k8.float() * x.k_scale[..., None]) @ rot.T  # back to K's channels: mean ~0
    assert keys[..., :80].mean(2).abs().max() < 0.05  # (rounding leaves a little in the pad)
    assert keys[..., 80:].pow(2).mean().sqrt() < 0.05 * keys[..., :80].pow(2).mean().sqrt()
    # V transposed, per channel, the padded keys zero
    v_back = x.vt8.float()[..., :300].transpose(2, 3) * x.v_scale[:, :, None, :]
    assert rel_rms(v_back, v.double()) < 0.05
    assert (x.vt8.float()[..., 300:] == 0).all()


def test_the_quantisation_kernels_inputs_match_the_torch_definition():
    """What fp8_quant_kernel.py is handed and writes: the sequence statistics equal the torch
    quantisation's (means and V's scale), its output tensors have the definition's shapes,
    dtypes and layouts, and the rotation's +-1 pattern is exact."""
    q, k, v = inputs(dim=80, heads=(4, 2))
    want = fp8.quantize_torch(q, k, v)
    q_mean, k_mean, v_scale = fp8.sequence_statistics(q, k, v)
    torch.testing.assert_close(q_mean, q.float().mean(2), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(k_mean, k.float().mean(2), rtol=1e-6, atol=1e-7)
    assert torch.equal(v_scale, want.v_scale)
    for got, ref in zip(fp8.quantized_outputs(q, k, v, v_scale), want):
        assert (got.shape, got.dtype, got.stride()) == (ref.shape, ref.dtype, ref.stride())
    signs = fp8.rotation_signs(128, torch.device("cpu"))
    assert signs.dtype == torch.bfloat16 and set(signs.float().unique().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(signs.float() / 128 ** 0.5, fp8.rotation(128, torch.device("cpu")),
                               rtol=0, atol=1e-7)


def test_probabilities_rounded_against_the_running_max():
    """The twin rounds P per key tile as the kernel does: with keys over several tiles it
    differs from rounding once against the final max, by FP8's step, not more."""
    q, k, v = inputs(batch=1, heads=(2, 2), seq=(64, 600), dim=64)
    x = fp8.quantize(q, k, v)
    twin = fp8.reference(x, 64, False, 0.125, None, None, None)
    qf, kf = x.q8.float() * x.q_scale[..., None], x.k8.float() * x.k_scale[..., None]
    p = torch.softmax(qf @ kf.transpose(2, 3) * 0.125, -1)
    p = p / p.amax(-1, keepdim=True)
    once = (p * 448).to(torch.float8_e4m3fn).float() / 448
    vf = x.vt8.float()[..., :600].transpose(2, 3) * x.v_scale[:, :, None, :]
    once = once @ vf / once.new_tensor(p.sum(-1, keepdim=True))
    assert 0 < (twin - once).abs().max() < 0.05


# FP8's own checks, then the op's (checks.py), which fp8_attention runs first
ERRORS = [
    (dict(dtype=torch.float32), "bfloat16 or float16"),
    (dict(dim=72), "multiple of 16"),
    (dict(heads=(3, 2)), r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    (dict(window=0), "window must be >= 1"),
    (dict(softcap=-1.0), "softcap must be a finite number > 0"),
    (dict(sinks=torch.zeros(3)), r"sinks must have shape \(Hq,\) = \(4,\)"),
]


@pytest.mark.parametrize("change, message", ERRORS, ids=[e[1] for e in ERRORS])
def test_argument_errors(change, message):
    change = dict(change)
    shape = {key: change.pop(key) for key in ("dtype", "dim", "heads") if key in change}
    q, k, v = inputs(**shape)
    with pytest.raises(ValueError, match=message):
        fp8_attention(q, k, v, **change)


def test_no_backward():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="no backward"):
        fp8_attention(q.requires_grad_(), k, v)


CUBIN_CASES = [("sm_90", 128, dict(is_causal=True)), ("sm_90", 64, {}),
               ("sm_90", 256, dict(window=100, softcap=30.0,
                                   sinks=torch.zeros(4, device="meta"))),  # on the query's device
               ("sm_90", 80, dict(is_causal=True)),
               ("sm_100", 128, dict(is_causal=True)), ("sm_120", 128, dict(is_causal=True))]


@pytest.mark.parametrize("arch, dim, kwargs", CUBIN_CASES,
                         ids=[f"{a}-d{d}-{'-'.join(k) or 'plain'}" for a, d, k in CUBIN_CASES])
def test_kernel_compiles(arch, dim, kwargs):
    pytest.importorskip("cuda.tile.compilation")

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")
    cubin = fp8.export_cubin(meta(1, 4, 1000, dim), meta(1, 2, 1000, dim),
                             meta(1, 2, 1000, dim), arch=arch, **kwargs)
    assert cubin[:4] == b"\x7fELF"


def test_one_query_leaves_nothing_to_round_in_its_scores():
    """Q less its mean: a decode step's single query is all in the exact bias mean(q) . k."""
    q, k, v = inputs(batch=1, heads=(4, 2), seq=(1, 50))
    x = fp8.quantize(q, k, v)
    assert (x.q8.float() == 0).all()
    k_smoothed = k.float() - k.float().mean(2, keepdim=True)
    want = q.float() @ k_smoothed.repeat_interleave(2, 1).transpose(2, 3)
    # fp32 both ways, summed in different orders (the CPU's matmul kernels differ by machine:
    # 1.9e-6 apart on one): far below the e4m3 rounding (about 1e-2) the bias keeps out.
    torch.testing.assert_close(x.k_bias, want[:, :, 0], rtol=1e-5, atol=1e-5)


QUANT_CUBIN_CASES = [("sm_90", 64), ("sm_90", 80), ("sm_90", 128), ("sm_90", 256),
                     ("sm_100", 128), ("sm_120", 128)]


@pytest.mark.parametrize("arch, dim", QUANT_CUBIN_CASES,
                         ids=[f"{a}-d{d}" for a, d in QUANT_CUBIN_CASES])
def test_quantisation_kernels_compile(arch, dim):
    pytest.importorskip("cuda.tile.compilation")

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")
    cubins = fp8.export_quantize_cubins(meta(1, 8, 1000, dim), meta(1, 2, 1000, dim),
                                        meta(1, 2, 1000, dim), arch=arch)
    assert len(cubins) == 3 and all(c[:4] == b"\x7fELF" for c in cubins)
