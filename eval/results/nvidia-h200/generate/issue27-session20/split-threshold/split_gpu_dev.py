"""GPU time of one b1 decode call (Llama-3-8B attention: 32/8, D128, bf16), unsplit vs the
auto split, replayed from a CUDA graph (host time out of it); and the eager host time."""
import sys, time
sys.path.insert(0, '.')
import torch
import hf_tiled_attention as hta
from hf_tiled_attention.launch import EAGER_SPLIT_MIN_BYTES
torch.manual_seed(0)
print("EAGER_SPLIT_MIN_BYTES", EAGER_SPLIT_MIN_BYTES)
for S in (2048, 4096, 8192, 16384, 32768, 65536, 131072):
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    row = [f"S={S:6d}"]
    for name, sched in (("unsplit", hta.Schedule(kv_splits=1)), ("auto", None)):
        f = lambda: hta.tiled_attention(q, k, v, is_causal=True, schedule=sched)
        for _ in range(3): f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20): f()
        g.replay(); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20): g.replay()
        torch.cuda.synchronize()
        gpu = (time.perf_counter() - t) / 400 * 1e6
        row.append(f"{name} gpu {gpu:7.1f} us")
    print("  ".join(row), flush=True)
