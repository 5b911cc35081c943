"""What the op does not differentiate: a gradient of its gradient (create_graph=True, then
another backward) and functorch transforms fail with one plain error that says so and what to
use instead, never with torch's internal messages or a silently missing term."""

import warnings

import pytest
import torch

import hf_tiled_attention as hta

CLEAR_ERROR = r"does not support higher-order gradients .*attn_implementation='eager'.*math"


@pytest.fixture(autouse=True)
def _quiet_reference_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reference path.*")
        yield


def _qkv(requires_grad=True):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, 2, 8, 16, generator=g).requires_grad_(requires_grad)
            for _ in range(3)]


def _attention(q, k, v):
    return hta.tiled_attention(q, k, v, is_causal=True)


def test_create_graph_keeps_the_first_order_gradients():
    """create_graph=True alone is fine: the same gradients as without it."""
    q, k, v = _qkv()
    plain = torch.autograd.grad((_attention(q, k, v) ** 2).sum(), (q, k, v))
    graphed = torch.autograd.grad((_attention(q, k, v) ** 2).sum(), (q, k, v),
                                  create_graph=True)
    assert all(g.requires_grad for g in graphed)
    for a, b in zip(plain, graphed):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("loss", ["sum", "square"])
@pytest.mark.parametrize("second", ["backward", "grad"])
def test_double_backward_is_a_clear_error(loss, second):
    """The incoming gradient constant (out.sum()) or not (out**2): differentiating the
    gradient in the inputs or into the leaves raises the plain error."""
    q, k, v = _qkv()
    out = _attention(q, k, v)
    first, = torch.autograd.grad(out.sum() if loss == "sum" else (out ** 2).sum(), q,
                                 create_graph=True)
    with pytest.raises(RuntimeError, match=CLEAR_ERROR):
        if second == "backward":
            first.pow(2).sum().backward()
        else:
            torch.autograd.grad(first.pow(2).sum(), (q, k))


@pytest.mark.parametrize("transform", ["grad", "vmap", "jacrev", "jvp"])
def test_functorch_transforms_are_a_clear_error(transform):
    q, k, v = _qkv(requires_grad=False)
    run = {
        "grad": lambda: torch.func.grad(lambda q: _attention(q, k, v).sum())(q),
        "vmap": lambda: torch.func.vmap(lambda q: _attention(q, k, v))(q[None]),
        "jacrev": lambda: torch.func.jacrev(lambda q: _attention(q, k, v).sum())(q),
        "jvp": lambda: torch.func.jvp(lambda q: _attention(q, k, v), (q,),
                                      (torch.ones_like(q),)),
    }[transform]
    with pytest.raises(RuntimeError, match=CLEAR_ERROR):
        run()
