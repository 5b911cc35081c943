"""Read the compiled kernel without a GPU: registers, spills, shared memory, instruction mix.

Compiles the variant the op would launch for one call shape (same planner, same launch-time
layout assumptions) to a cubin with cuTile's exporter, then reads it with NVIDIA's `cuobjdump`
and `nvdisasm` (on PATH, or from the `nvidia-cuda-cuobjdump` / `nvidia-cuda-nvdisasm` wheels).

    python eval/inspect_cubin.py                                   # bf16, D=128, sm_90, default schedule
    python eval/inspect_cubin.py --causal --schedule tile_m=128 --schedule num_worker_warps=8
    python eval/inspect_cubin.py --sass > kernel.sass              # the full disassembly

What to look for on Hopper: `HGMMA` (warpgroup MMA) and `UTMALDG` (TMA loads) present, `LDL` /
`STL` (register spills to local memory) absent, registers <= 255.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_tiled_attention import Schedule  # noqa: E402
from hf_tiled_attention.launch import export_cubin, plan_launch  # noqa: E402
from eval.common import DTYPES, parse_heads, parse_schedules  # noqa: E402
from hf_tiled_attention.schedule import resolve_schedule  # noqa: E402

# Instruction classes worth a glance: tensor cores, TMA, spills, softmax math, conversions.
WATCH = ["HGMMA", "HMMA", "UTMALDG", "LDG", "LDL", "STL", "MUFU", "FFMA", "FMUL", "FADD",
         "FMNMX", "F2FP", "SYNCS", "BAR"]


def nvidia_tool(name: str) -> str:
    """Path of a CUDA binary tool: PATH first, then the pip wheels' nvidia/cu*/bin."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
        for root in nvidia.__path__:
            for candidate in sorted(Path(root).glob(f"cu*/bin/{name}")):
                return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError(f"{name} not found: put the CUDA toolkit on PATH or "
                            f"`pip install nvidia-cuda-{name}`")


def compile_cubin(*, arch: str = "sm_90", dtype: torch.dtype = torch.bfloat16,
                  head_dim: int = 128, causal: bool = False, heads: tuple[int, int] = (32, 8),
                  seq_q: int = 4096, seq_kv: int = 4096, schedule: Schedule | None = None,
                  sm_count: int = 132) -> bytes:
    """The cubin of the kernel variant a call of this shape launches (meta tensors, no GPU)."""
    q = torch.empty(1, heads[0], seq_q, head_dim, dtype=dtype, device="meta")
    k = torch.empty(1, heads[1], seq_kv, head_dim, dtype=dtype, device="meta")
    arch_major = int(arch.removeprefix("sm_")) // 10
    resolved = resolve_schedule(schedule, arch_major, dtype, head_dim, causal, seq_q=seq_q,
                                seq_kv=seq_kv)
    plan = plan_launch(q, k, None, causal=causal, scale=head_dim ** -0.5, window=None,
                       softcap=None, diag_offset=seq_kv - seq_q, schedule=resolved,
                       return_lse=True, sm_count=sm_count)
    return export_cubin(plan, q, k, arch=arch)


def disassemble(cubin: bytes) -> tuple[str, str]:
    """(resource usage report, SASS text) of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([nvidia_tool("cuobjdump"), "--dump-resource-usage", str(path)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([nvidia_tool("nvdisasm"), "-c", str(path)],
                              capture_output=True, text=True, check=True).stdout
    return usage, sass


def report(cubin: bytes) -> dict:
    """Registers, stack/shared bytes and per-opcode instruction counts of a cubin."""
    usage, sass = disassemble(cubin)
    fields = {key.lower(): int(value)
              for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    ops = collections.Counter()
    for line in sass.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if match:
            ops[match.group(1)] += 1
    return {**fields, "instructions": sum(ops.values()), "ops": dict(ops)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm_90", choices=["sm_80", "sm_90", "sm_100", "sm_120"])
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--heads", default="32/8", help="Hq/Hkv")
    parser.add_argument("--seq-q", type=int, default=4096)
    parser.add_argument("--seq-kv", type=int, default=4096)
    parser.add_argument("--schedule", action="append", default=[],
                        help="a Schedule field: FIELD=VALUE (repeatable)")
    parser.add_argument("--sass", action="store_true", help="print the full SASS instead")
    args = parser.parse_args(argv)
    schedules = parse_schedules(args.schedule)
    if len(schedules) != 1:
        raise SystemExit("--schedule takes one value per field here (FIELD=VALUE)")
    heads = parse_heads(args.heads)
    cubin = compile_cubin(arch=args.arch, dtype=DTYPES[args.dtype], head_dim=args.head_dim,
                          causal=args.causal, heads=heads, seq_q=args.seq_q, seq_kv=args.seq_kv,
                          schedule=schedules[0])
    if args.sass:
        print(disassemble(cubin)[1])
        return 0
    info = report(cubin)
    print(f"registers {info.get('reg')}  stack {info.get('stack')} B  shared {info.get('shared')} B"
          f"  instructions {info['instructions']}")
    print("  ".join(f"{op} {info['ops'].get(op, 0)}" for op in WATCH))
    if info["ops"].get("LDL") or info["ops"].get("STL"):
        print("register spills: LDL/STL present")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
