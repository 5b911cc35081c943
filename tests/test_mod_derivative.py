"""CPU: a score_mod's derivative in its score (mod_derivative), as the backward kernels run it,
against torch autograd of the mod itself; and which score_mods get one."""

import math

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention.mods import compile_mods

V = hta.variants
B, H, SQ, SKV = 2, 3, 7, 11
# The module's captured tensors come from their own generator, not the global one: under
# pytest-xdist the global state at import depends on which modules a worker imported before.
_gen = torch.Generator().manual_seed(0)
table = torch.randn(H, generator=_gen)  # captured tensors are fp32 (the kernel reads them)
positions = torch.randn(SKV, generator=_gen)


def scaled_per_head(score, b, h, q_idx, kv_idx):
    t = score * table[h]
    return torch.where(q_idx >= kv_idx, t, t * 0.5)


def rational(score, b, h, q_idx, kv_idx):
    return score / (1.0 + abs(score)) - (score - positions[kv_idx]) / (2.0 + score * score)


def transcendental(score, b, h, q_idx, kv_idx):
    x = torch.exp(-score * score) + torch.log(3.0 + torch.sin(score)) ** 2
    return torch.sqrt(2.0 + torch.cos(x)) - torch.exp2(score * 0.25) + torch.log2(5.0 + x) ** 3


def kinks(score, b, h, q_idx, kv_idx):
    low = torch.minimum(score, score * 0.25 + 0.5)
    return torch.maximum(low, torch.tanh(score)) + abs(score - 1.0) + torch.floor(score) * 2


def piecewise_constant(score, b, h, q_idx, kv_idx):
    return torch.ceil(score)


def calls_a_helper(score, b, h, q_idx, kv_idx):
    return _helper(score) * 2


def _helper(x):
    return x * x


def loops(score, b, h, q_idx, kv_idx):
    for _ in range(2):
        score = score * 0.5
    return score


DERIVED = [V.softcap(20.0), scaled_per_head, rational, transcendental, kinks,
           piecewise_constant, loops]


def grid(score_dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    score = (torch.randn(B, H, SQ, SKV, generator=gen, dtype=score_dtype) * 3)
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    q = torch.arange(SQ)[None, None, :, None]
    kv = torch.arange(SKV)[None, None, None, :]
    return score, b, h, q, kv


@pytest.mark.parametrize("fast_math", [False, True], ids=["exact", "fast_math"])
@pytest.mark.parametrize("score_mod", DERIVED, ids=lambda f: f.__name__)
def test_derivative_matches_autograd_of_the_mod(score_mod, fast_math):
    compiled = compile_mods(score_mod, None, fast_math=fast_math)
    assert compiled.score_mod_grad is not None and compiled.score_mod_differentiable
    score, b, h, q, kv = grid()
    score.requires_grad_()
    want, = torch.autograd.grad(compiled.score_mod(score, b, h, q, kv).sum(), score)
    got = compiled.score_mod_grad(score.detach(), b, h, q, kv)
    got = torch.as_tensor(got, dtype=torch.float64).expand_as(want)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_kernel_source_has_the_derivative():
    """The cuTile twin of the derivative is generated next to the torch one (cuTile's names)."""
    compiled = compile_mods(V.softcap(20.0), None, fast_math=True)
    grad_source = open(compiled.path).read().split("def _fn0_grad")[1].split("def ")[0]
    assert "ct.tanh" in grad_source and "RoundingMode.APPROX" in grad_source
    assert "score_mod_grad = _fn0_grad" in open(compiled.path).read()


@pytest.mark.parametrize("score_mod, differentiable, derived", [
    (V.alibi(V.alibi_slopes(H)), True, False),       # additive: derivative 1, nothing derived
    (calls_a_helper, False, False),                  # another function of the score
    (loops, True, True),                             # unrolled: assignments, one expression
    (V.softcap(20.0), True, True),
], ids=["alibi", "helper", "loop", "softcap"])
def test_which_score_mods_run_on_the_backward_kernels(score_mod, differentiable, derived):
    compiled = compile_mods(score_mod, None)
    assert compiled.score_mod_differentiable is differentiable
    assert (compiled.score_mod_grad is not None) is derived


# Learnable captures: each read of a float tensor a term of its gradient (capture_grad_entries).
slopes = torch.rand(H, generator=_gen)
bias_table = torch.randn(H, 9, generator=_gen)
buckets = torch.randint(0, 9, (SQ, SKV), generator=_gen)
head_scale = torch.rand(H, generator=_gen) + 0.5


def learnable_alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def learnable_t5_bias(score, b, h, q_idx, kv_idx):
    return score + bias_table[h, buckets[q_idx, kv_idx]]


def learnable_everything(score, b, h, q_idx, kv_idx):
    x = (score * head_scale[h] + slopes[h] * (kv_idx - q_idx)
         + bias_table[h, buckets[q_idx, kv_idx]])
    return torch.tanh(x * bias_table[h, 2]) * 3.0 + positions[kv_idx] * slopes[h]


@pytest.mark.parametrize("score_mod, mask_mod", [
    (learnable_alibi, None), (learnable_t5_bias, None), (learnable_everything, None),
    (learnable_alibi, V.document_mask(torch.arange(SKV) // 4))],
    ids=["alibi", "t5_bias", "everything", "alibi+documents"])
def test_capture_gradients_match_autograd_of_the_mod(score_mod, mask_mod):
    """What the dK/dV kernel adds into each learnable capture's gradient (the torch twin of
    its atomics), summed over every score, equals autograd of sum(dS * mod) where p > 0 (with
    a mask_mod's captures too: the gradient arrays follow all of them)."""
    compiled = compile_mods(score_mod, mask_mod)
    captures = compiled.captures
    assert compiled.capture_grad_slots == tuple(  # (the documents' ids are integers)
        slot for slot, t in enumerate(captures) if t.is_floating_point())
    score, b, h, q, kv = grid()
    gen = torch.Generator().manual_seed(1)
    ds = torch.randn(score.shape, generator=gen, dtype=torch.float64)
    p = (torch.rand(score.shape, generator=gen) > 0.3).double()  # some weights 0 (hidden)
    leaves = [t.detach().double().requires_grad_() if t.is_floating_point() else t
              for t in captures]
    module = compiled.module
    modded = module.score_mod_torch(score, b, h, q, kv, tuple(leaves))
    loss = torch.where(p > 0, ds * modded, 0.0).sum()
    slots = compiled.capture_grad_slots
    want = torch.autograd.grad(loss, [leaves[s] for s in slots])
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in captures]
    bits = sum(1 << s for s in slots)
    compiled.capture_grad_twin()(p, ds, score, b, h, q, kv, grads, bits)
    for slot, expected in zip(slots, want):
        # (the twin reads and multiplies in fp32, as the kernel: over 120 draws of the captures
        # the sums of these 462 scores differed from fp64 autograd by at most 1.5e-5)
        torch.testing.assert_close(grads[slot], expected, rtol=1e-6, atol=5e-5)
    only_first = [torch.zeros(t.shape, dtype=torch.float64) for t in captures]
    compiled.capture_grad_twin()(p, ds, score, b, h, q, kv, only_first, 1 << slots[0])
    assert all(not g.any() for s, g in enumerate(only_first) if s != slots[0])


class _TorchTiles:
    """cuTile's functions that the generated capture-gradient adds call, on torch tensors (a
    tile is a tensor; an index tuple broadcasts as the kernel's does): enough to run the
    kernel's text on the CPU, tile by tile. Any other name fails the test."""

    class MemoryOrder:
        RELAXED = "relaxed"

    block = (0, 0, 0)   # the block being run, and the grid (set by the test)
    grid = (1, 1, 1)

    def bid(self, axis):
        return self.block[axis]

    def num_blocks(self, axis):
        return self.grid[axis]

    @staticmethod
    def where(cond, x, y):
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        return torch.where(cond, x, y.to(x.dtype) if y.dim() == 0 else y)

    @staticmethod
    def sum(x, axis=None, keepdims=False):
        return x.sum() if axis is None else x.sum(dim=axis, keepdim=keepdims)

    @staticmethod
    def min(x):
        return x.min()

    @staticmethod
    def max(x):
        return x.max()

    @staticmethod
    def gather(array, index):
        return array[tuple(i.long() for i in torch.broadcast_tensors(*map(torch.as_tensor,
                                                                            index)))]

    @staticmethod
    def atomic_add(array, index, values, memory_order=None):
        *index, values = torch.broadcast_tensors(*map(torch.as_tensor, index),
                                                torch.as_tensor(values))
        array.index_put_(tuple(i.long() for i in index), values.to(array.dtype),
                         accumulate=True)

    def __getattr__(self, name):  # math functions (tanh, exp, ...) as torch's
        if name in ("tanh", "exp", "exp2", "log", "log2", "sqrt", "sin", "cos", "abs",
                    "minimum", "maximum", "floor", "ceil"):
            return getattr(torch, name)
        raise AttributeError(f"the test's cuTile stand-in has no {name}")


wide_table = torch.randn(80, H, generator=_gen)  # 80 entries: tiles whose reads span > 32
wide_buckets = torch.randint(0, 80, (SQ, SKV), generator=_gen)


def learnable_wide_table(score, b, h, q_idx, kv_idx):
    return score + wide_table[wide_buckets[q_idx, kv_idx], h]


@pytest.mark.parametrize("partials", [False, True], ids=["atomics", "partials"])
@pytest.mark.parametrize("score_mod", [learnable_t5_bias, learnable_wide_table,
                                       learnable_everything], ids=lambda f: f.__name__)
def test_kernel_capture_adds_equal_their_twin(score_mod, partials):
    """The cuTile text of the capture-gradient adds (the dK/dV kernel's: tiles of keys x
    queries, b and h scalars), run with torch standing in for cuTile over tiles of 4 keys x 3
    queries, adds what the torch twin adds over the whole grid: the bucket table's per-index
    tile sums (spans up to 32) and its per-score adds (wider spans) included. With
    ``partials`` (deterministic mode) each block (key tile, head, batch) adds only into its own
    row, index by index at any span, and the rows sum to the twin's."""
    import types
    compiled = compile_mods(score_mod, None)
    captures, slots = compiled.captures, compiled.capture_grad_slots
    kernel_fn = compiled.module.score_mod_capture_grad
    assert "for _b in range(_lo, _hi + 1)" in open(compiled.path).read()
    tiles = _TorchTiles()
    tiles.grid = (-(-SKV // 4), H, B)
    kernel_fn = types.FunctionType(kernel_fn.__code__, {**kernel_fn.__globals__, "ct": tiles})
    score, b, h, q, kv = grid()
    gen = torch.Generator().manual_seed(2)
    ds = torch.randn(score.shape, generator=gen, dtype=torch.float64)
    p = (torch.rand(score.shape, generator=gen) > 0.3).double()
    bits = sum(1 << s for s in slots)
    want = [torch.zeros(t.shape, dtype=torch.float64) for t in captures]
    compiled.capture_grad_twin()(p, ds, score, b, h, q, kv, want, bits)
    rows = (math.prod(tiles.grid),) if partials else ()
    got = [torch.zeros(rows + t.shape, dtype=torch.float64) for t in captures]
    spans = set()
    for bi in range(B):
        for hi in range(H):
            for k0 in range(0, SKV, 4):
                tiles.block = (k0 // 4, hi, bi)
                row = k0 // 4 + tiles.grid[0] * (hi + H * bi)
                before = [g.clone() for g in got]
                for q0 in range(0, SQ, 3):
                    keys = torch.arange(k0, min(k0 + 4, SKV))[:, None]     # axis 0: keys
                    queries = torch.arange(q0, min(q0 + 3, SQ))[None, :]   # axis 1: queries
                    tile = (bi, hi, queries, keys)
                    kernel_fn(p[tile], ds[tile], score[tile], bi, hi, queries, keys,
                              captures + tuple(got), bits, partials)
                    if score_mod is learnable_wide_table:
                        seen = wide_buckets[queries, keys][p[tile] > 0]
                        spans.add(bool(len(seen)) and int(seen.max() - seen.min()) >= 32)
                if partials:  # this block's adds landed in its row only
                    for slot in slots:
                        changed = (got[slot] != before[slot]).flatten(1).any(1).nonzero()
                        assert changed.flatten().tolist() in ([], [row])
    for slot in slots:
        total = got[slot].sum(0) if partials else got[slot]
        torch.testing.assert_close(total, want[slot], rtol=1e-9, atol=1e-9)
    if score_mod is learnable_wide_table:
        assert spans == {False, True}  # both branches ran


def test_no_capture_gradient_without_float_captures():
    assert compile_mods(V.softcap(20.0), None).capture_grad_slots == ()
    assert compile_mods(lambda s, b, h, q, kv: s + (kv - q) * 0.5, None).capture_grad_twin() is None
