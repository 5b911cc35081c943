"""GPU: score_mod / mask_mod compiled into the cuTile kernel, against the fp64 definition, with
poisoned outputs."""

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention import variants
from semantics import assert_matches_definition, definition
from test_kernel_gpu import TOLERANCE, _kernel_required, poison_allocator  # noqa: F401
from variant_cases import VARIANT_CASES, make_variant_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def check_variant(q, k, v, kwargs, dtype):
    poison_allocator(q.numel() * 4)
    out, lse = hta.tiled_attention(q, k, v, return_lse=True, **kwargs)
    torch.cuda.synchronize()
    want_out, want_lse = definition(q, k, v, **kwargs)
    assert_matches_definition(out, lse, want_out, want_lse, atol=TOLERANCE[dtype], lse_atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c.name)
def test_variant_kernel_matches_definition(case, dtype):
    q, k, v, kwargs = make_variant_inputs(case, "cuda", dtype)
    check_variant(q, k, v, kwargs, dtype)


@pytest.mark.parametrize("seq_q", [1, 5])
def test_mods_on_short_queries_with_key_splits(seq_q):
    """Decode-shaped calls (keys split over blocks) with a score_mod and a mask_mod."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, seq_q, 128, generator=g).cuda().bfloat16()
    k, v = (torch.randn(2, 2, 5000, 128, generator=g).cuda().bfloat16() for _ in range(2))
    kwargs = dict(score_mod=variants.alibi(variants.alibi_slopes(8).cuda()),
                  mask_mod=variants.sliding_window_with_sinks(3000, 4), is_causal=True)
    check_variant(q, k, v, kwargs, torch.bfloat16)


def test_mask_mod_matches_builtin_window():
    """The same visibility through a mask_mod and through the built-in causal window."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 8, 1000, 64, generator=g).cuda().half() for _ in range(3))
    builtin = hta.tiled_attention(q, k, v, is_causal=True, window=100)
    via_mod = hta.tiled_attention(q, k, v, mask_mod=variants.sliding_window(100))
    assert (builtin.float() - via_mod.float()).abs().max().item() <= 2e-3
