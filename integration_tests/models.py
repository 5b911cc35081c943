"""Tiny random-weight models for the integration tests, built twice (own config each)."""

from __future__ import annotations

import copy

import torch
import transformers

import hf_tiled_attention  # noqa: F401  (registers "tiled")

VOCAB = 128
WINDOW = 6  # smaller than every test sequence, so windows bite


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
                tie_word_embeddings=False)
    base.update(kw)
    return base


def make_config(name: str):
    if name == "llama":
        return transformers.LlamaConfig(**_common())
    if name == "mistral":
        return transformers.MistralConfig(**_common(sliding_window=WINDOW))
    if name == "qwen2":
        return transformers.Qwen2Config(**_common(
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
            layer_types=["sliding_attention", "full_attention"]))
    if name == "qwen3":
        return transformers.Qwen3Config(**_common(head_dim=16))
    if name == "gemma2":
        return transformers.Gemma2Config(**_common(
            head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
            final_logit_softcapping=30.0, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"]))
    if name == "gemma3":
        return transformers.Gemma3TextConfig(**_common(
            head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"]))
    if name == "phi3":
        return transformers.Phi3Config(**_common(sliding_window=None))
    if name == "gpt_oss":  # learned attention sinks (s_aux), mixed sliding/full layers, MoE
        return transformers.GptOssConfig(**_common(
            head_dim=16, sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1,
            layer_types=["sliding_attention", "full_attention"]))
    if name == "afmoe":  # .view()s the attention output: needs it contiguous; sliding + full
        return transformers.AfmoeConfig(**_common(
            head_dim=16, sliding_window=WINDOW, moe_intermediate_size=32, num_experts=2,
            num_experts_per_tok=1, num_shared_experts=1, num_dense_layers=1,
            layer_types=["sliding_attention", "full_attention"]))
    if name == "deepseek_v3":  # multi-head latent attention: query/key heads 32, values 16
        return transformers.DeepseekV3Config(**_common(
            num_key_value_heads=4, head_dim=16, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, kv_lora_rank=32, q_lora_rank=32, n_routed_experts=2,
            num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=1,
            moe_intermediate_size=32))
    if name == "llama4":  # text only: chunked attention (chunks of 8) on its first layer
        return transformers.Llama4TextConfig(**_common(
            head_dim=16, attention_chunk_size=8, intermediate_size_mlp=128, num_local_experts=2,
            num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0]))
    raise KeyError(name)


ALL_MODELS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt_oss",
              "afmoe", "deepseek_v3"]
# Models whose masks transformers builds with overlays (tested on their own).
OVERLAY_MODELS = ["llama4"]
SLIDING_MODELS = ["mistral", "qwen2", "gemma2", "gemma3", "gpt_oss"]

_CACHE: dict = {}


def build(name: str, impl: str, seed: int = 0):
    """A model with its own config object and weights from a fixed seed."""
    torch.manual_seed(seed)
    if (name, seed) not in _CACHE:
        ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(make_config(name)),
                                                            attn_implementation="eager")
        _CACHE[(name, seed)] = {k: v.clone() for k, v in ref.state_dict().items()}
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(make_config(name)),
                                                          attn_implementation=impl)
    model.load_state_dict(_CACHE[(name, seed)])
    model.eval()
    assert model.config._attn_implementation == impl
    return model


def pair(name: str, seed: int = 0):
    tiled, eager = build(name, "tiled", seed), build(name, "eager", seed)
    assert tiled.config is not eager.config
    assert tiled.config._attn_implementation == "tiled"
    assert eager.config._attn_implementation == "eager"
    return tiled, eager


def padded_batch(lengths, total, side="left", seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, total - n:] = 1
        else:
            mask[b, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device)
