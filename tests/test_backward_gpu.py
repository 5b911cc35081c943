"""GPU: the cuTile backward kernels against fp64 autograd of the definition, with poisoned
outputs (the shared case matrix in 16-bit, fp32's TF32x3, every head-dim tile, masks with
empty rows, sinks, mask_mods), bitwise reproducibility, and a compiled training step.

Run on a CUDA machine with cuda-tile installed: ``pytest -m gpu tests``. Skipped elsewhere.
"""

import warnings
from dataclasses import replace

import pytest
import torch

import hf_tiled_attention as hta
from gradients import (EMPTY_ROW_CASES, MASK_GRAD_CASES, assert_grads_match,
                       empty_rows_have_zero_grads, op_and_definition_grads)
from semantics import SEMANTIC_CASES, Case
from test_kernel_gpu import _kernel_required, poison_allocator  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def check_grads(case, dtype, **kwargs):
    poison_allocator(case.batch * case.heads_q * max(case.seq_q, case.seq_kv) * 256 * 4)
    got, want = op_and_definition_grads(case, "cuda", dtype, **kwargs)
    torch.cuda.synchronize()
    assert_grads_match(got, want, dtype)


# bf16 over the whole case matrix, fp16 (the same code path, other rounding) over a third of
# it: each case compiles its own kernel variants, and the suite must fit one device call.
GRAD_CASES = ([pytest.param(case, torch.bfloat16, id=f"bf16-{case.name}")
               for case in SEMANTIC_CASES]
              + [pytest.param(case, torch.float16, id=f"fp16-{case.name}")
                 for case in SEMANTIC_CASES[::3]])


@pytest.mark.parametrize("case, dtype", GRAD_CASES)
def test_gradients_match_definition(case, dtype):
    check_grads(case, dtype)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
def test_fp32_gradients_tf32x3(head_dim):
    check_grads(Case(head_dim=head_dim, causal=True, seq_q=200, seq_kv=230, window=150),
                torch.float32)


@pytest.mark.parametrize("head_dim", [16, 24, 40, 96, 112, 160, 192, 200, 256])
def test_every_head_dim_tile(head_dim):
    """(96, 160, 192: two tiles in the backward, BackwardSchedule.split_head_dim)"""
    check_grads(Case(head_dim=head_dim, causal=True, seq_q=130, seq_kv=130), torch.bfloat16)


def test_head_dim_padded_instead_of_split():
    """BackwardSchedule.split_head_dim=False: 96 zero-padded to 128 in the backward."""
    from hf_tiled_attention.schedule import backward_schedule, set_backward_schedule

    set_backward_schedule(replace(backward_schedule(96), split_head_dim=False))
    try:
        check_grads(Case(head_dim=96, causal=True, seq_q=130, seq_kv=130, heads_q=8, heads_kv=2),
                    torch.bfloat16)
    finally:
        set_backward_schedule(None)


@pytest.mark.parametrize("case", [
    Case(batch=1, heads_q=32, heads_kv=8, seq_q=2048, seq_kv=2048, head_dim=128, causal=True),
    Case(batch=2, heads_q=16, heads_kv=16, seq_q=1000, seq_kv=1000, head_dim=64),
    Case(batch=1, heads_q=8, heads_kv=2, seq_q=777, seq_kv=1500, head_dim=128, causal=True,
         window=300, mask="bool_keypad"),
], ids=lambda c: c.name)
def test_long_sequences(case):
    check_grads(case, torch.bfloat16)


@pytest.mark.parametrize("case", EMPTY_ROW_CASES, ids=lambda c: c.name)
def test_rows_without_keys_get_zero_gradients(case):
    empty_rows_have_zero_grads(case, "cuda", torch.bfloat16)


def test_mask_mods_train_on_the_kernels():
    case = Case(seq_q=300, seq_kv=300, causal=True, heads_q=8, heads_kv=2)
    ids = (torch.arange(300) // 71).cuda()
    check_grads(case, torch.bfloat16, mask_mod=hta.variants.document_mask(ids))
    check_grads(replace(case, causal=False), torch.float16,
                mask_mod=hta.variants.sliding_window(40))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_additive_score_mods_train_on_the_kernels(dtype):
    """ALiBi and a T5-style bias table (no grad) run in the backward kernels: no warning of
    the reference path, gradients as the definition's."""
    case = Case(seq_q=300, seq_kv=300, heads_q=8, heads_kv=2)
    V = hta.variants
    alibi = V.alibi(V.alibi_slopes(8).cuda())
    table = torch.randn(600, device="cuda")

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + 300]

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*reference path on the GPU.*")
        check_grads(replace(case, causal=True), dtype, score_mod=alibi)
        check_grads(case, dtype, score_mod=bias, mask_mod=V.document_mask(
            (torch.arange(300) // 77).cuda()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_derived_score_mods_train_on_the_kernels(dtype):
    """score_mods whose derivative in the score mod_derivative derives (tanh softcap, a
    per-head scale under a where, a rational function of the score) run in the backward
    kernels: no warning of the reference path, gradients as the definition's; one with a
    document mask_mod (hidden scores, whose derivative must not reach the gradients)."""
    case = Case(seq_q=300, seq_kv=300, heads_q=8, heads_kv=2)
    V = hta.variants
    scales = (torch.rand(8, device="cuda") + 0.5)

    def scaled(score, b, h, q_idx, kv_idx):
        t = score * scales[h]
        return torch.where(q_idx >= kv_idx, t, t * 0.5)

    def rational(score, b, h, q_idx, kv_idx):
        return score / (1.0 + abs(score) * 0.1) - score * score * 0.01

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*reference path on the GPU.*")
        check_grads(replace(case, causal=True), dtype, score_mod=V.softcap(4.0))
        check_grads(case, dtype, score_mod=scaled)
        check_grads(case, dtype, score_mod=rational,
                    mask_mod=V.document_mask((torch.arange(300) // 77).cuda()))


@pytest.mark.parametrize("mode", ["fast", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_learnable_score_mod_on_the_kernels(dtype, mode):
    """A score_mod that reads tensors which require grad trains on the kernels: the dK/dV
    kernel adds their gradients by atomics (a relative-position table per element, per-head
    slopes summed per tile first, a T5 bucket table per entry and tile; the T5 case is not
    causal and its lengths are not whole tiles, so the last key tile's rows past seq_kv are
    walked and must add nothing). In deterministic mode each block adds into its own rows
    (CAPTURE_PARTIALS), which torch sums: the gradients repeat bit for bit. No reference-path
    warning."""
    case = Case(seq_q=120, seq_kv=150, causal=True, heads_q=8, heads_kv=2)
    table = torch.randn(300, device="cuda").requires_grad_()
    slopes = (torch.rand(8, device="cuda") * 0.2).requires_grad_()

    def bias(score, b, h, q_idx, kv_idx):
        return score * (1.0 + slopes[h]) + table[q_idx - kv_idx + 150]

    # T5's bucket table: a tile's scores land on few entries, added once per entry and tile
    # (mod_translator.GRAD_BUCKET_SPAN), not per score
    t5_table = (torch.randn(32, 8, device="cuda") * 0.5).requires_grad_()
    t5_bias = hta.variants.relative_position_bias(
        t5_table, hta.variants.relative_position_buckets(120, 150, max_distance=64).cuda(), 120)
    runs = ((case, bias, (table, slopes)), (replace(case, causal=False), t5_bias, (t5_table,)))
    hta.set_deterministic(mode == "deterministic")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for run_case, mod, learnable in runs:
                check_grads(run_case, dtype, score_mod=mod, learnable=learnable)
                if mode == "deterministic":
                    first, second = (op_and_definition_grads(
                        run_case, "cuda", dtype, score_mod=mod, learnable=learnable)[0]
                        for _ in range(2))
                    assert all(torch.equal(first[name], second[name]) for name in first)
    finally:
        hta.set_deterministic(None)
    assert not [w for w in caught if "reference path" in str(w.message)]


def test_learnable_score_mod_in_deterministic_mode_without_room(monkeypatch):
    """Where the per-block rows would pass CAPTURE_PARTIALS_MAX_BYTES, the gradients come from
    the reference path, with a warning that says so."""
    from hf_tiled_attention import backward_launch
    monkeypatch.setattr(backward_launch, "CAPTURE_PARTIALS_MAX_BYTES", 1024)
    case = Case(seq_q=120, seq_kv=120, causal=True)
    table = torch.randn(240, device="cuda").requires_grad_()

    def roomless_bias(score, b, h, q_idx, kv_idx):  # (its own name: the warning is once)
        return score + table[q_idx - kv_idx + 120]

    hta.set_deterministic(True)
    try:
        with pytest.warns(RuntimeWarning, match="deterministic mode"):
            check_grads(case, torch.float32, score_mod=roomless_bias, learnable=(table,))
    finally:
        hta.set_deterministic(None)


@pytest.fixture
def deterministic():
    """The backward made bitwise reproducible for one test (hta.set_deterministic)."""
    hta.set_deterministic(True)
    yield
    hta.set_deterministic(None)


@pytest.mark.parametrize("case", [Case(causal=True, mask="bool_keypad", seq_q=500, seq_kv=500),
                                  Case(heads_q=8, heads_kv=1, softcap=5.0, seq_q=300,
                                       seq_kv=300),
                                  Case(mask="additive_keypad", seq_q=300, seq_kv=300)],
                         ids=lambda c: c.name)
def test_deterministic_gradients_are_bitwise_reproducible(case, deterministic):
    mask_grad = case.mask == "additive_keypad"  # summed over heads and query tiles
    first, _ = op_and_definition_grads(case, "cuda", torch.bfloat16, mask_grad=mask_grad)
    second, _ = op_and_definition_grads(case, "cuda", torch.bfloat16, mask_grad=mask_grad)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_torch_deterministic_flag_makes_the_backward_reproducible():
    case = Case(heads_q=8, heads_kv=2, causal=True, seq_q=400, seq_kv=400)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert hta.deterministic()
        first, _ = op_and_definition_grads(case, "cuda", torch.bfloat16)
        second, _ = op_and_definition_grads(case, "cuda", torch.bfloat16)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("case", SEMANTIC_CASES[1::4], ids=lambda c: c.name)
def test_deterministic_mode_gradients(case, deterministic):
    """The two-kernel dQ pass (the deterministic mode; the case matrix above runs the default
    one) against the definition."""
    check_grads(case, torch.bfloat16)


@pytest.mark.parametrize("mode", ["fast", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", MASK_GRAD_CASES, ids=lambda c: c.name)
def test_additive_mask_gradients_on_the_kernels(case, dtype, mode):
    """An additive mask that requires grad gets the scores' gradient summed over the dims it
    broadcasts, from the dK/dV kernel: TMA reduce-adds into its own shape (fast), or one add
    per element into full batch and head dims summed by torch (deterministic)."""
    hta.set_deterministic(mode == "deterministic")
    try:
        check_grads(case, dtype, mask_grad=True)
    finally:
        hta.set_deterministic(None)


def test_compiled_training_step_on_the_gpu():
    torch.manual_seed(0)
    weights = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
    ids = (torch.arange(256, device="cuda") // 50)
    documents = hta.variants.document_mask(ids)

    def step(x):
        q = (x @ weights).view(1, 256, 4, 16).transpose(1, 2)
        out = hta.tiled_attention(q, q[:, :2], q[:, :2], mask_mod=documents)
        return out.float().square().mean()

    compiled = torch.compile(step, fullgraph=True)
    for seed in range(3):
        x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator("cuda").manual_seed(seed))
        weights.grad = None
        compiled(x).backward()
        got = weights.grad.clone()
        weights.grad = None
        step(x).backward()
        # (inductor's fused bf16 matmul backward may round differently from eager's)
        torch.testing.assert_close(got, weights.grad, atol=2e-2 * got.abs().max().item(),
                                   rtol=0)


@pytest.mark.parametrize("case", [
    Case(heads_q=8, heads_kv=2, causal=True, seq_q=300, seq_kv=300, head_dim=64),
    Case(heads_q=8, heads_kv=2, seq_q=200, seq_kv=260, head_dim=128, window=90, softcap=5.0),
    Case(heads_q=4, heads_kv=4, seq_q=130, seq_kv=130, head_dim=64, mask="additive_heads"),
    Case(heads_q=8, heads_kv=2, causal=True, seq_q=200, seq_kv=200, head_dim=96),  # two parts
], ids=lambda c: c.name)
def test_dq_added_in_the_kv_kernel(case):
    """BackwardSchedule.dq_add (the fast mode's default up to D=64, which the case matrix runs;
    here at D=96 and 128 too, on other tiles): dQ made in the dK/dV kernel and added by TMA
    reduce-adds into fp32, no dQ kernel; with a mask gradient."""
    from hf_tiled_attention.schedule import backward_schedule, set_backward_schedule

    set_backward_schedule(replace(backward_schedule(case.head_dim), dq_add=True, kv_keys=64,
                                  kv_queries=32))
    hta.set_deterministic(False)
    try:
        check_grads(case, torch.bfloat16, mask_grad=case.mask is not None)
    finally:
        set_backward_schedule(None)
        hta.set_deterministic(None)


@pytest.mark.parametrize("case", [
    Case(heads_q=8, heads_kv=2, causal=True, seq_q=300, seq_kv=300, head_dim=128),
    Case(heads_q=4, heads_kv=4, seq_q=130, seq_kv=200, head_dim=64, mask="bool_keypad"),
], ids=lambda c: c.name)
def test_programmatic_dependent_launches(case, deterministic):
    """BackwardSchedule.pdl (off in the table): the dK/dV and dQ kernels launched as
    programmatic dependents, waiting for the rows kernel's output only where they read it,
    give the default launches' gradients bitwise, run after run (in deterministic mode: the
    fast mode's dQ adds, taken at D=64, add in any order)."""
    from hf_tiled_attention.schedule import backward_schedule, set_backward_schedule

    default, _ = op_and_definition_grads(case, "cuda", torch.bfloat16)
    set_backward_schedule(replace(backward_schedule(case.head_dim), pdl=True))
    try:
        for _ in range(3):
            poison_allocator(case.batch * case.heads_q * case.seq_q * 256 * 4)
            got, want = op_and_definition_grads(case, "cuda", torch.bfloat16)
            for name in default:
                assert torch.equal(got[name], default[name]), name
        assert_grads_match(got, want, torch.bfloat16)
    finally:
        set_backward_schedule(None)


@pytest.mark.parametrize("case, documents", [
    (Case(heads_q=8, heads_kv=2, causal=True, seq_q=300, seq_kv=300, head_dim=128), False),
    (Case(heads_q=4, heads_kv=4, seq_q=130, seq_kv=200, head_dim=64, mask="bool_keypad"), False),
    (Case(heads_q=4, heads_kv=2, seq_q=77, seq_kv=131, head_dim=96, mask="bool_empty_rows",
          softcap=3.0), False),
    (Case(heads_q=8, heads_kv=2, seq_q=600, seq_kv=600, head_dim=64, causal=True), True),
    (Case(heads_q=4, heads_kv=2, seq_q=150, seq_kv=150, head_dim=256, window=60), False),
], ids=lambda c: c.name if isinstance(c, Case) else ("documents" if c else "plain"))
def test_unchecked_loads(case, documents, deterministic):
    """BackwardSchedule.unchecked_loads (on in the table): the steps' LSE / Delta rows and tile
    states loaded without bounds checks from the Delta kernel's rows padded to whole tiles
    give the checked loads' gradients bitwise (sequence lengths that are not whole tiles, rows
    that see no key, a key mask's states, a mask_mod's per-row table), on a poisoned
    allocator, so a padded row read but never written would show (deterministic mode, so
    that the D=64 rows' dQ comes from its own kernel, bitwise)."""
    from hf_tiled_attention.schedule import backward_schedule, set_backward_schedule

    mask_mod = None
    if documents:  # uneven documents: edge steps read their tiles' states
        lengths = torch.tensor([7, 150, 33, 260, 90, 60])
        mask_mod = hta.variants.document_mask(
            torch.repeat_interleave(torch.arange(6), lengths).cuda())
    table = backward_schedule(case.head_dim)
    grads = {}
    try:
        for unchecked in (False, True):
            set_backward_schedule(replace(table, unchecked_loads=unchecked))
            poison_allocator(case.batch * case.heads_q * case.seq_q * 256 * 4)
            grads[unchecked] = op_and_definition_grads(case, "cuda", torch.bfloat16,
                                                       mask_mod=mask_mod)
    finally:
        set_backward_schedule(None)
    (checked, _), (got, want) = grads[False], grads[True]
    for name in checked:
        assert torch.equal(got[name], checked[name]), name
    assert_grads_match(got, want, torch.bfloat16)


@pytest.mark.parametrize("edge_states, table_order", [(False, False), (False, True),
                                                      (True, True)])
def test_mask_walk_schedules(edge_states, table_order):
    """BackwardSchedule.edge_states / table_order (the table's D=64 row: True, False; the
    D=128 row, which the case matrix runs, has edge_states False) on
    uneven documents and on striped rows and keys, whose walks hold empty tiles besides the
    one gap the table jumps (computed, contributing 0, without edge_states)."""
    from hf_tiled_attention.schedule import backward_schedule, set_backward_schedule

    lengths = torch.tensor([7, 150, 33, 260, 90, 60])
    ids = torch.repeat_interleave(torch.arange(6), lengths).cuda()
    seen = (torch.arange(600) % 200 < 50).cuda()  # rows and keys 50-199 of every 200 hidden

    def stripes(b, h, q_idx, kv_idx):
        return seen[q_idx] & seen[kv_idx]

    case = Case(heads_q=8, heads_kv=2, seq_q=600, seq_kv=600, head_dim=64)
    set_backward_schedule(replace(backward_schedule(64), edge_states=edge_states,
                                  table_order=table_order))
    try:
        check_grads(replace(case, causal=True), torch.bfloat16,
                    mask_mod=hta.variants.document_mask(ids))
        check_grads(case, torch.bfloat16, mask_mod=stripes)
    finally:
        set_backward_schedule(None)
