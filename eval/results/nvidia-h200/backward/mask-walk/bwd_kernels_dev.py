"""Dev: per-kernel GPU time of one variant's backward, tiled vs flex (torch.profiler), and the
whole backward's median (CUDA events). --warm-only: compile and leave (fills the caches).
--schedule k=v,...: a BackwardSchedule for tiled."""
import sys, statistics, argparse
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
import hf_tiled_attention as hta
from hf_tiled_attention.schedule import BackwardSchedule, set_backward_schedule
from eval import backward_bench as bb

p = argparse.ArgumentParser()
p.add_argument("variant"); p.add_argument("--warm-only", action="store_true")
p.add_argument("--batch", type=int, default=4); p.add_argument("--seq", type=int, default=4096)
p.add_argument("--backends", nargs="+", default=["tiled", "flex"])
p.add_argument("--schedule", default="")
a = p.parse_args()
if a.schedule:
    from dataclasses import replace
    from hf_tiled_attention.schedule import backward_schedule
    kw = {k: (int(v) if v.isdigit() else v == "True") for k, v in (x.split("=") for x in a.schedule.split(","))}
    set_backward_schedule(replace(backward_schedule(128), **kw))
B, S, HQ, HKV, D = a.batch, a.seq, 32, 8, 128
dev = "cuda"
if a.variant == "builtin-causal":
    spec = bb.call_spec("none", B, HQ, S, True, dev)
else:
    spec = bb.call_spec(a.variant, B, HQ, S, None, dev)
g = torch.Generator(device=dev).manual_seed(0)
q = torch.randn(B, HQ, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
k = torch.randn(B, HKV, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
v = torch.randn(B, HKV, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
do = torch.randn(q.shape, device=dev, dtype=torch.bfloat16, generator=g)
for backend in a.backends:
    call = bb.make_call(backend, spec, B, HQ, S, dev)
    out = call(q, k, v)
    grad = torch.empty_like(out).copy_(do)
    bwd = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    for _ in range(3):
        bwd()
    torch.cuda.synchronize()
    if a.warm_only:
        continue
    times = []
    for _ in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); bwd(); e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            bwd()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] = per.get(ev.name, 0.0) + ev.device_time / 10
    top = sorted(per.items(), key=lambda x: -x[1])[:6]
    print(f"{a.variant:15s} {backend:6s} {a.schedule or 'default':30s} bwd median {statistics.median(times):.3f} ms | "
          + " | ".join(f"{n[:38]} {t/1000:.3f}" for n, t in top), flush=True)
