"""Experiment (session 45, for the next device session): prompt chunks read from the cache
against the same chunks over gathered keys, under load-schedule variants of the prefill tiles.

    python .pending/experiments/paged_prefill_variants.py
    POINTS="[(8, 128, 4096)]" VARIANTS="['compiler', 'latency 2/4']" python .pending/...

On an H100 (perf-notes step 66) a chunk through the cache ran at 0.54-0.69x the TF/s of the
same chunk over gathered keys. The sm_90 cubins differ in the edge tiles' V zeroing and in the
next tile's address waiting on a slot read one tile ahead. Variants: the compiler's load
schedule (main's), latency hints on K/V (schedule.VARLEN_PREFILL_LATENCY: the forward kernel's
2/4, and 1/1, 8/8), and no slot prefetch. Each point: graph replay, TF/s of the causal chunk;
`gathered` is the packed kernel on K/V gathered beforehand (no page lookups). Points:
(requests, queries each, keys each), Llama-3-8B attention (32/8 heads, D=128, bf16), pages of
256 shuffled. Each variant compiles its own prefill kernels (tens of seconds on a cold host).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from eval.paged_decode_bench import decode_step  # noqa: E402
from hf_tiled_attention import varlen  # noqa: E402
from hf_tiled_attention.timing import graph_replay_ms  # noqa: E402

SETTINGS = {  # name -> (VARLEN_PREFILL_LATENCY, VARLEN_PREFETCH_SLOT)
    "compiler": ((None, None), True),
    "latency 2/4": ((2, 4), True),
    "latency 1/1": ((1, 1), True),
    "latency 8/8": ((8, 8), True),
    "no prefetch": ((None, None), False),
    "latency 4/4": ((4, 4), True),
    "latency 2/8": ((2, 8), True),
    "latency 4/8": ((4, 8), True),
    "latency 3/6": ((3, 6), True),
}
points = eval(os.environ.get("POINTS", "[(8, 128, 4096), (32, 128, 4096), (8, 512, 4096)]"))
variants = eval(os.environ.get("VARIANTS", repr(list(SETTINGS))))
for requests, queries, keys in points:
    q, ck, cv, slots, cu_q, cu_k = decode_step(requests, keys, 32, 8, 128, 256, "cuda",
                                               torch.bfloat16, queries=queries)
    kf, vf = ck[slots], cv[slots]
    out = torch.empty_like(q)
    pairs = requests * (queries * keys - queries * (queries - 1) // 2)
    flops = 4 * 32 * 128 * pairs
    want = varlen.varlen_attention(q, kf, vf, cu_q, cu_k, queries).float()
    for name in variants:
        varlen.VARLEN_PREFILL_LATENCY, varlen.VARLEN_PREFETCH_SLOT = SETTINGS[name]
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
