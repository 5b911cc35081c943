"""Experiment (session 43, for the next device session): where a short paged decode step's time
goes, launch by launch, replayed from a CUDA graph.

    python .pending/experiments/paged_launch_parts.py
    POINTS="[(64, 1024), (128, 1024), (32, 4096)]" python .pending/experiments/paged_launch_parts.py

A paged varlen call is three launches (varlen.launches): the marking of requests whose key
tiles are whole blocks, the block-load launch, and the row-gathering launch (which, when every
request is whole, only reads its request's mark and exits). On the H200 (perf-notes step 64)
64 x 1k keys took 0.1056 ms paged against 0.0867 gathered (one launch): 19 us, about what two
more dependent launches could cost. This times each launch alone, each pair, and all three,
beside the gathered call; the copy rate of the same bytes for scale. Points: (requests, keys),
one query each, Llama-3-8B attention (32/8 heads, D=128, bf16), pages of 256 shuffled.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from eval.paged_decode_bench import decode_step  # noqa: E402
from hf_tiled_attention import varlen  # noqa: E402
from hf_tiled_attention.launch import launch_each  # noqa: E402
from hf_tiled_attention.timing import graph_replay_ms  # noqa: E402


points = eval(os.environ.get("POINTS", "[(64, 1024), (128, 1024), (256, 1024), (32, 4096)]"))
for requests, keys in points:
    q, ck, cv, slots, cu_q, cu_k = decode_step(requests, keys, 32, 8, 128, 256, "cuda",
                                               torch.bfloat16)
    kf, vf = ck[slots], cv[slots]
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    parts = varlen.launches(q, ck, cv, cu_q, cu_k, 1, scale, None, None, None, slots, out)
    names = ["mark", "blocks", "rows"]
    assert len(parts) == 3, len(parts)

    def run(chosen):
        return lambda: launch_each(q.device, [parts[i] for i in chosen])

    mb = 2 * kf.numel() * kf.element_size() / 1e6
    copy_ms = graph_replay_ms(lambda: (kf.clone(), vf.clone()), calls=10)
    rows = {"copy of K and V": copy_ms}
    for chosen in ([0], [1], [2], [0, 1], [1, 2], [0, 1, 2]):
        rows["+".join(names[i] for i in chosen)] = graph_replay_ms(run(chosen), calls=20)
    rows["paged call (varlen_attention)"] = graph_replay_ms(
        lambda: varlen.varlen_attention(q, ck, cv, cu_q, cu_k, 1, key_slots=slots, out=out),
        calls=20)
    rows["gathered call"] = graph_replay_ms(
        lambda: varlen.varlen_attention(q, kf, vf, cu_q, cu_k, 1, out=out), calls=20)
    for name, ms in rows.items():
        print(f"R={requests} keys={keys} ({mb:.0f} MB of K/V) {name}: {ms * 1e3:.1f} us",
              flush=True)
    del q, ck, cv, slots, kf, vf, out
