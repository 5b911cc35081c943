"""Experiment (session 49, for the next device session): where transformers 5.19+'s decode call,
`flash_attn_with_kvcache`, spends the 14-19 us it costs over its attention launch alone when
replayed from a CUDA graph (perf-notes step 71; queued back to back it costs 5-11 us).

    python .pending/experiments/kvcache_call_parts.py
    POINTS="[(32, 2048), (64, 1024)]" python .pending/experiments/kvcache_call_parts.py

The call is two launches on a GPU: the bookkeeping (kvcache_kernel.py: the new tokens written,
the key offsets and the slot list) and the attention over the call's layout. Timed from a
graph, 20 calls a replay, each line alone: the bookkeeping launch into buffers made once, the
same with a batch of no new tokens (offsets and slot list only), the attention alone
(paged_decode_bench's `pages-as-kvcache`), both launches into buffers made once, and the whole
call as a user makes it. Points: (requests, keys), one query each, Llama-3-8B attention (32/8
heads, D=128, bf16), pages of 256 shuffled. Session 50 (perf-notes step 72): the whole call's
extra 10 us over both launches were its layouts made again inside the capture.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from eval.paged_decode_bench import decode_step, kvcache_layout  # noqa: E402
from hf_tiled_attention.flash_interface import (_layout, append_launch,  # noqa: E402
                                                flash_attn_with_kvcache)
from hf_tiled_attention.launch import launch_each  # noqa: E402
from hf_tiled_attention.timing import graph_replay_ms  # noqa: E402
from hf_tiled_attention.varlen import varlen_attention_on_pages  # noqa: E402


PAGE = 256
points = eval(os.environ.get("POINTS", "[(32, 1024), (32, 2048), (64, 1024), (256, 1024)]"))
for requests, keys in points:
    q, cache_k, cache_v, slots, _, _ = decode_step(requests, keys, 32, 8, 128, PAGE, "cuda",
                                                   torch.bfloat16)
    table = (slots.view(requests, keys)[:, ::PAGE] // PAGE).to(torch.int32)
    new_k, new_v = (cache[slots].view(requests, keys, 8, 128)[:, keys - 1:].contiguous()
                    for cache in (cache_k, cache_v))
    seqlens = torch.full((requests,), keys - 1, dtype=torch.int32, device="cuda")
    cu_q, cu_k_call, slots_call = kvcache_layout(table, keys, 1, PAGE)
    cu_k = torch.empty_like(_layout(requests, 1, table.shape[1], PAGE, q.device)[1])
    slot_list = torch.empty(requests, table.shape[1] * PAGE, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)

    def bookkeeping(k=new_k, v=new_v):
        launch_each(q.device, [append_launch(table, seqlens, k, v, cache_k, cache_v, cu_k,
                                             slot_list, PAGE)])

    def attention(cu_k_rows=cu_k_call, key_slots=slots_call):
        varlen_attention_on_pages(q, cache_k, cache_v, cu_q, cu_k_rows, 1, key_slots=key_slots,
                                  key_pages=PAGE, out=out, every_row=True)

    pages = (-1, PAGE, 8, 128)
    rows = {
        "bookkeeping launch": bookkeeping,
        "bookkeeping, no new tokens": lambda: bookkeeping(new_k[:, :0], new_v[:, :0]),
        "attention alone (pages-as-kvcache)": attention,
        "both launches, buffers made once": lambda: (
            bookkeeping(), attention(cu_k[:2 * requests + 1], slot_list.flatten())),
        "whole call": lambda: flash_attn_with_kvcache(
            q.view(requests, 1, 32, 128), cache_k.view(pages), cache_v.view(pages), new_k,
            new_v, cache_seqlens=seqlens, block_table=table, causal=True),
    }
    mb = 2 * slots.numel() * 8 * 128 * 2 / 1e6
    for name, fn in rows.items():
        try:   # one part that fails (a batch of no new tokens, say) leaves the others' lines
            result = f"{graph_replay_ms(fn, calls=20) * 1e3:.1f} us"
        except Exception as exc:  # noqa: BLE001
            result = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        print(f"R={requests} keys={keys} ({mb:.0f} MB of K/V) {name}: {result}", flush=True)
    del q, cache_k, cache_v, slots, out, slot_list
