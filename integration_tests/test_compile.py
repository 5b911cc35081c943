"""torch.compile: the backend traces without graph breaks and matches eager (CPU, fp32)."""

import pytest
import torch
from transformers import StaticCache

from models import pair, padded_batch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["mistral", "gemma2", "qwen2"])
def test_compiled_forward_fullgraph(name):
    """fullgraph=True: any graph break (ours included) fails the compile."""
    tiled, eager = pair(name)
    ids, mask = padded_batch([12, 20, 7], 20, "left", seed=9)
    compiled = torch.compile(tiled, fullgraph=True, backend="eager")
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask, use_cache=False).logits
        for use_cache in (False, True):
            out = compiled(ids, attention_mask=mask, use_cache=use_cache).logits
            torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=0)


def test_compiled_forward_inductor():
    tiled, eager = pair("llama")
    ids, mask = padded_batch([12, 16], 16, "right", seed=10)
    compiled = torch.compile(tiled)
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask, use_cache=False).logits
        ref = eager(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_compiled_static_cache_decode(name):
    """Decode steps compiled with fullgraph=True on a StaticCache (traced query offset),
    left-padded, greedy, against eager step by step."""
    tiled, eager = pair(name)
    ids, mask = padded_batch([8, 5], 8, "left", seed=11)
    steps = 8

    def run(model, compile_decode):
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps)
        decode = torch.compile(model, fullgraph=True, backend="eager") if compile_decode else model
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
            tokens, am = [], mask
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps):
                tokens.append(nxt)
                am = torch.cat([am, torch.ones_like(nxt)], dim=1)
                pos = pos[:, -1:] + 1
                out = decode(nxt, attention_mask=am, position_ids=pos, past_key_values=cache)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(tokens, dim=1), out.logits

    tok_t, logit_t = run(tiled, True)
    tok_e, logit_e = run(eager, False)
    assert torch.equal(tok_t, tok_e)
    torch.testing.assert_close(logit_t, logit_e, atol=1e-4, rtol=0)
