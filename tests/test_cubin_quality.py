"""CPU: the Hopper cubins of the default schedules use the hardware they were tuned for.

A kernel change that makes the compiler spill registers, drop TMA loads or fall back from
warpgroup MMA (HGMMA) slows the H200 several-fold without failing any correctness test; this
reads the sm_90 SASS (cuobjdump/nvdisasm from the test extras) and fails instead.
"""

import pytest
import torch

pytest.importorskip("cuda.tile.compilation")
from eval.inspect_cubin import compile_cubin, report  # noqa: E402


@pytest.mark.parametrize("head_dim, causal, seq_q, heads", [
    (128, False, 4096, (32, 8)), (128, True, 4096, (32, 8)), (64, True, 4096, (32, 8)),
    (256, False, 4096, (32, 8)), (80, False, 4096, (32, 8)), (96, True, 4096, (32, 8)),
    # decode: the packed group tile keeps the warpgroup MMA (one query x 4 heads, 16 x 8 heads)
    (128, True, 1, (32, 8)), (64, True, 1, (32, 8)), (128, True, 16, (32, 4)),
])
def test_default_hopper_kernel_uses_tma_and_wgmma_without_spills(head_dim, causal, seq_q, heads):
    info = report(compile_cubin(arch="sm_90", dtype=torch.bfloat16, head_dim=head_dim,
                                causal=causal, seq_q=seq_q, heads=heads, seq_kv=16384))
    ops = info["ops"]
    assert ops.get("HGMMA", 0) > 0, "no warpgroup MMA: the tensor-core path regressed"
    assert ops.get("UTMALDG", 0) > 0, "no TMA loads: K/V went back to per-thread loads"
    assert not ops.get("LDL") and not ops.get("STL") and info.get("stack", 0) == 0, \
        f"register spills: {info.get('reg')} registers, stack {info.get('stack')} B"
