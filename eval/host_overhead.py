"""Where a short call's time goes: host work vs GPU work, tiled next to sdpa (GPU only).

For each path it prints the CUDA-event median of one call (what kernel_bench reports: it
includes the host's launch latency when the GPU is idle), the host time per call (200 calls
queued without synchronising) and the time per call back to back (GPU-bound unless the host is
slower), then the cost of the launcher's pieces. The transformers rows call each backend's
attention function as a model layer does (decode: one query against the cache).

    python eval/host_overhead.py                      # B=16, 32/8 heads, S=1024, D=128, causal
    python eval/host_overhead.py --batch 1 --seq-q 1 --seq 16384      # decode

Without a GPU, ``--stub-launch`` times the host path alone (on any machine): the op takes its
kernel path on CPU tensors with ``cuda.tile.launch`` a no-op, so every line is Python and torch
work the host does before the GPU sees a launch (the two ``ct.launch`` calls themselves, about
10-13 us each on the H200 host, are not in it). Everything but the training row (a forward
that autograd records, and its backward) is timed under ``torch.no_grad()``. The row "tiled,
model's layers" is the call as a model's second and later layers make it (with the mask its
mask function made: they repeat the first layer's launch); "transformers tiled" passes no mask,
which takes the adapter's full path every time. With one query (``--seq-q 1``) two rows time
``varlen_attention`` as continuous batching calls it for a decode step (``--batch`` requests of
``--seq`` keys each, on shuffled pages of 256 slots: "varlen paged", what "paged|tiled" runs;
"varlen gathered", the keys in request order): transformers 5.17 captures no CUDA graph for
"paged|tiled", so a short step's host work is the step's time:

    python eval/host_overhead.py --stub-launch --batch 8 --seq-q 1 --seq 8192
    python eval/host_overhead.py --batch 64 --seq-q 1 --seq 1024

Results of earlier runs: eval/results/nvidia-h200/decode/host-overhead-*.txt,
eval/results/nvidia-h200/train/host-overhead-*.txt and, older,
eval/results/nvidia-h200/archive/kernel-two-warpgroups-2026-11-30-6d558b1/host-overhead-*.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention as hta  # noqa: E402
from hf_tiled_attention.call_options import call_options  # noqa: E402
from hf_tiled_attention.launch import (launch_arrays, plan_launch,  # noqa: E402
                                       run_kernel)
from hf_tiled_attention.schedule import resolve_schedule  # noqa: E402
from hf_tiled_attention.timing import median_ms  # noqa: E402
from eval.common import parse_heads  # noqa: E402

CALLS = 200
STUB_CALLS = 2000  # host work alone: more calls per round for the same resolution


@contextlib.contextmanager
def stubbed_launch():
    """The op's kernel path on CPU tensors with every launch a no-op (sm_90, 132 SMs assumed)."""
    import cuda.tile as ct
    from hf_tiled_attention import op

    with contextlib.ExitStack() as stack:
        for target, value in ((op, {"kernel_available": lambda device: True,
                                    "sm_count": lambda device: 132,
                                    "_arch_major": lambda device: 9}),
                              (ct, {"launch": lambda *args, **options: None}),
                              (torch._C, {"_cuda_getCurrentRawStream": lambda index: 0}),
                              (torch._C, {"_cuda_getDevice": lambda: None})):
            for name, stub in value.items():
                stack.enter_context(mock.patch.object(target, name, stub, create=True))
        hta.clear_caches()  # plans made here must not leak out, nor real ones in
        try:
            yield
        finally:
            hta.clear_caches()


def per_call_ms(fn, calls: int = CALLS, cuda: bool = True) -> tuple[float, float]:
    """(host ms per call with calls queued, ms per call back to back incl. the GPU; without
    ``cuda`` both are the host's)."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    if cuda:
        torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / calls * 1e3


@torch.no_grad()  # as generate() runs (with autograd on, the op also checks requires_grad)
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", default="32/8", help="Hq/Hkv")
    parser.add_argument("--seq", type=int, default=1024, help="keys")
    parser.add_argument("--seq-q", type=int, default=0, help="queries (0: as many as keys)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--stub-launch", action="store_true",
                        help="time the host path alone on CPU tensors, launches stubbed")
    args = parser.parse_args(argv)
    if not args.stub_launch and not torch.cuda.is_available():
        raise SystemExit("host_overhead: needs a CUDA GPU (it times host work against GPU work); "
                         "--stub-launch times the host path alone without one")
    from hf_tiled_attention.transformers_backend import tiled_attention_forward
    from hf_tiled_attention.transformers_mask import tiled_mask

    hq, hkv = parse_heads(args.heads)
    d, scale = args.head_dim, args.head_dim ** -0.5
    seq_q = args.seq_q or args.seq
    device = "cpu" if args.stub_launch else "cuda"
    # The query as a model layer hands it over: a (B, S, H, D) projection viewed as (B, H, S, D).
    q = torch.randn(args.batch, seq_q, hq, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(args.batch, hkv, args.seq, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sm_count = 132 if args.stub_launch else torch.cuda.get_device_properties(
        q.device).multi_processor_count
    plan = plan_launch(q, k, call_options(None, causal=True, scale=scale,
                                          diag_offset=args.seq - seq_q),
                       resolve_schedule(None, 9, q.dtype, d, True, seq_q=seq_q, seq_kv=args.seq),
                       sm_count=sm_count)
    print(f"plan: grid {plan.grid}, kv_splits {plan.kv_splits}, rows per tile "
          f"{plan.variant.tile_m} (query heads packed: {plan.variant.g_tile})")

    class Layer(torch.nn.Module):  # what the attention functions read off a model's layer
        is_causal = True
        config = None
        num_key_value_groups = hq // hkv

    layer = Layer().eval()
    layer_mask = tiled_mask(args.batch, seq_q, args.seq, q_offset=args.seq - seq_q)
    # Training (the one path timed with grad enabled): the forward as autograd records it,
    # and its backward.
    q_grad, k_grad, v_grad = (t.detach().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn_like(q)

    def forward_and_backward():
        with torch.enable_grad():
            out = hta.tiled_attention(q_grad, k_grad, v_grad, is_causal=True)
            torch.autograd.grad(out, (q_grad, k_grad, v_grad), grad_out)

    tiled_paths = {
        "tiled_attention": lambda: hta.tiled_attention(q, k, v, is_causal=True),
        "training fwd + bwd": forward_and_backward,
        "torch.ops custom op": lambda: torch.ops.hf_tiled_attention.attention(
            q, k, v, None, 0, True, scale, 0, 0.0, args.seq - seq_q, hta.Schedule().as_list(),
            None, [], False),
        "run_kernel only": lambda: run_kernel(plan, q, k, v, None),
        "transformers tiled": lambda: tiled_attention_forward(layer, q, k, v, None,
                                                              scaling=scale),
        # As a model's layers call it: with the mask its mask function made for the forward,
        # whose first layer's launch the others repeat.
        "tiled, model's layers": lambda: tiled_attention_forward(layer, q, k, v, layer_mask,
                                                                 scaling=scale),
    }
    if seq_q == 1:  # a continuous-batching decode step over the same keys per request
        from eval.paged_decode_bench import decode_step
        vq, cache_k, cache_v, slots, cu_q, cu_k = decode_step(args.batch, args.seq, hq, hkv, d,
                                                              256, device, torch.bfloat16)
        k_flat, v_flat = cache_k[slots], cache_v[slots]
        v_out = torch.empty_like(vq)
        tiled_paths["varlen paged"] = lambda: hta.varlen_attention(
            vq, cache_k, cache_v, cu_q, cu_k, 1, key_slots=slots, out=v_out)
        tiled_paths["varlen gathered"] = lambda: hta.varlen_attention(
            vq, k_flat, v_flat, cu_q, cu_k, 1, out=v_out)
    if args.stub_launch:
        with stubbed_launch():
            # (0: the stubbed current stream, whose next calls reuse the split workspace)
            tiled_paths["launch_arrays only"] = lambda: launch_arrays(plan, q, k, v, None, 0)
            for name, fn in tiled_paths.items():
                per_call_ms(fn, STUB_CALLS // 10, cuda=False)  # warm-up
                # Median of 7 rounds: this CPU's scheduling hiccups stay out of the number.
                us = statistics.median(per_call_ms(fn, STUB_CALLS, cuda=False)[0]
                                       for _ in range(7)) * 1e3
                print(f"{name:22s} host/call {us:.1f} us (launches stubbed)", flush=True)
        return 0

    import cuda.tile as ct
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    arrays = launch_arrays(plan, q, k, v, None)
    kernel, stream = plan.kernel, torch.cuda.current_stream()
    causal_sdpa = seq_q > 1  # SDPA's is_causal is top-left aligned; one query sees every key
    paths = dict(tiled_paths)
    paths.update({
        "bare ct.launch": lambda: ct.launch(stream, plan.grid, kernel,
                                            arrays.attention + plan.trailing_args),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal_sdpa,
                                                       enable_gqa=True),
        "transformers sdpa": lambda: sdpa_attention_forward(layer, q, k, v, None, scaling=scale,
                                                            is_causal=causal_sdpa),
    })
    for name, fn in paths.items():
        for _ in range(20):  # compile and warm up
            fn()
        event = median_ms(fn, cuda=True, warmup=5, reps=50)
        host, total = per_call_ms(fn)
        print(f"{name:22s} event-median {event:.3f} ms   host/call {host:.3f} ms   "
              f"back-to-back/call {total:.3f} ms", flush=True)

    def device_context():
        with torch.cuda.device(q.device):
            pass

    for name, fn in {"torch.cuda.device ctx": device_context,
                     "one tiny torch.empty": lambda: torch.empty(1, device=q.device)}.items():
        print(f"{name:22s} host/call {per_call_ms(fn)[0]:.4f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
