"""Compare benchmark runs point by point: is a change as fast as the code before it?

    python eval/compare_sweeps.py BEFORE/kernel_sweep.csv AFTER/kernel_sweep.csv [AFTER2/...]
    python eval/compare_sweeps.py OLD1/kernel_sweep.csv NEW1/... NEW2/... --before-also OLD2/...

Takes kernel_bench's and backward_bench's CSVs (both are named kernel_sweep.csv; the point's
columns are read from the header). For each point tiled ran in every file (same shape, dtype,
mask options; for the backward also the pass), the ratio of ``gpu_ms`` (back-to-back
throughput) after / before (with several files on a side, the best of them: two runs of the
same code differ by a few percent per point on the H200, and the best of two is the fairer
estimate of each; run the trees in turns), its geometric mean, the worst points, and how many
are within ``--within`` (default 2%). ``--min-ms`` leaves out points shorter than that, which
the host's launch work dominates (decode at small caches: their run-to-run spread exceeds 2x).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

# The columns that name a point: kernel_bench's, and backward_bench's (which has a "pass").
POINT = ("dtype", "batch", "heads_q", "heads_kv", "seq_q", "seq_kv", "head_dim", "causal",
         "window", "left_pad")
BACKWARD_POINT = ("variant", "pass", "dtype", "batch", "heads_q", "heads_kv", "seq", "head_dim",
                  "causal")


def tiled_points(path: Path) -> dict:
    """``{point: gpu_ms}`` of tiled's rows, the point as ``column=value`` strings."""
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        columns = BACKWARD_POINT if "pass" in (rows.fieldnames or ()) else POINT
        return {tuple(f"{c}={r[c]}" for c in columns): float(r["gpu_ms"]) for r in rows
                if r["backend"] == "tiled" and r["status"] == "ok" and r["gpu_ms"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path, nargs="+")
    parser.add_argument("--before-also", type=Path, nargs="+", default=[],
                        help="more runs of the code before (the best of each side is compared)")
    parser.add_argument("--within", type=float, default=0.02)
    parser.add_argument("--min-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    befores = [tiled_points(p) for p in [args.before] + args.before_also]
    afters = [tiled_points(p) for p in args.after]
    best = {k: min(b[k] for b in befores) for k in befores[0] if all(k in b for b in befores)}
    keys = [k for k in best if best[k] >= args.min_ms and all(k in a for a in afters)]
    if not keys:
        raise SystemExit("compare_sweeps: no point in common")
    ratios = {k: min(a[k] for a in afters) / best[k] for k in keys}
    geomean = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
    within = sum(r <= 1 + args.within for r in ratios.values())
    print(f"{len(keys)} points (gpu_ms >= {args.min_ms}): after / before geomean {geomean:.4f}, "
          f"{within}/{len(keys)} within {args.within:.0%}")
    for key, ratio in sorted(ratios.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {ratio:.3f}  " + " ".join(key))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
