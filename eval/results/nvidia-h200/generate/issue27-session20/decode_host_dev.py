"""Host time of one decode call through the adapter with the TiledMask a model's forward hands
every layer (stubbed launches, CPU tensors)."""
import sys, time, statistics, cProfile, pstats
sys.path.insert(0, '.')
import torch
from eval.host_overhead import stubbed_launch
from hf_tiled_attention.transformers_backend import tiled_attention_forward
from hf_tiled_attention.transformers_mask import tiled_mask

B, HQ, HKV, S, D = 1, 32, 8, 1024, 128
q = torch.randn(B, 1, HQ, D, dtype=torch.bfloat16).transpose(1, 2)
k = torch.randn(B, HKV, S, D, dtype=torch.bfloat16)
v = torch.randn_like(k)

class Layer(torch.nn.Module):
    is_causal = True
    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig
        self.config = LlamaConfig()
layer = Layer().eval()
pos = torch.tensor([[S - 1]])
with torch.no_grad(), stubbed_launch():
    def call():
        mask = tiled_mask(B, 1, S, q_offset=S - 1, kv_offset=0,
                          attention_mask=torch.ones(B, S, dtype=torch.long))
        for _ in range(32):
            tiled_attention_forward(layer, q, k, v, mask, scaling=D ** -0.5, dropout=0.0,
                                    position_ids=pos, is_causal=None)
    for _ in range(50):
        call()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(100):
            call()
        times.append((time.perf_counter() - t) / 100 / 32 * 1e6)
    print(f"per layer call (incl. mask/32): {statistics.median(times):.1f} us")
    if len(sys.argv) > 1:
        cProfile.run("for _ in range(300): call()", "/tmp/prof")
        pstats.Stats("/tmp/prof").sort_stats("tottime").print_stats(25)
