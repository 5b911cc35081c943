"""Values with their own head dim (multi-head latent attention, value_head_dim.py): the op
against the fp64 definition, forward and backward, values narrower and wider than keys, on the
CPU reference path and (marked gpu) on the kernels with poisoned outputs."""

import math

import pytest
import torch

import hf_tiled_attention as hta
from gradients import assert_grads_match
from semantics import assert_matches_definition, definition

# (query/key head dim, value head dim): DeepSeek-V3's 192 / 128 shrunk, and values wider than
# keys (MiMo-V2-Flash)
DIMS = [(32, 16), (24, 64), (192, 128)]
OPTIONS = [dict(is_causal=True), dict(window=5, softcap=8.0), dict(is_causal=True, sinks=True)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2, torch.float16: 4e-3}


def _inputs(qk_dim, value_dim, device, dtype, seq_q=37, seq_kv=45):
    g = torch.Generator().manual_seed(qk_dim + value_dim)
    q = torch.randn(2, 4, seq_q, qk_dim, generator=g)
    k = torch.randn(2, 2, seq_kv, qk_dim, generator=g)
    v = torch.randn(2, 2, seq_kv, value_dim, generator=g)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def _check(qk_dim, value_dim, options, device, dtype):
    q, k, v = _inputs(qk_dim, value_dim, device, dtype)
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = torch.linspace(-1.0, 2.0, 4, device=device)
    out, lse = hta.tiled_attention(q, k, v, return_lse=True, **options)
    want, want_lse = definition(q, k, v, **options)
    assert out.shape == (2, 4, 37, value_dim)
    assert_matches_definition(out, lse, want, want_lse, atol=TOLERANCE[dtype], lse_atol=1e-2)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    wanted = torch.autograd.grad(want, (q, k, v), grad.double())
    assert_grads_match(dict(zip("qkv", got)), dict(zip("qkv", wanted)), dtype)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o))
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"qk{d[0]}-v{d[1]}")
def test_matches_definition_on_the_reference_path(dims, options):
    _check(*dims, options, "cpu", torch.float32)


def test_default_scale_is_the_query_head_dim():
    """Values wider than keys pad the query too; the default scale stays 1/sqrt(qk dim)."""
    q, k, v = _inputs(16, 48, "cpu", torch.float32)
    out = hta.tiled_attention(q, k, v)
    explicit = hta.tiled_attention(q, k, v, scale=1 / math.sqrt(16))
    assert torch.equal(out, explicit)


def test_too_wide_a_padded_head_dim_is_refused():
    q, k, v = _inputs(64, 264, "cpu", torch.float32)
    with pytest.raises(ValueError, match="head dim must be a multiple of 8 from 16 to 256, got 264"):
        hta.tiled_attention(q, k, v)


def test_other_mismatches_keep_their_message():
    q, k, _ = _inputs(32, 16, "cpu", torch.float32)
    v = torch.randn(2, 2, 44, 16)
    with pytest.raises(ValueError, match="key and value must have the same shape"):
        hta.tiled_attention(q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o))
@pytest.mark.parametrize("dims", DIMS[1:], ids=lambda d: f"qk{d[0]}-v{d[1]}")
def test_matches_definition_on_the_kernels(dims, options, dtype=torch.bfloat16):
    if not hta.kernel_available(torch.device("cuda", torch.cuda.current_device())):
        pytest.fail("CUDA is present but the cuTile kernel is not available")
    blocks = [torch.full((1 << 22,), math.nan, device="cuda") for _ in range(4)]
    del blocks  # freed NaN blocks: unwritten output rows would read NaN
    _check(*dims, options, "cuda", dtype)
