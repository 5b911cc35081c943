"""Compare kernel_bench runs point by point: is a change as fast as the code before it?

    python eval/compare_sweeps.py BEFORE/kernel_sweep.csv AFTER/kernel_sweep.csv [AFTER2/...]

For each point tiled ran in every file (same shape, dtype, mask options), the ratio of
``gpu_ms`` (back-to-back throughput) after / before (with several AFTER files, the best of
them: two runs of the same code differ by a few percent per point on the H200, and the best of
two is the fairer estimate of each), its geometric mean, the worst points, and how many are
within ``--within`` (default 2%). ``--min-ms`` leaves out points shorter than that, which the
host's launch work dominates (decode at small caches: their run-to-run spread exceeds 2x).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

POINT = ("dtype", "batch", "heads_q", "heads_kv", "seq_q", "seq_kv", "head_dim", "causal",
         "window", "left_pad")


def tiled_points(path: Path) -> dict:
    with open(path, newline="") as f:
        return {tuple(r[c] for c in POINT): float(r["gpu_ms"]) for r in csv.DictReader(f)
                if r["backend"] == "tiled" and r["status"] == "ok" and r["gpu_ms"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path, nargs="+")
    parser.add_argument("--within", type=float, default=0.02)
    parser.add_argument("--min-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    before = tiled_points(args.before)
    afters = [tiled_points(p) for p in args.after]
    keys = [k for k in before if before[k] >= args.min_ms and all(k in a for a in afters)]
    if not keys:
        raise SystemExit("compare_sweeps: no point in common")
    ratios = {k: min(a[k] for a in afters) / before[k] for k in keys}
    geomean = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
    within = sum(r <= 1 + args.within for r in ratios.values())
    print(f"{len(keys)} points (gpu_ms >= {args.min_ms}): after / before geomean {geomean:.4f}, "
          f"{within}/{len(keys)} within {args.within:.0%}")
    for key, ratio in sorted(ratios.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {ratio:.3f}  " + " ".join(f"{c}={v}" for c, v in zip(POINT, key)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
