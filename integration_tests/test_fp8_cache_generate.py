"""generate() with the FP8 KV cache (fp8_cache.py) on the CPU, fp32: "tiled" over the cache's
rows against eager over a cache that holds the same roundings (its states quantised and
dequantised on their way in), left padded, dynamic and static, sliding and full layers, sinks.
On a GPU (marker ``gpu``): generate() runs the decode kernel, eager and compiled."""

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

import hf_tiled_attention as hta
from hf_tiled_attention import fp8_cache_attention
from hf_tiled_attention.fp8_cache import (ROW_EXTRA, dequantize_rows, keys_from_rows,
                                          quantize_keys, quantize_rows_torch)
from models import build, padded_batch

NEW = 8
MODELS = ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"]


class _Rounded:
    """A cache layer mix-in for eager: the states an FP8 cache would hold, dequantised."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(keys_from_rows(quantize_keys(key_states), key_states.dtype),
                              dequantize_rows(quantize_rows_torch(value_states),
                                              value_states.dtype), *args, **kwargs)


def _rounded(cache):
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, (DynamicLayer, StaticLayer)):
            rounded = object.__new__(type("Rounded" + type(layer).__name__,
                                          (_Rounded, type(layer)), {}))
            rounded.__dict__.update(layer.__dict__)
            cache.layers[index] = rounded
    return cache


def _caches(kind, tiled, eager, length):
    if kind == "dynamic":
        return (hta.Fp8DynamicCache(config=tiled.config),
                _rounded(DynamicCache(config=eager.config)))
    return (hta.Fp8StaticCache(config=tiled.config, max_cache_len=length),
            _rounded(StaticCache(config=eager.config, max_cache_len=length)))


def _generate(model, ids, mask, cache):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0, past_key_values=cache,
                              output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_generate_reads_the_rows_as_eager_reads_the_same_roundings(name, kind):
    tiled, eager = build(name, "tiled"), build(name, "eager")
    ids, mask = padded_batch([9, 4, 7], 9, "left", seed=2)
    fp8, rounded = _caches(kind, tiled, eager, 9 + NEW)
    got, want = _generate(tiled, ids, mask, fp8), _generate(eager, ids, mask, rounded)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4,
                               rtol=0)
    layer = fp8.layers[-1]
    head_dim = tiled.config.head_dim if getattr(tiled.config, "head_dim", None) else \
        tiled.config.hidden_size // tiled.config.num_attention_heads
    assert layer.keys.dtype == torch.uint8
    assert layer.keys.shape[-1] == head_dim + ROW_EXTRA
    assert layer.keys.shape[:2] == (3, tiled.config.num_key_value_heads)


def test_rows_cost_fewer_bytes_than_the_states():
    tiled = build("llama", "tiled")
    ids, mask = padded_batch([9, 9], 9, "left", seed=1)
    cache = hta.Fp8DynamicCache(config=tiled.config)
    _generate(tiled, ids, mask, cache)
    plain = DynamicCache(config=tiled.config)
    _generate(tiled, ids, mask, plain)
    rows = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    states = sum(layer.keys.nbytes + layer.values.nbytes for layer in plain.layers)
    head_dim = tiled.config.hidden_size // tiled.config.num_attention_heads  # 16 here
    assert rows / states == pytest.approx((head_dim + ROW_EXTRA) / (4 * head_dim))  # fp32


def test_cache_refuses_a_model_that_cannot_read_it():
    eager = build("llama", "eager")
    with pytest.raises(ValueError, match="attn_implementation is 'eager'.*'tiled'"):
        hta.Fp8DynamicCache(config=eager.config)
    with pytest.raises(ValueError, match="attn_implementation is 'eager'"):
        hta.Fp8StaticCache(config=eager.config, max_cache_len=16)
    with pytest.raises(TypeError, match="ddp_cache_data"):
        hta.Fp8DynamicCache(config=build("llama", "tiled").config, ddp_cache_data=[])


def test_cache_without_config_grows_fp8_layers():
    tiled = build("llama", "tiled")
    ids, mask = padded_batch([6], 6, "left", seed=5)
    cache = hta.Fp8DynamicCache()
    got = _generate(tiled, ids, mask, cache)
    want = _generate(tiled, ids, mask, hta.Fp8DynamicCache(config=tiled.config))
    assert torch.equal(got.sequences, want.sequences)
    assert all(layer.keys.dtype == torch.uint8 for layer in cache.layers)


def test_beam_search_reorders_the_rows():
    tiled, eager = build("llama", "tiled"), build("llama", "eager")
    ids, mask = padded_batch([7, 5], 7, "left", seed=6)
    outs = []
    for model, cache in zip((tiled, eager), _caches("dynamic", tiled, eager, 0)):
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3,
                                       do_sample=False, pad_token_id=0, past_key_values=cache))
    assert torch.equal(outs[0], outs[1])


def _decode_in_torch(query, key_rows, value_rows, key_mask=None, *, causal, scale, window,
                     softcap, diag_offset, sinks):
    """fp8_cache_attention.decode's contract in torch (fp32): what the kernel must compute from
    the arguments the adapter hands it."""
    from hf_tiled_attention.reference import empty_output
    k, v = (dequantize_rows(r, torch.float32) for r in (key_rows, value_rows))
    group = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = query.float() @ k.transpose(2, 3) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(query.shape[2])[:, None] + diag_offset
    keys = torch.arange(k.shape[2])[None, :]
    seen = torch.ones_like(pos + keys, dtype=torch.bool)
    if causal:
        seen &= keys <= pos
    if window:
        seen &= keys > pos - window
    if key_mask is not None:
        seen = seen & key_mask
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)], -1)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], 2)
    out = torch.nan_to_num(torch.softmax(s, -1)) @ v
    return empty_output(query).copy_(out)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_decode_steps_hand_the_kernel_what_it_must_compute(name, kind, monkeypatch):
    """The adapter's decode-kernel route on the CPU, the kernel replaced by its contract in
    torch: generate() as on the dequantised rows, and every decode step taken by the route
    (causal at the cache's offset, windows, left padding or a static cache's mask, softcap,
    sinks)."""
    calls = []

    def decode(*args, **kwargs):
        calls.append(kwargs)
        return _decode_in_torch(*args, **kwargs)
    tiled = build(name, "tiled")
    ids, mask = padded_batch([9, 4, 7], 9, "left", seed=2)
    want = _generate(tiled, ids, mask, _caches(kind, tiled, tiled, 9 + NEW)[0])
    monkeypatch.setattr(fp8_cache_attention, "_decodes", lambda *args: True)
    monkeypatch.setattr(fp8_cache_attention, "decode", decode)
    got = _generate(tiled, ids, mask, _caches(kind, tiled, tiled, 9 + NEW)[0])
    # every step, the 9-token prefill too (at most 16 queries: the kernel's)
    assert len(calls) == tiled.config.num_hidden_layers * NEW
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4,
                               rtol=0)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

def _fp8_gpu():
    if not torch.cuda.is_available() or \
            not fp8_cache_attention.cache_kernels_run_on(torch.device("cuda")):
        pytest.skip("needs a GPU with e4m3 conversion (sm_89+) and cuda-tile")


def _count_decodes(monkeypatch) -> list:
    calls = []
    launch = fp8_cache_attention._decode_launch

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return launch(*args, **kwargs)
    monkeypatch.setattr(fp8_cache_attention, "_decode_launch", counted)
    return calls


def _stepwise_logits(model, cache, sequences, mask, prompt: int, new: int):
    """The logits of each generated step of ``sequences``, fed token by token into ``cache``
    as generate() feeds them (left-padded positions)."""
    full = torch.cat([mask, mask.new_ones(mask.shape[0], new)], 1)
    positions = (full.cumsum(-1) - 1).clamp_min(0)
    steps = []
    with torch.no_grad():
        out = model(sequences[:, :prompt], attention_mask=full[:, :prompt],
                    position_ids=positions[:, :prompt], past_key_values=cache, use_cache=True)
        steps.append(out.logits[:, -1])
        for t in range(prompt, prompt + new - 1):
            out = model(sequences[:, t:t + 1], attention_mask=full[:, :t + 1],
                        position_ids=positions[:, t:t + 1], past_key_values=cache,
                        use_cache=True)
            steps.append(out.logits[:, -1])
    return torch.stack(steps, 1).float()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_generate_decodes_from_the_rows(name, monkeypatch):
    """bf16 generate() with the decode kernel, against fp32 eager over a cache holding the
    same roundings (fed the generated tokens): within twice the error of the bf16 run whose
    decode steps attend to the dequantised rows instead (the kernel off) plus bf16's step.
    Both bf16 runs round each new key and value from states that differ from fp32's by bf16
    noise, so an e4m3 neighbour now and then: that noise is the yardstick."""
    _fp8_gpu()
    model = build(name, "tiled").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = padded_batch([40, 25, 33], 40, "left", seed=7, device="cuda")
    calls = _count_decodes(monkeypatch)
    new = 12
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                             output_logits=True,
                             past_key_values=hta.Fp8DynamicCache(config=model.config))
    assert len(calls) == model.config.num_hidden_layers * (new - 1)
    got = torch.stack(out.logits, 1).float()
    fp32 = build(name, "eager").to("cuda")
    exact = _stepwise_logits(fp32, _rounded(DynamicCache(config=fp32.config)), out.sequences,
                             mask, 40, new)
    monkeypatch.setattr(fp8_cache_attention, "_kernel_computes", lambda call, key_mask: False)
    off = _stepwise_logits(model, hta.Fp8DynamicCache(config=model.config), out.sequences,
                           mask, 40, new)
    assert len(calls) == model.config.num_hidden_layers * (new - 1), "the kernel was off"
    kernel_err = (got - exact).abs().max().item()
    off_err = (off - exact).abs().max().item()
    assert kernel_err <= 2 * off_err + 0.1, (kernel_err, off_err)


@pytest.mark.gpu
def test_compiled_static_generate_matches_eager_launches():
    _fp8_gpu()
    model = build("llama", "tiled").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = padded_batch([30, 18], 30, "left", seed=8, device="cuda")
    runs = []
    for compiled in (False, True):
        cache = hta.Fp8StaticCache(config=model.config, max_cache_len=64)
        with torch.no_grad():
            runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=10,
                                       do_sample=False, pad_token_id=0, past_key_values=cache,
                                       disable_compile=not compiled))
    assert torch.equal(runs[0], runs[1])


def test_keys_and_values_of_different_head_dims_are_refused():
    """Multi-head latent attention (DeepSeek) stores values narrower than keys: the FP8 cache's
    rows have one head dim, so it says so before anything is stored."""
    model = build("deepseek_v3", "tiled")
    ids = torch.randint(3, 100, (1, 6))
    with pytest.raises(ValueError, match=r"FP8 cache: keys and values of different head dims "
                                         r"\(32 and 16"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                       past_key_values=hta.Fp8DynamicCache(config=model.config), pad_token_id=0)
