"""CPU: the Hopper cubins of the default schedules use the hardware they were tuned for.

A kernel change that makes the compiler spill registers, drop TMA loads or fall back from
warpgroup MMA (HGMMA) slows the H200 several-fold without failing any correctness test; this
reads the sm_90 SASS (cuobjdump/nvdisasm from the test extras) and fails instead.
"""

import pytest
import torch

pytest.importorskip("cuda.tile.compilation")
from eval.inspect_cubin import backward_cubins, compile_cubin, report  # noqa: E402


@pytest.mark.parametrize("head_dim, causal, seq_q, heads", [
    (128, False, 4096, (32, 8)), (128, True, 4096, (32, 8)), (64, True, 4096, (32, 8)),
    (256, False, 4096, (32, 8)), (80, False, 4096, (32, 8)), (96, True, 4096, (32, 8)),
    # decode: the packed group tile keeps the warpgroup MMA (one query x 4 heads, 16 x 8 heads,
    # 5 x 8 heads), and the split entry's merge does not spill
    (128, True, 1, (32, 8)), (64, True, 1, (32, 8)), (128, True, 16, (32, 4)),
    (128, True, 5, (32, 4)),
])
def test_default_hopper_kernel_uses_tma_and_wgmma_without_spills(head_dim, causal, seq_q, heads):
    info = report(compile_cubin(arch="sm_90", dtype=torch.bfloat16, head_dim=head_dim,
                                causal=causal, seq_q=seq_q, heads=heads, seq_kv=16384))
    ops = info["ops"]
    assert ops.get("HGMMA", 0) > 0, "no warpgroup MMA: the tensor-core path regressed"
    assert ops.get("UTMALDG", 0) > 0, "no TMA loads: K/V went back to per-thread loads"
    assert not ops.get("LDL") and not ops.get("STL") and info.get("stack", 0) == 0, \
        f"register spills: {info.get('reg')} registers, stack {info.get('stack')} B"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_varlen_decode_tiles_fit_their_blocks_per_sm(head_dim, paged):
    """The continuous-batching decode launch that streams keys (packed keys, or the cache's
    whole blocks) fits VARLEN_DECODE_OCCUPANCY blocks in an SM's 228 KB of shared memory (1 KB
    each reserved) with at most 24 B of stack: left to the compiler it took 211 KB, one block
    per SM, and short requests read the cache 10-20% slower (perf-notes step 63)."""
    from test_varlen import _launch_args

    from hf_tiled_attention import varlen
    from hf_tiled_attention.schedule import VARLEN_DECODE_OCCUPANCY
    cubins = varlen.export_cubins(*_launch_args(paged=paged, head_dim=head_dim,
                                                cache_rows=65536), arch="sm_90")
    info = report(cubins[1] if paged else cubins[0])  # paged: after the marking launch
    assert VARLEN_DECODE_OCCUPANCY * (info["shared"] + 1024) <= 228 * 1024, info["shared"]
    assert info.get("stack", 0) <= 24 and info["ops"].get("UTMALDG", 0) > 0, \
        f"{info.get('reg')} registers, stack {info.get('stack')} B"


# Stack bytes the varlen prefill tiles (128 x 64, a prompt chunk in a serving step) may spill
# on VARLEN_PREFILL_WORKER_WARPS warps (sm_90), per launch: packed keys; or from the cache, its
# whole blocks and its rows gathered. With the compiler's warps they spilled 264 / 352 / 1800 B
# at D=128 and 2616 B packed at D=256 (perf-notes step 64). D=256 from the cache is not here:
# cuTile's CPU exporter fails it at any warp count, while the GPU suite compiles and runs it.
PREFILL_SPILL_ALLOWED = [(64, False, (0,)), (64, True, (0, 72)), (128, False, (16,)),
                         (128, True, (16, 640)), (256, False, (0,))]


@pytest.mark.parametrize("head_dim, paged, allowed", PREFILL_SPILL_ALLOWED)
def test_varlen_prefill_tiles_keep_the_mma_and_spill_little(head_dim, paged, allowed):
    from test_varlen import _launch_args

    from hf_tiled_attention import varlen
    cubins = varlen.export_cubins(*_launch_args(paged=paged, head_dim=head_dim, max_q=300,
                                                cache_rows=65536), arch="sm_90")
    for cubin, limit in zip(cubins[-len(allowed):], allowed):  # the prefill launches come last
        info = report(cubin)
        assert info["ops"].get("HGMMA", 0) > 0, "no warpgroup MMA"
        assert info.get("stack", 0) <= limit, \
            f"{info.get('reg')} registers, stack {info.get('stack')} B (allowed {limit})"


# Stack bytes the table's dK/dV schedule may spill per head dim (bf16, causal, GQA, sm_90;
# perf-notes steps 42-43): above D=160 its 64-row query steps spill about 480 B and still ran
# 1.05-1.30x faster than the 32-row steps, which spill 0-24 B; at D=160 the 32-row steps won.
BACKWARD_SPILL_ALLOWED = {192: 512, 256: 512}


@pytest.mark.parametrize("head_dim", [64, 128, 160, 192, 256])
def test_backward_hopper_kernels_use_wgmma_without_spills(head_dim):
    """The backward's three kernels at their default schedules (bf16, causal, GQA): dK/dV and
    dQ on warpgroup MMA and within BACKWARD_SPILL_ALLOWED's stack (none at D <= 160); the
    Delta kernel within the registers its occupancy hint plans for (without the
    hint the compiler took 255 and one block per SM: 1.5x slower)."""
    from hf_tiled_attention.schedule import backward_schedule

    rows, kv, dq = (report(cubin) for cubin in backward_cubins(head_dim=head_dim, causal=True,
                                                               batch=4))
    for name, info in (("dK/dV", kv), ("dQ", dq)):
        assert info["ops"].get("HGMMA", 0) > 0, f"{name}: no warpgroup MMA"
        allowed = BACKWARD_SPILL_ALLOWED.get(head_dim, 0)
        assert info.get("stack", 0) <= allowed, \
            f"{name}: {info.get('reg')} registers, stack {info.get('stack')} B (allowed {allowed})"
    schedule = backward_schedule(head_dim)
    budget = 65536 // (schedule.rows_occupancy * schedule.rows_warps * 32)
    assert rows["reg"] <= budget and rows.get("stack", 0) == 0, \
        f"Delta kernel: {rows['reg']} registers, stack {rows.get('stack')} B; budget {budget}"


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_backward_unchecked_loads_shorten_the_steps(documents):
    """BackwardSchedule.unchecked_loads: the dK/dV kernel's loop loses the bounds checks of its
    LSE / Delta rows and tile states (causal D=128: 2784 -> 2352 instructions on sm_90,
    perf-notes step 41), and the dQ kernel does not grow."""
    from dataclasses import replace

    import hf_tiled_attention as hta
    from hf_tiled_attention.backward_launch import backward_plan, export_backward_cubins
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.masks import mod_mask
    from hf_tiled_attention.mods import compile_mods
    from hf_tiled_attention.schedule import backward_schedule

    q = torch.empty(2, 8, 1024, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 1024, 128, dtype=torch.bfloat16, device="meta")
    mask = mods = None
    if documents:
        mods = compile_mods(None, hta.variants.document_mask(torch.arange(1024) // 300))
        mask = mod_mask(mods, 2, 8, 1024, 1024, torch.device("cpu"))
    counts = []
    for unchecked in (False, True):
        plan = backward_plan(torch.bfloat16, 4, 128,
                             call_options(mask, causal=True, scale=128 ** -0.5, mods=mods),
                             replace(backward_schedule(128), unchecked_loads=unchecked))
        _, kv, dq = (report(c) for c in export_backward_cubins(plan, q, k, mask, arch="sm_90"))
        counts.append((kv["instructions"], dq["instructions"]))
    (kv_checked, dq_checked), (kv_unchecked, dq_unchecked) = counts
    assert kv_unchecked < 0.95 * kv_checked, counts
    assert dq_unchecked <= dq_checked, counts


@pytest.mark.parametrize("pdl", [False, True])
def test_backward_programmatic_dependent_launch_in_the_sass(pdl):
    """BackwardSchedule.pdl: the Delta kernel lets its dependent start (PREEXIT, griddepcontrol
    .launch_dependents), the dK/dV kernel waits (ACQBULK, griddepcontrol.wait) and lets the dQ
    kernel start, the dQ kernel waits; none of it without pdl."""
    rows, kv, dq = (report(cubin)["ops"] for cubin in backward_cubins(
        head_dim=128, causal=True, heads=(8, 2), seq=1024, batch=2, overrides={"pdl": pdl}))
    want = {"rows": (1, 0), "dK/dV": (1, 1), "dQ": (0, 1)}  # (PREEXIT, ACQBULK) with pdl
    for name, ops in (("rows", rows), ("dK/dV", kv), ("dQ", dq)):
        got = (ops.get("PREEXIT", 0), ops.get("ACQBULK", 0))
        assert got == (want[name] if pdl else (0, 0)), f"{name}: {got}"
