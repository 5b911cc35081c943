"""CPU: the packed-requests op (varlen.py) against a dense definition, its paged reads, its
argument checks, and its kernel compiling to cubin for sm_80/90/100/120.

The definition: one dense mask over the whole packed row (request ids and end-aligned
positions) and one softmax, in fp64, written apart from the op's reference (which works
request by request)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_tiled_attention as hta
from hf_tiled_attention import varlen, varlen_attention


def packed_case(q_lens, k_lens, heads_q=4, heads_kv=2, head_dim=16, dtype=torch.float32,
                seed=0):
    generator = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(q_lens), sum(k_lens)
    q = torch.randn(total_q, heads_q, head_dim, generator=generator).to(dtype)
    k = torch.randn(total_k, heads_kv, head_dim, generator=generator).to(dtype)
    v = torch.randn(total_k, heads_kv, head_dim, generator=generator).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def definition(q, k, v, cu_q, cu_k, scale, window=None, softcap=None, sinks=None):
    """fp64 attention over the packed row with one dense (Tq, Tk) mask."""
    request_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), (cu_q[1:] - cu_q[:-1]).long())
    request_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), (cu_k[1:] - cu_k[:-1]).long())
    # A query's position counted from its request's last key; a key's likewise.
    from_end_q = cu_q[1:].long()[request_q] - 1 - torch.arange(len(request_q))
    from_end_k = cu_k[1:].long()[request_k] - 1 - torch.arange(len(request_k))
    allowed = (request_q[:, None] == request_k[None, :]) & \
        (from_end_k[None, :] >= from_end_q[:, None])
    if window is not None:
        allowed &= from_end_k[None, :] - from_end_q[:, None] < window
    group = q.shape[1] // k.shape[1]
    qd = q.double().transpose(0, 1)
    kd = k.double().transpose(0, 1).repeat_interleave(group, 0)
    vd = v.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, len(request_q), 1)],
                           -1)
    weights = torch.nan_to_num(torch.softmax(scores, -1))
    if sinks is not None:
        weights = weights[..., :-1]
    return (weights @ vd).transpose(0, 1)


# Decode steps (1 query), a chunk after a cached part (3 of 9), a whole prefill (7 of 7), an
# empty request, and one whose keys all fall outside a small window.
Q_LENS = (1, 3, 7, 0, 1, 5)
K_LENS = (12, 9, 7, 4, 20, 40)


@pytest.mark.parametrize("features", [
    {}, {"window": 4}, {"softcap": 2.0}, {"sinks": True}, {"window": 3, "softcap": 5.0, "sinks": True},
], ids=lambda f: "+".join(f) or "plain")
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 2), (3, 1)], ids=str)
def test_matches_definition(features, heads):
    q, k, v, cu_q, cu_k = packed_case(Q_LENS, K_LENS, *heads)
    sinks = torch.randn(heads[0]) if features.get("sinks") else None
    kwargs = dict(window=features.get("window"), softcap=features.get("softcap"), sinks=sinks)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(Q_LENS), scale=0.3, **kwargs)
    expected = definition(q, k, v, cu_q, cu_k, 0.3, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_reads_equal_gathered():
    """Keys scattered over a cache's slots, read through ``key_slots``, give the packed keys'
    result; slots past a request's keys and the rest of the cache are never read."""
    q, k, v, cu_q, cu_k = packed_case(Q_LENS, K_LENS, 4, 2)
    slots = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:k.shape[0]]
    cache_k = torch.full((300, 2, 16), float("nan"))
    cache_v = torch.full((300, 2, 16), float("nan"))
    cache_k[slots], cache_v[slots] = k, v
    for key_slots in (slots.to(torch.int32), slots):
        paged = varlen_attention(q, cache_k, cache_v, cu_q, cu_k, 7, window=5, key_slots=key_slots)
        torch.testing.assert_close(paged, varlen_attention(q, k, v, cu_q, cu_k, 7, window=5))


def test_key_pages_is_a_word_the_reference_path_holds_the_caller_to():
    """``key_pages``: each request's keys (one with queries), from its first, fill whole pages
    in order, wherever the request starts in ``key_slots`` (transformers' read indices pack the
    requests back to back); the reference path refuses slots that do not, and gives the plain
    paged result on slots that do."""
    q, k, v, cu_q, cu_k = packed_case((1, 2), (6, 5), 4, 2)
    assert cu_k.tolist() == [0, 6, 11]                     # the second request starts at 6
    page = lambda p, n: p * 4 + torch.arange(n)            # noqa: E731 (the first n of page p)
    slots = torch.cat([page(5, 4), page(2, 2), page(8, 4), page(10, 1)])
    cache_k, cache_v = torch.zeros(48, 2, 16), torch.zeros(48, 2, 16)
    cache_k[slots], cache_v[slots] = k, v
    out = varlen.varlen_attention_on_pages(q, cache_k, cache_v, cu_q, cu_k, 2, key_slots=slots,
                                           key_pages=4)
    torch.testing.assert_close(out, varlen_attention(q, k, v, cu_q, cu_k, 2))
    shifted = torch.cat([slots[:6], slots[6:] + 1])         # request 1 one slot into its pages
    for broken, request in ((slots.flip(0), 0), (shifted, 1)):
        with pytest.raises(ValueError, match=f"request {request}'s key_slots are not whole pag"):
            varlen.varlen_attention_on_pages(q, cache_k, cache_v, cu_q, cu_k, 2,
                                             key_slots=broken, key_pages=4)
    # a request with no queries reads nothing: its slots may lie anywhere
    none = torch.tensor([0, 1, 1, 3], dtype=torch.int32)
    varlen.varlen_attention_on_pages(
        q, cache_k, cache_v, none, torch.tensor([0, 4, 7, 11], dtype=torch.int32), 2,
        key_slots=torch.cat([page(5, 4), page(2, 3).flip(0), page(8, 4)]), key_pages=4)


def test_every_row_is_a_word_the_reference_path_holds_the_caller_to():
    """``every_row`` (the output allocated without a zero fill): the requests' queries must be
    all of query's rows and ``max_seqlen_q`` at least the longest; the reference path refuses a
    call that breaks it and gives the plain result on one that keeps it."""
    q, k, v, cu_q, cu_k = packed_case((2, 3), (4, 3))
    out = varlen.varlen_attention_on_pages(q, k, v, cu_q, cu_k, 3, key_pages=None,
                                           every_row=True)
    torch.testing.assert_close(out, varlen_attention(q, k, v, cu_q, cu_k, 3))
    padded = torch.cat([q, torch.randn(4, 4, 16)])      # 4 rows past the requests
    for query, longest in ((padded, 3), (q, 2)):
        with pytest.raises(ValueError, match="every_row: the requests' queries"):
            varlen.varlen_attention_on_pages(query, k, v, cu_q, cu_k, longest, key_pages=None,
                                             every_row=True)


def test_rows_past_the_requests_are_left_alone():
    q, k, v, cu_q, cu_k = packed_case((2, 3), (4, 3))
    q = torch.cat([q, torch.randn(4, 4, 16)])          # 4 padding rows after the requests
    out = torch.full_like(q, 7.0)
    varlen_attention(q, k, v, cu_q, cu_k, 3, out=out)
    assert (out[5:] == 7.0).all()
    assert (varlen_attention(q, k, v, cu_q, cu_k, 3)[5:] == 0).all()


def test_half_precision_inputs():
    q, k, v, cu_q, cu_k = packed_case(Q_LENS, K_LENS, 4, 2, dtype=torch.bfloat16)
    out = varlen_attention(q, k, v, cu_q, cu_k, 7)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), definition(q, k, v, cu_q, cu_k, 0.25),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(query=a["query"][0]), r"query must be a 3-D tensor"),
    (lambda a: a.update(key=a["key"].half(), value=a["value"].half()), r"share one dtype"),
    (lambda a: a.update(key=a["key"][:, :1].expand(-1, 3, -1).contiguous(),
                        value=a["value"][:, :1].expand(-1, 3, -1).contiguous()),
     r"multiple of the key/value heads"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), r"cu_seqlens_q must be .*int32"),
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:-1]), r"one length \(R \+ 1\)"),
    (lambda a: a.update(max_seqlen_q=0), r"max_seqlen_q must be a positive int"),
    (lambda a: a.update(max_seqlen_q=2), r"max_seqlen_q=2 is below request 1's 3 queries"),
    (lambda a: a.update(window=0), r"window must be a positive int"),
    (lambda a: a.update(softcap=-1.0), r"softcap must be a positive number"),
    (lambda a: a.update(sinks=torch.zeros(3)), r"sinks must be .*\(Hq,\) = \(4,\)"),
    (lambda a: a.update(key_slots=torch.zeros(5, dtype=torch.int16)), r"key_slots must be"),
    (lambda a: a.update(out=torch.empty(3, 4, 16)), r"out must be a contiguous"),
    (lambda a: a.update(scale=0.0), r"scale must be a positive number"),
])
def test_bad_arguments_are_named(change, message):
    q, k, v, cu_q, cu_k = packed_case(Q_LENS, K_LENS, 4, 2)
    args = dict(query=q, key=k, value=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7)
    change(args)
    with pytest.raises((ValueError, TypeError), match=message):
        varlen_attention(**args)


@pytest.mark.parametrize("pages, slots, message", [
    (4, None, r"pass key_slots with it"), (0, torch.arange(17), r"key_pages must be a posit")])
def test_bad_key_pages_are_named(pages, slots, message):
    """The package's own entry with a page size (not exported: only its callers' layouts
    guarantee whole pages, which the GPU cannot check); varlen_attention takes no key_pages."""
    q, k, v, cu_q, cu_k = packed_case(Q_LENS, K_LENS, 4, 2)
    with pytest.raises(ValueError, match=message):
        varlen.varlen_attention_on_pages(q, k, v, cu_q, cu_k, 7, key_slots=slots,
                                         key_pages=pages)
    with pytest.raises(TypeError, match="key_pages"):
        varlen_attention(q, k, v, cu_q, cu_k, 7, key_slots=slots, key_pages=pages)
    assert "varlen_attention_on_pages" not in hta.__all__


# ---------------------------------------------------------------------------------------------
# The kernel compiles (no GPU: cuTile's exporter)
# ---------------------------------------------------------------------------------------------

def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _launch_args(dtype=torch.bfloat16, heads=(32, 8), head_dim=128, max_q=1, paged=True,
                 window=None, softcap=None, sinks=False, cache_rows=4096):
    q = _meta(64, heads[0], head_dim, dtype=dtype)
    k = _meta(cache_rows, heads[1], head_dim, dtype=dtype)
    cu = _meta(9, dtype=torch.int32)
    return (q, k, k, cu, cu, max_q, 0.1, window, softcap,
            _meta(heads[0], dtype=torch.float32) if sinks else None,
            _meta(64, dtype=torch.int64) if paged else None, _meta(64, heads[0], head_dim,
                                                                   dtype=dtype))


VARIANTS = {  # decode from the cache; a prefill chunk (gathered keys) with every feature; GQA
    # groups that do not pack (7) and a head dim that pads (80); fp16 and fp32
    "decode-paged": {},
    "prefill-all-features": dict(max_q=300, paged=False, window=128, softcap=30.0, sinks=True),
    "group7-d80-paged-prefill": dict(heads=(28, 4), head_dim=80, max_q=64),
    "fp16-d64": dict(dtype=torch.float16, head_dim=64, heads=(16, 16)),
    "fp32-d256": dict(dtype=torch.float32, head_dim=256, max_q=40, paged=False),
    # 2**31 elements and more: the entry with 64-bit addresses, paged and packed
    "wide-paged": dict(cache_rows=2 ** 21 + 16, max_q=64),
    "wide-packed": dict(cache_rows=2 ** 21 + 16, paged=False),
}


# sm_90 (the H200) compiles every variant, the other archs the two main ones.
CASES = [(variant, "sm_90") for variant in VARIANTS] + [
    (variant, arch) for variant in ("decode-paged", "prefill-all-features")
    for arch in ("sm_80", "sm_100", "sm_120")]


def test_prefill_launches_take_the_schedule_latency_hints(monkeypatch):
    """schedule.VARLEN_PREFILL_LATENCY reaches the prefill-shaped launches' constants (None:
    0, the compiler's choice); decode-shaped launches keep the compiler's. With the default
    hints, the prefill launches compile (sm_90)."""
    from hf_tiled_attention import schedule, varlen_kernel as K

    def latencies():
        return [(args[-1][K.K_LATENCY], args[-1][K.V_LATENCY])
                for kernel, _, args in varlen.launches(*_launch_args(max_q=300))
                if kernel is not K.whole_tile_requests_kernel]
    assert schedule.VARLEN_PREFILL_LATENCY == (2, 4)  # perf-notes step 67
    assert latencies() == [(0, 0)] * 2 + [(2, 4)] * 2
    monkeypatch.setattr(varlen, "VARLEN_PREFILL_LATENCY", (None, None))
    assert latencies() == [(0, 0)] * 4
    monkeypatch.setattr(varlen, "VARLEN_PREFILL_LATENCY", (2, 4))
    pytest.importorskip("cuda.tile.compilation")
    cubins = varlen.export_cubins(*_launch_args(max_q=300), arch="sm_90", key_pages=256)
    assert len(cubins) == 2 and all(cubin[:4] == b"\x7fELF" for cubin in cubins)


def test_block_loads_take_the_schedule_slots_ahead(monkeypatch):
    """schedule.VARLEN_PREFETCH_TILES (decode tiles, prefill tiles) reaches the block-load
    launches' PREFETCH constant; row gathers take 0; a value other than 0, 1, 2 is named.
    Slots two tiles ahead and none compile (sm_90, both tile shapes, whole pages)."""
    from hf_tiled_attention import varlen_kernel as K

    def ahead(**options):
        return [(args[-1][K.BLOCKS], args[-1][K.PREFETCH])
                for kernel, _, args in varlen.launches(*_launch_args(max_q=300), **options)
                if kernel is not K.whole_tile_requests_kernel]
    assert ahead() == [(True, 1), (False, 0)] * 2
    monkeypatch.setattr(varlen, "VARLEN_PREFETCH_TILES", (0, 2))
    assert ahead() == [(True, 0), (False, 0), (True, 2), (False, 0)]
    assert ahead(key_pages=256) == [(K.EVERY_REQUEST, 0), (K.EVERY_REQUEST, 2)]
    monkeypatch.setattr(varlen, "VARLEN_PREFETCH_TILES", (1, 3))
    with pytest.raises(ValueError, match="VARLEN_PREFETCH_TILES.*0, 1 or 2.*3"):
        ahead()
    pytest.importorskip("cuda.tile.compilation")
    for tiles in ((2, 0), (0, 2)):
        monkeypatch.setattr(varlen, "VARLEN_PREFETCH_TILES", tiles)
        cubins = varlen.export_cubins(*_launch_args(max_q=300), arch="sm_90", key_pages=256)
        assert len(cubins) == 2 and all(cubin[:4] == b"\x7fELF" for cubin in cubins)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100", "sm_120"])
def test_kernel_compiles_for_pages_of_whole_tiles(arch):
    """flash_attn_with_kvcache's pages of whole key tiles: the block-load launches that read
    every request (decode and prefill tiles, one each) compile."""
    pytest.importorskip("cuda.tile.compilation")
    cubins = varlen.export_cubins(*_launch_args(max_q=300), arch=arch, key_pages=256)
    assert len(cubins) == 2 and all(cubin[:4] == b"\x7fELF" for cubin in cubins)


# flash_attn_with_kvcache's bookkeeping launch: (kv heads, head dim, cache_seqlens' dtype):
# Llama's 8 x 128, one head, tiles padded past 5 heads and D=96, D=256.
APPEND_CASES = [(8, 128, torch.int64), (1, 64, torch.int32), (5, 96, torch.int32),
                (4, 256, torch.int64)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100", "sm_120"])
@pytest.mark.parametrize("heads_kv, head_dim, lengths_dtype", APPEND_CASES)
def test_kvcache_append_kernel_compiles(arch, heads_kv, head_dim, lengths_dtype):
    """The one launch that writes flash_attn_with_kvcache's new tokens into the cache and makes
    the key offsets and the slot list (kvcache_kernel.py), with the arguments the call hands
    it."""
    pytest.importorskip("cuda.tile.compilation")
    from hf_tiled_attention.flash_interface import append_launch
    from hf_tiled_attention.fp8 import export_kernel_cubin

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")
    batch, new, page = 6, 2, 256
    grid, kernel, args = append_launch(
        meta(batch, 5, dtype=torch.int32), meta(batch, dtype=lengths_dtype),
        meta(batch, new, heads_kv, head_dim), meta(batch, new, heads_kv, head_dim),
        meta(40 * page, heads_kv, head_dim), meta(40 * page, heads_kv, head_dim),
        meta(16, dtype=torch.int32), meta(batch, 5 * page, dtype=torch.int64), page)
    assert grid == (batch, 1, 1)
    assert export_kernel_cubin(kernel, args, arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("variant, arch", CASES, ids=["-".join(c) for c in CASES])
def test_kernel_compiles(variant, arch):
    pytest.importorskip("cuda.tile.compilation")
    cubins = varlen.export_cubins(*_launch_args(**VARIANTS[variant]), arch=arch)
    # decode-shaped tiles, and prefill-shaped ones where max_seqlen_q allows longer requests;
    # from a paged cache each three: the marking of whole requests for its key tile (128 keys
    # decoding, 64 in prefill), block loads, gathers
    shapes = 1 if VARIANTS[variant].get("max_q", 1) == 1 else 2
    paged = VARIANTS[variant].get("paged", True)
    assert len(cubins) == (3 * shapes if paged else shapes)
    assert all(cubin[:4] == b"\x7fELF" for cubin in cubins)


def test_launch_arrays_view_storage_that_reaches_16_rows():
    """The launches pad each array to a multiple of 16 rows (never read): an input whose storage
    reaches that far (transformers' cu_seqlens, slices of a static buffer) is viewed in place,
    with no copy kernel; one at its storage's end is copied; ``out``, which the kernel writes,
    is always copied."""
    static = torch.arange(6 * 65, dtype=torch.int32).view(6, 65)
    cu_seqlens = static[2, :33]
    padded = varlen._rows_of_16(cu_seqlens)
    assert padded.shape == (48,) and padded.data_ptr() == cu_seqlens.data_ptr()
    assert torch.equal(padded[:33], cu_seqlens)
    at_the_end = static[5, 60:]
    padded = varlen._rows_of_16(at_the_end)
    assert padded.shape == (16,) and padded.data_ptr() != at_the_end.data_ptr()
    assert torch.equal(padded[:5], at_the_end)
    rows = torch.zeros(64, 2, 8)[:33]
    assert varlen._rows_of_16(rows).data_ptr() == rows.data_ptr()
    assert varlen._rows_of_16(rows, may_view=False).data_ptr() != rows.data_ptr()
    whole = static[0, :32]
    assert varlen._rows_of_16(whole) is whole


def test_each_launch_takes_its_entry():
    """64-bit addresses for the cache and for arrays of 2**31 elements; decode tiles that stream
    keys (packed, or the cache's whole blocks) with VARLEN_DECODE_OCCUPANCY blocks per SM up
    to VARLEN_DECODE_OCCUPANCY_MAX_D; prefill tiles with VARLEN_PREFILL_WORKER_WARPS; the
    decode row gathers and wider decode heads with the compiler's choice."""
    from hf_tiled_attention import varlen_kernel as K

    def kernels(key_pages=None, **kwargs):
        return [launch[0] for launch in varlen.launches(*_launch_args(**kwargs),
                                                        key_pages=key_pages)]

    assert kernels(cache_rows=2 ** 21 - 16, paged=False) == [K.varlen_decode_kernel]
    assert kernels(cache_rows=2 ** 21, paged=False) == [K.varlen_decode_paged_kernel]
    assert kernels(head_dim=256, paged=False) == [K.varlen_forward_kernel]
    # from the cache: marking whole-block requests, block loads, row gathers
    assert kernels() == [K.whole_tile_requests_kernel, K.varlen_decode_paged_kernel,
                         K.varlen_forward_paged_kernel]
    assert kernels(head_dim=256)[1:] == [K.varlen_forward_paged_kernel] * 2
    # a prefill chunk beside decode steps: decode tiles, then prefill tiles
    assert kernels(max_q=300, paged=False) == [K.varlen_decode_kernel, K.varlen_prefill_kernel]
    assert kernels(max_q=300, paged=False, head_dim=256)[1:] == [K.varlen_prefill_kernel]
    assert kernels(max_q=300)[3:] == [K.whole_tile_requests_kernel] + \
        [K.varlen_prefill_paged_kernel] * 2
    # pages of whole key tiles (flash_attn_with_kvcache's word): block loads alone, one launch
    # per tile shape; pages of 64 keys hold whole prefill tiles only (decode tiles take 128)
    assert kernels(key_pages=256) == [K.varlen_decode_paged_kernel]
    assert kernels(key_pages=256, max_q=300) == [K.varlen_decode_paged_kernel,
                                                 K.varlen_prefill_paged_kernel]
    assert kernels(key_pages=64, max_q=300) == [K.whole_tile_requests_kernel,
                                                K.varlen_decode_paged_kernel,
                                                K.varlen_forward_paged_kernel,
                                                K.varlen_prefill_paged_kernel]


# ---------------------------------------------------------------------------------------------
# FlashAttention's interface (flash_interface.py, the Hub-kernel route)
# ---------------------------------------------------------------------------------------------

def test_flash_varlen_interface_matches_the_definition():
    from hf_tiled_attention.flash_interface import flash_attn_varlen_func
    q, k, v, cu_q, cu_k = packed_case(Q_LENS, K_LENS, 4, 2)
    sinks = torch.randn(4)
    # transformers passes (window - 1, window - 1) for a window of `window` keys
    out = flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k.long(), torch.tensor(7), 40,
                                 softmax_scale=0.3, causal=True, window_size=(3, 3),
                                 softcap=5.0, s_aux=sinks)
    expected = definition(q, k, v, cu_q, cu_k, 0.3, window=4, softcap=5.0, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def block_table_slots(table: torch.Tensor, lengths: torch.Tensor, page: int) -> list:
    """Each request's cache slots in key order: its ``lengths[b]`` keys on the pages its block
    table row lists (the layout flash_attn_with_kvcache reads and writes)."""
    slots = []
    for row, n in zip(table.long(), lengths.tolist()):
        position = torch.arange(n, device=table.device)
        slots.append(row[position // page] * page + position % page)
    return slots


def test_flash_kvcache_interface_writes_the_new_keys_and_reads_the_block_table():
    """transformers' decode steps on its block table: the new keys and values land in the
    requests' pages at cache_seqlens, then each request's queries attend to its keys where
    they lie (pages shuffled; unused table entries -1, as transformers fills them)."""
    from hf_tiled_attention.flash_interface import flash_attn_with_kvcache
    g = torch.Generator().manual_seed(3)
    pages, page, heads_q, heads_kv, dim = 12, 8, 4, 2, 16
    cached = torch.tensor([5, 0, 19])                       # keys each request has so far
    new, queries = 2, 2
    k_cache = torch.randn(pages, page, heads_kv, dim, generator=g)
    v_cache = torch.randn(pages, page, heads_kv, dim, generator=g)
    table = torch.full((3, 4), -1, dtype=torch.int32)
    order = torch.randperm(pages, generator=g)
    table[0, :1], table[1, :1], table[2, :3] = order[:1], order[1:2], order[2:5]
    q = torch.randn(3, queries, heads_q, dim, generator=g)
    k_new, v_new = (torch.randn(3, new, heads_kv, dim, generator=g) for _ in range(2))
    sinks = torch.randn(heads_q, generator=g)
    before = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                  block_table=table, softmax_scale=0.3, causal=True,
                                  window_size=(5, 5), softcap=4.0, s_aux=sinks)
    keys, values, written = [], [], torch.zeros(pages * page, dtype=torch.bool)
    for b, (n, slot) in enumerate(zip(cached.tolist(),
                                      block_table_slots(table, cached + new, page))):
        written[slot[n:]] = True
        keys.append(k_cache.flatten(0, 1)[slot])
        values.append(v_cache.flatten(0, 1)[slot])
        torch.testing.assert_close(keys[-1][n:], k_new[b], rtol=0, atol=0)
        torch.testing.assert_close(values[-1][n:], v_new[b], rtol=0, atol=0)
    for cache, old in zip((k_cache, v_cache), before):   # nothing else in the cache moved
        assert torch.equal(cache.flatten(0, 1)[~written], old.flatten(0, 1)[~written])
    cu_q = torch.arange(4, dtype=torch.int32) * queries
    cu_k = torch.tensor([0, *(cached + new).cumsum(0).tolist()], dtype=torch.int32)
    expected = definition(q.flatten(0, 1), torch.cat(keys), torch.cat(values), cu_q, cu_k,
                          0.3, window=6, softcap=4.0, sinks=sinks)
    torch.testing.assert_close(out.flatten(0, 1).double(), expected, atol=1e-5, rtol=1e-5)


def test_flash_kvcache_interface_ignores_padding_rows():
    """Rows transformers adds to fill a captured graph's batch (cache_seqlens -1, block table
    row -1): nothing written for them, zeros out, the real rows as without them."""
    from hf_tiled_attention.flash_interface import flash_attn_with_kvcache
    g = torch.Generator().manual_seed(5)
    cache = [torch.randn(6, 8, 2, 16, generator=g) for _ in range(2)]
    table = torch.tensor([[3, 1, -1], [-1, -1, -1], [0, -1, -1], [-1, -1, -1]],
                         dtype=torch.int32)
    cached = torch.tensor([9, -1, 2, -1])
    q = torch.randn(4, 1, 4, 16, generator=g)
    k_new, v_new = (torch.randn(4, 1, 2, 16, generator=g) for _ in range(2))
    real = [0, 2]
    padded_cache = [c.clone() for c in cache]
    out = flash_attn_with_kvcache(q, *padded_cache, k_new, v_new, cache_seqlens=cached,
                                  block_table=table, causal=True)
    want = flash_attn_with_kvcache(q[real], *cache, k_new[real], v_new[real],
                                   cache_seqlens=cached[real], block_table=table[real],
                                   causal=True)
    torch.testing.assert_close(out[real], want, rtol=0, atol=0)
    assert (out[[1, 3]] == 0).all()
    for padded, alone in zip(padded_cache, cache):
        assert torch.equal(padded, alone)


class TorchSteps(TorchDispatchMode):
    """The names of the torch ops run inside it that launch work (views left out): each eager
    one is a GPU kernel of its own."""
    free = {"view", "unsqueeze", "slice", "select", "flatten", "_unsafe_view", "alias",
            "expand", "as_strided", "t", "transpose", "detach"}

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.free:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_flash_kvcache_interface_runs_few_torch_steps(monkeypatch):
    """Every eager torch step of a decode call is a GPU kernel of its own (about 3 us in a
    graph, beside a short step's 50-110 us attention): a decode call with new tokens runs at
    most 17 that launch work besides the attention (it ran 39), its shape-fixed tensors made
    once and kept, and the varlen call gets offsets whose storage reaches 16 rows (read in
    place, no copy)."""
    from hf_tiled_attention import flash_interface
    from hf_tiled_attention.memo import cache_sizes

    calls = []

    def attention(q, k, v, cu_q, cu_k, max_q, **options):
        calls.append((cu_q, cu_k))
        return q
    monkeypatch.setattr(varlen, "varlen_attention_on_pages", attention)
    g = torch.Generator().manual_seed(4)
    cache = [torch.randn(32, 16, 2, 8, generator=g) for _ in range(2)]
    table = torch.randperm(32, generator=g)[:24].view(6, 4).to(torch.int32)
    cached = torch.tensor([3, 17, 40, 0, 63, 5], dtype=torch.int32)
    q = torch.randn(6, 1, 4, 8, generator=g)
    new = [torch.randn(6, 1, 2, 8, generator=g) for _ in range(2)]
    flash_interface.flash_attn_with_kvcache(q, *cache, *new, cache_seqlens=cached,
                                            block_table=table, causal=True)
    kept = cache_sizes()["flash_interface.layouts"]
    with TorchSteps() as steps:
        flash_interface.flash_attn_with_kvcache(q, *cache, *new, cache_seqlens=cached,
                                                block_table=table, causal=True)
    assert len(steps.names) <= 17, steps.names
    assert "arange" not in steps.names and cache_sizes()["flash_interface.layouts"] == kept
    for offsets in calls[-1]:
        assert offsets.shape == (13,) and offsets.dtype == torch.int32
        assert offsets.untyped_storage().nbytes() >= 16 * 4
    assert calls[-1][1].tolist() == [0, 4, 64, 82, 128, 169, 192, 193, 256, 320, 320, 326, 384]


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_table=None), r"reads a paged cache: pass block_table"),
    (dict(causal=False), r"causal only \(causal=False with 2 queries"),
    (dict(k=torch.zeros(1, 1, 2, 16)), r"k and v together \(got k \(1, 1, 2, 16\), v None"),
    (dict(k=torch.zeros(1, 1, 2, 16), v=torch.zeros(1, 2, 2, 16)),
     r"k and v must be \(B, Sn, Hkv, D\) of one shape"),
    (dict(k=torch.zeros(1, 1, 4, 16), v=torch.zeros(1, 1, 4, 16)),
     r"the cache's \(Hkv, D\) = \(2, 16\), got \(1, 1, 4, 16\)"),
])
def test_flash_kvcache_interface_refuses_what_it_does_not_compute(kwargs, message):
    from hf_tiled_attention.flash_interface import flash_attn_with_kvcache
    cache = torch.zeros(4, 8, 2, 16)
    args = dict(cache_seqlens=torch.tensor([3]), block_table=torch.zeros(1, 2, dtype=torch.int32),
                causal=True)
    with pytest.raises(ValueError, match=message):
        flash_attn_with_kvcache(torch.zeros(1, 2, 4, 16), cache, cache.clone(),
                                **{**args, **kwargs})


def test_flash_batched_interface_matches_tiled_attention():
    from hf_tiled_attention.flash_interface import flash_attn_func
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 4, 16, generator=g)
    k, v = (torch.randn(2, 9, 2, 16, generator=g) for _ in range(2))
    out = flash_attn_func(q, k, v, softmax_scale=0.2, causal=True, window_size=(2, 0))
    want = hta.tiled_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               is_causal=True, scale=0.2, window=3).transpose(1, 2)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dropout_p=0.1), r"no attention dropout \(dropout_p=0.1\)"),
    (dict(causal=False), r"causal only"),
    (dict(causal=False, window_size=(3, 1)), r"causal only"),
])
def test_flash_interface_refuses_what_it_does_not_compute(kwargs, message):
    from hf_tiled_attention.flash_interface import flash_attn_varlen_func
    q, k, v, cu_q, cu_k = packed_case(Q_LENS, K_LENS, 4, 2)
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 40, **{"causal": True, **kwargs})


def test_flash_batched_window_must_be_one_width_without_causal():
    from hf_tiled_attention.flash_interface import flash_attn_func
    q = torch.randn(1, 3, 2, 16)
    with pytest.raises(ValueError, match=r"window_size=\(3, 1\)"):
        flash_attn_func(q, q, q, window_size=(3, 1))


def test_no_backward_is_an_error():
    q, k, v, cu_q, cu_k = packed_case(Q_LENS, K_LENS, 4, 2)
    with pytest.raises(ValueError, match="varlen_attention has no backward"):
        varlen_attention(q.requires_grad_(), k, v, cu_q, cu_k, 7)
    with torch.no_grad():
        varlen_attention(q, k, v, cu_q, cu_k, 7)
