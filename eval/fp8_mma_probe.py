"""FP8 matrix products in cuTile: what rate ct.mma reaches on float8_e4m3fn operands beside
bf16, by operand layout and accumulation mode (groundwork for an FP8 attention kernel).

    python eval/fp8_mma_probe.py               # GPU: the rates, beside cuBLAS's bf16 and FP8
    python eval/fp8_mma_probe.py --sass        # any machine: the sm_90 cubins' MMA instructions

A plain tiled GEMM, ``C (M, N) bf16 = A (M, K) @ B``, 128 x 256 x 64 tiles, fp32 accumulation,
M = N = K = 8192, with B given ``(K, N)`` (N-major: the layout of V in ``P @ V``) or as
``Bt (N, K)`` (K-major, transposed in the kernel as it loads), ``use_fast_acc`` off and on (FP8
only), and three sets of compiler hints (cuTile's defaults, one block per SM, and that with
clusters of two). Each row: TF/s (``triton.testing.do_bench``'s median) and the error against
the fp32 product of the same (rounded) operands. Results:
eval/results/<gpu>/fp8-mma-probe/fp8_mma.csv and environment.json.
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import cuda.tile as ct
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eval.common import ResultsWriter, output_dir  # noqa: E402

TILE_M, TILE_N, TILE_K = 128, 256, 64
SIZE = 8192
COLUMNS = ["operands", "b_layout", "fast_acc", "hints", "tflops", "rel_err", "status", "reason"]
DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def gemm(A, B, C, k_major: ct.Constant[int], fast_acc: ct.Constant[int]):
    block_m, block_n = ct.bid(0), ct.bid(1)
    acc = ct.full((TILE_M, TILE_N), 0, dtype=ct.float32)
    for k in range(ct.num_tiles(A, axis=1, shape=(TILE_M, TILE_K))):
        a = ct.load(A, index=(block_m, k), shape=(TILE_M, TILE_K))
        if k_major:  # B holds Bt (N, K): the tile as the MMA's K-major operand
            b = ct.transpose(ct.load(B, index=(block_n, k), shape=(TILE_N, TILE_K)))
        else:
            b = ct.load(B, index=(k, block_n), shape=(TILE_K, TILE_N))
        acc = ct.mma(a, b, acc, use_fast_acc=bool(fast_acc))
    ct.store(C, index=(block_m, block_n), tile=ct.astype(acc, C.dtype))


HINTS = {"default": ct.kernel(gemm), "occupancy1": ct.kernel(gemm, occupancy=1),
         "occupancy1-cluster2": ct.kernel(gemm, occupancy=1, num_ctas=2)}


def launch(kernel, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, k_major: bool,
           fast_acc: bool) -> torch.Tensor:
    grid = (a.shape[0] // TILE_M, c.shape[1] // TILE_N, 1)
    ct.launch(torch.cuda.current_stream(), grid, kernel, (a, b, c, int(k_major), int(fast_acc)))
    return c


def cases():
    """(operands, k_major, fast_acc) of every row."""
    for operands in DTYPES:
        for k_major in (False, True):
            for fast_acc in ((False, True) if operands == "e4m3" else (False,)):
                yield operands, k_major, fast_acc


def measure(writer: ResultsWriter) -> None:
    import triton.testing
    torch.manual_seed(0)
    a32 = torch.randn(SIZE, SIZE, device="cuda")
    b32 = torch.randn(SIZE, SIZE, device="cuda")
    flops = 2 * SIZE ** 3
    for operands, k_major, fast_acc in cases():
        dtype = DTYPES[operands]
        a, b = a32.to(dtype), (b32.t().contiguous() if k_major else b32).to(dtype)
        want = a.float() @ (b.float().t() if k_major else b.float())
        c = torch.empty(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
        for hints, kernel in HINTS.items():
            row = dict(operands=operands, b_layout="K-major" if k_major else "N-major",
                       fast_acc=int(fast_acc), hints=hints, tflops="", rel_err="",
                       status="ok", reason="")
            try:
                c.fill_(float("nan"))  # every element must be written
                got = launch(kernel, a, b, c, k_major, fast_acc).float()
                ms = triton.testing.do_bench(lambda: launch(kernel, a, b, c, k_major, fast_acc),
                                             warmup=50, rep=300)
                row.update(tflops=f"{flops / ms / 1e9:.0f}",
                           rel_err=f"{((got - want).norm() / want.norm()).item():.2e}")
            except Exception as exc:  # a variant cuTile refuses: recorded, the rest go on
                row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:200]}")
            writer.add(row)
            print(" ".join(f"{k}={v}" for k, v in row.items() if v != ""), flush=True)
    one = torch.ones((), device="cuda")
    a, b = a32.bfloat16(), b32.bfloat16()
    a8, bt8 = a32.to(torch.float8_e4m3fn), b32.t().contiguous().to(torch.float8_e4m3fn)
    for operands, fn in (("bf16", lambda: a @ b), ("e4m3", lambda: torch._scaled_mm(
            a8, bt8.t(), one, one, out_dtype=torch.bfloat16))):
        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
        row = dict(operands=operands, b_layout="K-major" if operands == "e4m3" else "N-major",
                   fast_acc="", hints="cuBLAS (torch)", tflops=f"{flops / ms / 1e9:.0f}",
                   rel_err="", status="ok", reason="")
        writer.add(row)
        print(" ".join(f"{k}={v}" for k, v in row.items() if v != ""), flush=True)


def mma_instructions(arch: str = "sm_90") -> dict:
    """``{(operands, b_layout): Counter of the cubin's warpgroup MMA opcodes}``, compiled for
    ``arch`` without a GPU (cuTile's exporter)."""
    from cuda.tile.compilation import (ArrayConstraint, CallingConvention, ConstantConstraint,
                                       KernelSignature, export_kernel)
    from eval.inspect_cubin import nvidia_tool

    def array(dtype):
        return ArrayConstraint(dtype, 2, index_dtype=ct.int32, stride_lower_bound_incl=0,
                               alias_groups=(), may_alias_internally=False,
                               stride_constant=[None, 1], stride_divisible_by=[16, 1],
                               shape_divisible_by=[TILE_N, TILE_N], base_addr_divisible_by=16)
    found = {}
    for operands, k_major, _ in cases():
        if (operands, k_major) in found:
            continue
        dtype = ct.bfloat16 if operands == "bf16" else ct.float8_e4m3fn
        signature = KernelSignature([array(dtype), array(dtype), array(ct.bfloat16),
                                     ConstantConstraint(int(k_major)), ConstantConstraint(0)],
                                    CallingConvention.cutile_python_v2())
        buffer = io.BytesIO()
        export_kernel(HINTS["default"], [signature], buffer, gpu_code=arch,
                      output_format="cubin")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(buffer.getvalue())
            f.flush()
            sass = subprocess.run([nvidia_tool("cuobjdump"), "-sass", f.name],
                                  capture_output=True, text=True, check=True).stdout
        layout = "K-major" if k_major else "N-major"
        found[(operands, k_major)] = (layout, collections.Counter(
            re.findall(r"\b([A-Z]GMMA\.\S+)", sass)))
    return {(operands, layout): ops for (operands, _), (layout, ops) in found.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sass", action="store_true",
                        help="print the sm_90 cubins' MMA instructions (no GPU needed)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    if args.sass or not torch.cuda.is_available():
        if not args.sass:
            print("fp8_mma_probe: no CUDA GPU here; the sm_90 cubins' MMA instructions instead")
        for (operands, layout), ops in mma_instructions().items():
            print(f"{operands} B {layout}: {dict(ops)}")
        return 0
    out_dir = output_dir(args.out, "fp8-mma-probe")
    writer = ResultsWriter(out_dir, "fp8_mma", COLUMNS, argv)
    measure(writer)
    print(f"csv: {writer.finish()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
