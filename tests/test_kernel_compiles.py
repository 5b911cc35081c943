"""CPU: the cuTile kernel compiles to cubin for sm_80, sm_90, sm_100 and sm_120.

No GPU needed: cuda.tile.compilation.export_kernel runs the whole compiler. Each variant is
planned by the op's own launcher (launch.plan_launch on meta tensors) with the default schedule,
so a change that breaks any dtype, head-dim tile or feature combination fails here. Covered:
every dtype x head-dim tile with all features on, and each mask layout / feature switch off.
"""

import pytest
import torch

from hf_tiled_attention.launch import export_cubin, plan_launch
from hf_tiled_attention.masks import compact_mask
from hf_tiled_attention.schedule import Schedule, resolve_schedule

pytest.importorskip("cuda.tile.compilation")

ARCHS = ["sm_80", "sm_90", "sm_100", "sm_120"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEAD_DIMS = [16, 32, 64, 128, 256]   # one per head-dim tile
DECODE = Schedule(pack_gqa=True, kv_splits=0)


def _plan(dtype, head_dim, *, causal=True, window=128, softcap=30.0, mask="bool_rows",
          return_lse=True, heads_q=32, heads_kv=8, schedule=None, seq_q=1024, sm_count=0):
    q = torch.empty(2, heads_q, seq_q, head_dim, dtype=dtype, device="meta")
    k = torch.empty(2, heads_kv, 1024, head_dim, dtype=dtype, device="meta")
    masks = {
        None: None,
        "bool_rows": torch.empty(2, heads_q, seq_q, 1024, dtype=torch.bool, device="meta"),
        "bool_keypad": torch.empty(2, 1, 1, 1024, dtype=torch.bool, device="meta"),
        "additive_heads": torch.empty(1, heads_q, seq_q, 1024, dtype=dtype, device="meta"),
    }
    compact = None if masks[mask] is None else compact_mask(masks[mask], 2, heads_q, seq_q, 1024)
    schedule = resolve_schedule(schedule, 9, dtype, head_dim, causal)
    plan = plan_launch(q, k, compact, causal=causal, scale=0.1, window=window, softcap=softcap,
                       diag_offset=1024 - seq_q, schedule=schedule, return_lse=return_lse,
                       sm_count=sm_count)
    return plan, (q, k, compact)


VARIANTS = [pytest.param(dtype, d, {}, id=f"{str(dtype)[6:]}-d{d}-all")
            for dtype in DTYPES for d in HEAD_DIMS] + [
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
    pytest.param(torch.float32, 80, dict(mask=None), id="fp32-d80-split"),
    # a fixed grid of blocks that loop over the tiles, with every feature
    pytest.param(torch.bfloat16, 128, dict(schedule=Schedule(persistent=True)),
                 id="bf16-d128-persistent-all"),
    # decode: GQA rows packed into one tile, keys split over blocks
    pytest.param(torch.bfloat16, 128, dict(seq_q=1, mask="bool_keypad", softcap=None, window=None,
                                           sm_count=132, schedule=DECODE),
                 id="bf16-d128-decode-packed-split"),
]


def _compile(plan_and_tensors, arch):
    plan, tensors = plan_and_tensors
    return export_cubin(plan, *tensors, arch=arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype, head_dim, options", VARIANTS)
def test_kernel_compiles_to_cubin(arch, dtype, head_dim, options):
    cubin = _compile(_plan(dtype, head_dim, **options), arch)
    assert cubin[:4] == b"\x7fELF", "export_kernel must produce an ELF cubin"


def test_decode_plan_packs_rows_and_splits_keys():
    plan, _ = _plan(torch.bfloat16, 128, seq_q=1, mask="bool_keypad", window=None, sm_count=132,
                    schedule=DECODE)
    assert plan.variant.packed_rows and plan.variant.tile_m == 16
    assert plan.kv_splits == 2 and plan.grid == (2, 8, 2)   # 8 key tiles, 16 blocks unsplit
    headed, _ = _plan(torch.bfloat16, 128, seq_q=1, mask="additive_heads", window=None,
                      sm_count=132, schedule=DECODE)
    assert not headed.variant.packed_rows  # a per-head mask keeps one head per block


def test_persistent_plan_launches_one_wave():
    plan, _ = _plan(torch.bfloat16, 128, sm_count=132, schedule=Schedule(persistent=True))
    occupancy = plan.variant.occupancy
    assert plan.grid == (132 * occupancy, 1, 1) and plan.variant.constants[-1] is True
    # fewer tiles than one wave: one block per tile
    small, _ = _plan(torch.bfloat16, 128, seq_q=64, heads_q=8, sm_count=132, mask=None,
                     schedule=Schedule(persistent=True, tile_m=64))
    assert small.grid == (8 * 2, 1, 1)
    # the SM count unknown (meta tensors): one block per tile, still correct
    unknown, _ = _plan(torch.bfloat16, 128, schedule=Schedule(persistent=True, tile_m=64))
    assert unknown.grid == (16 * 32 * 2, 1, 1)


def test_head_dim_split_reaches_the_kernel():
    tile_d_at = 4  # TILE_D's position in the kernel's constants; TAIL_D follows it
    split, _ = _plan(torch.bfloat16, 80)
    assert split.variant.constants[tile_d_at:tile_d_at + 2] == (64, 16)
    padded, _ = _plan(torch.bfloat16, 80, schedule=Schedule(split_head_dim=False))
    assert padded.variant.constants[tile_d_at:tile_d_at + 2] == (128, 0)


def test_prefill_plan_does_not_split():
    plan, _ = _plan(torch.bfloat16, 128, sm_count=132, schedule=DECODE)
    assert plan.kv_splits == 1 and not plan.variant.packed_rows


def test_default_schedule_neither_packs_nor_splits():
    plan, _ = _plan(torch.bfloat16, 128, seq_q=1, mask="bool_keypad", window=None, sm_count=132)
    assert plan.kv_splits == 1 and not plan.variant.packed_rows
