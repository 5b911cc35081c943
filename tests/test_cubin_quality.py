"""CPU: the Hopper cubins of the default schedules use the hardware they were tuned for.

A kernel change that makes the compiler spill registers, drop TMA loads or fall back from
warpgroup MMA (HGMMA) slows the H200 several-fold without failing any correctness test; this
reads the sm_90 SASS (cuobjdump/nvdisasm from the test extras) and fails instead.
"""

import pytest
import torch

pytest.importorskip("cuda.tile.compilation")
from eval.inspect_cubin import compile_cubin, report  # noqa: E402


@pytest.mark.parametrize("head_dim, causal", [(128, False), (128, True), (64, True), (256, False),
                                              (80, False), (96, True)])
def test_default_hopper_kernel_uses_tma_and_wgmma_without_spills(head_dim, causal):
    info = report(compile_cubin(arch="sm_90", dtype=torch.bfloat16, head_dim=head_dim,
                                causal=causal))
    ops = info["ops"]
    assert ops.get("HGMMA", 0) > 0, "no warpgroup MMA: the tensor-core path regressed"
    assert ops.get("UTMALDG", 0) > 0, "no TMA loads: K/V went back to per-thread loads"
    assert not ops.get("LDL") and not ops.get("STL") and info.get("stack", 0) == 0, \
        f"register spills: {info.get('reg')} registers, stack {info.get('stack')} B"
