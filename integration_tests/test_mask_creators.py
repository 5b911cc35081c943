"""CPU: each of transformers' create_*_mask functions, called with the "tiled" config, gives a
compact description (kernel flags, a key vector and, for overlays, a mask_mod: no dense mask)
whose visibility is exactly the mask the same function builds for "eager"."""

import copy
import inspect
import re

import pytest
import transformers
import torch
from transformers import masking_utils as mu

import hf_tiled_attention  # noqa: F401  (registers "tiled")
from hf_tiled_attention import transformers_backend as tb
from hf_tiled_attention.mods import index_grid
from models import _common, build, make_config, padded_batch


def visibility(mask: tb.TiledMask) -> torch.Tensor:
    """The (B, 1, Sq, Skv) bool mask a TiledMask describes, by the op's rules."""
    batch, _, seq_q, seq_kv = mask.shape
    b, h, q, k = index_grid(batch, (1,), torch.arange(seq_q), torch.arange(seq_kv))
    pos = q + mask.diag_offset
    visible = torch.ones(batch, 1, seq_q, seq_kv, dtype=torch.bool)
    if mask.causal:
        visible &= k <= pos
    if mask.window is not None:
        visible &= k > pos - mask.window
        if not mask.causal:
            visible &= k < pos + mask.window
    if mask.key_mask is not None:
        visible &= mask.key_mask
    if mask.mods is not None:
        visible &= mask.mods.mask_mod(b, h, q, k)
    return visible


def _config(name: str, impl: str):
    config = copy.deepcopy(make_config(name))
    config._attn_implementation = impl
    return config


def _and_even_keys(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx % 2 == 0


PACKED = torch.cat([torch.arange(5), torch.arange(4), torch.arange(3)])[None].expand(2, -1)
CASES = {
    "causal": (mu.create_causal_mask, "llama", {}),
    "sliding-window": (mu.create_sliding_window_causal_mask, "mistral", {}),
    "chunked": (mu.create_chunked_causal_mask, "llama4", {}),
    "bidirectional": (mu.create_bidirectional_mask, "llama", {}),
    "bidirectional-sliding": (mu.create_bidirectional_sliding_window_mask, "mistral", {}),
    # transformers detects packing only without a padding mask
    "causal-packed": (mu.create_causal_mask, "llama", {"position_ids": PACKED, "pad": None}),
    "causal-and-overlay": (mu.create_causal_mask, "llama", {"and_mask_function": _and_even_keys}),
    # Gemma 3's image tokens: blocks of bidirectional attention as an or_mask_function
    "causal-or-blocks": (mu.create_causal_mask, "gemma3", {"or_mask_function": mu.blockwise_overlay(
        torch.tensor([[-1, -1, 0, 0, 0, -1, -1, 1, 1, -1, -1, -1]] * 2))}),
}
if "block_sequence_ids" in inspect.signature(mu.create_causal_mask).parameters:
    # Gemma 3's image blocks as transformers >= 5.2x passes them: block ids, or-ed in by it
    CASES["causal-block-ids"] = (mu.create_causal_mask, "gemma3", {"block_sequence_ids": (
        torch.tensor([[-1, -1, 0, 0, 0, -1, -1, 1, 1, -1, -1, -1]] * 2))})
OVERLAY_CASES = ("chunked", "causal-packed", "causal-and-overlay", "causal-or-blocks",
                 "causal-block-ids")
# The cache argument's name: `cache` from transformers 5.2x, `past_key_values` before.
NO_CACHE = {"cache" if "cache" in inspect.signature(mu.create_causal_mask).parameters
            else "past_key_values": None}


@pytest.mark.parametrize("case", list(CASES))
def test_mask_creator_is_compact_and_exact(case):
    create, model, kwargs = CASES[case]
    kwargs = dict(kwargs)
    _, pad = padded_batch([12, 9], 12, "left", seed=3)
    pad = kwargs.pop("pad", pad)
    embeds = torch.zeros(2, 12, 64)
    tiled = create(_config(model, "tiled"), embeds, pad, **NO_CACHE, **kwargs)
    eager = create(_config(model, "eager"), embeds, pad, **NO_CACHE, **kwargs)
    assert isinstance(tiled, tb.TiledMask) and tiled.dense is None
    assert (tiled.mods is not None) == (case in OVERLAY_CASES)
    assert torch.equal(visibility(tiled), eager == 0)


def test_llama4_chunked_attention_matches_eager():
    """Llama 4's chunked layers (left-padded batch) run through the chunk overlay as a
    mask_mod, with the same logits as eager."""
    tiled, eager = build("llama4", "tiled"), build("llama4", "eager")
    ids, pad = padded_batch([21, 13], 21, "left", seed=4)
    with torch.no_grad():
        want = eager(ids, attention_mask=pad).logits
        got = tiled(ids, attention_mask=pad).logits
    keep = pad.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=0)


def _not_dense(mask) -> bool:
    """None, or a key vector (B or 1, 1, 1, Skv): nothing O(Sq x Skv)."""
    tensor = getattr(mask, "tensor", mask)
    return tensor is None or tensor.shape[-2] == 1


def _gemma3_with_images(impl: str):
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(**_common(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"]))
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=56, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, boi_token_index=3,
                                       eoi_token_index=4, image_token_index=5)
    return transformers.Gemma3ForConditionalGeneration._from_config(
        config, attn_implementation=impl).eval()


def test_gemma3_image_tokens_match_eager_without_a_dense_mask(op_calls):
    """Gemma 3 with images (a tiny SigLIP tower): the image tokens attend to each other both
    ways (transformers' block overlay), which reaches the op as a mask_mod, and the logits of
    a left-padded batch match eager's."""
    eager = _gemma3_with_images("eager")
    tiled = _gemma3_with_images("tiled")
    tiled.load_state_dict(eager.state_dict())
    image = [3, 5, 5, 5, 5, 4]  # begin, 4 image tokens, end
    ids = torch.tensor([[1, 10, 11, *image, 13, 14, 15, 16, 17, 18, 19],
                        [0, 0, 1, *image, *image, 20]])  # two images in a row
    pad = (ids != 0).long()
    token_types = (ids == 5).long()
    pixels = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=pad, pixel_values=pixels,
                     token_type_ids=token_types).logits
        got = tiled(input_ids=ids, attention_mask=pad, pixel_values=pixels,
                    token_type_ids=token_types).logits
        causal_only = eager(input_ids=ids, attention_mask=pad, pixel_values=pixels).logits
    keep = pad.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=0)
    assert (causal_only[keep] - want[keep]).abs().max() > 1e-2  # the overlay matters here
    assert all(mask is None for mask, _ in op_calls)
    assert sum(mods is not None for _, mods in op_calls) == 2  # the two text layers
    with torch.no_grad():  # and greedy decoding after the images, with a cache
        out_t, out_e = (model.generate(input_ids=ids, attention_mask=pad, pixel_values=pixels,
                                       token_type_ids=token_types, max_new_tokens=8,
                                       min_new_tokens=8, do_sample=False, pad_token_id=0)
                        for model in (tiled, eager))
    assert torch.equal(out_t, out_e)
    assert all(_not_dense(mask) for mask, _ in op_calls)


def test_llama4_chunks_at_cache_offsets_match_eager_without_a_dense_mask(op_calls):
    """Llama 4's chunk overlay with a cache: chunked prefill of a left-padded batch (chunks of
    more than 16 queries: the overlay takes absolute positions, so the mod shifts its indices
    by the cache offsets) and greedy decoding across chunk boundaries (one query a step: the
    dense mask of one row) match eager; nothing O(Sq x Skv) reaches the op."""
    from transformers import DynamicCache

    tiled, eager = build("llama4", "tiled"), build("llama4", "eager")
    ids, pad = padded_batch([40, 31], 40, "left", seed=6)
    logits = []
    with torch.no_grad():
        for model in (tiled, eager):
            cache, pieces = DynamicCache(config=model.config), []
            for start, end in ((0, 19), (19, 40)):  # the second chunk starts at offset 19
                pieces.append(model(ids[:, start:end], attention_mask=pad[:, :end],
                                    past_key_values=cache, use_cache=True).logits)
            logits.append(torch.cat(pieces, dim=1))
        prefill_calls = len(op_calls)
        out_t = tiled.generate(ids, attention_mask=pad, max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0)
        out_e = eager.generate(ids, attention_mask=pad, max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0)
    keep = pad.bool()
    torch.testing.assert_close(logits[0][keep], logits[1][keep], atol=1e-4, rtol=0)
    assert torch.equal(out_t, out_e)
    assert all(_not_dense(mask) for mask, _ in op_calls)
    chunked = [mods for _, mods in op_calls[:prefill_calls] if mods is not None]
    assert len(chunked) == 2  # the chunked layer, both prefill chunks
    # shifted: the query offset is read from a captured tensor
    assert re.search(r"q_idx \+ ct\.gather\(_captures\[\d\], \(0,\)\)", open(chunked[1].path).read())


def test_an_overlay_at_cache_offsets_compiles_for_sm90():
    """The shifted mod (offsets read from a captured tensor) compiles into the kernel."""
    pytest.importorskip("cuda.tile.compilation")
    from hf_tiled_attention.call_options import call_options
    from hf_tiled_attention.launch import export_cubin, plan_launch
    from hf_tiled_attention.masks import mod_mask
    from hf_tiled_attention.schedule import resolve_schedule

    fn = mu.and_masks(mu.causal_mask_function, mu.chunked_overlay(8, torch.tensor([0, 3])))
    m = tb.tiled_mask(batch_size=2, q_length=20, kv_length=40, q_offset=20, mask_function=fn,
                      attention_mask=torch.ones(2, 40, dtype=torch.bool))
    assert m.mods is not None and m.diag_offset == 20
    q = torch.randn(2, 4, 20, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 40, 64, dtype=torch.bfloat16)
    mask = mod_mask(m.mods, 2, 4, 20, 40, torch.device("cpu"))
    plan = plan_launch(q, k, call_options(mask, causal=True, scale=0.125, diag_offset=20,
                                          mods=m.mods),
                       resolve_schedule(None, 9, q.dtype, 64, True, seq_q=20, seq_kv=40))
    assert export_cubin(plan, q, k, mask, arch="sm_90")[:4] == b"\x7fELF"
