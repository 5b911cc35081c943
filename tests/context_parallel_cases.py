"""Context-parallel attention cases, shared by the CPU tests (one process playing every rank, and
spawned gloo ranks exchanging keys for real) and the GPU test (the kernels on each simulated
rank's shard): the inputs, the whole-sequence call each rank's rows must equal, and the
comparison of outputs, LSEs and every gradient (q, k, v, sinks, a learnable captured table)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

import hf_tiled_attention as hta
from hf_tiled_attention.key_exchange import gathered_keys
from hf_tiled_attention.shard_layout import SequenceLayout, position_work
from hf_tiled_attention.sharded_attention import SequenceShards, attend_runs, sharded_attention


@dataclass(frozen=True)
class ShardCase:
    name: str
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 2
    seq: int = 48
    head_dim: int = 16
    causal: bool = True
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: bool = False
    documents: Optional[str] = None   # "spanning": documents across chunk edges; "gap": and a
    padding: bool = False             # tail in no document. padding: left/right-padded rows
    mods: bool = False                # a learnable bias table and a per-row prefix, captured
    layout: str = "head_tail"         # or "balanced" (3 chunks per rank), "contiguous"


SHARD_CASES = [
    ShardCase("causal"),
    ShardCase("window-within-chunk", window=5),
    ShardCase("window-across-chunks", window=20),
    ShardCase("bidirectional", causal=False),
    ShardCase("bidirectional-window", causal=False, window=7),
    ShardCase("documents", documents="spanning"),
    ShardCase("documents-balanced", documents="spanning", layout="balanced"),
    ShardCase("documents-window-padding", documents="gap", padding=True, window=9),
    ShardCase("padding-empty-rows", padding=True),
    ShardCase("bidirectional-documents", causal=False, documents="gap", batch=1),
    ShardCase("softcap-sinks", softcap=2.0, sinks=True),
    ShardCase("gqa-8-1", heads_q=8, heads_kv=1),
    ShardCase("captured-tensor-mods", causal=False, mods=True),
    ShardCase("contiguous", layout="contiguous", window=11),
]
CASES_BY_NAME = {case.name: case for case in SHARD_CASES}


@dataclass
class ShardInputs:
    """The whole sequence's inputs and what each rank needs besides them."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    d_out: torch.Tensor
    d_lse: torch.Tensor
    layout: SequenceLayout
    document_ids: Optional[torch.Tensor] = None
    key_padding: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None       # learnable (Hq, 2S - 1), read by score_mod
    options: dict = field(default_factory=dict)

    def learnable(self) -> dict:
        return {name: t for name, t in (("sinks", self.sinks), ("bias", self.bias))
                if t is not None}

    def shards(self, rank: int, group=None) -> SequenceShards:
        return SequenceShards(self.layout, rank, group, self.document_ids, self.key_padding)


def scaled(case: ShardCase, unit: int, head_dim: int) -> ShardCase:
    """The case at ``unit`` times its length (and window), with another head dim."""
    return replace(case, seq=case.seq * unit, head_dim=head_dim,
                   window=None if case.window is None else case.window * unit)


def make_inputs(case: ShardCase, world: int, device, dtype, seed: int = 0) -> ShardInputs:
    if case.seq % 48:
        raise ValueError(f"the cases' documents and padding are laid out on 48-position units, "
                         f"got seq={case.seq}")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    seq = case.seq
    q = rand(case.batch, case.heads_q, seq, case.head_dim)
    k = rand(case.batch, case.heads_kv, seq, case.head_dim)
    v = rand(case.batch, case.heads_kv, seq, case.head_dim)
    d_out = rand(case.batch, case.heads_q, seq, case.head_dim).float()
    d_lse = rand(case.batch, case.heads_q, seq).float() * 0.5
    unit = seq // 48               # the lengths below are for 48 positions, scaled
    docs = None
    if case.documents is not None:
        lengths = [7 * unit, 19 * unit, 13 * unit, 9 * unit]  # edges inside chunks
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
        if case.documents == "gap":
            ids[40 * unit:] = -1   # past the last document: sees nothing, seen by none
        docs = ids[None].to(device)
    padding = None
    if case.padding:
        padding = torch.ones(case.batch, seq, dtype=torch.bool)
        padding[0, :7 * unit] = False  # left padding: its rows see no key when causal
        padding[-1, seq - 10 * unit:] = False
        padding = padding.to(device)
    sinks = rand(case.heads_q).float() if case.sinks else None
    bias = None
    options = dict(is_causal=case.causal, window=case.window, softcap=case.softcap)
    if case.mods:
        bias = (rand(case.heads_q, 2 * seq - 1).float() * 0.3)
        prefix = torch.tensor([seq // 4, seq // 2][:case.batch], dtype=torch.int32, device=device)
        options.update(score_mod=_relative_bias(bias, seq), mask_mod=_prefix_lm(prefix))
    if case.layout == "balanced":
        layout = SequenceLayout.balanced(position_work(seq, None if docs is None else docs.cpu()),
                                         world, 3)
    elif case.layout == "contiguous":
        layout = SequenceLayout.contiguous(seq, world)
    else:
        layout = SequenceLayout.head_tail(seq, world)
    return ShardInputs(q, k, v, d_out, d_lse, layout, docs, padding, sinks, bias, options)


def _relative_bias(bias: torch.Tensor, seq: int):
    offset = seq - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx - q_idx + offset]
    return score_mod


def _prefix_lm(prefix: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)
    return mask_mod


def whole_sequence_mask(inputs: ShardInputs) -> Optional[torch.Tensor]:
    """Documents, padding and the mask_mod of the whole sequence as one dense bool mask
    ``(B, Hq or 1, S, S)``, written out from their definitions."""
    q = inputs.q
    batch, heads, seq = q.shape[0], q.shape[1], q.shape[2]
    visible = torch.ones(batch, 1, seq, seq, dtype=torch.bool, device=q.device)
    if inputs.document_ids is not None:
        ids = inputs.document_ids.expand(batch, -1)
        visible = visible & ((ids[:, None, :, None] == ids[:, None, None, :])
                             & (ids[:, None, :, None] >= 0))
    if inputs.key_padding is not None:
        visible = visible & inputs.key_padding[:, None, None, :]
    mask_mod = inputs.options.get("mask_mod")
    if mask_mod is not None:
        pos = torch.arange(seq, device=q.device)
        visible = visible & mask_mod(torch.arange(batch, device=q.device)[:, None, None, None],
                                     torch.arange(heads, device=q.device)[None, :, None, None],
                                     pos[:, None], pos[None, :])
    unmasked = (inputs.document_ids is None and inputs.key_padding is None and mask_mod is None)
    return None if unmasked else visible


def loss(out, lse, d_out, d_lse) -> torch.Tensor:
    """What the gradients are taken of; a row with no visible key counts its LSE as 0."""
    lse = torch.where(lse.isinf(), 0.0, lse)
    return (out.float() * d_out).sum() + (lse * d_lse).sum()


def whole_sequence_grads(inputs: ShardInputs) -> tuple:
    """``(out, lse, grads)`` of the unsharded op call (grads: q, k, v and the learnables)."""
    tensors = {name: t.detach().clone().requires_grad_()
               for name, t in (("q", inputs.q), ("k", inputs.k), ("v", inputs.v),
                               *inputs.learnable().items())}
    options = dict(inputs.options)
    options.pop("mask_mod", None)
    if inputs.bias is not None:
        options["score_mod"] = _relative_bias(tensors["bias"], inputs.q.shape[2])
    out, lse = hta.tiled_attention(tensors["q"], tensors["k"], tensors["v"],
                                   whole_sequence_mask(inputs), return_lse=True,
                                   sinks=tensors.get("sinks"), **options)
    values = torch.autograd.grad(loss(out, lse, inputs.d_out, inputs.d_lse),
                                 list(tensors.values()))
    return out.detach(), lse.detach(), dict(zip(tensors, values))


def rank_grads(inputs: ShardInputs, rank: int, group=None) -> tuple:
    """``(out, lse, grads)`` of one rank's shard: with a ``group``, through
    :func:`sharded_attention` (keys exchanged for real; ``grads`` this rank's rows of dq, dk,
    dv and its share of the learnables'); without, one process playing the rank (the key
    buffer taken from the whole sequence, ``grads`` the shard's contributions to the whole
    sequence's dq, dk, dv)."""
    shards = inputs.shards(rank, group)
    learnable = {name: t.detach().clone().requires_grad_()
                 for name, t in inputs.learnable().items()}
    options = dict(inputs.options)
    if inputs.bias is not None:
        options["score_mod"] = _relative_bias(learnable["bias"], inputs.q.shape[2])
    if group is not None:
        local = {name: shards.shard(t, 2).detach().clone().requires_grad_()
                 for name, t in (("q", inputs.q), ("k", inputs.k), ("v", inputs.v))}
        out, lse = sharded_attention(local["q"], local["k"], local["v"], shards, return_lse=True,
                                     sinks=learnable.get("sinks"), **options)
    else:
        local = {name: t.detach().clone().requires_grad_()
                 for name, t in (("q", inputs.q), ("k", inputs.k), ("v", inputs.v))}
        plan = shards.plan(inputs.options["is_causal"], inputs.options["window"],
                           inputs.q.device)
        keys, values = gathered_keys(local["k"], local["v"], plan)
        out, lse = attend_runs(shards.shard(local["q"], 2), keys, values, shards, plan,
                               scale=None, sinks=learnable.get("sinks"), return_lse=True,
                               **{"mask_mod": None, "score_mod": None, **options})
    tensors = {**local, **learnable}
    values = torch.autograd.grad(loss(out, lse, shards.shard(inputs.d_out, 2),
                                      shards.shard(inputs.d_lse, 2)), list(tensors.values()))
    return out.detach(), lse.detach(), dict(zip(tensors, values))


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tolerance: float) -> None:
    """Within ``tolerance`` of the largest magnitude of ``want``; -inf exactly where it is."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got.isinf(), want.isinf()), f"{what}: -inf rows differ"
    got, want = (torch.where(t.isinf(), 0.0, t.double()) for t in (got, want))
    scale = max(want.abs().max().item(), 1.0)
    err = (got - want).abs().max().item()
    assert err <= tolerance * scale, f"{what}: max abs error {err:.3g} > {tolerance * scale:.3g}"


def check_simulated_ranks(case: ShardCase, world: int, device, dtype, tolerance: float) -> int:
    """Every rank played in one process: its rows of the output and LSE equal the whole
    sequence's, and the ranks' gradients sum to the whole sequence's. Returns how many query
    rows (over all ranks, batch rows and heads) saw no key."""
    inputs = make_inputs(case, world, device, dtype)
    out, lse, want = whole_sequence_grads(inputs)
    total = {name: torch.zeros_like(grad, dtype=torch.float64) for name, grad in want.items()}
    empty = 0
    for rank in range(world):
        got_out, got_lse, grads = rank_grads(inputs, rank)
        shards = inputs.shards(rank)
        assert_close(got_out, shards.shard(out, 2), f"rank {rank} out", tolerance)
        assert_close(got_lse, shards.shard(lse, 2), f"rank {rank} lse", tolerance)
        empty += int(got_lse.isinf().sum())
        for name, grad in grads.items():
            total[name] += grad.double()
    for name, grad in want.items():
        assert_close(total[name], grad, f"d{name}", tolerance)
    return empty


# fp32 rounding: the sharded calls sum their keys in other orders than the whole-sequence call.
CPU_TOLERANCE = 1e-5


def spawned_rank_results(rank: int, world: int) -> dict:
    """Every case on this spawned rank with the keys exchanged over the world group:
    ``{case: (error message or None, rows of this rank that saw no key)}``. The collectives
    all run before any comparison, so one rank's failure cannot leave the others waiting."""
    import torch.distributed as dist
    results = {}
    for case in SHARD_CASES:
        inputs = make_inputs(case, world, "cpu", torch.float32)
        out, lse, want = whole_sequence_grads(inputs)
        got_out, got_lse, grads = rank_grads(inputs, rank, dist.group.WORLD)
        for name in inputs.learnable():  # each rank holds its share of their gradients
            dist.all_reduce(grads[name])
        shards = inputs.shards(rank)
        try:
            assert_close(got_out, shards.shard(out, 2), "out", CPU_TOLERANCE)
            assert_close(got_lse, shards.shard(lse, 2), "lse", CPU_TOLERANCE)
            for name, grad in want.items():
                expected = shards.shard(grad, 2) if name in ("q", "k", "v") else grad
                assert_close(grads[name], expected, f"d{name}", CPU_TOLERANCE)
            results[case.name] = (None, int(got_lse.isinf().sum()))
        except AssertionError as exc:
            results[case.name] = (f"rank {rank}: {exc}", 0)
    results["compiled"] = (_compiled_matches_eager(rank, world), 0)
    return results


def _compiled_matches_eager(rank: int, world: int) -> Optional[str]:
    """sharded_attention under torch.compile (aot_eager: dynamo and AOT autograd trace the
    exchange and the op calls; planning runs eagerly) gives the eager output and gradients."""
    import torch.distributed as dist
    case = CASES_BY_NAME["documents-window-padding"]
    inputs = make_inputs(case, world, "cpu", torch.float32)
    compiled = torch.compile(sharded_attention, backend="aot_eager")
    results = []
    for attention in (sharded_attention, compiled):
        shards = inputs.shards(rank, dist.group.WORLD)
        local = [shards.shard(t, 2).detach().requires_grad_() for t in (inputs.q, inputs.k,
                                                                          inputs.v)]
        out = attention(*local, shards, **inputs.options)
        out.backward(shards.shard(inputs.d_out, 2))
        results.append([out.detach()] + [t.grad for t in local])
    try:
        for name, got, want in zip(("out", "dq", "dk", "dv"), results[1], results[0]):
            assert_close(got, want, f"compiled {name}", CPU_TOLERANCE)
    except AssertionError as exc:
        return f"rank {rank}: {exc}"
    return None
