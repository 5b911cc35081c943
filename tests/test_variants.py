"""CPU: score_mod / mask_mod through the reference path against the fp64 definition, the
variants' patterns against plain loops, the translation's errors, and every variant's kernel
compiling for sm_90."""

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention import variants
from hf_tiled_attention.mods import ModError, compile_mods
from semantics import assert_matches_definition, definition
from variant_cases import VARIANT_CASES, make_variant_inputs

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


# The reference path's "no GPU" warning.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c.name)
def test_variant_reference_matches_definition(case, dtype):
    q, k, v, kwargs = make_variant_inputs(case, "cpu", dtype)
    out, lse = hta.tiled_attention(q, k, v, return_lse=True, **kwargs)
    want_out, want_lse = definition(q, k, v, **kwargs)
    assert_matches_definition(out, lse, want_out, want_lse, atol=TOLERANCE[dtype], lse_atol=2e-4)


def _pattern(mask_mod, batch, seq):
    b, q, kv = (torch.arange(batch)[:, None, None, None], torch.arange(seq)[:, None],
                torch.arange(seq)[None, :])
    return torch.broadcast_to(mask_mod(b, torch.zeros(1, 1, 1, 1, dtype=torch.long), q, kv),
                              (batch, 1, seq, seq))[:, 0]


def test_variant_patterns_match_loops():
    seq = 40
    cases = {
        "sinks": (variants.sliding_window_with_sinks(8, 2),
                  lambda b, i, j: j <= i and (i - j < 8 or j < 2)),
        "chunked": (variants.chunked_attention(16), lambda b, i, j: j <= i and i // 16 == j // 16),
        "prefix": (variants.prefix_lm(torch.tensor([5, 0])), lambda b, i, j: j < (5, 0)[b] or j <= i),
        "prefix-int": (variants.prefix_lm(16), lambda b, i, j: j < 16 or j <= i),
        "documents": (variants.document_mask(variants.document_ids_from_cu_seqlens(
            torch.tensor([0, 10, 11, 40]))),
            lambda b, i, j: j <= i and (i < 10) == (j < 10) and (i == 10) == (j == 10)),
        "window": (variants.sliding_window(8), lambda b, i, j: 0 <= i - j < 8),
    }
    for name, (mod, rule) in cases.items():
        got = _pattern(mod, 2, seq)
        want = torch.tensor([[[rule(b, i, j) for j in range(seq)] for i in range(seq)]
                             for b in range(2)])
        assert torch.equal(got, want), name


def test_alibi_slopes_and_t5_buckets():
    torch.testing.assert_close(variants.alibi_slopes(8), torch.tensor(
        [2.0 ** -(i + 1) for i in range(8)]))
    assert variants.alibi_slopes(12).shape == (12,)
    buckets = variants.relative_position_buckets(4, 300)   # relative -3 .. 299
    assert buckets.dtype == torch.int32 and buckets.shape == (303,)
    assert buckets[3] == 0 and int(buckets.max()) <= 31    # relative 0 -> bucket 0
    assert buckets[3 + 1] == 17 and buckets[3 - 1] == 1    # +1: the upper half, -1: the lower


def test_translation_shares_kernels_between_equal_closures():
    first = compile_mods(variants.alibi(variants.alibi_slopes(8)), variants.causal_mask)
    second = compile_mods(variants.alibi(variants.alibi_slopes(8)), variants.causal_mask)
    assert first.key == second.key and first.captures[0] is not second.captures[0]
    other = compile_mods(variants.softcap(20.0), None)
    assert other.key != compile_mods(variants.softcap(30.0), None).key  # constants are code


def _same_document(ids_q, ids_k):
    def same_document(b, h, q_idx, kv_idx):
        return ids_q[q_idx] == ids_k[kv_idx]
    return same_document


def test_new_closures_of_one_structure_are_not_translated_again(monkeypatch):
    """The transformers adapter makes new closures every forward: one translation per
    structure, each call reading its own tensors (and a closure whose two captured tensors the
    first translation shared as one slot, because they were one tensor there, translated
    again)."""
    from hf_tiled_attention import mod_translator

    translated = []
    original = mod_translator.Translator.function
    monkeypatch.setattr(mod_translator.Translator, "function", lambda self, fn, *args, **kw: (
        translated.append(fn) or original(self, fn, *args, **kw)))
    ids = torch.tensor([0, 0, 1, 1, 1])
    first = compile_mods(None, _same_document(ids, ids))
    assert len(translated) == 1 and len(first.captures) == 1
    other = torch.tensor([0, 1, 1, 2, 2])
    second = compile_mods(None, _same_document(other, other))
    assert len(translated) == 1 and second.key == first.key and second.captures[0] is other
    q_idx, kv_idx = torch.arange(5)[:, None], torch.arange(5)[None, :]
    assert torch.equal(second.mask_mod(0, 0, q_idx, kv_idx), other[:, None] == other[None, :])
    apart = compile_mods(None, _same_document(ids, other))  # two tensors: two slots
    assert len(translated) == 2 and len(apart.captures) == 2 and apart.key != first.key
    assert torch.equal(apart.mask_mod(0, 0, q_idx, kv_idx), ids[:, None] == other[None, :])


def test_mods_from_key_refuses_a_capture_count_its_code_does_not_read():
    """A key translated from one tensor passed twice has one slot: handing it two tensors (the
    query and the key ids of a document rule) would read the first for both, so it is refused."""
    from hf_tiled_attention.mods import mods_from_key

    ids = torch.zeros(1, 4, dtype=torch.int32)
    one_slot = compile_mods(None, lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx])
    assert len(mods_from_key(one_slot.key, (ids,)).captures) == 1
    with pytest.raises(ValueError, match="read 1 captured tensors, got 2"):
        mods_from_key(one_slot.key, (ids, ids.clone()))


def test_translation_memo_is_bounded():
    """Each forward of the transformers adapter makes new closures (holding its tensors): the
    memo of translations must not keep them all."""
    import hf_tiled_attention as hta

    for width in range(300):
        compile_mods(None, variants.sliding_window(width % 3 + 1))
    assert hta.cache_sizes()["translated mods"] <= 256


def _with_list(b, h, q_idx, kv_idx):
    return q_idx >= LIMITS[0]


LIMITS = [3]


def _with_method(b, h, q_idx, kv_idx):
    return q_idx.abs() >= kv_idx


def _with_unknown_torch(score, b, h, q_idx, kv_idx):
    return torch.erf(score)


def test_mod_errors_name_the_problem():
    slopes = torch.ones(4)

    def unindexed(score, b, h, q_idx, kv_idx):
        return score + slopes

    def three_args(b, h, q_idx):
        return q_idx >= 0

    with pytest.raises(ModError, match="captured 'LIMITS' is a list"):
        compile_mods(None, _with_list)
    with pytest.raises(ModError, match="attribute access"):
        compile_mods(None, _with_method)
    with pytest.raises(ModError, match="torch.erf is not available"):
        compile_mods(_with_unknown_torch, None)
    with pytest.raises(ModError, match="'slopes' must be indexed"):
        compile_mods(unindexed, None)
    with pytest.raises(ModError, match="mask_mod must take 4 arguments"):
        compile_mods(None, three_args)
    q = k = v = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="either attn_mask or mask_mod"):
        hta.tiled_attention(q, k, v, torch.ones(8, 8, dtype=torch.bool),
                            mask_mod=variants.causal_mask)
    with pytest.raises(ValueError, match="either softcap or score_mod"):
        hta.tiled_attention(q, k, v, softcap=5.0, score_mod=variants.softcap(5.0))
    with pytest.raises(TypeError, match="score_mod must be a function"):
        hta.tiled_attention(q, k, v, score_mod=3)
    elsewhere = variants.alibi(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"alibi.<locals>.score_mod reads a captured tensor of "
                       r"shape \(2,\) on meta; mods run on the query's device \(cpu\)"):
        hta.tiled_attention(q, k, v, score_mod=elsewhere)


def _builds_a_list(score, b, h, q_idx, kv_idx):
    a = [1.0, 2.0]
    return score * a[1]


def _if_on_a_tensor(b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return q_idx >= 0
    return kv_idx >= 0


def _while_loop(score, b, h, q_idx, kv_idx):
    while score > 0:
        score = score - 1
    return score


def _and_on_tensors(b, h, q_idx, kv_idx):
    return q_idx >= 0 and kv_idx >= 0


def _chained(b, h, q_idx, kv_idx):
    return 0 <= kv_idx <= q_idx


def _ternary_on_a_tensor(score, b, h, q_idx, kv_idx):
    return score if q_idx > 3 else -score


@pytest.mark.parametrize("mod, role, pattern", [
    (_builds_a_list, "score_mod", r"_builds_a_list \(.*test_variants.py, line \d+\): a list cannot"),
    (_if_on_a_tensor, "mask_mod", r"_if_on_a_tensor \(.*line \d+\): `if q_idx > kv_idx` depends "
                                  r"on the mod's arguments .*torch.where"),
    (_while_loop, "score_mod", r"_while_loop \(.*line \d+\): a while loop cannot run"),
    (_and_on_tensors, "mask_mod", r"`and` on per-element values: use &"),
    (_chained, "mask_mod", r"chained comparison"),
    (_ternary_on_a_tensor, "score_mod", r"depends on the mod's arguments: use torch.where"),
])
def test_mods_that_cannot_compile_are_refused_up_front(mod, role, pattern):
    """Refused when translated (the CPU path translates too: what CI and users without a GPU
    see first), naming the mod, its file and line, on tiled_attention's path as well."""
    kwargs = {role: mod}
    with pytest.raises(ModError, match=pattern):
        compile_mods(kwargs.get("score_mod"), kwargs.get("mask_mod"))
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ModError, match=pattern):
        hta.tiled_attention(q, q, q, **kwargs)


def test_the_error_names_the_line_in_the_file():
    import inspect
    with pytest.raises(ModError) as caught:
        compile_mods(None, _if_on_a_tensor)
    line = inspect.getsourcelines(_if_on_a_tensor)[1] + 1  # the `if`, one line below the def
    assert f"line {line})" in str(caught.value)


WIDTH = 4
CAUSAL = True
RULES = (variants.causal_mask, variants.sliding_window(6))


def _static_branches(b, h, q_idx, kv_idx):
    """`if` on captured numbers, a loop over captured functions and a constant range."""
    seen = q_idx >= 0
    if CAUSAL and WIDTH > 2:
        seen = seen & (kv_idx <= q_idx)
    for rule in RULES:
        seen = seen & rule(b, h, q_idx, kv_idx)
    for step in range(2):
        seen = seen & (kv_idx != q_idx - 10 * (step + 1))
    return seen


def test_static_control_flow_is_translated():
    """What is fixed when the mod is translated (captured numbers, captured tuples of
    functions, constant ranges) may steer an if or a loop: the loop is unrolled."""
    mods = compile_mods(None, _static_branches)
    b, h, q, k = (torch.zeros(1, 1, 1, 1, dtype=torch.long),) * 2 + (
        torch.arange(40)[:, None], torch.arange(40)[None, :])
    want = _static_branches(b, h, q, k)
    assert torch.equal(torch.broadcast_to(mods.mask_mod(b, h, q, k), want.shape), want)
    text = open(mods.path).read()
    assert "for " not in text and text.count("q_idx - 10 * (step + 1)") == 0  # unrolled


def test_prefix_lm_arguments():
    with pytest.raises(TypeError, match="prefix_lengths must be an int or a \\(B,\\) integer "
                                        "tensor, got Tensor of shape \\(2, 1\\)"):
        variants.prefix_lm(torch.tensor([[3], [4]]))
    with pytest.raises(ValueError, match="prefix_lengths must be >= 0"):
        variants.prefix_lm(-1)


def _rejected_by_cutile(score, b, h, q_idx, kv_idx, captures):
    return {"a dict": score}["a dict"]


def test_kernel_compile_errors_name_the_mod():
    """A mod that translates but that cuTile rejects: the error names the mod and the
    generated module (here the generated function is swapped for one cuTile cannot compile)."""
    import types

    pytest.importorskip("cuda.tile.compilation")
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.launch import export_cubin, plan_launch
    from hf_tiled_attention.mods import CompiledMods
    from hf_tiled_attention.schedule import resolve_schedule

    good = compile_mods(variants.softcap(7.0), None)
    module = types.ModuleType("broken_mods")
    module.score_mod = _rejected_by_cutile
    broken = CompiledMods("broken", module, (), good.path, good.names)
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    plan = plan_launch(q, q, call_options(None, causal=False, scale=0.1, mods=broken),
                       resolve_schedule(None, 9, q.dtype, 64, False))
    with pytest.raises(ModError, match="score_mod softcap.<locals>.score_mod did not compile"):
        export_cubin(plan, q, q, None, arch="sm_90")


def test_fast_math_only_when_asked():
    """16-bit calls: approximate tanh, division by a number as a product (softcap's cost)."""
    fast = open(compile_mods(variants.softcap(8.0), None, fast_math=True).path).read()
    exact = open(compile_mods(variants.softcap(8.0), None).path).read()
    assert "ct.tanh(score * 0.125, rounding_mode=ct.RoundingMode.APPROX)" in fast
    assert "ct.tanh(score / 8.0)" in exact and "APPROX" not in exact


def _halves(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx) / 2 - q_idx / score


def test_fast_math_division_compiles_for_ints_and_keeps_tile_divisors():
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    mods = compile_mods(_halves, None, fast_math=True)
    assert "(kv_idx - q_idx) * 0.5 - q_idx / score" in open(mods.path).read()
    pytest.importorskip("cuda.tile.compilation")
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.launch import export_cubin, plan_launch
    from hf_tiled_attention.schedule import resolve_schedule
    plan = plan_launch(q, q, call_options(None, causal=False, scale=0.1, mods=mods),
                       resolve_schedule(None, 9, q.dtype, 64, False))
    assert export_cubin(plan, q, q, None, arch="sm_90")[:4] == b"\x7fELF"


def test_lambda_mods_translate():
    mod = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    assert "q_idx >= kv_idx" in open(compile_mods(None, mod).path).read()


def _hide_odd_keys(score, b, h, q_idx, kv_idx):
    return torch.where(kv_idx % 2 == 0, score, -float("inf"))


def test_float_inf_becomes_a_constant():
    text = open(compile_mods(_hide_odd_keys, None).path).read()
    assert "ct.where(kv_idx % 2 == 0, score, -math.inf)" in text
    q = torch.randn(1, 2, 8, 16)
    out = hta.tiled_attention(q, q, q, score_mod=_hide_odd_keys)
    want, _ = definition(q, q, q, score_mod=_hide_odd_keys)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    pytest.importorskip("cuda.tile.compilation")
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.launch import export_cubin, plan_launch
    from hf_tiled_attention.schedule import resolve_schedule
    q = q.to(torch.bfloat16)
    mods = compile_mods(_hide_odd_keys, None)
    plan = plan_launch(q, q, call_options(None, causal=False, scale=0.25, mods=mods),
                       resolve_schedule(None, 9, q.dtype, 16, False))
    assert export_cubin(plan, q, q, None, arch="sm_90")[:4] == b"\x7fELF"


def test_kernel_copy_with_mods_keeps_the_signature():
    """A launch compiles the copy from its annotations (which parameters are constants): the
    copy must declare exactly what the kernel does."""
    import inspect

    pytest.importorskip("cuda.tile")
    from hf_tiled_attention import kernel
    from hf_tiled_attention.launch import kernel_copy_with_mods, mod_callers

    mods = compile_mods(variants.softcap(5.0), variants.causal_mask)
    copy = kernel_copy_with_mods(mods.module)
    original = kernel.attention_forward
    assert inspect.signature(copy) == inspect.signature(original)
    assert copy.__annotations__ == original.__annotations__
    assert copy.__globals__["_score_mod"] is mods.module.score_mod
    assert copy.__globals__["_mask_mod"] is mods.module.mask_mod
    # every helper that reaches a mod is found from the code and copied with the new globals
    callers = {fn.__name__ for fn in mod_callers(original)}
    assert {"attention_forward", "_query_tile", "_attend_tile"} <= callers
    for name in callers:
        assert copy.__globals__[name].__globals__ is copy.__globals__


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c.name)
def test_variant_kernel_compiles_sm90(case):
    pytest.importorskip("cuda.tile.compilation")
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.launch import export_cubin, plan_launch
    from hf_tiled_attention.masks import mod_mask
    from hf_tiled_attention.schedule import resolve_schedule

    q, k, _, kwargs = make_variant_inputs(case, "cpu", torch.bfloat16)
    mods = compile_mods(kwargs.get("score_mod"), kwargs.get("mask_mod"), fast_math=True)
    mask = None if mods.mask_mod is None else mod_mask(
        mods, case.batch, case.heads_q, case.seq_q, case.seq_kv, torch.device("cpu"))
    causal = kwargs.get("is_causal", False)
    schedule = resolve_schedule(None, 9, q.dtype, case.head_dim, causal, seq_q=case.seq_q,
                                seq_kv=case.seq_kv)
    plan = plan_launch(q, k, call_options(mask, causal=causal, scale=0.125,
                                          diag_offset=case.seq_kv - case.seq_q,
                                          return_lse=True, mods=mods), schedule)
    assert plan.variant.constants.SCORE_MOD == (mods.score_mod is not None)
    cubin = export_cubin(plan, q, k, mask, arch="sm_90")
    assert cubin[:4] == b"\x7fELF"


def test_static_control_flow_compiles_sm90():
    pytest.importorskip("cuda.tile.compilation")
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.launch import export_cubin, plan_launch
    from hf_tiled_attention.masks import mod_mask
    from hf_tiled_attention.schedule import resolve_schedule

    mods = compile_mods(None, _static_branches, fast_math=True)
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    mask = mod_mask(mods, 1, 2, 64, 64, torch.device("cpu"))
    plan = plan_launch(q, q, call_options(mask, causal=False, scale=0.1, mods=mods),
                       resolve_schedule(None, 9, q.dtype, 64, False))
    assert export_cubin(plan, q, q, mask, arch="sm_90")[:4] == b"\x7fELF"


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_mods_cross_torch_compile(backend):
    """A score_mod and a mask_mod made outside the compiled function run under
    torch.compile(fullgraph=True): translated once while tracing, their generated code's key
    and captured tensors go through the registered op (here to its reference side), and a
    captured tensor is an input of the graph, read at every call."""
    torch._dynamo.reset()
    q, k, v = torch.randn(2, 4, 50, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    slopes = variants.alibi_slopes(4)
    ids = torch.tensor([0] * 20 + [1] * 30, dtype=torch.int32)
    score_mod, mask_mod = variants.alibi(slopes), variants.document_mask(ids)

    def attend(q, k, v):
        return hta.tiled_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)

    compiled = torch.compile(attend, fullgraph=True, backend=backend)
    want, _ = definition(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    torch.testing.assert_close(compiled(q, k, v).double(), want, atol=2e-5, rtol=0)
    slopes.mul_(3.0)   # the graph reads the captured tensor, not a copy made at trace time
    want, _ = definition(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    torch.testing.assert_close(compiled(q, k, v).double(), want, atol=2e-5, rtol=0)
    torch._dynamo.reset()
