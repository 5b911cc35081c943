"""Dev: fill cuTile's disk cache for one (head dim, causal, mode) of backward_bench's standard
bf16 points (every seq), so no compile falls inside the timed run."""
import dataclasses, sys
import torch
import hf_tiled_attention as hta
from hf_tiled_attention.schedule import backward_schedule, set_backward_schedule
d, causal, mode = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
if mode == "det":
    set_backward_schedule(dataclasses.replace(backward_schedule(d), dq_add=False))
hkv = 8 if d == 128 else 32
for seq in (1024, 4096, 16384):
    b = 16384 // seq
    q = torch.randn(b, 32, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = hta.tiled_attention(q, k, v, None, is_causal=causal)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
print("precompiled", d, causal, mode, flush=True)
