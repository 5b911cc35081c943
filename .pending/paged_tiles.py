"""Experiment: the paged decode read on this tree with 64- and 128-key decode tiles, the next
block's slot prefetched or not, one process (``python exp/paged_tiles.py OUT_DIR``; R=32 x 16k
and R=256 x 4k keys, as perf-notes steps 52-56)."""
import sys
from pathlib import Path

import hf_tiled_attention.varlen as varlen
from eval import paged_decode_bench

out = Path(sys.argv[1])
original = varlen.varlen_tiles
for requests, keys in ((32, 16384), (256, 4096)):
    for tile in (64, 128):
        for prefetch in (True, False):
            varlen.varlen_tiles = lambda q, g, paged, tile=tile: (
                (16, tile) if paged and q * g <= 16 else original(q, g, paged))
            varlen.VARLEN_PREFETCH_SLOT = prefetch
            print(f"tile {tile} prefetch {prefetch}", flush=True)
            paged_decode_bench.main(["--requests", str(requests), "--keys", str(keys), "--reps",
                                     "30", "--out", str(out / f"t{tile}-p{int(prefetch)}-r{requests}-k{keys}")])
