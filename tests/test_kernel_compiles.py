"""CPU: the cuTile kernels compile to cubin for sm_80, sm_90, sm_100 and sm_120.

No GPU needed: cuda.tile.compilation.export_kernel runs the whole compiler. Each variant is
planned by the op's own launcher (launch.plan_launch on meta tensors) with the default schedule,
so a change that breaks any dtype, head-dim tile or feature combination fails here.

sm_90 (the H200 the defaults are tuned for) compiles every dtype x head-dim tile with all features
on, each feature switch and the decode paths with their merge. The other archs compile every
head-dim tile in bf16, each other dtype once and every feature variant: a dtype's code path is
the same at every head dim (fp32's three-TF32 variants cost 5-25 s each to compile, 97 s at
sm_120 for one of them, so they are not repeated per arch).
"""

import dataclasses
import inspect

import pytest
import torch

import hf_tiled_attention as hta

from hf_tiled_attention.call_options import call_options
from hf_tiled_attention.kernel_params import AttentionConstants, MergeConstants
from hf_tiled_attention.launch import export_cubin, plan_launch
from hf_tiled_attention.masks import compact_mask
from hf_tiled_attention.schedule import Schedule, resolve_schedule

pytest.importorskip("cuda.tile.compilation")

ARCHS = ["sm_80", "sm_90", "sm_100", "sm_120"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEAD_DIMS = [16, 32, 64, 128, 256]   # one per head-dim tile


def _plan(dtype, head_dim, *, causal=True, window=128, softcap=30.0, mask="bool_rows",
          return_lse=True, heads_q=32, heads_kv=8, schedule=None, seq_q=1024, sm_count=0,
          key_mask_table=True):
    q = torch.empty(2, heads_q, seq_q, head_dim, dtype=dtype, device="meta")
    k = torch.empty(2, heads_kv, 1024, head_dim, dtype=dtype, device="meta")
    masks = {
        None: None,
        "bool_rows": torch.empty(2, heads_q, seq_q, 1024, dtype=torch.bool, device="meta"),
        "bool_keypad": torch.empty(2, 1, 1, 1024, dtype=torch.bool, device="meta"),
        "additive_keys": torch.empty(1, 1, 1, 1024, dtype=dtype, device="meta"),
        "additive_heads": torch.empty(1, heads_q, seq_q, 1024, dtype=dtype, device="meta"),
    }
    compact = None if masks[mask] is None else compact_mask(masks[mask], 2, heads_q, seq_q, 1024)
    schedule = resolve_schedule(schedule, 9, dtype, head_dim, causal, seq_q=seq_q, seq_kv=1024)
    plan = plan_launch(q, k, call_options(compact, causal=causal, scale=0.1, window=window,
                                          softcap=softcap, diag_offset=1024 - seq_q,
                                          return_lse=return_lse,
                                          key_mask_table=key_mask_table),
                       schedule, sm_count=sm_count)
    return plan, (q, k, compact)


def _matrix(dtype, head_dim):
    return pytest.param(dtype, head_dim, {}, id=f"{str(dtype)[6:]}-d{head_dim}-all")


DECODE = dict(seq_q=1, mask="bool_keypad", softcap=None, window=None, sm_count=132)
FEATURES = [
    pytest.param(torch.bfloat16, 128, dict(causal=False, window=None, softcap=None, mask=None,
                                           return_lse=False), id="bf16-d128-plain"),
    pytest.param(torch.bfloat16, 128, dict(causal=False, softcap=None, mask="bool_keypad"),
                 id="bf16-d128-window-keypad"),
    pytest.param(torch.float16, 64, dict(mask="additive_heads", heads_kv=32),
                 id="fp16-d64-additive-mha"),
    pytest.param(torch.bfloat16, 128, dict(causal=False, window=None, softcap=None, mask=None,
                                           schedule=Schedule(tile_m=128, num_worker_warps=8)),
                 id="bf16-d128-plain-two-warpgroups"),
    # head dims as a power of two plus a second tile (80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32)
    pytest.param(torch.bfloat16, 80, {}, id="bf16-d80-split-all"),
    pytest.param(torch.bfloat16, 160, {}, id="bf16-d160-split-all"),   # 128 + 32, 128x128 tiles
    pytest.param(torch.float16, 96, dict(causal=False, window=None, softcap=None, mask=None),
                 id="fp16-d96-split-plain"),
    # decode: a kv head's query heads packed into a 64-row tile, keys split over blocks
    pytest.param(torch.bfloat16, 128, DECODE, id="bf16-d128-decode-packed-split"),
]
SM90_ONLY = [
    pytest.param(torch.float32, 80, dict(mask=None), id="fp32-d80-split"),
    # decode variants: a key vector applied on every tile (traced calls), 16 queries x 8 heads
    # (a 128-row tile, two warpgroups), MHA (split, not packed), an additive key vector, D=256
    pytest.param(torch.bfloat16, 128, dict(DECODE, key_mask_table=False),
                 id="bf16-d128-decode-keymask-no-table"),
    pytest.param(torch.bfloat16, 80, dict(DECODE, seq_q=16, heads_kv=4, causal=True),
                 id="bf16-d80-decode16-g8"),
    pytest.param(torch.float16, 64, dict(DECODE, heads_kv=32, mask=None), id="fp16-d64-decode-mha"),
    pytest.param(torch.float16, 256, dict(DECODE, heads_kv=1, mask="additive_keys", window=300),
                 id="fp16-d256-decode-mqa-additive-window"),
    pytest.param(torch.bfloat16, 64, dict(DECODE, seq_q=3, heads_q=12, heads_kv=4),
                 id="bf16-d64-decode3-group3"),   # a group of 3 heads in a tile of 4
    # 16 queries of one head (no packing) with their keys split three ways
    pytest.param(torch.bfloat16, 64, dict(DECODE, seq_q=16, heads_kv=32,
                                          schedule=Schedule(kv_splits=3)),
                 id="bf16-d64-decode16-mha-split3"),
    pytest.param(torch.float32, 64, DECODE, id="fp32-d64-decode"),
]
def _cases():
    for arch in ARCHS:
        if arch == "sm_90":
            grid = [_matrix(dtype, d) for dtype in DTYPES for d in HEAD_DIMS] + SM90_ONLY
        else:
            grid = ([_matrix(torch.bfloat16, d) for d in HEAD_DIMS]
                    + [_matrix(torch.float16, 128), _matrix(torch.float32, 32)])
        for param in grid + FEATURES:
            yield pytest.param(arch, *param.values, id=f"{param.id}-{arch}")


@pytest.mark.parametrize("arch, dtype, head_dim, options", list(_cases()))
def test_kernel_compiles_to_cubin(arch, dtype, head_dim, options):
    plan, tensors = _plan(dtype, head_dim, **options)
    assert export_cubin(plan, *tensors, arch=arch)[:4] == b"\x7fELF"


def _constant_params(fn) -> list:
    params = inspect.signature(fn).parameters
    return [name for name, p in params.items() if "ConstantAnnotation" in repr(p.annotation)]


def test_constants_are_declared_once():
    """The attention kernels (forward, the two backward ones) take their constants as one
    AttentionConstants tuple (the last parameter) and every declared field is read by one of
    them; the forward's split entry takes a MergeConstants tuple M after it, every field of
    which the merge reads."""
    from hf_tiled_attention import backward_kernel, kernel, merge
    for entry in (kernel.attention_forward, kernel.attention_forward_lean,
                  backward_kernel.attention_backward_kv, backward_kernel.attention_backward_q):
        assert _constant_params(entry) == ["C"]
        assert list(inspect.signature(entry).parameters)[-1] == "C"
    source = inspect.getsource(kernel) + inspect.getsource(backward_kernel)
    unread = [name for name in AttentionConstants._fields if f"C[P.{name}]" not in source]
    assert not unread, f"declared but never read by the kernels: {unread}"
    assert _constant_params(kernel.attention_forward_split) == ["C", "M"]
    assert list(inspect.signature(kernel.attention_forward_split).parameters)[-2:] == ["C", "M"]
    source = inspect.getsource(merge)
    unread = [name for name in MergeConstants._fields if f"M[P.{name}]" not in source]
    assert not unread, f"declared but never read by the merge: {unread}"


def test_decode_plan_packs_rows_and_splits_keys():
    plan, _ = _plan(torch.bfloat16, 128, **DECODE)
    # 64 rows = 16 positions x 4 heads; 8 kv heads x batch 2 = 16 blocks would take 17 splits to
    # fill 132 SMs x 2, but 8 key tiles of 128 make at most 4 splits of 2 tiles
    assert plan.variant.g_tile == 4 and plan.variant.tile_m == 64
    assert plan.kv_splits == 4 and plan.grid == (4, 8, 2) and plan.entry == "split"
    # the merge: one position x 4 heads at a time, two 64-column chunks, all 4 slices at once
    assert (plan.merge.MERGE_ROWS, plan.merge.SPLIT_TILE, plan.merge.CHUNK_D,
            plan.merge.D_CHUNKS) == (1, 4, 64, 2)
    assert plan.views.arrivals == (2, 8, 1)  # a count per (batch row, kv head, query tile)
    headed, _ = _plan(torch.bfloat16, 128, **dict(DECODE, mask="additive_heads"))
    assert headed.variant.g_tile == 1  # a per-head mask keeps one head per block
    wide, _ = _plan(torch.bfloat16, 128, **dict(DECODE, seq_q=16, heads_kv=4))
    assert (wide.variant.g_tile, wide.variant.tile_m, wide.variant.num_worker_warps,
            wide.variant.occupancy) == (8, 128, 8, 1)
    # MQA: 32 query heads of one kv head as two tiles of 16 (grid heads 2 per kv head)
    mqa, _ = _plan(torch.bfloat16, 128, **dict(DECODE, heads_kv=1, mask=None))
    assert (mqa.variant.g_tile, mqa.variant.constants.GROUP, mqa.grid[1]) == (16, 2, 2)
    odd, _ = _plan(torch.bfloat16, 128, **dict(DECODE, heads_q=24, heads_kv=1, mask=None))
    assert odd.variant.g_tile == 1  # 24 heads: 16 does not divide them, not packed


def test_decode_splits_fill_the_gpu():
    q = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, 131072, 128, dtype=torch.bfloat16, device="meta")
    schedule = resolve_schedule(None, 9, torch.bfloat16, 128, True, seq_q=1, seq_kv=131072)
    options = call_options(None, causal=True, scale=0.1, diag_offset=131071)
    long = plan_launch(q, k, options, schedule, sm_count=132)
    assert long.kv_splits == 33 and long.grid == (33, 8, 1)   # one wave of 264 blocks
    assert long.merge.SPLIT_TILE == 16   # 33 slices in three loads
    big_batch = plan_launch(q.expand(32, -1, -1, -1), k.expand(32, -1, -1, -1), options,
                            schedule, sm_count=132)
    assert big_batch.kv_splits == 1 and big_batch.merge is None  # 256 blocks fill it already


def test_host_launched_decode_splits_only_long_key_streams():
    """An eager decode call launches from the host each time: below EAGER_SPLIT_MIN_BYTES of
    K/V per unsplit block the merge's launch costs more than the split saves, so it runs as one
    launch; a CUDA-graph replay (host_launched=False) keeps its splits; asked-for splits stay."""
    from hf_tiled_attention.launch import EAGER_SPLIT_MIN_BYTES

    def plan(seq_kv, host_launched, kv_splits=None, dtype=torch.bfloat16, head_dim=128):
        q = torch.empty(1, 32, 1, head_dim, dtype=dtype, device="meta")
        k = torch.empty(1, 8, seq_kv, head_dim, dtype=dtype, device="meta")
        schedule = resolve_schedule(None, 9, dtype, head_dim, True, seq_q=1, seq_kv=seq_kv)
        if kv_splits is not None:
            schedule = dataclasses.replace(schedule, kv_splits=kv_splits)
        return plan_launch(q, k, call_options(None, causal=True, scale=0.1,
                                              diag_offset=seq_kv - 1),
                           schedule, sm_count=132, host_launched=host_launched)

    # 2 x 1025 keys x 128 x 2 bytes: 0.5 MB per block
    assert plan(1025, True).kv_splits == 1 and plan(1025, True).merge is None
    assert plan(1025, False).kv_splits > 1
    # the boundary, in bytes of K and V per unsplit block (bf16: 512 per key at D=128)
    edge = EAGER_SPLIT_MIN_BYTES // 512
    assert plan(edge - 1, True).kv_splits == 1 and plan(edge, True).kv_splits > 1
    # fp32 streams twice the bytes per key: half the keys reach it
    assert plan(edge // 2, True, dtype=torch.float32).kv_splits > 1
    assert plan(8193, True).kv_splits == plan(8193, False).kv_splits > 1
    assert plan(1025, True, kv_splits=3).kv_splits == 3  # asked for: as asked


def test_head_dim_split_reaches_the_kernel():
    split, _ = _plan(torch.bfloat16, 80)
    assert (split.variant.constants.TILE_D, split.variant.constants.TAIL_D) == (64, 16)
    padded, _ = _plan(torch.bfloat16, 80, schedule=Schedule(split_head_dim=False))
    assert (padded.variant.constants.TILE_D, padded.variant.constants.TAIL_D) == (128, 0)


def test_prefill_plan_does_not_split():
    for splits in (0, 3):  # automatic or asked for: queries of more than 16 rows never split
        plan, _ = _plan(torch.bfloat16, 128, sm_count=132, seq_q=17,
                        schedule=Schedule(pack_gqa=True, kv_splits=splits))
        assert plan.kv_splits == 1 and plan.variant.g_tile == 1 and plan.merge is None


def test_decode_packing_can_be_turned_off():
    plan, _ = _plan(torch.bfloat16, 128, **dict(DECODE, schedule=Schedule(pack_gqa=False,
                                                                           kv_splits=1)))
    assert plan.kv_splits == 1 and plan.variant.g_tile == 1 and plan.merge is None


def _kept_workspaces() -> int:
    return hta.cache_sizes()["key-split workspaces"]


def test_split_workspace_is_reused_per_plan_and_stream(monkeypatch):
    from hf_tiled_attention import launch

    hta.clear_caches()
    plan, (q, k, _) = _plan(torch.bfloat16, 128, **dict(DECODE, mask=None))
    q, k = torch.randn(q.shape, dtype=q.dtype), torch.randn(k.shape, dtype=k.dtype)
    first = launch.launch_arrays(plan, q, k, k, None, keep_for_stream=0)
    again = launch.launch_arrays(plan, q, k, k, None, keep_for_stream=0)
    # The split launch's partial outputs, LSEs and arrival counts are the same memory call after
    # call, laid out as a fresh workspace would be; the output is new every call. The counts
    # start at zero (the kernel leaves them so).
    fresh = launch.launch_arrays(plan, q, k, k, None).attention[9:]
    assert len(fresh) == 3 and len(first.attention) == 12
    for kept, repeat, new in zip(first.attention[9:], again.attention[9:], fresh):
        assert kept.data_ptr() == repeat.data_ptr() != new.data_ptr()
        assert (kept.shape, kept.stride(), kept.storage_offset(), kept.dtype) == \
            (new.shape, new.stride(), new.storage_offset(), new.dtype)
    arrivals = first.attention[11]
    assert arrivals.dtype == torch.int32 and arrivals.shape == plan.views.arrivals
    assert not arrivals.any() and not fresh[2].any()
    assert first.out.data_ptr() != again.out.data_ptr()
    # Another plan gets its own; past the byte budget the kept ones are dropped, not grown.
    other, _ = _plan(torch.bfloat16, 128, **dict(DECODE, mask=None, heads_kv=4))
    launch.launch_arrays(other, q, k[:, :4], k[:, :4], None, keep_for_stream=0)
    assert _kept_workspaces() == 2
    monkeypatch.setattr(launch, "_MAX_KEPT_WORKSPACE_BYTES", plan.views.workspace * 4 * 2)
    third, _ = _plan(torch.bfloat16, 128, **dict(DECODE, mask=None, heads_kv=2))
    kept = launch.launch_arrays(third, q, k[:, :2], k[:, :2], None, keep_for_stream=0)
    assert _kept_workspaces() == 1
    again = launch.launch_arrays(third, q, k[:, :2], k[:, :2], None, keep_for_stream=0)
    assert again.attention[9].data_ptr() == kept.attention[9].data_ptr()


def test_only_eager_calls_keep_device_memory():
    """The registered op (torch.compile, CUDA graphs: allocations may come from a graph's
    pool) and autotuning candidates make their workspace, placeholders and block tables per
    call; an eager call keeps them for the next."""
    from eval.host_overhead import stubbed_launch
    from hf_tiled_attention import op

    q = torch.randn(2, 32, 1, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 8, 4096, 128, dtype=torch.bfloat16)
    keys = torch.rand(2, 1, 1, 4096) > 0.2
    with stubbed_launch():
        torch.ops.hf_tiled_attention.attention(q, k, k, keys, 1, True, 0.1, 0, 0.0, 4095,
                                               Schedule().as_list(), None, [], False)
        sizes = hta.cache_sizes()
        assert sizes["key-split workspaces"] == sizes["launch placeholders"] == 0
        op.attention(q, k, k, keys, causal=True, scale=0.1, window=None, softcap=None,
                     diag_offset=4095)
        sizes = hta.cache_sizes()
        assert sizes["key-split workspaces"] == sizes["launch placeholders"] == 1
