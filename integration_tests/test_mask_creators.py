"""CPU: each of transformers' create_*_mask functions, called with the "tiled" config, gives a
compact description (kernel flags, a key vector and, for overlays, a mask_mod: no dense mask)
whose visibility is exactly the mask the same function builds for "eager"."""

import copy

import pytest
import torch
from transformers import masking_utils as mu

import hf_tiled_attention  # noqa: F401  (registers "tiled")
from hf_tiled_attention import transformers_backend as tb
from hf_tiled_attention.mods import index_grid
from models import build, make_config, padded_batch


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


@pytest.mark.parametrize("case", list(CASES))
def test_mask_creator_is_compact_and_exact(case):
    create, model, kwargs = CASES[case]
    kwargs = dict(kwargs)
    _, pad = padded_batch([12, 9], 12, "left", seed=3)
    pad = kwargs.pop("pad", pad)
    embeds = torch.zeros(2, 12, 64)
    tiled = create(_config(model, "tiled"), embeds, pad, cache=None, **kwargs)
    eager = create(_config(model, "eager"), embeds, pad, cache=None, **kwargs)
    assert isinstance(tiled, tb.TiledMask) and tiled.dense is None
    assert (tiled.mods is not None) == (case in ("chunked", "causal-packed",
                                                 "causal-and-overlay", "causal-or-blocks"))
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
