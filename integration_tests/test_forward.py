"""Plain forward: tiled vs eager logits on non-pad positions (CPU, fp32)."""

import copy
import warnings

import pytest
import torch
import transformers

import hf_tiled_attention
from hf_tiled_attention import transformers_backend as tb
from hf_tiled_attention.mods import index_grid
from models import ALL_MODELS, SLIDING_MODELS, build, make_config, padded_batch, pair

ATOL = 1e-4


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_padded_forward_matches_eager(name, side):
    tiled, eager = pair(name)
    ids, mask = padded_batch([13, 20, 7], 20, side, seed=1)
    with torch.no_grad():
        lt = tiled(ids, attention_mask=mask).logits
        le = eager(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert torch.isfinite(lt).all()
    torch.testing.assert_close(lt[keep], le[keep], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_unpadded_forward_matches_eager(name):
    tiled, eager = pair(name)
    ids = torch.randint(3, 128, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(tiled(ids).logits, eager(ids).logits, atol=ATOL, rtol=0)


def test_window_actually_bites():
    """Negative control: the sliding window changes the result at these lengths."""
    tiled, _ = pair("mistral")
    cfg = copy.deepcopy(make_config("mistral"))
    cfg.sliding_window = None
    no_window = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    no_window.load_state_dict(tiled.state_dict())
    no_window.eval()
    ids = torch.randint(3, 128, (1, 20))
    with torch.no_grad():
        diff = (tiled(ids).logits - no_window(ids).logits).abs().max()
    assert diff > 1e-2


def test_encoder_decoder_matches_eager():
    """BART: a bidirectional encoder over a padded batch, a causal decoder, and cross-attention
    (Sq != Skv, not causal, the encoder's padding) in one model; forward and greedy generate."""
    cfg = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=128, decoder_ffn_dim=128,
                                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    eager = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(cfg),
                                                           attn_implementation="eager").eval()
    tiled = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(cfg),
                                                           attn_implementation="tiled").eval()
    tiled.load_state_dict(eager.state_dict())
    ids, mask = padded_batch([14, 9], 14, "right", seed=5)
    decoder_ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        lt = tiled(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        le = eager(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        torch.testing.assert_close(lt, le, atol=ATOL, rtol=0)
        gen = [m.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                          do_sample=False) for m in (tiled, eager)]
    assert torch.equal(*gen)


def test_attention_sinks_actually_bite():
    """Negative control for gpt-oss's learned sinks (the s_aux kwarg): a backend that drops
    them is far from eager, so test_padded_forward_matches_eager[gpt_oss] checks them."""
    def without_sinks(module, *args, s_aux=None, **kwargs):
        return tb.tiled_attention_forward(module, *args, **kwargs)

    transformers.AttentionInterface.register("tiled_without_sinks", without_sinks)
    transformers.masking_utils.AttentionMaskInterface.register("tiled_without_sinks",
                                                               tb.tiled_mask)
    dropped, eager = build("gpt_oss", "tiled_without_sinks"), build("gpt_oss", "eager")
    ids = torch.randint(3, 128, (2, 20))
    with torch.no_grad():
        assert (dropped(ids).logits - eager(ids).logits).abs().max() > 1e-1


@pytest.mark.parametrize("name, pattern", [
    ("indices", r"sparse attention \(indices=\.\.\.\); use attn_implementation='eager'\."),
    ("block_indices", r"sparse attention \(block_indices="),
])
def test_unsupported_attention_kwargs_are_a_clear_error(name, pattern):
    """DeepSeek-style sparse attention passes the keys each query keeps; the kernel has no
    such mode, so the call fails instead of attending without them. (T5's position_bias runs
    as an additive mask: test_trained_masks.py.)"""
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match=pattern):
        tb.tiled_attention_forward(torch.nn.Module(), q, k, k, None, scaling=0.25,
                                   **{name: torch.zeros(1, 3, 2, dtype=torch.long)})


def test_fully_padded_rows_are_zero_not_nan():
    """A query row with no visible key (a left-pad position) gives 0 attention output."""
    tiled, _ = pair("llama")
    ids, mask = padded_batch([5, 12], 12, "left")
    seen = []
    layer = tiled.model.layers[0].self_attn
    hook = layer.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
    try:
        with torch.no_grad():
            logits = tiled(ids, attention_mask=mask).logits
    finally:
        hook.remove()
    assert torch.isfinite(logits).all()
    # attention output before o_proj is zero -> o_proj(0) = 0 (no bias in Llama)
    assert seen[0][0, :7].abs().max() == 0


def test_mask_passed_to_op_is_compact(monkeypatch):
    """Causal, sliding-window and padding masks never reach the op as an O(Sq x Skv) tensor."""
    shapes, first_forward = [], []
    real = tb._op_attention

    def spy(q, k, v, mask, **kw):
        tensor = getattr(mask, "tensor", mask)  # the adapter hands over a CompactMask
        shapes.append((None if mask is None else tuple(tensor.shape), kw["causal"], kw["window"]))
        first_forward.append((id(mask), kw["window"]))
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(tb, "_op_attention", spy)
    tiled = build("qwen2", "tiled")
    ids, mask = padded_batch([9, 16], 16, "left")
    with torch.no_grad():
        tiled(ids, attention_mask=mask)
        # the layers of one forward that share a mask share one compact copy (and its tables)
        assert len(first_forward) == tiled.config.num_hidden_layers
        assert len(set(first_forward)) == len({w for _, w in first_forward})
        tiled(ids[1:], attention_mask=mask[1:])  # unpadded row: no mask at all
        tiled.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert shapes
    for shape, causal, _ in shapes:
        assert causal
        assert shape is None or shape[2] == 1, shape
    assert (2, 1, 1, 16) in [s for s, _, _ in shapes]
    assert (None, True, None) in shapes and (None, True, 6) in shapes


def test_mask_function_outputs():
    from transformers import masking_utils as mu

    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    m = tb.tiled_mask(batch_size=2, q_length=5, kv_length=5, mask_function=mu.causal_mask_function,
                      attention_mask=pad)
    assert m.causal and m.window is None and m.diag_offset == 0 and m.dense is None
    assert m.key_mask.shape == (2, 1, 1, 5)
    m = tb.tiled_mask(batch_size=2, q_length=5, kv_length=5, mask_function=mu.causal_mask_function,
                      attention_mask=torch.ones(2, 5, dtype=torch.bool))
    assert m.key_mask is None
    # sliding-window cache: keys start at position 3, queries at 7 -> diagonal 4
    m = tb.tiled_mask(batch_size=1, q_length=2, kv_length=6, q_offset=7, kv_offset=3,
                      mask_function=mu.sliding_window_causal_mask_function(5), local_size=5)
    assert (m.causal, m.window, m.diag_offset) == (True, 5, 4)
    m = tb.tiled_mask(batch_size=1, q_length=4, kv_length=4,
                      mask_function=mu.sliding_window_bidirectional_mask_function(2))
    assert (m.causal, m.window) == (False, 3)
    m = tb.tiled_mask(batch_size=1, q_length=4, kv_length=4,
                      mask_function=mu.bidirectional_mask_function)
    assert (m.causal, m.window, m.key_mask, m.dense) == (False, None, None, None)
    # an overlay (packed documents, chunks, ...) runs as a mask_mod next to the kernel's causal
    # rule, the padding folded in; together they are sdpa's mask
    fn = mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: (q // 2) == (k // 2))
    m = tb.tiled_mask(batch_size=2, q_length=5, kv_length=5, mask_function=fn,
                      attention_mask=pad)
    want = mu.sdpa_mask(batch_size=2, q_length=5, kv_length=5, mask_function=fn,
                        attention_mask=pad, allow_is_causal_skip=False)
    assert m.causal and m.dense is None and m.key_mask is None and m.mods is not None
    b, h, q, k = index_grid(2, (1,), torch.arange(5), torch.arange(5))
    assert torch.equal(m.mods.mask_mod(b, h, q, k) & (k <= q), want)
    # an overlay the kernel cannot run (a method call): dense, with one warning naming it
    fn = mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: (q // 2).eq(k // 2))
    hf_tiled_attention.clear_caches()
    with pytest.warns(RuntimeWarning, match=r"the mask function and_masks.<locals>.and_mask "
                      r"cannot run in the kernel \(function .*<lambda> .*line \d+\): "
                      r"attribute access '\(q // 2\).eq'"):
        m = tb.tiled_mask(batch_size=1, q_length=4, kv_length=4, mask_function=fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per function: not again
        tb.tiled_mask(batch_size=1, q_length=4, kv_length=4, mask_function=fn)
    want = mu.sdpa_mask(batch_size=1, q_length=4, kv_length=4, mask_function=fn,
                        allow_is_causal_skip=False)
    assert not m.causal and m.dense is not None and torch.equal(m.dense, want)
    # an overlay at cache offsets (queries at 5.., keys at 1..): the mod shifts its indices;
    # decoding (at most 16 queries) keeps the small dense mask
    fn = mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: (q // 2) == (k // 2))
    m = tb.tiled_mask(batch_size=1, q_length=20, kv_length=24, q_offset=5, kv_offset=1,
                      mask_function=fn)
    want = mu.sdpa_mask(batch_size=1, q_length=20, kv_length=24, q_offset=5, kv_offset=1,
                        mask_function=fn, allow_is_causal_skip=False)
    assert m.dense is None and m.mods is not None and (m.causal, m.diag_offset) == (True, 4)
    b, h, q, k = index_grid(1, (1,), torch.arange(20), torch.arange(24))
    assert want.any() and torch.equal(m.mods.mask_mod(b, h, q, k) & (k <= q + 4), want)
    m = tb.tiled_mask(batch_size=1, q_length=2, kv_length=6, q_offset=5, kv_offset=1,
                      mask_function=fn)
    assert m.dense is not None and m.dense.shape == (1, 1, 2, 6) and m.mods is None


@pytest.mark.parametrize("pattern", ["chunked", "packed", "blockwise"])
def test_transformers_overlays_become_mask_mods(pattern):
    """transformers' own overlays (Llama 4 chunks with left padding, packed sequences, block
    ids) translate into the kernel's mask_mod: no dense mask, and the same visibility as the
    mask sdpa gets. Each compiles for sm_90."""
    from transformers import masking_utils as mu

    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9], dtype=torch.bool)
    overlay = {
        "chunked": lambda: mu.chunked_overlay(4, torch.tensor([2, 0])),
        "packed": lambda: mu.packed_sequence_mask_function(
            torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1]])),
        "blockwise": lambda: mu.blockwise_overlay(
            torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 2]])),
    }[pattern]()
    fn = mu.and_masks(mu.causal_mask_function, overlay)
    m = tb.tiled_mask(batch_size=2, q_length=9, kv_length=9, mask_function=fn,
                      attention_mask=pad)
    assert m.dense is None and m.mods is not None and m.causal
    want = mu.sdpa_mask(batch_size=2, q_length=9, kv_length=9, mask_function=fn,
                        attention_mask=pad, allow_is_causal_skip=False)
    b, h, q, k = index_grid(2, (1,), torch.arange(9), torch.arange(9))
    assert torch.equal(m.mods.mask_mod(b, h, q, k) & (k <= q), want)
    pytest.importorskip("cuda.tile.compilation")
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.launch import export_cubin, plan_launch
    from hf_tiled_attention.masks import mod_mask
    from hf_tiled_attention.schedule import resolve_schedule
    query = torch.randn(2, 4, 9, 64, dtype=torch.bfloat16)
    key = torch.randn(2, 2, 9, 64, dtype=torch.bfloat16)
    mask = mod_mask(m.mods, 2, 4, 9, 9, torch.device("cpu"))
    plan = plan_launch(query, key, call_options(mask, causal=True, scale=0.125, mods=m.mods),
                       resolve_schedule(None, 9, query.dtype, 64, True))
    assert export_cubin(plan, query, key, mask, arch="sm_90")[:4] == b"\x7fELF"


@pytest.mark.parametrize("name", SLIDING_MODELS)
def test_mask_compactness_bidirectional(name):
    """config.is_causal=False routes through create_bidirectional*_mask: compact too."""
    from transformers import masking_utils as mu

    cfg = make_config(name)
    cfg._attn_implementation = "tiled"
    emb = torch.zeros(2, 7, 64)
    pad = torch.ones(2, 7, dtype=torch.long)
    pad[0, :2] = 0
    m = mu.create_bidirectional_mask(cfg, emb, pad)
    assert isinstance(m, tb.TiledMask) and not m.causal and m.key_mask.shape == (2, 1, 1, 7)


def test_models_that_use_the_mask_as_a_tensor_get_a_clear_error():
    """Bloom adds the mask to its scores in its own code (no AttentionInterface): the compact
    TiledMask says what happened and what to use instead."""
    cfg = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="tiled").eval()
    with pytest.raises(TypeError, match="used it as a tensor.*Use attn_implementation='sdpa'"):
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 5)))
    mask = tb.TiledMask(causal=True, window=None, diag_offset=0)
    with pytest.raises(AttributeError, match=r"used it as a tensor \(attribute \.dtype\)"):
        mask.dtype
    assert not hasattr(mask, "device") and hasattr(mask, "ndim")  # hasattr probes still work
    assert copy.deepcopy(mask).causal and mask.dim() == 4


def test_output_attentions_is_a_clear_error():
    tiled, _ = pair("llama")
    with pytest.raises(ValueError, match="output_attentions"):
        with torch.no_grad():
            tiled(torch.randint(3, 128, (1, 5)), output_attentions=True)


def test_training_dropout_is_a_clear_error():
    cfg = copy.deepcopy(make_config("llama"))
    cfg.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="tiled")
    model.train()
    with pytest.raises(ValueError, match="dropout=0.1.*attention_dropout to 0.0"):
        model(torch.randint(3, 128, (1, 5)))
    model.eval()  # dropout is 0 at inference
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 5)))


def test_register_explicit_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert hf_tiled_attention.register(name="tiled_alias") == "tiled_alias"
    assert AttentionInterface._global_mapping["tiled_alias"] is tb.tiled_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["tiled_alias"] is tb.tiled_mask
    assert ALL_MASK_ATTENTION_FUNCTIONS["tiled"] is tb.tiled_mask
    model = build("mistral", "tiled_alias")
    _, eager = pair("mistral")
    ids, mask = padded_batch([4, 9], 9, "left")
    with torch.no_grad():
        lt, le = model(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    torch.testing.assert_close(lt[mask.bool()], le[mask.bool()], atol=ATOL, rtol=0)


def test_user_4d_mask_matches_eager():
    """A user-given 4-D mask is passed through by transformers (dense by construction)."""
    tiled, eager = pair("llama")
    s = 8
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool))
    allowed[5:, :3] = False  # hide a prefix from the last rows
    add = torch.zeros(1, 1, s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ids = torch.randint(3, 128, (1, s))
    with torch.no_grad():
        torch.testing.assert_close(tiled(ids, attention_mask=add).logits,
                                   eager(ids, attention_mask=add).logits, atol=ATOL, rtol=0)
