"""attn_implementation="tiled_fp8" in transformers models (CPU: FP8 attention's CPU twin, the
kernel's roundings): logits near eager's, generate() with a cache, and the calls it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hf_tiled_attention  # noqa: F401  (registers "tiled" and "tiled_fp8")
from hf_tiled_attention import fp8_backend
from models import VOCAB, build, padded_batch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from semantics import definition  # noqa: E402

MODELS = ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"]


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits.float()


def _rel(got, want):
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("name", MODELS)
def test_adapter_passes_each_layers_rule(name, monkeypatch):
    """With exact attention in FP8's place (fp32 model), eager's logits: the adapter hands the
    op each layer's causal flag, window, scale, softcap and sinks."""
    monkeypatch.setattr(fp8_backend, "fp8_attention", lambda q, k, v, **kw: definition(
        q, k, v, **kw)[0].to(q.dtype))
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    got, want = (_logits(build(name, impl), ids) for impl in ("tiled_fp8", "eager"))
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_logits_within_fp8_error(name, monkeypatch):
    """bf16 models: the FP8 logits' error against fp32 eager within 6x bf16 eager's (these
    models' head dim is 16: a token's scale covers 16 channels)."""
    calls = []
    fp8_attention = fp8_backend.fp8_attention
    monkeypatch.setattr(fp8_backend, "fp8_attention",
                        lambda *a, **k: calls.append(1) or fp8_attention(*a, **k))
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    exact = _logits(build(name, "eager"), ids)
    bf16 = _logits(build(name, "eager").to(torch.bfloat16), ids)
    fp8_model = build(name, "tiled_fp8").to(torch.bfloat16)
    got = _logits(fp8_model, ids)
    assert len(calls) == fp8_model.config.num_hidden_layers
    assert 0 < _rel(got, exact) < 6 * _rel(bf16, exact)


def test_generate_with_a_cache():
    """Decode steps (one query over the cache): each step's logits within FP8's error of fp32
    eager's on the same row (6x bf16 eager's, as above)."""
    fp8 = build("llama", "tiled_fp8").to(torch.bfloat16)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    result = fp8.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    assert result.sequences.shape == (1, 18)
    steps = torch.stack(result.logits, 1).float()
    exact = _logits(build("llama", "eager"), result.sequences)[:, 11:17]
    bf16 = _logits(build("llama", "eager").to(torch.bfloat16), result.sequences)[:, 11:17]
    assert _rel(steps, exact) < 6 * _rel(bf16, exact)


def test_padded_rows_refused_with_the_alternative():
    model = build("llama", "tiled_fp8").to(torch.bfloat16)
    ids, mask = padded_batch([10, 16], 16)
    with pytest.raises(ValueError, match="padded rows.*attn_implementation='tiled'"):
        _logits(model, ids, attention_mask=mask)


def test_fp32_model_refused():
    model = build("llama", "tiled_fp8")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        _logits(model, torch.randint(3, VOCAB, (1, 8)))
