"""Masks that train: a 4-D float attention_mask that requires grad, and T5's learned relative
position bias (the `position_bias` kwarg), which "tiled" runs as an additive mask whose
gradient the backward computes. Tiny random-weight models, fp32, against eager, CPU."""

import copy

import pytest
import torch
import transformers

from models import VOCAB, build


def test_float_4d_mask_that_requires_grad_gets_its_gradient():
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    base = torch.zeros(2, 1, 12, 12)
    base.masked_fill_(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    base = base + torch.randn(2, 1, 12, 12, generator=torch.Generator().manual_seed(1)) * 0.5
    results = {}
    for impl in ("eager", "tiled"):
        model = build("llama", impl)
        mask = base.clone().requires_grad_()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        results[impl] = (loss.detach(), mask.grad)
    (loss_e, grad_e), (loss_t, grad_t) = results["eager"], results["tiled"]
    assert grad_t is not None and grad_e.abs().max() > 0
    torch.testing.assert_close(loss_t, loss_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_t, grad_e, atol=1e-5 * grad_e.abs().max().item(), rtol=1e-4)


def _t5(impl: str, seed: int = 0, dropout_rate: float = 0.0):
    torch.manual_seed(seed)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=dropout_rate,
                                   relative_attention_num_buckets=8,
                                   relative_attention_max_distance=20, decoder_start_token_id=0,
                                   pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(copy.deepcopy(config))
    return model.set_attn_implementation(impl) or model


def _t5_batch():
    g = torch.Generator().manual_seed(2)
    inputs = torch.randint(2, VOCAB, (2, 11), generator=g)
    labels = torch.randint(2, VOCAB, (2, 7), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0  # the second row is right-padded
    return dict(input_ids=inputs, attention_mask=mask, labels=labels)


def test_t5_trains_like_eager():
    """Three SGD steps of a tiny T5 (encoder: padding; decoder: causal self-attention and
    cross-attention): losses and every gradient, the relative bias tables included."""
    batch = _t5_batch()
    runs = {}
    for impl in ("eager", "tiled"):
        model = _t5(impl)
        assert model.config._attn_implementation == impl
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(3):
            optim.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            losses.append(loss.item())
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
            optim.step()
        runs[impl] = (losses, grads)
    (losses_e, grads_e), (losses_t, grads_t) = runs["eager"], runs["tiled"]
    assert losses_e[-1] < losses_e[0]
    torch.testing.assert_close(torch.tensor(losses_t), torch.tensor(losses_e), atol=1e-5,
                               rtol=1e-5)
    assert grads_t.keys() == grads_e.keys()
    bias_tables = [n for n in grads_e if "relative_attention_bias" in n]
    assert bias_tables and all(grads_e[n].abs().max() > 0 for n in bias_tables)
    for name, want in grads_e.items():
        torch.testing.assert_close(grads_t[name], want, atol=1e-4 * want.abs().max().item() + 1e-7,
                                   rtol=1e-3, msg=name)


def test_t5_generates_like_eager():
    batch = _t5_batch()
    outputs = {impl: _t5(impl).eval().generate(input_ids=batch["input_ids"],
                                              attention_mask=batch["attention_mask"],
                                              max_new_tokens=6, do_sample=False)
               for impl in ("eager", "tiled")}
    assert torch.equal(outputs["tiled"], outputs["eager"])


@pytest.mark.parametrize("bias, error, pattern", [
    (torch.zeros(1, 3, 5, 5), ValueError, "position_bias of shape"),
    (torch.zeros(1, 4, 5, 5, dtype=torch.long), TypeError,
     "position_bias must be a floating-point tensor"),
])
def test_bad_position_bias_is_refused(bias, error, pattern):
    from hf_tiled_attention.transformers_backend import tiled_attention_forward

    q = torch.randn(1, 4, 5, 16)
    with pytest.raises(error, match=pattern):
        tiled_attention_forward(torch.nn.Module(), q, q, q, None, scaling=1.0,
                                position_bias=bias)


def test_t5_dropout_error_names_its_config_attribute():
    """T5 keeps its dropout in `dropout_rate`: the error names that, not attention_dropout."""
    model = _t5("tiled", dropout_rate=0.1)
    model.train()
    with pytest.raises(ValueError, match=r"dropout=0.1.*set the config's dropout_rate to 0.0"):
        model(**_t5_batch())
