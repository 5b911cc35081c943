#!/usr/bin/env bash
# The paged read on the patch's tree (carry .gpu and exp, a copy of .pending): 64- and 128-key
# tiles, with and without the prefetched slot, at two points, one process (8 compiles: about
# 4 minutes on a fresh host); the log comes back in $OUT (the CSVs stay in /tmp).
set -u
export PYTHONPATH=.:${PYTHONPATH:-}
mkdir -p "$OUT/r"
timeout "${1:-300}" python exp/paged_tiles.py /tmp/paged > "$OUT/r/log.txt" 2>&1; echo "rc $?"
grep -h "paged decode\|tile " "$OUT/r/log.txt"
grep -h -i "error\|Traceback" "$OUT/r/log.txt" | head -5
