"""Read the compiled kernel without a GPU: registers, spills, shared memory, instruction mix.

Compiles the variant the op would launch for one call shape (same planner, same launch-time
layout assumptions) to a cubin with cuTile's exporter, then reads it with NVIDIA's `cuobjdump`
and `nvdisasm` (on PATH, or from the `nvidia-cuda-cuobjdump` / `nvidia-cuda-nvdisasm` wheels).

    python eval/inspect_cubin.py                                   # bf16, D=128, sm_90, default schedule
    python eval/inspect_cubin.py --causal --schedule tile_m=128 --schedule num_worker_warps=8
    python eval/inspect_cubin.py --sass > kernel.sass              # the full disassembly
    python eval/inspect_cubin.py --backward --head-dim 192 --backward-schedule unchecked_loads=false

``--backward`` reads the backward's three kernels (Delta, dK/dV, dQ) at the table's
BackwardSchedule, with ``--backward-schedule FIELD=VALUE`` replacing fields.

What to look for on Hopper: `HGMMA` (warpgroup MMA) and `UTMALDG` (TMA loads) present, `LDL` /
`STL` (register spills to local memory) absent, registers <= 255. Where a kernel spills, the
spills inside its step loops (`mma_loops`: the innermost loops holding MMAs) are what costs:
at D=192 the backward's dK/dV kernel with 392 B of stack reloaded 22-26 values per step and
ran 1.4x slower than with 384 B that reloaded 14-18 (perf-notes step 43).
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
from hf_tiled_attention.call_options import call_options  # noqa: E402
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
    options = call_options(None, causal=causal, scale=head_dim ** -0.5,
                           diag_offset=seq_kv - seq_q, return_lse=True)
    plan = plan_launch(q, k, options, resolved, sm_count=sm_count)
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


_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")


def report(cubin: bytes) -> dict:
    """Registers, stack/shared bytes, per-opcode instruction counts and the innermost MMA
    loops (:func:`mma_loops`) of a cubin."""
    usage, sass = disassemble(cubin)
    fields = {key.lower(): int(value)
              for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    ops = collections.Counter()
    for line in sass.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            ops[match.group(2)] += 1
    return {**fields, "instructions": sum(ops.values()), "ops": dict(ops),
            "mma_loops": mma_loops(sass)}


def mma_loops(sass: str) -> list[dict]:
    """The innermost loops of a SASS listing that hold tensor-core MMAs (HGMMA / QGMMA, the
    warpgroup MMA in 16 and 8 bits, or HMMA): a kernel's steps. A loop is a branch back to an
    earlier label (in the body: not one of the out-of-line waits after the last EXIT);
    innermost: no other such loop inside it. Per loop, in address order: ``instructions``,
    ``mma``, ``LDL`` (spill reloads), ``STL`` (spill stores) and ``ops`` (every opcode's count)
    between its label and its branch."""
    listing, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        match = _INSTRUCTION.match(line)
        if match:
            address = int(match.group(1), 16)
            listing.append((address, match.group(2), match.group(3)))
            labels.update((name, address) for name in pending)
            pending = []
    # (after the last EXIT the compiler puts out-of-line waits that branch back into the body)
    body_end = max((address for address, op, _ in listing if op == "EXIT"), default=1 << 62)
    spans = set()
    for address, op, rest in listing:
        target = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" and address < body_end else None
        if target and labels.get(target.group(1), address) < address:
            spans.add((labels[target.group(1)], address))
    loops = []
    for lo, hi in sorted(spans):
        body = collections.Counter(op for address, op, _ in listing if lo <= address <= hi)
        mma = body["HGMMA"] + body["QGMMA"] + body["HMMA"]
        if mma:
            loops.append(dict(span=(lo, hi), instructions=sum(body.values()), mma=mma,
                              LDL=body["LDL"], STL=body["STL"], ops=dict(body)))
    return [loop for loop in loops if not any(
        other is not loop and loop["span"][0] <= other["span"][0]
        and other["span"][1] <= loop["span"][1] for other in loops)]


def backward_cubins(*, arch: str = "sm_90", dtype: torch.dtype = torch.bfloat16,
                    head_dim: int = 128, causal: bool = False, heads: tuple[int, int] = (32, 8),
                    seq: int = 4096, batch: int = 1,
                    overrides: dict | None = None) -> tuple[bytes, ...]:
    """The cubins of the backward's three kernels (Delta, dK/dV, dQ) for one call shape, at the
    table's BackwardSchedule with ``overrides`` replaced."""
    import dataclasses

    from hf_tiled_attention.backward_launch import backward_plan, export_backward_cubins
    from hf_tiled_attention.schedule import backward_schedule

    q = torch.empty(batch, heads[0], seq, head_dim, dtype=dtype, device="meta")
    k = torch.empty(batch, heads[1], seq, head_dim, dtype=dtype, device="meta")
    schedule = dataclasses.replace(backward_schedule(head_dim), **(overrides or {}))
    plan = backward_plan(dtype, heads[0] // heads[1], head_dim,
                         call_options(None, causal=causal, scale=head_dim ** -0.5), schedule)
    return export_backward_cubins(plan, q, k, arch=arch)


def _print_report(info: dict, name: str = "") -> None:
    print(f"{name}registers {info.get('reg')}  stack {info.get('stack')} B  shared "
          f"{info.get('shared')} B  instructions {info['instructions']}")
    print("  ".join(f"{op} {info['ops'].get(op, 0)}" for op in WATCH))
    for loop in info["mma_loops"]:
        print(f"  step loop {loop['span'][0]:#x}-{loop['span'][1]:#x}: {loop['instructions']} "
              f"instructions, {loop['mma']} MMA, spills: {loop['LDL']} LDL / {loop['STL']} STL")
    if info["ops"].get("LDL") or info["ops"].get("STL"):
        print("register spills: LDL/STL present")


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
    parser.add_argument("--backward", action="store_true",
                        help="the backward's kernels (Delta, dK/dV, dQ) instead of the forward's")
    parser.add_argument("--backward-schedule", action="append", default=[],
                        help="with --backward, a BackwardSchedule field: FIELD=VALUE "
                        "(repeatable)")
    args = parser.parse_args(argv)
    heads = parse_heads(args.heads)
    if args.backward:
        from eval.backward_bench import schedule_labels

        combos = list(schedule_labels(args.backward_schedule).values()) or [{}]
        if len(combos) != 1:
            raise SystemExit("--backward-schedule takes one value per field here "
                             "(FIELD=VALUE)")
        cubins = backward_cubins(arch=args.arch, dtype=DTYPES[args.dtype],
                                 head_dim=args.head_dim, causal=args.causal, heads=heads,
                                 seq=args.seq_q, overrides=combos[0])
        for name, cubin in zip(("Delta", "dK/dV", "dQ"), cubins):
            if args.sass:
                print(f"// {name}\n{disassemble(cubin)[1]}")
            else:
                _print_report(report(cubin), f"{name}: ")
        return 0
    schedules = parse_schedules(args.schedule)
    if len(schedules) != 1:
        raise SystemExit("--schedule takes one value per field here (FIELD=VALUE)")
    cubin = compile_cubin(arch=args.arch, dtype=DTYPES[args.dtype], head_dim=args.head_dim,
                          causal=args.causal, heads=heads, seq_q=args.seq_q, seq_kv=args.seq_kv,
                          schedule=schedules[0])
    if args.sass:
        print(disassemble(cubin)[1])
        return 0
    _print_report(report(cubin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
