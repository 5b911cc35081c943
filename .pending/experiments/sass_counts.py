"""The FP8 cache decode kernel's step loops in its sm_90 cubin, per MMA-operand variant and
query dtype (B=8, 32/8 heads, one query, 16k keys; no GPU):

    python exp/experiments/sass_counts.py            # D=128
    python exp/experiments/sass_counts.py 64 256
"""
import sys

import torch

sys.path.insert(0, ".")
import hf_tiled_attention.fp8_cache_attention as fca  # noqa: E402
from eval.inspect_cubin import report  # noqa: E402
from hf_tiled_attention.fp8_cache import ROW_EXTRA  # noqa: E402
from hf_tiled_attention.memo import clear_caches  # noqa: E402

WATCH = ["QGMMA", "HGMMA", "F2FP", "HADD2", "PRMT", "LDS", "STS", "FMUL", "FADD", "MUFU", "FSEL"]

for dim in [int(a) for a in sys.argv[1:]] or [128]:
    for dtype in (torch.bfloat16, torch.float16):
        for qk, pv in ((0, 2), (0, 0), (2, 2)):
            fca.FP8_CACHE_QK_PARTS, fca.FP8_CACHE_PV_PARTS = qk, pv
            clear_caches()  # the decode plan is memoized with the knobs' values
            q = torch.empty(8, 32, 1, dim, dtype=dtype, device="meta")
            rows = torch.empty(8, 8, 16384, dim + ROW_EXTRA, dtype=torch.uint8, device="meta")
            info = report(fca.export_cubins(q, rows, rows, arch="sm_90", sm_count=0)[0])
            for loop in info["mma_loops"]:
                print(f"D={dim} {str(dtype)[6:]} qk={qk} pv={pv}: registers {info.get('reg')}, "
                      f"stack {info.get('stack')} B; loop {loop['instructions']} instructions, "
                      f"{loop['LDL']} LDL: " + " ".join(
                          f"{op} {loop['ops'].get(op, 0)}" for op in WATCH), flush=True)
