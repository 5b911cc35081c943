"""Gradients of the op against fp64 autograd of the definition (semantics.definition), shared
by the CPU tests (reference path) and the GPU tests (cuTile backward kernels)."""

from __future__ import annotations

import torch

import hf_tiled_attention as hta
from semantics import Case, definition, make_inputs, make_sinks, op_kwargs

# Max abs gradient error allowed, relative to the largest fp64 gradient of that tensor. fp32:
# the training issue's bound; 16-bit: P and dS are rounded to the input dtype before their
# MMAs (as in every FlashAttention backward), a few units of that dtype's rounding.
GRAD_TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def op_and_definition_grads(case: Case, device, dtype, *, seed: int = 0, lse_weight: float = 0.5,
                            score_mod=None, mask_mod=None, learnable=(), mask_grad=False):
    """``(got, want)``: dicts of the gradients of ``sum(out * dOut) + lse_weight * sum(lse *
    dLse)`` for q, k, v (and sinks, each tensor in ``learnable``, and with ``mask_grad`` the
    case's additive mask, as made: before any broadcast or expand), from the op in ``dtype``
    and from the fp64 definition. dOut and dLse are random; rows with no visible key count
    their LSE as 0 (it is -inf)."""
    q, k, v, mask = make_inputs(case, device, dtype, seed=seed)
    mask_leaf = None
    if mask_grad:
        mask_leaf = unexpanded(mask).detach().clone().requires_grad_()
        mask = mask_leaf.expand(mask.shape)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    d_out = torch.randn(q.shape, generator=g).to(device)
    d_lse = torch.randn(q.shape[:3], generator=g).to(device) * lse_weight
    kwargs = op_kwargs(case, device)
    sinks = kwargs.pop("sinks")

    def loss(out, lse):
        lse = torch.where(lse.isinf(), 0.0, lse)
        return (out.double() * d_out.double()).sum() + (lse.double() * d_lse.double()).sum()

    def grads(inputs, result, leaf=None):
        tensors = (list(inputs) + ([sinks] if sinks is not None else []) + list(learnable)
                   + ([leaf] if leaf is not None else []))
        values = torch.autograd.grad(loss(*result), tensors, allow_unused=True)
        names = (["q", "k", "v"] + (["sinks"] if sinks is not None else [])
                 + [f"learnable{i}" for i in range(len(learnable))]
                 + (["mask"] if leaf is not None else []))
        return {name: (torch.zeros_like(t) if value is None else value)
                for name, t, value in zip(names, tensors, values)}

    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        sinks.requires_grad_()
    got = grads(inputs, hta.tiled_attention(*inputs, mask, return_lse=True, sinks=sinks,
                                            score_mod=score_mod, mask_mod=mask_mod, **kwargs),
                mask_leaf)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact_leaf = None if mask_leaf is None else mask_leaf.detach().double().requires_grad_()
    exact_mask = mask if exact_leaf is None else exact_leaf.expand(mask.shape)
    want = grads(exact, definition(*exact, exact_mask, sinks=sinks, score_mod=score_mod,
                                   mask_mod=mask_mod, **kwargs), exact_leaf)
    return got, want


def unexpanded(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with the dims an ``expand`` made (stride 0) narrowed back to size 1."""
    for dim in range(mask.dim()):
        if mask.shape[dim] > 1 and mask.stride(dim) == 0:
            mask = mask.narrow(dim, 0, 1)
    return mask


def assert_grads_match(got: dict, want: dict, dtype) -> None:
    for name, expected in want.items():
        value = got[name]
        assert value.shape == expected.shape, name
        assert torch.isfinite(value).all(), f"d{name} has NaN/inf"
        scale = expected.abs().max().item() or 1.0
        err = (value.double() - expected).abs().max().item()
        assert err <= GRAD_TOLERANCE[dtype] * scale, \
            f"d{name}: max abs err {err:.3g} > {GRAD_TOLERANCE[dtype]} x {scale:.3g}"


# Cases with query rows that see no key: bottom-right causal with more queries than keys, and
# a mask that hides whole rows (checked by empty_rows_have_zero_grads on the CPU and the GPU).
EMPTY_ROW_CASES = [Case(seq_q=150, seq_kv=70, causal=True),
                   Case(mask="bool_empty_rows", causal=True)]


def empty_rows_have_zero_grads(case: Case, device, dtype) -> None:
    """Rows that see no key: dq exactly 0 (and never NaN)."""
    q, k, v, mask = make_inputs(case, device, dtype)
    q.requires_grad_()
    kwargs = op_kwargs(case, device)
    kwargs.pop("sinks")
    out, lse = hta.tiled_attention(q, k, v, mask, return_lse=True, **kwargs)
    (out.float().square().sum() + torch.where(lse.isinf(), 0.0, lse).sum()).backward()
    empty = lse.isinf()
    assert empty.any(), "the case must have rows that see no key"
    assert (q.grad[empty] == 0).all() and torch.isfinite(q.grad).all()


# Additive masks that require grad: every broadcast the op keeps compact (batch, heads, rows,
# an expand), GQA and MQA, rows that see nothing, softcap, a window, sinks.
MASK_GRAD_CASES = [
    Case(seq_q=64, seq_kv=100, mask="additive"),
    Case(mask="additive_heads", causal=True, window=40),
    Case(mask="additive_finfo_min", heads_q=8, heads_kv=1),
    Case(seq_q=70, seq_kv=90, mask="additive_2d", softcap=3.0),
    Case(mask="additive_expanded", causal=True, sinks=True),
    Case(seq_q=150, seq_kv=70, mask="additive_keypad", causal=True),
]


__all__ = ["EMPTY_ROW_CASES", "MASK_GRAD_CASES", "GRAD_TOLERANCE", "assert_grads_match",
           "empty_rows_have_zero_grads", "make_sinks", "op_and_definition_grads"]
