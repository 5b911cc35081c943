"""CPU: the backward kernels (rows, dK/dV, dQ) compile to cubin (cuTile's exporter, no GPU), for the variants the
op can launch: every head-dim tile with causal + window + softcap + a per-row mask on sm_90,
head dims of two tiles,
each mask kind, fp16 and fp32, a mask_mod's kernel copies, score_mods (additive, and with their
derivative: mod_derivative), and the other archs once."""

from dataclasses import replace

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention.backward_launch import backward_plan, export_backward_cubins
from hf_tiled_attention.call_options import call_options
from hf_tiled_attention.masks import compact_mask, mod_mask
from hf_tiled_attention.mods import compile_mods
from hf_tiled_attention.schedule import backward_schedule

pytest.importorskip("cuda.tile.compilation")

B, HQ, HKV, S = 2, 8, 2, 300


def _mask(kind, dtype):
    shapes = {"bool_rows": ((B, 1, S, S), torch.bool), "bool_keypad": ((B, 1, 1, S), torch.bool),
              "additive_heads": ((1, HQ, S, S), dtype), "additive_keypad": ((B, 1, 1, S), dtype)}
    if kind is None:
        return None
    if kind == "documents":
        ids = torch.arange(S) // 70
        return mod_mask(compile_mods(None, hta.variants.document_mask(ids)), B, HQ, S, S,
                        torch.device("cpu"))
    shape, mask_dtype = shapes[kind]
    return compact_mask(torch.empty(shape, dtype=mask_dtype, device="meta"), B, HQ, S, S)


def _hard_score_mod(score, b, h, q_idx, kv_idx):
    """Every derivative rule of mod_derivative at once."""
    x = score / (1.0 + abs(score)) + torch.exp2(-score * score) - torch.sqrt(2.0 + torch.sin(score))
    y = torch.where(q_idx >= kv_idx, torch.maximum(x, score * 0.5), torch.log(3.0 + torch.cos(x)))
    return y ** 2 * 0.1 - torch.minimum(torch.floor(score), torch.tanh(score))


_SLOPES = torch.rand(HQ)
_BIAS = torch.randn(HQ, 32)
_BUCKETS = torch.randint(0, 32, (S, S), dtype=torch.int32)


def _learnable_mod(score, b, h, q_idx, kv_idx):
    """A per-head scale and slope and a T5-style bucket table: three kinds of reads."""
    return score * _SLOPES[h] + _SLOPES[h] * (kv_idx - q_idx) + _BIAS[h, _BUCKETS[q_idx, kv_idx]]


def _cubins(arch, dtype, head_dim, causal=True, window=64, softcap=30.0, mask="bool_rows",
            score_mod=None, mask_grad=False, dq_add=False, learn_captures=False,
            **schedule_changes):
    q = torch.empty(B, HQ, S, head_dim, dtype=dtype, device="meta")
    k = torch.empty(B, HKV, S, head_dim, dtype=dtype, device="meta")
    compact = _mask(mask, dtype)
    mods = compact.mods if mask == "documents" else None
    if score_mod is not None:  # with the documents' mask_mod, as the op would compile them
        mods = compile_mods(score_mod, hta.variants.document_mask(torch.arange(S) // 70),
                            fast_math=dtype != torch.float32)
        compact = mod_mask(mods, B, HQ, S, S, torch.device("cpu"))
    schedule = replace(backward_schedule(head_dim), dq_add=dq_add, **schedule_changes)
    capture_grads = sum(1 << s for s in mods.capture_grad_slots) if learn_captures else 0
    options = call_options(compact, causal=causal, scale=0.1, window=window, softcap=softcap,
                           mods=mods)
    plan = backward_plan(dtype, HQ // HKV, head_dim, options, schedule, mask_grad, not dq_add,
                         capture_grads)
    assert plan.kv.DQ_ADD is dq_add and (plan.kv.MASK_GRAD != 0) is mask_grad
    assert plan.kv.CAPTURE_PARTIALS is (learn_captures and not dq_add)
    if score_mod is not None:  # a score_mod that is not additive brings its derivative
        assert plan.kv.SCORE_MOD_GRAD is plan.q.SCORE_MOD_GRAD is not mods.score_mod_additive
    return export_backward_cubins(plan, q, k, compact, arch=arch, window=window or 0)


CASES = [pytest.param("sm_90", torch.bfloat16, d, {}, id=f"sm_90-bf16-d{d}-all")
         for d in (16, 32, 64, 128, 256)] + [
    pytest.param("sm_90", torch.float16, 80, dict(causal=False, window=None, softcap=None,
                                                 mask=None), id="sm_90-fp16-d80-plain"),
    # head dims of two tiles (96 = 64 + 32, 160 = 128 + 32), with every option, and dq_add's
    # reduce-adds of both parts
    pytest.param("sm_90", torch.bfloat16, 96, {}, id="sm_90-bf16-d96-all"),
    pytest.param("sm_90", torch.bfloat16, 160, dict(mask="documents", window=None),
                 id="sm_90-bf16-d160-mask_mod"),
    pytest.param("sm_90", torch.bfloat16, 96, dict(window=None, softcap=None, mask=None,
                                                   dq_add=True), id="sm_90-d96-dq_add"),
    pytest.param("sm_90", torch.float32, 64, dict(window=None, softcap=None, mask=None),
                 id="sm_90-fp32-d64-causal"),
    pytest.param("sm_90", torch.bfloat16, 128, dict(causal=False, window=None, softcap=None,
                                                    mask="bool_keypad"), id="sm_90-keypad"),
    pytest.param("sm_90", torch.float16, 64, dict(window=None, softcap=None,
                                                  mask="additive_heads"), id="sm_90-additive"),
    pytest.param("sm_90", torch.bfloat16, 128, dict(window=None, softcap=None,
                                                    mask="documents"), id="sm_90-mask_mod"),
    # the mask walk's other schedule: edge steps without states, blocks longest walk first
    pytest.param("sm_90", torch.bfloat16, 128, dict(window=None, softcap=None, mask="documents",
                                                    edge_states=False, table_order=True),
                 id="sm_90-mask_mod-edge_states"),
    pytest.param("sm_90", torch.bfloat16, 64, dict(
        window=None, softcap=None, mask=None,
        score_mod=hta.variants.alibi(hta.variants.alibi_slopes(HQ))), id="sm_90-alibi-documents"),
    pytest.param("sm_90", torch.bfloat16, 128, dict(
        window=None, softcap=None, mask=None, score_mod=hta.variants.softcap(30.0)),
        id="sm_90-softcap_mod-documents"),
    pytest.param("sm_90", torch.float32, 64, dict(
        window=None, softcap=None, mask=None, score_mod=_hard_score_mod),
        id="sm_90-fp32-every_derivative_rule"),
    # an additive mask's gradient (TMA reduce-adds): per row, and a key vector's row sums
    pytest.param("sm_90", torch.bfloat16, 128, dict(window=None, mask="additive_heads",
                                                    mask_grad=True), id="sm_90-mask_grad_rows"),
    pytest.param("sm_90", torch.float32, 64, dict(causal=False, window=None, softcap=None,
                                                  mask="additive_keypad", mask_grad=True),
                 id="sm_90-fp32-mask_grad_row_sums"),
    pytest.param("sm_90", torch.bfloat16, 64, dict(window=None, softcap=None, mask=None,
                                                   dq_add=True), id="sm_90-dq_add"),
    # learnable captures: the dK/dV kernel adds their gradients (per-head sums, a gathered
    # table's per-index sums or per-score atomics); deterministic (not dq_add): each block into
    # its own rows
    pytest.param("sm_90", torch.bfloat16, 128, dict(
        window=None, softcap=None, mask=None, score_mod=_learnable_mod, learn_captures=True),
        id="sm_90-learnable_captures"),
    pytest.param("sm_90", torch.bfloat16, 128, dict(
        window=None, softcap=None, mask=None, score_mod=_learnable_mod, learn_captures=True,
        dq_add=True), id="sm_90-learnable_captures-fast"),
    # loads without bounds checks (rows padded to whole tiles): a per-row mask's edge states,
    # a key mask's one state per key tile, two head-dim parts
    pytest.param("sm_90", torch.bfloat16, 96, dict(unchecked_loads=True),
                 id="sm_90-d96-all-unchecked"),
    pytest.param("sm_90", torch.float16, 64, dict(causal=False, window=None, softcap=None,
                                                  mask="bool_keypad", unchecked_loads=True),
                 id="sm_90-keypad-unchecked"),
] + [pytest.param(arch, torch.bfloat16, 128, dict(window=None, softcap=None, mask=None),
                  id=f"{arch}-bf16-d128-causal") for arch in ("sm_80", "sm_100", "sm_120")]


@pytest.mark.parametrize("arch, dtype, head_dim, options", CASES)
def test_backward_kernels_compile_to_cubin(arch, dtype, head_dim, options):
    cubins = _cubins(arch, dtype, head_dim, **options)   # rows, dK/dV, dQ
    assert len(cubins) == 3 and all(cubin[:4] == b"\x7fELF" for cubin in cubins)
