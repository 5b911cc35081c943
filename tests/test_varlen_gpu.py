"""GPU: the packed-requests kernel (varlen_kernel.py) against the fp64 definition and the op's
reference, its paged reads against gathered keys, and its capture in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from hf_tiled_attention import varlen, varlen_attention
from test_kernel_gpu import TOLERANCE, _kernel_required, poison_allocator  # noqa: F401
from test_varlen import TorchSteps, block_table_slots, definition

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PAGE = 16  # slots per cache page in most of these tests: tiles read row by row (a cache of
# pages holding whole key tiles, as transformers' default of 256 slots, is read in blocks)


def serving_case(q_lens, k_lens, heads_q, heads_kv, head_dim, dtype, seed=0, page=PAGE,
                 shifted=()):
    """Packed requests and a paged cache holding their keys: each request's keys on its own
    pages, the pages shuffled over the cache, the cache's other slots NaN. Requests in
    ``shifted`` sit one slot past their pages' starts (their tiles straddle blocks)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads_q, head_dim, generator=g)
    k, v = (torch.randn(sum(k_lens), heads_kv, head_dim, generator=g) for _ in range(2))
    pages = sum(-(-(n + 1) // page) for n in k_lens) + 3
    order = torch.randperm(pages, generator=g)
    slots, used = [], 0
    for r, n in enumerate(k_lens):
        start = 1 if r in shifted else 0
        span = -(-(n + start) // page)
        within = torch.arange(start, start + n)
        slots += (order[used:used + span][within // page] * page + within % page).tolist()
        used += span
    slots = torch.tensor(slots, dtype=torch.int64)
    cache_k = torch.full((pages * page, heads_kv, head_dim), float("nan"))
    cache_v = cache_k.clone()
    cache_k[slots], cache_v[slots] = k, v
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
          for n in (q_lens, k_lens)]
    on_gpu = [t.cuda() for t in (q, k, v, cache_k, cache_v)]
    q, k, v, cache_k, cache_v = (t.to(dtype) for t in on_gpu)
    return q, k, v, cache_k, cache_v, slots.cuda(), cu[0].cuda(), cu[1].cuda()


# (query lengths, key lengths): decode steps only; decode and prefill chunks mixed; a long
# prefill; requests of zero queries; keys over many tiles.
BATCHES = {
    "decode": ((1,) * 12, (1, 7, 64, 65, 128, 300, 1000, 2049, 17, 33, 5000, 129)),
    "mixed": ((1, 37, 1, 200, 1, 64), (900, 37, 3, 1200, 4000, 64)),
    "prefill": ((700, 129), (700, 1500)),
    "empty-requests": ((0, 5, 0, 1), (10, 5, 0, 30)),
}
FEATURES = {
    "plain": {}, "window": {"window": 100}, "softcap": {"softcap": 20.0},
    "sinks": {"sinks": True}, "all": {"window": 33, "softcap": 30.0, "sinks": True},
}
HEADS = {"gqa4": (32, 8), "mha": (8, 8), "gqa7": (28, 4), "gqa16": (16, 1)}


def check(batch, heads, head_dim, dtype, features, paged, key_pages=None, **layout):
    q_lens, k_lens = BATCHES[batch]
    q, k, v, cache_k, cache_v, slots, cu_q, cu_k = serving_case(q_lens, k_lens, *HEADS[heads],
                                                                 head_dim, dtype, **layout)
    sinks = torch.randn(q.shape[1], device="cuda") if features.get("sinks") else None
    kwargs = dict(window=features.get("window"), softcap=features.get("softcap"), sinks=sinks,
                  scale=head_dim ** -0.5)
    poison_allocator(q.numel() * 8)
    if paged:
        out = varlen.varlen_attention_on_pages(q, cache_k, cache_v, cu_q, cu_k, max(q_lens),
                                               key_slots=slots, key_pages=key_pages, **kwargs)
    else:
        out = varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), **kwargs)
    torch.cuda.synchronize()
    want = definition(q.cpu().float(), k.cpu().float(), v.cpu().float(), cu_q.cpu(), cu_k.cpu(),
                      **{**kwargs, "sinks": None if sinks is None else sinks.cpu()})
    assert torch.isfinite(out).all()
    err = (out.double().cpu() - want).abs().max().item()
    assert err <= TOLERANCE[dtype], err


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "gathered"])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_kernel_matches_definition(batch, features, paged):
    check(batch, "gqa4", 128, torch.bfloat16, FEATURES[features], paged)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_heads_dims_dtypes(heads, head_dim, dtype):
    if dtype == torch.float32 and head_dim == 256:
        pytest.skip("fp32 at D=256 does not fit a tile's registers")
    check("mixed", heads, head_dim, dtype, FEATURES["all"] if heads == "gqa4" else {}, True)


@pytest.mark.parametrize("features", ["plain", "all"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("page", [128, 256])
def test_pages_of_whole_tiles_read_as_blocks(page, batch, features):
    """Pages holding whole key tiles (transformers' 256 slots): each tile one block load; the
    second request of each batch straddles blocks, so both reads meet in one launch."""
    check(batch, "gqa4", 128, torch.bfloat16, FEATURES[features], True, page=page,
          shifted=(1,))


@pytest.mark.parametrize("features", ["plain", "all"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("page", [128, 256])
def test_key_pages_reads_every_request_in_one_launch(page, batch, features):
    """The caller's word that every request's keys lie on whole pages from its first key
    (transformers 5.17's read indices: requests back to back in the slot list, each starting
    on a page, wherever that falls in the list): one launch of block loads for all of them."""
    check(batch, "gqa4", 128, torch.bfloat16, FEATURES[features], True, page=page,
          key_pages=page)


@pytest.mark.parametrize("page, shifted", [(256, ()), (128, (2, 4)), (16, ())],
                         ids=["whole-pages", "two-shifted", "small-pages"])
def test_whole_tile_requests_marks_what_blocks_can_read(page, shifted):
    """The paged call's first launch (varlen_kernel.whole_tile_requests) against its rule in
    Python: a request is read by block loads where each of its key tiles' slots run
    consecutively from a multiple of the tile (to the request's last key)."""
    import cuda.tile as ct
    from hf_tiled_attention.varlen_kernel import whole_tile_requests_kernel
    q_lens, k_lens = (1,) * 7, (1, 64, 65, 300, 1000, 2049, 0)
    q, _, _, cache_k, cache_v, slots, cu_q, cu_k = serving_case(
        q_lens, k_lens, 8, 2, 64, torch.bfloat16, page=page, shifted=shifted)
    first = varlen.launches(q, cache_k, cache_v, cu_q, cu_k, 1, 0.1, None, None, None, slots,
                            torch.empty_like(q))[0]
    kernel, grid, args = first
    assert kernel is whole_tile_requests_kernel
    args[2].fill_(-7)
    ct.launch(torch.cuda.current_stream().cuda_stream, grid, kernel, args)
    marked = args[2][:len(k_lens)].tolist()
    tile, cu, listed = args[3][0], cu_k.tolist(), slots.tolist()
    expected = []
    for r in range(len(k_lens)):
        keys = listed[cu[r]:cu[r + 1]]
        starts = range(0, len(keys), tile)
        expected.append(int(all(keys[s] % tile == 0 and keys[s:s + tile] == list(
            range(keys[s], keys[s] + len(keys[s:s + tile]))) for s in starts)))
    assert marked == expected
    if page >= tile and not shifted:
        assert all(expected)
    assert sum(expected) < len(expected) or not shifted


def test_arrays_past_2_31_elements():
    """A cache of more than 2**31 elements read past that point (one request on aligned
    blocks, two a slot off them), and the same rows as packed keys: the 64-bit entry."""
    rows, heads_kv, head_dim = 2 ** 21 + 8192, 8, 128
    q_lens, k_lens = (1, 1, 40), (3000, 1500, 700)
    starts = (2 ** 21 + 4096, 2 ** 21 + 1, 2 ** 21 + 1501)
    g = torch.Generator(device="cuda").manual_seed(0)
    cache_k, cache_v = (torch.randn(rows, heads_kv, head_dim, generator=g, device="cuda",
                                    dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(sum(q_lens), 32, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
    slots = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, k_lens)]).cuda()
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0)], dtype=torch.int32)
                  for n in (q_lens, k_lens))
    want = definition(q.cpu().float(), cache_k[slots].cpu().float(),
                      cache_v[slots].cpu().float(), cu_q, cu_k, scale=head_dim ** -0.5)
    paged = varlen_attention(q, cache_k, cache_v, cu_q.cuda(), cu_k.cuda(), 40, key_slots=slots)
    # Packed: the whole cache as keys, a first request of no queries owning the rows below.
    cu_q_packed = torch.tensor([0, 0, 1, 41], dtype=torch.int32, device="cuda")
    cu_k_packed = torch.tensor([0, starts[1], starts[2], starts[2] + k_lens[2]],
                               dtype=torch.int32, device="cuda")
    packed = varlen_attention(q[1:], cache_k, cache_v, cu_q_packed, cu_k_packed, 40)
    torch.cuda.synchronize()
    for out, expected in ((paged, want), (packed, want[1:])):
        assert torch.isfinite(out).all()
        err = (out.double().cpu() - expected).abs().max().item()
        assert err <= TOLERANCE[torch.bfloat16], err


def test_strided_query_and_preset_output():
    """The query as transformers hands it (a transposed view) and an output whose rows past
    the requests keep their values."""
    q, _, _, cache_k, cache_v, slots, cu_q, cu_k = serving_case(
        (1, 9, 1), (50, 9, 700), 32, 8, 128, torch.bfloat16)
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    out = torch.full((q.shape[0] + 5, 32, 128), 3.0, device="cuda", dtype=torch.bfloat16)
    q_padded = torch.cat([q_strided, torch.zeros(5, 32, 128, device="cuda",
                                                 dtype=torch.bfloat16)])
    varlen_attention(q_padded, cache_k, cache_v, cu_q, cu_k, 9, key_slots=slots, out=out)
    torch.testing.assert_close(out[:11], varlen_attention(q, cache_k, cache_v, cu_q, cu_k, 9,
                                                          key_slots=slots))
    assert (out[11:] == 3.0).all()


def test_captured_in_a_cuda_graph():
    """One capture, replayed on other requests of the same shapes: the launch reads no value
    on the host, so the replay computes the new requests."""
    q, _, _, cache_k, cache_v, slots, cu_q, cu_k = serving_case(
        (1, 1, 30, 1), (100, 2000, 30, 7), 32, 8, 128, torch.bfloat16)
    out = torch.zeros_like(q)
    varlen_attention(q, cache_k, cache_v, cu_q, cu_k, 30, key_slots=slots, out=out)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        varlen_attention(q, cache_k, cache_v, cu_q, cu_k, 30, key_slots=slots, out=out)
    # New lengths in the same tensors: fewer keys for request 1, a longer chunk for request 0.
    cu_q.copy_(torch.tensor([0, 25, 26, 32, 33], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, 100, 1500, 1536, 1543], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, varlen_attention(q, cache_k, cache_v, cu_q, cu_k, 30,
                                                     key_slots=slots))


def test_reference_and_kernel_agree_in_fp32():
    """The op's CPU reference (what the CPU tests check) and the kernel: one semantics."""
    q, _, _, cache_k, cache_v, slots, cu_q, cu_k = serving_case(
        (1, 40, 3), (300, 40, 90), 8, 2, 64, torch.float32)
    sinks = torch.randn(8, device="cuda")
    kwargs = dict(window=50, softcap=10.0, sinks=sinks, key_slots=slots)
    kernel = varlen_attention(q, cache_k, cache_v, cu_q, cu_k, 40, **kwargs)
    reference = varlen._reference(q, cache_k, cache_v, cu_q, cu_k, 40, 0.125, 50, 10.0, sinks,
                                  slots, torch.zeros_like(q))
    torch.testing.assert_close(kernel, reference, atol=2e-5, rtol=2e-5)


def _block_table_case(cached, pages_per_request=8, page=256, heads=(32, 8), head_dim=128,
                      all_pages=False, new=1):
    """A paged cache (pages of ``page`` slots, shuffled, bf16) with each request's pages in its
    block table row (the entries past them -1, as transformers fills them; ``all_pages``: every
    entry a page), ``new`` queries and new keys/values per request: transformers 5.19+'s decode
    step on its block table (1), or a prompt chunk."""
    g = torch.Generator(device="cuda").manual_seed(4)
    batch = len(cached)
    pages = batch * pages_per_request + 3
    k_cache, v_cache = (torch.randn(pages, page, heads[1], head_dim, generator=g, device="cuda",
                                    dtype=torch.bfloat16) for _ in range(2))
    table = torch.full((batch, pages_per_request), -1, dtype=torch.int32, device="cuda")
    order = torch.randperm(pages, generator=g, device="cuda").to(torch.int32)
    for b, n in enumerate(cached):
        used = pages_per_request if all_pages else (n + new - 1) // page + 1
        table[b, :used] = order[b * pages_per_request:b * pages_per_request + used]
    q = torch.randn(batch, new, heads[0], head_dim, generator=g, device="cuda",
                    dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, new, heads[1], head_dim, generator=g, device="cuda",
                                dtype=torch.bfloat16) for _ in range(2))
    return q, k_cache, v_cache, k_new, v_new, table, torch.tensor(cached, device="cuda")


def _block_table_definition(q, k_cache, v_cache, table, lengths):
    slots = block_table_slots(table, lengths, k_cache.shape[1])
    keys = [k_cache.flatten(0, 1)[slot].cpu().float() for slot in slots]
    values = [v_cache.flatten(0, 1)[slot].cpu().float() for slot in slots]
    cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32) * q.shape[1]
    cu_k = torch.tensor([0, *lengths.cpu().cumsum(0).tolist()], dtype=torch.int32)
    return definition(q.flatten(0, 1).cpu().float(), torch.cat(keys), torch.cat(values), cu_q,
                      cu_k, scale=q.shape[-1] ** -0.5)


@pytest.mark.parametrize("page, new", [(256, 1), (256, 96), (64, 1), (16, 1)],
                         ids=["whole-pages", "chunk-whole-pages", "pages-of-64", "small-pages"])
def test_flash_kvcache_interface_reads_the_block_table(page, new):
    """FlashAttention's decode on a block table (flash_interface.flash_attn_with_kvcache, the
    Hub-kernel route of transformers 5.19+): the new keys written into their pages, then every
    request's keys read where they lie, against the definition. Pages of whole key tiles are
    read by block loads alone (varlen_attention_on_pages' key_pages), in decode tiles and in a prompt
    chunk's; pages of 64 hold whole prefill tiles but not decode tiles (128 keys), and pages of
    16 neither: those take the marking launch and row gathers."""
    from hf_tiled_attention.flash_interface import flash_attn_with_kvcache
    q, k_cache, v_cache, k_new, v_new, table, cached = _block_table_case(
        [0, 255, 256, 1000, 2047, 17, 511, 1], pages_per_request=2048 // page + 2, page=page,
        new=new)
    poison_allocator(q.numel() * 64)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                  block_table=table, softmax_scale=128 ** -0.5, causal=True)
    torch.cuda.synchronize()
    want = _block_table_definition(q, k_cache, v_cache, table, cached + new)
    err = (out.flatten(0, 1).double().cpu() - want).abs().max().item()
    assert torch.isfinite(out).all() and err <= TOLERANCE[torch.bfloat16], err
    for b, slot in enumerate(block_table_slots(table, cached + new, page)):  # new keys last
        assert torch.equal(k_cache.flatten(0, 1)[slot[-new:]], k_new[b])


def test_flash_kvcache_interface_in_a_cuda_graph():
    """Captured once and replayed with other lengths in the same tensors (transformers replays
    its decode steps so, with padding rows: cache_seqlens -1, table row -1): nothing of the call
    is decided on the host."""
    from hf_tiled_attention.flash_interface import flash_attn_with_kvcache
    q, k_cache, v_cache, k_new, v_new, table, cached = _block_table_case([10, 700, 300, 1500],
                                                                         all_pages=True)

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                       block_table=table, causal=True)
    step()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    cached.copy_(torch.tensor([100, 900, -1, 1600]))  # the same pages hold these; row 2 pads
    table[2].fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    want = _block_table_definition(q, k_cache, v_cache, table, cached + 1)
    err = (out.flatten(0, 1).double().cpu() - want).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], err


def test_flash_kvcache_capture_finds_the_warm_up_layouts():
    """A server warms a call up on one stream and captures it on the graph's own (torch's
    capture stream; timing.graph_replay_ms does the same): the capture must find the layouts
    the warm-up kept, not make them again inside the graph (with one layout per stream it did:
    small kernels worth about 10 us a call, perf-notes step 72)."""
    from hf_tiled_attention.flash_interface import flash_attn_with_kvcache
    q, k_cache, v_cache, k_new, v_new, table, cached = _block_table_case([10, 700, 300, 1500],
                                                                         all_pages=True)

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                       block_table=table, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), TorchSteps() as steps:
        step()
    assert "arange" not in steps.names, steps.names


@pytest.mark.parametrize("heads_kv, head_dim, lengths_dtype, new",
                         [(8, 128, torch.int64, 1), (5, 96, torch.int32, 3),
                          (1, 256, torch.int32, 1)], ids=["llama", "padded-tiles", "one-head"])
def test_flash_kvcache_append_kernel_matches_torch_steps(heads_kv, head_dim, lengths_dtype, new):
    """The one launch that writes the new tokens and makes the key offsets and the slot list
    (kvcache_kernel.py) against the torch steps it replaces, on two copies of one cache: the
    same slots written (a padding request, its table row -1 and its positions negative, writes
    none), nothing else touched, the same offsets and slot list. Kv heads and head dims that
    are not powers of two pad the kernel's tiles; those rows and columns must not be written."""
    from hf_tiled_attention import flash_interface
    batch, page = 5, 64
    q, k_cache, v_cache, k_new, v_new, table, cached = _block_table_case(
        [0, 63, 64, 500, 0], pages_per_request=10, page=page, heads=(heads_kv, heads_kv),
        head_dim=head_dim, new=new)
    cached = cached.to(lengths_dtype)
    cached[4] = -new  # a padding request: -1 in a decode step; no position of it >= 0
    table[4].fill_(-1)
    layout = flash_interface._layout(batch, new, table.shape[1], page, q.device)
    slots = flash_interface.slot_list(table, layout[2], page)
    caches = [(k_cache.flatten(0, 1).clone(), v_cache.flatten(0, 1).clone()) for _ in range(2)]
    poison_allocator(1 << 20)
    slots_by_kernel, by_kernel = flash_interface._append_on_device(table, cached, k_new, v_new,
                                                                   *caches[0], layout[1], page)
    by_torch = flash_interface._append_in_torch(slots, cached, k_new, v_new, *caches[1],
                                                layout[1], q.device)
    torch.cuda.synchronize()
    assert torch.equal(slots_by_kernel, slots)
    assert torch.equal(by_kernel[:2 * batch + 1], by_torch[:2 * batch + 1])
    for kernel_cache, torch_cache in zip(*caches):
        assert torch.equal(kernel_cache, torch_cache)
    assert not torch.equal(caches[0][0], k_cache.flatten(0, 1))  # it wrote something
