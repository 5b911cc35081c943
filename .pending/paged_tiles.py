"""Experiment: the paged decode read on this tree with 64- then 128-key decode tiles, one
process (``python exp/paged_tiles.py OUT_DIR``; R=32 x 16k and R=256 x 4k keys, as perf-notes
steps 52-56)."""
import sys
from pathlib import Path

import hf_tiled_attention.varlen as varlen
from eval import paged_decode_bench

out = Path(sys.argv[1])
original = varlen.varlen_tiles
for requests, keys in ((32, 16384), (256, 4096)):
    for tile in (64, 128):
        varlen.varlen_tiles = lambda q, g, paged, tile=tile: (
            (16, tile) if paged and q * g <= 16 else original(q, g, paged))
        print(f"tile {tile}", flush=True)
        paged_decode_bench.main(["--requests", str(requests), "--keys", str(keys), "--reps",
                                 "30", "--out", str(out / f"t{tile}-r{requests}-k{keys}")])
