"""Packed sequences: several documents in one row never attend to each other (CPU, fp32)."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from models import build, pair

LENGTHS = [7, 11, 5]  # documents longer than the sliding window (6)


def _docs(seed=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in LENGTHS]


def _separate_logits(model, docs):
    with torch.no_grad():
        return torch.cat([model(d[None], use_cache=False).logits[0] for d in docs])


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "qwen2"])
def test_restarting_position_ids(name, use_cache):
    """No cache: transformers detects packing and we get its mask. With a cache it does not;
    the attention function then honours position_ids itself."""
    tiled, eager = pair(name)
    docs = _docs()
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = tiled(ids, position_ids=pos, use_cache=use_cache).logits[0]
    torch.testing.assert_close(packed, _separate_logits(tiled, docs), atol=1e-4, rtol=0)
    torch.testing.assert_close(_separate_logits(tiled, docs), _separate_logits(eager, docs),
                               atol=1e-4, rtol=0)
    if not use_cache:  # eager masks packed documents only without a cache
        with torch.no_grad():
            ref = eager(ids, position_ids=pos, use_cache=False).logits[0]
        torch.testing.assert_close(packed, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_flattening_collator_cu_seq_lens(name, use_cache):
    tiled = build(name, "tiled")
    docs = _docs(7)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    assert "cu_seq_lens_q" in batch and "position_ids" in batch
    batch.pop("labels", None)
    with torch.no_grad():
        packed = tiled(**batch, use_cache=use_cache).logits[0]
    torch.testing.assert_close(packed, _separate_logits(tiled, docs), atol=1e-4, rtol=0)


def test_cu_seq_lens_alone_isolate_documents():
    """cu_seq_lens kwargs without restarting position_ids still separate the documents."""
    tiled = build("mistral", "tiled")
    docs = _docs(8)
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        # use_cache=True keeps transformers from building its own packed mask
        packed = tiled(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=max(LENGTHS), max_length_k=max(LENGTHS)).logits[0]
        # monotone positions: only cu_seq_lens say where documents start
        mono = tiled(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS),
                     max_length_k=max(LENGTHS), use_cache=False).logits[0]
        crossing = tiled(ids, use_cache=False).logits[0]
    torch.testing.assert_close(packed, _separate_logits(tiled, docs), atol=1e-4, rtol=0)
    # first document is unaffected by the position shift; later ones differ from the unpacked run
    torch.testing.assert_close(mono[:LENGTHS[0]], packed[:LENGTHS[0]], atol=1e-4, rtol=0)
    assert (mono[LENGTHS[0]:] - crossing[LENGTHS[0]:]).abs().max() > 1e-3


def test_packed_documents_reach_the_op_as_a_mask_mod(op_calls):
    """Every packed-sequence signal reaches the op as a mask_mod over per-token ids, never as
    a dense (B, 1, Sq, Skv) mask."""
    seen = op_calls
    tiled = build("llama", "tiled")
    docs = _docs(9)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
    with torch.no_grad():
        tiled(ids, position_ids=pos, use_cache=True)    # the adapter reads position_ids
        tiled(ids, position_ids=pos, use_cache=False)   # transformers' packed-sequence overlay
        tiled(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS),
              max_length_k=max(LENGTHS), use_cache=False)
    assert len(seen) == 6  # two layers, three forwards
    for mask, mods in seen:
        assert mods is not None and mods.mask_mod is not None
        assert mask is None
        assert all(t.numel() <= ids.shape[1] for t in mods.captures)  # O(S) per-token vectors
    assert seen[0][1] is seen[1][1]  # one translation per forward, shared by its layers


@pytest.mark.parametrize("cu_k", [[0, 7, 17, 23], [0, 7, 23]], ids=["values", "shape"])
def test_unequal_cu_seq_lens_are_an_error(cu_k):
    """cu_seq_lens_q and cu_seq_lens_k must hold the same boundaries (eager checks values)."""
    tiled = build("llama", "tiled")
    ids = torch.cat(_docs(10))[None]
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
    with pytest.raises(ValueError, match="equal boundaries"), torch.no_grad():
        tiled(ids, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32),
              max_length_q=max(LENGTHS), max_length_k=max(LENGTHS), use_cache=False)


def test_padding_inside_a_packed_document_hides_that_key():
    """cu_seq_lens with an attention_mask that hides a key inside a document: the key ids
    carry the padding (documents.key_documents), so a later query of that document does not see
    it, as in the document run alone with the same mask. (The pre-translated rule once read the
    query ids for the keys as well, and the key stayed visible.)"""
    tiled = build("llama", "tiled")
    docs = _docs(11)
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
    hidden = LENGTHS[0] + 3  # the fourth token of the second document
    mask = torch.ones_like(ids)
    mask[0, hidden] = 0
    with torch.no_grad():
        packed = tiled(ids, attention_mask=mask, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=max(LENGTHS), max_length_k=max(LENGTHS),
                       use_cache=False).logits[0]
        alone = [tiled(d[None], attention_mask=m[None], use_cache=False).logits[0]
                 for d, m in zip(docs, mask[0].split(LENGTHS))]
    later = slice(hidden + 1, LENGTHS[0] + LENGTHS[1])  # the document's queries after the key
    torch.testing.assert_close(packed[later], torch.cat(alone)[later], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name, window", [("llama", None), ("mistral", 6)])
def test_transformers_packed_rows_become_the_documents_rule(name, window, monkeypatch):
    """Restarting position_ids without a cache: transformers (5.17 and 5.19+, which also
    remaps its rule to per-document positions) hands the mask function its same-document
    overlay; the op gets the kernel's causal / window flags and the adapter's documents rule,
    whose block table comes from each tile's id bounds (never the rule on every pair)."""
    from hf_tiled_attention import masks, op
    from hf_tiled_attention.documents import same_document_key

    seen = []
    real = op.attention

    def spy(query, key, value, mask=None, **kwargs):
        seen.append(kwargs)
        return real(query, key, value, mask, **kwargs)

    from hf_tiled_attention import transformers_backend
    monkeypatch.setattr(transformers_backend, "_op_attention", spy)
    monkeypatch.setattr(masks.ModMask, "evaluate", lambda self, rows, cols: pytest.fail(
        "the document rule was evaluated per element") if len(rows) > 2 else
        masks.index_grid(self.batch, (1,), rows, cols)[0].expand(-1, 1, len(rows), len(cols)) > 0)
    tiled = build(name, "tiled")
    docs = _docs(12)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = tiled(ids, position_ids=pos, use_cache=False).logits[0]
    assert len(seen) == 2  # two layers
    for kwargs in seen:
        assert kwargs["causal"] and kwargs["window"] == window
        assert kwargs["mods"].key == same_document_key()
    torch.testing.assert_close(packed, _separate_logits(tiled, docs), atol=1e-4, rtol=0)
