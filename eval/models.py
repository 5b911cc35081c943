"""Model shapes the whole-model evals build from configs, with random weights (no download)."""

from __future__ import annotations

import copy

import torch

SHAPES = {
    # Published shapes of the two models (hidden size, heads, kv heads, MLP, vocab, window).
    "llama3-8b": dict(model_type="llama", hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      rope_theta=500000.0, max_position_embeddings=131072),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                       rope_theta=10000.0, max_position_embeddings=32768, sliding_window=4096),
    "tiny-llama": dict(model_type="llama", hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, vocab_size=256),
}


def model_device(job: str) -> tuple[bool, str, torch.dtype]:
    """(on a GPU, device, dtype) of a whole-model eval: bf16 on the GPU, else fp32 on the CPU
    through the reference path, which the eval says."""
    if torch.cuda.is_available():
        return True, "cuda", torch.bfloat16
    print(f"{job}: no CUDA GPU here; running a tiny model at small sizes through the CPU "
          "reference path (numbers say nothing about GPU speed).")
    return False, "cpu", torch.float32


def build_config(name: str, layers: int):
    from transformers import AutoConfig
    spec = dict(SHAPES[name])
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, num_hidden_layers=layers, **spec)


# "tiled" run into the FP8 KV cache (hf_tiled_attention.Fp8DynamicCache / Fp8StaticCache).
FP8_CACHE_BACKEND = "tiled_fp8_cache"
# "tiled" served by continuous batching with CUDA graphs asked for (serve_throughput.py).
GRAPHS_BACKEND = "tiled+graphs"
# Eval backends that are an attention implementation with something else of their own (the
# cache they generate into, how they are served): the implementation their model loads with.
IMPLEMENTATIONS = {FP8_CACHE_BACKEND: "tiled", GRAPHS_BACKEND: "tiled"}


def build_models(backends: list[str], config, dtype, device) -> dict:
    """One model per backend, same weights, each with a deep-copied config of its own (a model
    reads its backend from its config at run time)."""
    from transformers import AutoModelForCausalLM
    models = {}
    state = None
    for backend in backends:
        implementation = IMPLEMENTATIONS.get(backend, backend)
        own = copy.deepcopy(config)
        own._attn_implementation = implementation
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(own, dtype=dtype,
                                                     attn_implementation=implementation)
        if state is None:
            state = model.state_dict()
        else:
            model.load_state_dict(state)
        assert model.config._attn_implementation == implementation
        models[backend] = model.eval()
    assert len({id(m.config) for m in models.values()}) == len(models)
    return models
