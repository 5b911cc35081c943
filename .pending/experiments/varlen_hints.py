"""Experiment (session 42, for the next device session): a serving step's varlen launches with
other compiler hints, replayed from a CUDA graph, one process per setting.

    python .pending/experiments/varlen_hints.py main          # the kernels as they are
    python .pending/experiments/varlen_hints.py prefill8      # prefill tiles: 8 worker warps
    POINTS="[(8, 4096, 512), (32, 4096, 128)]" python .pending/experiments/varlen_hints.py main

Each point is (requests, keys, queries per request) on Llama-3-8B's attention (32/8 heads,
D=128, bf16), keys on shuffled pages of 256 slots (eval/paged_decode_bench.decode_step); modes
``paged`` and ``gathered`` as in that bench. ``prefill8`` replaces the hint-less kernel entries
with ``num_worker_warps=8``; with the pending decode-occupancy commits applied only the prefill
tiles and the decode row gathers still use those entries, without them the decode tiles change
too, so run it on the tree the commits made.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from eval.paged_decode_bench import decode_step  # noqa: E402
from hf_tiled_attention import varlen_attention  # noqa: E402
from hf_tiled_attention import varlen_kernel as K  # noqa: E402
from hf_tiled_attention.timing import graph_replay_ms  # noqa: E402

setting = sys.argv[1]
if setting == "prefill8":
    K.varlen_forward_kernel = K.varlen_forward_kernel.replace_hints(num_worker_warps=8)
    K.varlen_forward_paged_kernel = K.varlen_forward_paged_kernel.replace_hints(
        num_worker_warps=8)
elif setting != "main":
    raise SystemExit(f"setting must be main or prefill8, got {setting!r}")
points = eval(os.environ.get("POINTS", "[(8, 4096, 512), (32, 4096, 128), (4, 16384, 2048)]"))
for requests, keys, queries in points:
    q, ck, cv, slots, cu_q, cu_k = decode_step(requests, keys, 32, 8, 128, 256, "cuda",
                                               torch.bfloat16, queries=queries)
    kf, vf = ck[slots], cv[slots]
    out = torch.empty_like(q)
    flops = 4 * 32 * 128 * requests * (queries * keys - queries * (queries - 1) // 2)
    for mode, fn in (("paged", lambda: varlen_attention(q, ck, cv, cu_q, cu_k, queries,
                                                        key_slots=slots, out=out)),
                     ("gathered", lambda: varlen_attention(q, kf, vf, cu_q, cu_k, queries,
                                                           out=out))):
        ms = graph_replay_ms(fn, calls=10)
        print(f"{setting} R={requests} keys={keys} queries={queries} {mode}: {ms:.4f} ms "
              f"{flops / ms / 1e9:.1f} TF/s", flush=True)
    del q, ck, cv, slots, kf, vf
