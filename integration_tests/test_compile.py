"""torch.compile: the backend traces without graph breaks and matches eager (CPU, fp32)."""

import pytest
import torch
from transformers import StaticCache

from models import build, pair, padded_batch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["mistral", "gemma2", "qwen2", "gpt_oss", "deepseek_v3"])
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


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_oss"])
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


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "qwen2"])
def test_static_cache_generate_compiles_once(name):
    """generate(cache_implementation="static") compiles the decode step (as it does on a GPU)
    and feeds it the masks it builds ahead of each step: no graph break anywhere (fullgraph),
    no more compilations than eager attention needs (one; two where the sliding-window cache
    fills up), never one per step, and eager attention's tokens."""
    from transformers import CompileConfig
    ids, mask = padded_batch([9, 4, 7], 9, "left", seed=2)
    graphs, tokens = {}, {}
    for impl in ("tiled", "eager"):
        model = build(name, impl)
        graphs[impl] = 0

        def counting_backend(gm, example_inputs, impl=impl):
            graphs[impl] += 1
            return gm.forward

        config = CompileConfig(backend=counting_backend, fullgraph=True, mode=None)
        config._compile_all_devices = True  # compile on the CPU too
        torch._dynamo.reset()
        with torch.no_grad():
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=12,
                                          min_new_tokens=12, do_sample=False, pad_token_id=0,
                                          cache_implementation="static",
                                          compile_config=config)
    assert 1 <= graphs["tiled"] <= graphs["eager"] <= 2, graphs
    assert torch.equal(tokens["tiled"], tokens["eager"])


def test_packed_rows_run_as_a_mask_mod_under_compile(op_calls):
    """cu_seq_lens (DataCollatorWithFlattening) under torch.compile(fullgraph=True): the
    documents reach the op as the same-document mask_mod (a pre-translated template whose
    per-token ids are graph values), not as a dense mask, and each matches its own run."""
    tiled = build("llama", "tiled")
    lengths = [7, 11, 5]
    g = torch.Generator().manual_seed(12)
    docs = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0, 7, 18, 23], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    compiled = torch.compile(tiled, fullgraph=True, backend="eager")
    with torch.no_grad():
        packed = compiled(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                          max_length_q=11, max_length_k=11, use_cache=False).logits[0]
        alone = torch.cat([tiled(d[None], use_cache=False).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=0)
    traced = op_calls[:tiled.config.num_hidden_layers]
    assert all(mods is not None and mask is None for mask, mods in traced), traced


def test_compiled_forward_without_cache_keeps_the_key_vector_given_a_mask(monkeypatch):
    """Traced without a cache, transformers cannot tell packed rows from one sequence (its
    check is data-dependent) and hands every mask function its packed-rows overlay, which the
    adapter cannot read under torch.compile: with no attention_mask, the mask is dense, as
    sdpa's is. An attention_mask (all ones) keeps the kernel's rule and a key vector: this is
    the README's advice for compiled training, and it must stay true."""
    from hf_tiled_attention import transformers_mask

    _MADE.clear()
    monkeypatch.setattr(transformers_mask.TiledMask, "__init__", _recording_init(
        transformers_mask.TiledMask.__init__))
    made = _MADE
    tiled, eager = pair("llama")
    ids, _ = padded_batch([16], 16, seed=12)
    ones = torch.ones_like(ids)
    compiled = torch.compile(tiled, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(ids, attention_mask=ones, use_cache=False).logits
        ref = eager(ids, use_cache=False).logits
    assert made and set(made) == {"rule"}
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


_MADE: list = []  # (module-level: what dynamo replays of a traced call's side effects)


def _recording_init(original):
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _MADE.append("dense" if self.dense is not None else "rule")
    return init
