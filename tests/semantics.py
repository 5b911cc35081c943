"""The op's definition in fp64, written as plainly as possible, plus the shared case matrix.

Both the CPU tests (reference path) and the GPU tests (cuTile kernel) compare against
``definition`` on random data built by ``make_inputs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch


def definition(query, key, value, attn_mask=None, *, is_causal=False, scale=None, window=None,
               softcap=None, score_mod=None, mask_mod=None, sinks=None):
    """fp64 SDPA with the op's semantics; returns (out, lse). Mods are applied to the whole
    (B, Hq, Sq, Skv) score matrix at once, on broadcasting index tensors. ``sinks`` (Hq,): one
    more key per head, always visible, with that logit and a zero value."""
    q, k, v = (t.double() for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    seq_q, seq_kv = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    b_idx = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
    h_idx = torch.arange(q.shape[1], device=q.device)[None, :, None, None]
    q_idx = torch.arange(seq_q, device=q.device)[:, None]
    kv_idx = torch.arange(seq_kv, device=q.device)[None, :]
    if score_mod is not None:
        s = torch.broadcast_to(score_mod(s, b_idx, h_idx, q_idx, kv_idx), s.shape)
    i = torch.arange(seq_q, device=q.device)[:, None] + (seq_kv - seq_q)
    j = torch.arange(seq_kv, device=q.device)[None, :]
    visible = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=q.device)
    if is_causal:
        visible &= j <= i
    if window is not None:
        visible &= j > i - window
        if not is_causal:
            visible &= j < i + window
    if mask_mod is not None:
        visible = visible & mask_mod(b_idx, h_idx, q_idx, kv_idx)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            s = s + attn_mask.double()
            visible = visible & (attn_mask != -math.inf)
    # Hidden keys get -inf whatever their score (a NaN there does not leak, as in eager attention
    # with a boolean mask); a visible NaN score or value makes the row NaN.
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink_logits = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, sink_logits], dim=-1)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])], dim=2)
    # A row with no visible key: weights 0 and LSE -inf (written so that its gradients are 0,
    # not NaN: the backward tests differentiate this definition).
    empty = (s == -math.inf).all(dim=-1, keepdim=True)
    safe = s.masked_fill(empty, 0.0)
    lse = torch.logsumexp(safe, dim=-1, keepdim=True)
    p = torch.exp(safe - lse).masked_fill(empty, 0.0)
    return p @ v, lse.masked_fill(empty, -math.inf).squeeze(-1)


@dataclass(frozen=True)
class Case:
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 2
    seq_q: int = 96
    seq_kv: int = 96
    head_dim: int = 64
    causal: bool = False
    window: Optional[int] = None
    softcap: Optional[float] = None
    scale: Optional[float] = None
    mask: Optional[str] = None      # see make_mask
    strided: bool = False           # q/k/v as (B, S, H, D) memory viewed as (B, H, S, D)
    sinks: bool = False             # attention-sink logits per query head (make_sinks)

    @property
    def name(self) -> str:
        parts = [f"b{self.batch}h{self.heads_q}-{self.heads_kv}q{self.seq_q}k{self.seq_kv}"
                 f"d{self.head_dim}"]
        for flag in ("causal", "strided", "sinks"):
            if getattr(self, flag):
                parts.append(flag)
        for field in ("window", "softcap", "scale", "mask"):
            if getattr(self, field) is not None:
                parts.append(f"{field}={getattr(self, field)}")
        return "-".join(parts)


def make_mask(kind: str, case: Case, device, dtype) -> torch.Tensor:
    b, h, sq, skv = case.batch, case.heads_q, case.seq_q, case.seq_kv
    g = torch.Generator(device="cpu").manual_seed(sum(map(ord, kind)))

    def rand_bool(*shape):
        return (torch.rand(*shape, generator=g) < 0.7).to(device)

    def rand_additive(*shape):
        bias = torch.randn(*shape, generator=g) * 2
        bias[torch.rand(*shape, generator=g) < 0.2] = -math.inf
        return bias.to(device=device, dtype=dtype)

    if kind == "bool":                 # full (B, Hq, Sq, Skv)
        return rand_bool(b, h, sq, skv)
    if kind == "bool_keypad":          # key padding (B, 1, 1, Skv), left padded
        pad = torch.arange(skv)[None, :] >= torch.tensor([0, skv // 3] * b)[:b, None]
        return pad.view(b, 1, 1, skv).to(device)
    if kind == "bool_expanded":        # (Sq, Skv) expanded to (B, Hq, Sq, Skv) with stride 0
        return rand_bool(sq, skv).expand(b, h, sq, skv)
    if kind == "bool_2d":              # (Sq, Skv), broadcast by rank
        return rand_bool(sq, skv)
    if kind == "bool_empty_rows":      # some query rows see nothing at all
        mask = rand_bool(b, 1, sq, skv)
        mask[:, :, ::7] = False
        return mask
    if kind == "additive":             # full, with -inf entries
        return rand_additive(b, h, sq, skv)
    if kind == "additive_heads":       # (1, Hq, Sq, Skv)
        return rand_additive(1, h, sq, skv)
    if kind == "additive_2d":          # (Sq, Skv), broadcast by rank
        return rand_additive(sq, skv)
    if kind == "additive_expanded":    # (1, 1, Sq, Skv) expanded to (B, Hq, Sq, Skv), stride 0
        return rand_additive(1, 1, sq, skv).expand(b, h, sq, skv)
    if kind == "additive_keypad":      # (B, 1, 1, Skv): a bias per key, -inf on some
        return rand_additive(b, 1, 1, skv)
    if kind == "additive_finfo_min":   # transformers' style: finfo.min for hidden keys
        mask = torch.zeros(b, 1, sq, skv, dtype=dtype)
        mask[:, :, :, : skv // 4] = torch.finfo(dtype).min
        return mask.to(device)
    raise ValueError(kind)


def make_inputs(case: Case, device, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(heads, seq):
        if case.strided:
            t = torch.randn(case.batch, seq, heads, case.head_dim, generator=g)
            return t.to(device=device, dtype=dtype).transpose(1, 2)
        t = torch.randn(case.batch, heads, seq, case.head_dim, generator=g)
        return t.to(device=device, dtype=dtype)

    q = rand(case.heads_q, case.seq_q)
    k = rand(case.heads_kv, case.seq_kv)
    v = rand(case.heads_kv, case.seq_kv)
    mask = None if case.mask is None else make_mask(case.mask, case, device, dtype)
    return q, k, v, mask


def make_sinks(case: Case, device) -> torch.Tensor:
    """Sink logits of both signs, some larger than a row's typical scores."""
    g = torch.Generator(device="cpu").manual_seed(5)
    return (torch.randn(case.heads_q, generator=g) * 2 + 1).to(device)


def op_kwargs(case: Case, device="cpu") -> dict:
    return dict(is_causal=case.causal, window=case.window, softcap=case.softcap, scale=case.scale,
                sinks=make_sinks(case, device) if case.sinks else None)


_BASE = Case()
SEMANTIC_CASES = [
    _BASE,
    replace(_BASE, causal=True),
    replace(_BASE, heads_q=8, heads_kv=1, causal=True),                  # MQA
    replace(_BASE, heads_kv=4),                                          # MHA
    replace(_BASE, seq_q=40, seq_kv=200, causal=True),                   # Sq < Skv, bottom-right
    replace(_BASE, seq_q=150, seq_kv=70, causal=True),                   # Sq > Skv: empty rows
    replace(_BASE, seq_q=1, seq_kv=333, causal=True),                    # decode
    replace(_BASE, seq_q=1, seq_kv=333, window=64, causal=True),         # decode, windowed
    replace(_BASE, causal=True, window=17),
    replace(_BASE, window=9),                                            # symmetric window
    replace(_BASE, seq_q=50, seq_kv=180, causal=True, window=33),
    replace(_BASE, softcap=5.0, causal=True),
    replace(_BASE, softcap=2.0, scale=0.3),
    replace(_BASE, scale=-0.2, causal=True),                            # scale < 0: no folding
    replace(_BASE, scale=0.0),                                           # uniform weights
    replace(_BASE, strided=True, causal=True),
    replace(_BASE, seq_q=77, seq_kv=131, mask="bool"),
    replace(_BASE, mask="bool_keypad", causal=True),
    replace(_BASE, mask="bool_expanded"),
    replace(_BASE, mask="bool_2d", softcap=3.0),
    replace(_BASE, mask="bool_empty_rows", causal=True),
    replace(_BASE, seq_q=64, seq_kv=100, mask="additive"),
    replace(_BASE, mask="additive_heads", causal=True, window=40),
    replace(_BASE, mask="additive_finfo_min"),
    replace(_BASE, mask="bool_keypad", strided=True, window=20, causal=True, softcap=4.0),
    replace(_BASE, causal=True, sinks=True),                             # gpt-oss's sinks
    replace(_BASE, seq_q=1, seq_kv=333, causal=True, window=64, sinks=True),  # decode
    replace(_BASE, seq_q=150, seq_kv=70, causal=True, sinks=True),       # empty rows stay 0
    replace(_BASE, mask="bool_empty_rows", softcap=3.0, sinks=True),
] + [replace(_BASE, head_dim=d, causal=True) for d in (16, 80, 96, 112, 128, 256)]


@dataclass(frozen=True)
class NanCase:
    """A case with one NaN element in ``tensor`` ("query", "key" or "value") at ``index``
    ``(b, h, s, d)``; ``spreads``: whether some output row must come out NaN."""
    case: Case
    tensor: str
    index: tuple
    spreads: bool = True

    @property
    def name(self) -> str:
        return f"nan-{self.tensor}{list(self.index)}-{self.case.name}"


def make_nan_inputs(nan_case: NanCase, device, dtype, seed: int = 0):
    q, k, v, mask = make_inputs(nan_case.case, device, dtype, seed=seed)
    {"query": q, "key": k, "value": v}[nan_case.tensor][nan_case.index] = math.nan
    return q, k, v, mask


NAN_CASES = [
    # rows from 70 on see the key: they are NaN, rows before it are not
    NanCase(Case(causal=True, seq_q=200, seq_kv=200), "key", (0, 1, 70, 3)),
    # a window of 32: only rows 100..131 see key 100
    NanCase(Case(causal=True, window=32, seq_q=200, seq_kv=200), "key", (1, 0, 100, 0)),
    # key 10 of batch row 1 is padding: nothing sees it
    NanCase(Case(mask="bool_keypad", seq_q=100, seq_kv=100), "key", (1, 1, 10, 5), spreads=False),
    # an additive mask's -inf hides the key from some rows; the others see it
    NanCase(Case(mask="additive", seq_q=64, seq_kv=100), "key", (0, 1, 37, 2)),
    NanCase(Case(causal=True), "query", (0, 2, 50, 1)),
    NanCase(Case(causal=True), "value", (0, 0, 30, 7)),
    # query row 10 sees no key (Sq > Skv): it stays exactly 0
    NanCase(Case(causal=True, seq_q=150, seq_kv=70), "query", (0, 0, 10, 0), spreads=False),
    # decode against a long cache (on the GPU its keys are split over blocks)
    NanCase(Case(batch=1, heads_q=8, heads_kv=2, seq_q=1, seq_kv=4000, causal=True), "key",
            (0, 1, 2500, 9)),
]


def check_nan_pattern(out, lse, want_out, want_lse, tolerance: float,
                      spreads: bool) -> None:
    """NaN exactly where the definition has NaN (rows that see a NaN score or value), the rest
    as close as ``tolerance``, fully masked rows exactly 0 with LSE -inf."""
    nan_rows = want_out.isnan().any(-1)
    assert bool(nan_rows.any()) == spreads, "the case must (or must not) make some row NaN"
    assert not bool(nan_rows.all()), "some rows must not see the NaN"
    assert torch.equal(out.isnan().any(-1), nan_rows), "NaN rows differ from the definition"
    assert torch.equal(lse.isnan(), want_lse.isnan())
    assert torch.equal(out.isnan(), want_out.isnan())
    fine = ~nan_rows
    err = (out.double()[fine] - want_out[fine]).abs().max().item()
    assert err <= tolerance, f"max abs err {err:.3g} > {tolerance} on the rows without NaN"
    empty = want_lse.isinf() & fine
    assert torch.equal(lse.isinf() & fine, empty)
    assert (out.double()[empty] == 0).all(), "rows with no visible key must be exactly 0"


def assert_matches_definition(out, lse, want_out, want_lse, *, atol: float, lse_atol: float):
    """out / lse of the op against the fp64 definition's: finite, within ``atol`` (max abs),
    rows with no visible key exactly 0 with LSE -inf, the other LSEs within ``lse_atol``."""
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN/inf in the output: unwritten or broken rows"
    err = (out.double() - want_out).abs().max().item()
    assert err <= atol, f"max abs err {err:.3g} > {atol}"
    empty = want_lse.isinf()
    assert torch.equal(lse.isinf(), empty)
    assert (out[empty] == 0).all(), "rows with no visible key must be exactly 0"
    if (~empty).any():
        lse_err = (lse[~empty].double() - want_lse[~empty]).abs().max().item()
        assert lse_err <= lse_atol, f"lse err {lse_err:.3g} > {lse_atol}"
