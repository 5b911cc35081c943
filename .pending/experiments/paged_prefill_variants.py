"""Experiment (sessions 45-46): prompt chunks read from the cache against the same chunks over
gathered keys, under load-schedule variants of the varlen kernel's tiles.

    python .pending/experiments/paged_prefill_variants.py
    POINTS="[(8, 128, 4096)]" VARIANTS="['compiler', 'latency 2/4']" python .pending/...

Session 46 (H100, perf-notes step 67, eval/results/nvidia-h100/serve/paged-prefill-variants.txt)
ran the hint settings: 2/4 (the forward kernel's) won on both modes and is main's default; a
chunk through the cache still runs at 0.72-0.77x the gathered keys' TF/s, and under the
compiler's hints it ran faster without the slot prefetch. The default variants now are the
slots loaded 0, 1 or 2 tiles ahead (schedule.VARLEN_PREFETCH_TILES, decode and prefill tiles
alike), under 2/4 and under the compiler's hints. Each point: graph replay, TF/s of the causal
chunk (decode points, one query: time only); `gathered` is the packed kernel on K/V gathered
beforehand (no page lookups). Points: (requests, queries each, keys each), Llama-3-8B
attention (32/8 heads, D=128, bf16), pages of 256 shuffled. Each variant compiles its own
kernels (tens of seconds on a cold host).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from eval.paged_decode_bench import decode_step  # noqa: E402
from hf_tiled_attention import varlen  # noqa: E402
from hf_tiled_attention.timing import graph_replay_ms  # noqa: E402

SETTINGS = {  # name -> (VARLEN_PREFILL_LATENCY, slots loaded ahead by prefill tiles)
    "compiler": ((None, None), 1),
    "latency 2/4": ((2, 4), 1),
    "latency 1/1": ((1, 1), 1),
    "latency 8/8": ((8, 8), 1),
    "no prefetch": ((None, None), 0),
    "latency 4/4": ((4, 4), 1),
    "latency 2/8": ((2, 8), 1),
    "latency 4/8": ((4, 8), 1),
    "latency 3/6": ((3, 6), 1),
    "2/4 no prefetch": ((2, 4), 0),
    "2/4 two ahead": ((2, 4), 2),
    "compiler two ahead": ((None, None), 2),
}
NEXT = ["latency 2/4", "2/4 no prefetch", "2/4 two ahead", "compiler", "no prefetch",
        "compiler two ahead"]
points = eval(os.environ.get("POINTS", "[(8, 128, 4096), (32, 128, 4096), (8, 512, 4096), "
                                       "(64, 1, 1024), (32, 1, 4096)]"))
variants = eval(os.environ.get("VARIANTS", repr(NEXT)))
for requests, queries, keys in points:
    q, ck, cv, slots, cu_q, cu_k = decode_step(requests, keys, 32, 8, 128, 256, "cuda",
                                               torch.bfloat16, queries=queries)
    kf, vf = ck[slots], cv[slots]
    out = torch.empty_like(q)
    pairs = requests * (queries * keys - queries * (queries - 1) // 2)
    flops = 4 * 32 * 128 * pairs
    want = varlen.varlen_attention(q, kf, vf, cu_q, cu_k, queries).float()
    for name in variants:
        varlen.VARLEN_PREFILL_LATENCY, ahead = SETTINGS[name]
        varlen.VARLEN_PREFETCH_TILES = (ahead, ahead)
        calls = {
            "paged-pages": lambda: varlen.varlen_attention_on_pages(
                q, ck, cv, cu_q, cu_k, queries, key_slots=slots, key_pages=256, out=out),
            "gathered": lambda: varlen.varlen_attention(q, kf, vf, cu_q, cu_k, queries, out=out),
        }
        for mode, call in calls.items():
            err = (call().float() - want).abs().max().item()
            ms = graph_replay_ms(call, calls=20)
            print(f"R={requests} queries={queries} keys={keys} {name:12s} {mode:12s}: "
                  f"{ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TF/s err {err:.1e}", flush=True)
    del q, ck, cv, slots, kf, vf, out
