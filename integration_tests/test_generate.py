"""generate(): tiled vs eager tokens with dynamic/static/sliding caches, left padding,
sampling, chunked prefill and assisted decoding (CPU, fp32)."""

import pytest
import torch
from transformers import DynamicCache, StaticCache

from models import ALL_MODELS, build, padded_batch, pair

NEW = 10  # prompt 9 + 10 new tokens > sliding window (6)


def _gen(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                              pad_token_id=0, **kw)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_greedy_generate_left_padded(name, cache):
    tiled, eager = pair(name)
    ids, mask = padded_batch([9, 4, 7], 9, "left", seed=2)
    out_t = _gen(tiled, ids, mask, do_sample=False, cache_implementation=cache)
    out_e = _gen(eager, ids, mask, do_sample=False, cache_implementation=cache)
    assert out_t.shape == (3, 9 + NEW)
    assert torch.equal(out_t, out_e)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_sampled_generate_left_padded(name):
    tiled, eager = pair(name)
    ids, mask = padded_batch([8, 5], 8, "left", seed=3)
    torch.manual_seed(123)
    out_t = _gen(tiled, ids, mask, do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(123)
    out_e = _gen(eager, ids, mask, do_sample=True, top_k=0, temperature=1.0)
    assert torch.equal(out_t, out_e)


def _chunked_logits(model, ids, mask, cache, chunks):
    pieces, start = [], 0
    with torch.no_grad():
        for size in chunks:
            end = start + size
            out = model(ids[:, start:end], attention_mask=mask[:, :end], past_key_values=cache,
                        use_cache=True)
            pieces.append(out.logits)
            start = end
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_chunked_prefill_with_cache(name, cache_kind):
    """Sq > 1 with a non-empty cache (chunked prefill / multi-token continuation), left padded."""
    tiled, eager = pair(name)
    ids, mask = padded_batch([16, 11], 16, "left", seed=4)

    def new_cache(model):
        if cache_kind == "dynamic":
            return DynamicCache(config=model.config)
        return StaticCache(config=model.config, max_cache_len=24)

    chunks = [5, 4, 7]
    lt = _chunked_logits(tiled, ids, mask, new_cache(tiled), chunks)
    le = _chunked_logits(eager, ids, mask, new_cache(eager), chunks)
    with torch.no_grad():
        full = tiled(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(lt[keep], le[keep], atol=1e-4, rtol=0)
    torch.testing.assert_close(lt[keep], full[keep], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_assisted_decoding(name):
    """Assisted generation verifies several candidate tokens at once (Sq > 1 with a cache)."""
    tiled = build(name, "tiled")
    assistant = build(name, "tiled", seed=1)  # different weights: some candidates get rejected
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    plain = _gen(tiled, ids, mask, do_sample=False)
    assisted = _gen(tiled, ids, mask, do_sample=False, assistant_model=assistant)
    _, eager = pair(name)
    assert torch.equal(assisted, plain)
    assert torch.equal(plain, _gen(eager, ids, mask, do_sample=False))
