"""Dev script (issue 27, session 22): host time of the pieces of a repeated decode call on the
H200 host, and of cuTile's launch against the number of array arguments.

    python eval/results/nvidia-h200/generate/issue27-session22/launch_cost_dev.py
"""
import statistics
import sys
import time
from pathlib import Path

import cuda.tile as ct
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))
from hf_tiled_attention.launch import _launch, kernel_with_hints, placeholders  # noqa: E402
from hf_tiled_attention.transformers_backend import (_repeat_key,  # noqa: E402
                                                     tiled_attention_forward)
from hf_tiled_attention.transformers_mask import tiled_mask  # noqa: E402


def one(A):
    t = ct.load(A, index=(0,), shape=(16,))
    ct.store(A, index=(0,), tile=t)


def four(A, B, C, D):
    t = ct.load(A, index=(0,), shape=(16,))
    ct.store(A, index=(0,), tile=t)


def nine(A, B, C, D, E, F_, G, H, I_):
    t = ct.load(A, index=(0,), shape=(16,))
    ct.store(A, index=(0,), tile=t)


def nine4d(A, B, C, D, E, F_, G, H, I_):
    t = ct.load(A, index=(0, 0, 0, 0), shape=(1, 1, 1, 16))
    ct.store(A, index=(0, 0, 0, 0), tile=t)


KERNELS = {n: ct.kernel(f) for n, f in ((1, one), (4, four), (9, nine))}
NINE4D = ct.kernel(nine4d)


def host_us(fn, calls=200, rounds=7):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


@torch.no_grad()
def main():
    B, HQ, HKV, S, D = 1, 32, 8, 1024, 128
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    class Layer(torch.nn.Module):
        is_causal = True
        config = None
        num_key_value_groups = HQ // HKV

    layer = Layer().eval()
    mask = tiled_mask(B, 1, S, q_offset=S - 1)
    tiled_attention_forward(layer, q, k, v, mask, scaling=D ** -0.5)
    entry = next(value for key, value in mask._memo.items()
                 if isinstance(key, tuple) and key[:1] == ("repeat",))
    _, call, relaunch = entry
    print("relaunch:", relaunch is not None, "splits", call.plan.kv_splits, "grid",
          call.plan.grid)
    stream = relaunch.stream
    out = torch.empty(relaunch.out_shape, dtype=q.dtype, device=q.device)
    out_rows = out.as_strided(*relaunch.out_rows)
    q_rows = q if relaunch.query_rows is None else q.as_strided(*relaunch.query_rows)
    attention = (q_rows, k, v, out_rows) + relaunch.attention_tail
    plan = call.plan
    # The nine-array entry on the same call (placeholders for what it never reads), against
    # the four-array one the relaunch passes (LaunchPlan.lean).
    v_ = plan.variant
    full_kernel = kernel_with_hints(v_.occupancy, v_.num_ctas, v_.num_worker_warps, None, False)
    unused = placeholders(q.device, 4 if v_.g_tile > 1 else 3, True)
    nine_args = (q_rows, k, v, out_rows, unused.lse, unused.mask, unused.states,
                 unused.ranges, ()) + plan.trailing_args
    print("lean plan:", plan.lean, "relaunch arrays:", len(attention))
    ref = relaunch.launch(q, k, v)
    ct.launch(stream, plan.grid, full_kernel, nine_args)
    torch.cuda.synchronize()
    print("nine-array entry: max |diff| against the relaunch's output",
          (out.float() - ref.float()).abs().max().item())
    rows = {
        "ct.launch nine-array entry, args built": lambda: ct.launch(
            stream, plan.grid, full_kernel, nine_args),
        "model's layer call": lambda: tiled_attention_forward(layer, q, k, v, mask,
                                                               scaling=D ** -0.5),
        "relaunch.launch": lambda: relaunch.launch(q, k, v),
        "call.launch (run_kernel)": lambda: call.launch(q, k, v),
        "_launch, args built": lambda: _launch(ct, stream, plan, attention, None),
        "ct.launch, args built": lambda: ct.launch(stream, plan.grid, plan.kernel,
                                                   attention + plan.trailing_args),
        "_repeat_key": lambda: _repeat_key(layer, q, k, v, D ** -0.5, 0.0, {}),
        "torch.empty out": lambda: torch.empty(relaunch.out_shape, dtype=q.dtype,
                                               device=q.device),
        "as_strided": lambda: out.as_strided(*relaunch.out_rows),
        "device + stream check": lambda: (torch._C._cuda_getDevice(),
                                          torch._C._cuda_getCurrentRawStream(0)),
        "sdpa (enable_gqa)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    a = torch.zeros(64, device="cuda")
    arrays4d = [torch.zeros(1, 1, 1, 64, device="cuda") for _ in range(9)]
    for n, kernel in KERNELS.items():
        rows[f"ct.launch, {n} 1-D arrays"] = (
            lambda kernel=kernel, n=n: ct.launch(stream, (1, 1, 1), kernel, (a,) * n))
    rows["ct.launch, 9 4-D arrays"] = lambda: ct.launch(stream, (1, 1, 1), NINE4D,
                                                        tuple(arrays4d))
    for name, fn in rows.items():
        print(f"{name:50s} {host_us(fn):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
