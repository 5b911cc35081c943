"""Dev: forward+backward with a trainable additive bias (1, Hq, S, S): tiled (both modes) vs sdpa."""
import sys, torch, torch.nn.functional as F
import hf_tiled_attention as hta
from torch.nn.attention import SDPBackend, sdpa_kernel
def bench(fn, reps=10):
    for _ in range(2): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]
for B, S, HQ, HKV, shape in ((4, 2048, 32, 8, "heads"),):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HQ, S, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(B, HKV, S, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(B, HKV, S, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    bshape = (1, HQ, S, S) if shape == "heads" else (B, 1, 1, S)
    bias = (torch.randn(bshape, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    do = torch.randn(B, HQ, S, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    row = {}
    def run_tiled():
        out = hta.tiled_attention(q, k, v, bias)
        return torch.autograd.grad(out, (q, k, v, bias), do)
    for mode in (False, True):
        hta.set_deterministic(mode); row[f"tiled_det={mode}"] = bench(run_tiled); got = run_tiled()
    hta.set_deterministic(None)
    for name, kind in (("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_math", SDPBackend.MATH)):
        def run_sdpa():
            with sdpa_kernel(kind):
                kk, vv = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
                out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias)
            return torch.autograd.grad(out, (q, k, v, bias), do)
        try:
            row[name] = bench(run_sdpa); want = run_sdpa()
            row[name + "_dmask_err"] = ((got[3].float() - want[3].float()).abs().max() / want[3].float().abs().max()).item()
        except Exception as e:
            row[name] = f"fail {type(e).__name__}: {str(e)[:80]}"
    print(B, S, shape, {k2: (round(x, 3) if isinstance(x, float) else x) for k2, x in row.items()}, flush=True)
