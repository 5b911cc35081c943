"""Dev: where batch-1 decode time goes, tiled vs sdpa (Llama-3-8B shape, 32 layers, bf16)."""
import cProfile, io, pstats, sys, time, warnings
import torch
sys.path.insert(0, ".")
warnings.filterwarnings("ignore")
import hf_tiled_attention  # noqa
from eval.models import build_config, build_models
from eval.generate_throughput import timed_generate

torch.manual_seed(0)
config = build_config("llama3-8b", 32)
models = build_models(["tiled", "sdpa"], config, torch.bfloat16, "cuda")
ids = torch.randint(10, 1000, (1, 1024), device="cuda")
with torch.inference_mode():
    for name in models: timed_generate(models[name], ids, 8, "dynamic")
    res = {n: [] for n in models}
    for rep in range(5):
        for name in models:
            t1 = timed_generate(models[name], ids, 1, "dynamic")
            t65 = timed_generate(models[name], ids, 65, "dynamic")
            res[name].append((t65 - t1) / 64 * 1000)
    for name, v in res.items():
        v.sort(); print(f"{name}: per decode step ms median {v[2]:.3f} all {[round(x,3) for x in v]}", flush=True)
    # host-only time of one decode step: CPU profile of 33 tokens
    for name in models:
        pr = cProfile.Profile()
        pr.enable(); timed_generate(models[name], ids, 33, "dynamic"); pr.disable()
        s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(25)
        print(f"==== {name} by tottime\n" + s.getvalue()[:6000], flush=True)
        s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("cumulative").print_stats("hf_tiled_attention|sdpa_attention|masking_utils", 30)
        print(f"==== {name} by cumulative (ours, sdpa's, masks)\n" + s.getvalue()[:7000], flush=True)
    # attention-function host time per call, synchronised, decode shape (1 query, 1100 keys)
    from hf_tiled_attention.transformers_backend import tiled_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    layer = models["tiled"].model.layers[0].self_attn
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 1100, 128, device="cuda", dtype=torch.bfloat16)
    for fn, name in ((tiled_attention_forward, "tiled"), (sdpa_attention_forward, "sdpa")):
        for _ in range(20): fn(layer, q, k, k, None, scaling=0.088, dropout=0.0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200): fn(layer, q, k, k, None, scaling=0.088, dropout=0.0)
        host = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize(); total = (time.perf_counter() - t) / 200 * 1e6
        print(f"{name} attention fn: host {host:.1f} us/call (queued), with drain {total:.1f}", flush=True)
