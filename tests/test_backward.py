"""The backward pass on the CPU (the reference path, what CI runs): gradients against fp64
autograd of the definition over the shared case matrix, mods with learnable captured tensors,
sinks, torch.compile of a training step, and the backward kernels compiled to cubin."""

import math
import warnings
from dataclasses import replace

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention import kernel_params as P
from hf_tiled_attention.call_options import call_options
from gradients import (EMPTY_ROW_CASES, MASK_GRAD_CASES, assert_grads_match,
                       empty_rows_have_zero_grads, op_and_definition_grads)
from semantics import SEMANTIC_CASES, Case


@pytest.fixture(autouse=True)
def _quiet_reference_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reference path.*")
        yield


@pytest.mark.parametrize("case", SEMANTIC_CASES, ids=lambda c: c.name)
def test_gradients_match_definition(case):
    got, want = op_and_definition_grads(case, "cpu", torch.float32)
    assert_grads_match(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gradients_in_16_bit(dtype):
    case = Case(causal=True, window=40, softcap=4.0, mask="bool_keypad")
    got, want = op_and_definition_grads(case, "cpu", dtype)
    assert got["q"].dtype == dtype
    assert_grads_match(got, want, dtype)


@pytest.mark.parametrize("case", EMPTY_ROW_CASES, ids=lambda c: c.name)
def test_rows_without_keys_get_zero_gradients(case):
    empty_rows_have_zero_grads(case, "cpu", torch.float32)


def test_learnable_bias_table_and_alibi_slopes_get_gradients():
    case = Case(seq_q=70, seq_kv=90, causal=True, heads_q=4, heads_kv=2)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(case.seq_q + case.seq_kv, generator=g).requires_grad_()
    slopes = (torch.rand(case.heads_q, generator=g) * 0.2).requires_grad_()
    offset = case.seq_kv

    def bias_and_alibi(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + offset] - slopes[h] * (q_idx - kv_idx)

    got, want = op_and_definition_grads(case, "cpu", torch.float32, score_mod=bias_and_alibi,
                                        learnable=(table, slopes))
    assert want["learnable0"].abs().max() > 0 and want["learnable1"].abs().max() > 0
    assert_grads_match(got, want, torch.float32)


def test_mask_mod_documents_and_variants():
    case = Case(seq_q=100, seq_kv=100)
    ids = torch.arange(100) // 23
    got, want = op_and_definition_grads(
        case, "cpu", torch.float32, mask_mod=hta.variants.document_mask(ids),
        score_mod=hta.variants.alibi(hta.variants.alibi_slopes(case.heads_q)))
    assert_grads_match(got, want, torch.float32)


def test_compiled_training_step_with_mods_does_not_recompile():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(64, generator=g).requires_grad_()

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[torch.abs(q_idx - kv_idx) % 64]

    causal = hta.variants.causal_mask
    weights = torch.randn(32, 32, generator=g).requires_grad_()

    def step(x):
        q = (x @ weights).view(1, 2, -1, 16)
        out = hta.tiled_attention(q, q[:, :1], q[:, :1], score_mod=bias, mask_mod=causal)
        return out.square().mean()

    compiled = torch.compile(step, fullgraph=True)
    torch._dynamo.utils.counters.clear()
    for seed in range(3):
        x = torch.randn(48, 32, generator=torch.Generator().manual_seed(seed))
        for p in (table, weights):
            p.grad = None
        compiled(x).backward()
        got = (table.grad.clone(), weights.grad.clone())
        table.grad = weights.grad = None
        step(x).backward()
        assert torch.allclose(got[0], table.grad, atol=1e-6)
        assert torch.allclose(got[1], weights.grad, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_gradients_are_bitwise_reproducible():
    case = Case(causal=True, mask="bool_keypad")
    first, _ = op_and_definition_grads(case, "cpu", torch.float32)
    second, _ = op_and_definition_grads(case, "cpu", torch.float32)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_backward_through_return_lse_only():
    q = torch.randn(1, 2, 10, 16, requires_grad=True)
    _, lse = hta.tiled_attention(q, q, q, is_causal=True, return_lse=True)
    lse.sum().backward()
    exact = q.detach().double().requires_grad_()
    s = (exact @ exact.transpose(-1, -2)) / 4.0
    s = s.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), -math.inf)
    torch.logsumexp(s, -1).sum().backward()
    assert torch.allclose(q.grad.double(), exact.grad, atol=1e-5)


def test_eager_backward_gets_only_the_gradients_used(monkeypatch):
    """Eager training (op._EagerAttention): an unused LSE brings no zero gradient for the
    kernels to read (grad_lse None), an unused output a zero one; both routes agree with the
    registered op's autograd (what compiled graphs run), called directly."""
    from hf_tiled_attention import op

    seen = []
    original = op.backward
    monkeypatch.setattr(op, "backward", lambda grad_out, *args, **kwargs: seen.append(
        (grad_out.abs().sum().item(), args[5])) or original(grad_out, *args, **kwargs))
    q = torch.randn(1, 4, 24, 16, requires_grad=True)
    k = torch.randn(1, 2, 24, 16, requires_grad=True)
    g = torch.randn(1, 4, 24, 16)
    out = hta.tiled_attention(q, k, k, is_causal=True)
    eager = torch.autograd.grad(out, (q, k), g)
    assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1] is None
    out, _ = torch.ops.hf_tiled_attention.attention(q, k, k, None, 0, True, 0.25, 0, 0.0, 0,
                                                   hta.Schedule().as_list(), None, [], True)
    registered = torch.autograd.grad(out.transpose(1, 2), (q, k), g.transpose(1, 2))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(eager, registered))
    _, lse = hta.tiled_attention(q, k, k, is_causal=True, return_lse=True)
    torch.autograd.grad(lse.sum(), (q, k))
    assert seen[-1][0] == 0 and seen[-1][1] is not None


def test_eager_backward_refuses_a_mask_changed_in_place():
    q = torch.randn(1, 2, 16, 16, requires_grad=True)
    keys = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    out = hta.tiled_attention(q, q, q, keys)
    keys[..., 3] = False
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_mask_mod_tables_are_built_once_across_op_calls(monkeypatch):
    """The registered ops rebuild their CompiledMods per call; a mask_mod's block tables must
    still be built once per mod and shape (eager calls keep them: forward, then backward)."""
    from hf_tiled_attention import masks
    from hf_tiled_attention.mods import compile_mods, mods_from_key

    built = []
    original = masks.ModMask._table
    monkeypatch.setattr(masks.ModMask, "_table",
                        lambda self, *args: built.append(args[:2]) or original(self, *args))
    compiled = compile_mods(None, hta.variants.causal_mask)
    for _ in range(3):
        mask = masks.mod_mask(mods_from_key(compiled.key, compiled.captures), 1, 2, 300, 300,
                              torch.device("cpu"), keep=True)
        mask.block_table(64, 64, keep=True)
        mask.block_table(64, 64, keep=True, transposed=True)
    assert built == [(64, 64)]


@pytest.mark.parametrize("name, additive", [
    ("alibi", True), ("t5", True), ("bias_minus", True), ("softcap", False), ("scaled", False),
    ("where", False)])
def test_which_score_mods_add_to_the_score(name, additive):
    """Which score_mods add terms to their score (the kernels then need no derivative)."""
    from hf_tiled_attention.mods import compile_mods
    V = hta.variants
    bias = torch.randn(64)

    def bias_minus(score, b, h, q, kv):
        doubled = bias[q] * 2
        return doubled + score - bias[kv]

    def scaled(score, b, h, q, kv):
        return score * 2

    def where(score, b, h, q, kv):
        return torch.where(q >= kv, score, score + 1)

    mods = {
        "alibi": V.alibi(V.alibi_slopes(4)),
        "t5": V.relative_position_bias(torch.randn(32, 4), V.relative_position_buckets(16, 16),
                                       16),
        "bias_minus": bias_minus, "softcap": V.softcap(3.0), "scaled": scaled, "where": where,
    }
    assert compile_mods(mods[name], None).score_mod_additive is additive


def _squares_by_helper(score, b, h, q_idx, kv_idx):
    return _square(score) * 0.1


def _square(x):
    return x * x


@pytest.mark.parametrize("mod, learnable, deterministic, on_kernels", [
    ("alibi", False, False, True), ("alibi", True, False, True), ("alibi", True, True, True),
    ("alibi", True, "no room", False), ("softcap", False, False, True),
    ("helper", False, False, False)],
    ids=["alibi", "alibi-learnable", "alibi-learnable-deterministic",
         "alibi-learnable-deterministic-no-room", "softcap", "helper"])
def test_score_mod_backward_route(monkeypatch, mod, learnable, deterministic, on_kernels):
    """With a GPU: an additive score_mod (ALiBi) and one with a derived derivative (tanh
    softcap) run their backward on the kernels, learnable slopes too (the dK/dV kernel adds
    their gradient; in deterministic mode into a row per block, unless those rows would take
    more than CAPTURE_PARTIALS_MAX_BYTES); a mod that calls another function on its score (no
    derivative rule) runs the reference path. Launches stubbed."""
    from hf_tiled_attention import backward_launch, op

    if deterministic == "no room":
        monkeypatch.setattr(backward_launch, "CAPTURE_PARTIALS_MAX_BYTES", 4 * 4 - 1)

    calls = []

    def stub(grad_out, query, key, value, out, lse, grad_lse, mask, options, **kwargs):
        calls.append(options.mods.names)
        return [torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)] + [
            torch.zeros_like(t) for t, flag in zip(options.mods.captures, kwargs["learnable"])
            if flag]

    monkeypatch.setattr(op, "kernel_available", lambda device: True)
    monkeypatch.setattr(backward_launch, "run_backward", stub)
    score_mod = {"alibi": hta.variants.alibi(hta.variants.alibi_slopes(4)),
                 "softcap": hta.variants.softcap(20.0), "helper": _squares_by_helper}[mod]
    q = torch.randn(1, 4, 32, 16)
    k = torch.randn(1, 2, 32, 16)
    out, lse = op.reference_attention(q, k, k, None, causal=True, scale=0.25, window=None,
                                      softcap=None, diag_offset=0)
    compiled = hta.mods.compile_mods(score_mod, None)
    monkeypatch.setattr(op, "deterministic", lambda: bool(deterministic))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the reference path's, on "a GPU"
        op.backward(torch.ones_like(q), q, k, k, out, lse, None, None,
                    call_options(None, causal=True, scale=0.25, mods=compiled),
                    learnable=[learnable] * len(compiled.captures))
    assert len(calls) == (1 if on_kernels else 0)


@pytest.mark.parametrize("mode", ["fast", "deterministic"])
def test_learnable_capture_rows_per_block_in_deterministic_mode(monkeypatch, mode):
    """The launcher with cuTile's launch stubbed: in deterministic mode the dK/dV kernel gets,
    for a learnable capture, a zeroed fp32 array with a row per block of its grid (key tiles x
    kv heads x batch) and CAPTURE_PARTIALS, and the gradient returned is the rows' sum in the
    capture's shape and dtype; in the fast mode one array of the capture's shape."""
    import cuda.tile as ct

    from hf_tiled_attention import backward_launch
    from hf_tiled_attention.schedule import backward_schedule

    launches = []

    def launch(stream, grid, kernel, args, programmatic_dependent_launch=False):
        launches.append((grid, args))
        if len(launches) == 2 and args[-1][P.CAPTURE_PARTIALS]:
            args[-7][1][3, 2] = 1.0   # block 3's row: slope 2
            args[-7][1][5, 2] = 0.5
    monkeypatch.setattr(ct, "launch", launch)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: None, raising=False)
    slopes = torch.rand(4, dtype=torch.bfloat16)
    mods = hta.mods.compile_mods(hta.variants.alibi(slopes), None)
    q = torch.randn(2, 4, 300, 32, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 300, 32, dtype=torch.bfloat16)
    out = torch.randn(q.shape, dtype=torch.bfloat16)
    hta.set_deterministic(mode == "deterministic")
    try:
        grads = backward_launch.run_backward(
            out, q, k, k, out, torch.randn(q.shape[:3]), None, None,
            call_options(None, causal=True, scale=0.2, mods=mods), learnable=[True])
    finally:
        hta.set_deterministic(None)
    (kv_grid, kv_args) = launches[1]
    rows, constants = kv_args[-7][1], kv_args[-1]
    assert kv_grid == (math.ceil(300 / backward_schedule(32).kv_keys), 2, 2)
    assert constants[P.CAPTURE_GRADS] == 1
    assert constants[P.CAPTURE_PARTIALS] is (mode == "deterministic")
    assert grads[3].shape == slopes.shape and grads[3].dtype == torch.bfloat16
    if mode == "deterministic":
        assert rows.shape == (math.prod(kv_grid), 4) and rows.dtype == torch.float32
        assert grads[3].tolist() == [0.0, 0.0, 1.5, 0.0]
    else:
        assert rows.shape == (4,)


@pytest.mark.parametrize("case", MASK_GRAD_CASES, ids=lambda c: c.name)
def test_additive_mask_gets_its_gradient(case):
    got, want = op_and_definition_grads(case, "cpu", torch.float32, mask_grad=True)
    assert want["mask"].abs().max() > 0
    assert got["mask"].dtype == torch.float32
    assert_grads_match(got, want, torch.float32)


def test_mask_gradient_in_the_masks_dtype():
    got, want = op_and_definition_grads(Case(mask="additive_heads"), "cpu", torch.bfloat16,
                                        mask_grad=True)
    assert got["mask"].dtype == torch.bfloat16
    assert_grads_match(got, want, torch.bfloat16)


def test_only_the_mask_requires_grad():
    """The output requires grad when only the mask does (the case a new user met: it did not,
    and the mask's gradient stayed None)."""
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    mask = torch.randn(1, 1, 16, 16, requires_grad=True)
    out = hta.tiled_attention(q, k, v, mask)
    assert out.requires_grad
    out.sum().backward()
    assert mask.grad is not None and mask.grad.abs().sum() > 0
    with torch.no_grad():
        assert not hta.tiled_attention(q, k, v, mask).requires_grad


def test_mask_gradient_under_torch_compile():
    q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
    leaf = torch.randn(2, 1, 32, 32, requires_grad=True)

    def loss(mask):
        return hta.tiled_attention(q, k, v, mask, is_causal=True).square().sum()

    loss(leaf).backward()
    want = leaf.grad.clone()
    leaf.grad = None
    torch.compile(loss, fullgraph=True, backend="aot_eager")(leaf).backward()
    torch.testing.assert_close(leaf.grad, want)


@pytest.mark.parametrize("with_mods, learn, pdl, dq_add", [
    (False, False, False, False), (True, False, False, False), (True, True, False, False),
    (False, False, True, False), (False, False, False, True)],
    ids=["no-mods", "alibi", "alibi-learnable", "pdl", "dq_add"])
def test_run_backward_plumbing_with_stubbed_launches(monkeypatch, with_mods, learn, pdl,
                                                     dq_add):
    """The launcher on the CPU with cuTile's launch stubbed: it returns [dq, dk, dv] and each
    learnable capture's gradient (in the capture's dtype and shape), hands the dK/dV kernel
    the zeroed fp32 arrays for them and its CAPTURE_GRADS bits, and launches three kernels
    (with BackwardSchedule.pdl the last two as programmatic dependents); with dq_add, in the
    fast mode, two (dQ comes from the dK/dV kernel's fp32 adds), in deterministic mode three."""
    import cuda.tile as ct

    from hf_tiled_attention import backward_launch
    from hf_tiled_attention.schedule import backward_schedule

    launches, dependent = [], []

    def launch(stream, grid, kernel, args, programmatic_dependent_launch=False):
        launches.append(args)
        dependent.append(programmatic_dependent_launch)
    monkeypatch.setattr(ct, "launch", launch)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: None, raising=False)
    slopes = torch.rand(4, dtype=torch.bfloat16)
    mods = hta.mods.compile_mods(hta.variants.alibi(slopes), None) if with_mods else None
    q, k = torch.randn(1, 4, 40, 32, dtype=torch.bfloat16), torch.randn(1, 2, 40, 32,
                                                                         dtype=torch.bfloat16)
    out = torch.randn(q.shape, dtype=torch.bfloat16)
    lse = torch.randn(q.shape[:3])
    schedule = replace(backward_schedule(32), pdl=pdl, dq_add=dq_add)

    def run():
        return backward_launch.run_backward(out, q, k, k, out, lse, None, None,
                                            call_options(None, causal=True, scale=0.2,
                                                         mods=mods),
                                            learnable=[learn] if with_mods else [],
                                            schedule=schedule)
    if dq_add:  # the deterministic mode launches the dQ kernel all the same
        hta.set_deterministic(True)
        try:
            run()
        finally:
            hta.set_deterministic(None)
        assert len(launches) == 3 and not launches[1][-1][P.DQ_ADD]
        launches.clear()
        dependent.clear()
    grads = run()
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape] + ([slopes.shape] * learn)
    assert grads[0].dtype == q.dtype and (learn is False or grads[3].dtype == torch.bfloat16)
    assert len(launches) == 3 - dq_add and dependent == [False, pdl, pdl][:3 - dq_add]
    assert launches[1][-1][P.DQ_ADD] is dq_add
    assert launches[0][-1] is pdl and all(args[-1][P.PDL] is pdl for args in launches[1:])
    kv_args = launches[1]
    captures, constants = kv_args[-7], kv_args[-1]
    assert constants[P.CAPTURE_GRADS] == int(learn)
    assert len(captures) == with_mods + learn  # the slopes, then (learnable) their gradient
    assert learn is False or (captures[1].dtype == torch.float32
                              and captures[1].shape == slopes.shape and not captures[1].any())


@pytest.mark.parametrize("unchecked", [False, True])
def test_unchecked_loads_read_rows_padded_to_whole_tiles(monkeypatch, unchecked):
    """BackwardSchedule.unchecked_loads: the Delta kernel's two arrays (and its grid) cover the
    query rows rounded up to whole tiles of all three kernels, so the other two kernels, told
    by UNCHECKED, may read them without bounds checks; without it, exactly the rows."""
    import cuda.tile as ct

    from hf_tiled_attention import backward_launch
    from hf_tiled_attention.schedule import backward_schedule

    launches = []
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args, **kw:
                        launches.append((grid, args)))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: None, raising=False)
    schedule = replace(backward_schedule(32), rows_tile=32, kv_queries=16, q_rows=128,
                       unchecked_loads=unchecked, dq_add=False)  # (three kernels)
    q, k = torch.randn(2, 4, 200, 32), torch.randn(2, 2, 200, 32)
    backward_launch.run_backward(q, q, k, k, q, torch.randn(q.shape[:3]), None, None,
                                 call_options(None, causal=True, scale=0.2),
                                 schedule=schedule)
    rows = 256 if unchecked else 200  # (200 rounded up to the 128-row dQ tiles)
    (rows_grid, rows_args), (_, kv_args), (_, q_args) = launches
    assert rows_grid == (math.ceil(rows / 32), 4, 2)
    assert rows_args[4].shape == rows_args[5].shape == (2, 4, rows)  # Delta, LSE
    assert kv_args[4] is rows_args[5] and kv_args[5] is rows_args[4]
    assert q_args[4] is rows_args[5] and q_args[5] is rows_args[4]
    assert kv_args[-1][P.UNCHECKED] is q_args[-1][P.UNCHECKED] is unchecked
