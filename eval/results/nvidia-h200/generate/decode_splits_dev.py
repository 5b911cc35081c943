"""Dev: batch-1 decode step time, sdpa vs tiled (default key splits) vs tiled with kv_splits=1."""
import sys, warnings, contextlib
import torch
sys.path.insert(0, ".")
warnings.filterwarnings("ignore")
import hf_tiled_attention as hta
from eval.models import build_config, build_models
from eval.generate_throughput import timed_generate
torch.manual_seed(0)
models = build_models(["tiled", "sdpa"], build_config("llama3-8b", 32), torch.bfloat16, "cuda")
variants = {"sdpa": ("sdpa", None), "tiled": ("tiled", None),
            "tiled_splits1": ("tiled", hta.Schedule(kv_splits=1)),
            "tiled_splits2": ("tiled", hta.Schedule(kv_splits=2))}
with torch.inference_mode():
    for prompt in (1024, 8192):
        ids = torch.randint(10, 1000, (1, prompt), device="cuda")
        for name, (m, s) in variants.items():
            with (hta.use_schedule(s) if s else contextlib.nullcontext()):
                timed_generate(models[m], ids, 4, "dynamic")
        res = {n: [] for n in variants}
        for rep in range(5):
            for name, (m, s) in variants.items():
                with (hta.use_schedule(s) if s else contextlib.nullcontext()):
                    t1 = timed_generate(models[m], ids, 1, "dynamic")
                    tn = timed_generate(models[m], ids, 65, "dynamic")
                res[name].append((tn - t1) / 64 * 1000)
        for name, v in res.items():
            v.sort(); print(f"prompt {prompt} {name}: decode step ms median {v[2]:.3f} {[round(x, 2) for x in v]}", flush=True)
