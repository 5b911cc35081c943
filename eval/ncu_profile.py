"""Hardware counters for one attention shape: `tiled` next to SDPA's kernels, under Nsight Compute.

For each backend it starts `ncu --clock-control none --profile-from-start off` on this script's
`--workload` mode, which calls the backend once to warm up and once more between
cudaProfilerStart and Stop, so only that call's kernels are profiled (`--backward`: the
backward's). The raw metrics of every profiled kernel go to `ncu_raw_<backend>.csv`;
`ncu_summary.csv` keeps the ones that say where a kernel's time goes: duration, SM and
tensor-pipe utilisation, issue activity, occupancy, registers, and the largest warp-stall
reasons.

    python eval/ncu_profile.py                                  # B=4 32/8 S=4096 D=128 bf16
    python eval/ncu_profile.py --causal --backends tiled sdpa_cudnn
    python eval/ncu_profile.py --seq 1024 --batch 16
    python eval/ncu_profile.py --backward --backends tiled sdpa_cudnn   # the backward's kernels
    python eval/ncu_profile.py --backward --variant documents --backends tiled flex

``--variant``: one of backward_bench.py's variants (its mods for `tiled`, the same mods and a
block mask for `flex`, FlexAttention compiled before the profiled part); ``--causal`` is then
the variant's.

Needs a GPU whose counters ncu can read (a Firecracker host of the lent H200s can).
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eval.common import (DTYPES, ResultsWriter, parse_heads, parse_schedules,  # noqa: E402
                         results_dir)

SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy",
            "LaunchStats", "SchedulerStats", "InstructionStats", "MemoryWorkloadAnalysis"]
# Metrics kept in the summary: exact names, then patterns (every match is kept).
SUMMARY_METRICS = [
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__block_size",
    "launch__grid_size",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "launch__shared_mem_per_block_dynamic",
]
SUMMARY_PATTERNS = [re.compile(r"^sm__(inst_executed_)?pipe_tensor.*pct_of_peak_sustained_active$"),
                    re.compile(r"^sm__pipe_.*gmma.*pct_of_peak_sustained_active$")]
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
TOP_STALLS = 8
COLUMNS = ["backend", "kernel", "metric", "unit", "value"]


def workload(args) -> None:
    """What ncu runs: one backend, a warm-up call, then the profiled call between
    cudaProfilerStart and Stop (process-wide: autograd launches the backward's kernels from its
    own thread, which an NVTX range of this one would not cover)."""
    from eval.kernel_bench import make_call

    hq, hkv = parse_heads(args.heads)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(args.batch, h, args.seq, args.head_dim, generator=gen, device="cuda",
                           dtype=dtype) for h in (hq, hkv, hkv))
    if args.variant:
        from eval import backward_bench
        spec = backward_bench.call_spec(args.variant, args.batch, hq, args.seq, None, "cuda")
        fn = backward_bench.make_call(args.workload, spec, args.batch, hq, args.seq, "cuda")
    else:
        fn = make_call(args.workload, args.causal, parse_schedules(args.schedule)[0])
    if args.backward:  # the forward runs before the profiled part: only the backward counts
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        d_out = torch.randn(q.shape, generator=gen, device="cuda", dtype=dtype)
        out = fn(q, k, v)
        d_out = torch.empty_like(out).copy_(d_out)  # in the output's layout, as a model's is

        def call():
            return torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
    else:
        def call():
            return fn(q, k, v)
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile_backend(backend: str, args, ncu: str) -> list[dict]:
    """Run the workload under ncu; the raw CSV page, one dict per profiled kernel."""
    command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page",
               "raw"]
    for section in SECTIONS:
        command += ["--section", section]
    command += [sys.executable, __file__, "--workload", backend] + forwarded(args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ncu failed for {backend} (rc {done.returncode}):\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    kernels, text = parse_raw_page(done.stdout)
    if not kernels:
        raise SystemExit(f"ncu profiled no kernel for {backend}:\n{done.stdout[-2000:]}")
    (args.out / f"ncu_raw_{backend}.csv").write_text(text)
    return kernels


def parse_raw_page(stdout: str) -> tuple[list[dict], str]:
    """ncu's `--csv --page raw` output -> one {metric: (value, unit)} dict per kernel, and the
    CSV text itself. ncu prints its own lines (==PROF==) first; the CSV starts at its header,
    whose second row holds the units."""
    start = stdout.find('"ID"')
    if start < 0:
        return [], ""
    text = stdout[start:]
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) < 3:
        return [], text
    header, units = rows[0], rows[1]
    return [{name: (value, unit) for name, unit, value in zip(header, units, row)}
            for row in rows[2:]], text


def summarise(backend: str, kernel: dict) -> list[dict]:
    name = kernel.get("Kernel Name", ("?", ""))[0]
    short = name if len(name) <= 60 else name[:57] + "..."
    picked = [m for m in SUMMARY_METRICS if m in kernel]
    picked += sorted(m for m in kernel if any(p.match(m) for p in SUMMARY_PATTERNS))
    stalls = sorted((m for m in kernel if STALL.match(m)),
                    key=lambda m: -_number(kernel[m][0]))[:TOP_STALLS]
    return [dict(backend=backend, kernel=short, metric=m, unit=kernel[m][1], value=kernel[m][0])
            for m in picked + stalls]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def forwarded(args) -> list[str]:
    flags = ["--batch", str(args.batch), "--heads", args.heads, "--seq", str(args.seq),
             "--head-dim", str(args.head_dim), "--dtype", args.dtype]
    for spec in args.schedule:
        flags += ["--schedule", spec]
    if args.variant:
        flags += ["--variant", args.variant]
    return (flags + (["--causal"] if args.causal else [])
            + (["--backward"] if args.backward else []))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", default="32/8", help="Hq/Hkv")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true",
                        help="profile the backward pass (dQ, dK, dV) instead of the forward")
    parser.add_argument("--schedule", action="append", default=[],
                        help="a Schedule field for tiled: FIELD=VALUE (repeatable)")
    parser.add_argument("--variant", default=None,
                        help="a backward_bench.py variant (documents, sliding-window, ...)")
    parser.add_argument("--backends", nargs="+", default=["tiled", "sdpa_cudnn", "sdpa_flash"])
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workload:
        workload(args)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("ncu_profile: needs a CUDA GPU")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(ncu).exists():
        raise SystemExit("ncu_profile: Nsight Compute (ncu) not found on PATH")
    if args.variant and args.schedule:
        raise SystemExit("ncu_profile: --schedule applies without --variant only")
    causal = args.variant or ("causal" if args.causal else "noncausal")
    args.out = args.out or results_dir("ncu") / (
        f"{args.dtype}-b{args.batch}-h{args.heads.replace('/', '-')}-s{args.seq}"
        f"-d{args.head_dim}-{causal}{'-backward' if args.backward else ''}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = ResultsWriter(args.out, "ncu_summary", COLUMNS, argv)
    for backend in args.backends:
        for kernel in profile_backend(backend, args, ncu):
            for row in summarise(backend, kernel):
                results.add(row)
                print(f"{backend:11s} {row['kernel'][:40]:40s} {row['metric']:70s} "
                      f"{row['value']:>12s} {row['unit']}", flush=True)
    print("summary:", results.finish())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
