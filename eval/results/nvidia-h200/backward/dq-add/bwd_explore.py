"""Dev script (not the repo's harness): backward latency of candidate BackwardSchedules with
dq_add (dQ made in the dK/dV kernel, TMA reduce-adds) against the deterministic two-kernel
default, cuDNN and FA2, one process, median of 20 synchronised calls after 3 warm-ups.

    python bwd_explore.py compile D CONFIG CAUSAL   # one variant per process: fills cuTile's cache
    python bwd_explore.py time OUT.json"""
import dataclasses, json, math, sys, time
import torch
import torch.nn.functional as F
import hf_tiled_attention as hta
from hf_tiled_attention import backward_launch as BL
from hf_tiled_attention.schedule import BackwardSchedule, set_backward_schedule

def S(**kw): return BackwardSchedule(**kw)
CONFIGS = {
    64: {"det": None, "add64x64": S(kv_keys=64, kv_queries=64, q_rows=64, q_keys=64, kv_warps=4, q_warps=4, kv_occupancy=2, q_occupancy=2, dq_add=True),
         "add128x64": S(kv_keys=128, kv_queries=64, q_rows=64, q_keys=64, dq_add=True)},
    128: {"det": None, "add64x64": S(kv_keys=64, kv_queries=64, q_rows=128, q_keys=64, dq_add=True),
          "add128x16": S(kv_keys=128, kv_queries=16, q_rows=128, q_keys=64, dq_add=True),
          "add64x32": S(kv_keys=64, kv_queries=32, q_rows=128, q_keys=64, dq_add=True)},
    256: {"det": None, "add64x64": S(kv_keys=64, kv_queries=64, q_rows=128, q_keys=32, rows_tile=32, dq_add=True)},
}
POINTS = [(128, 4, 4096, 32, 8, True), (128, 4, 4096, 32, 8, False), (128, 16, 1024, 32, 8, True),
          (128, 1, 16384, 32, 8, True), (64, 4, 4096, 32, 32, True), (64, 4, 4096, 32, 32, False),
          (64, 16, 1024, 32, 32, True), (256, 4, 2048, 16, 16, True)]

def use(d, name):
    """Deterministic mode with the table's schedule ("det"), or the fast mode with a candidate
    (as run on the H200: the same override, then made by monkeypatching backward_schedule)."""
    sched = CONFIGS[d][name]
    hta.set_deterministic(sched is None)
    set_backward_schedule(sched)

def inputs(d, b, s, hq, hkv, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    do = torch.randn(b, hq, s, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, do

def bench(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2]

def main(argv):
    """``compile D CONFIG CAUSAL`` or ``time OUT.json`` (the docstring's two modes), with
    this module's CONFIGS and POINTS (another script may replace them first)."""
    mode = argv[0]
    if mode == "compile":  # one (d, config, causal) per process: fills cuTile's disk cache
        d, name, causal = int(argv[1]), argv[2], argv[3] == "1"
        use(d, name)
        q, k, v, do = inputs(d, 1, 256, 4, 2 if d == 128 else 4)
        out = hta.tiled_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), do)
        torch.cuda.synchronize(); print("compiled", d, name, causal, flush=True)
        return

    results = []
    for d, b, s, hq, hkv, causal in POINTS:
        q, k, v, do = inputs(d, b, s, hq, hkv)
        pairs = b * hq * (s * (s + 1) / 2 if causal else s * s)
        flops = 2.5 * 4 * pairs * d
        from torch.nn.attention import SDPBackend, sdpa_kernel
        row = dict(d=d, b=b, s=s, heads=f"{hq}/{hkv}", causal=causal)
        for backend, kind in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(kind):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
                g = torch.empty_like(out).copy_(do)
                row[backend] = bench(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
                if backend == "cudnn": ref = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            except Exception as e:
                row[backend] = None; print(backend, "failed", e)
        for name in CONFIGS[d]:
            use(d, name)
            out = hta.tiled_attention(q, k, v, is_causal=causal)
            g = torch.empty_like(out).copy_(do)
            grads = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            err = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(grads, ref))
            row[name] = bench(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
            row[name + "_err"] = round(err, 4)
        best = min(row[n] for n in CONFIGS[d])
        row["det_vs_cudnn"] = round(row["cudnn"] / row["det"], 3) if row.get("cudnn") else None
        row["best_vs_cudnn"] = round(row["cudnn"] / best, 3) if row.get("cudnn") else None
        print(json.dumps(row), flush=True)
        results.append(row)
        del q, k, v, do, out, g, grads
    hta.set_deterministic(None)
    json.dump(results, open(argv[1], "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
