"""Training with attn_implementation="tiled" on the CPU (the reference path's backward):
gradients equal eager's, Trainer's loss curve follows sdpa's, gradient checkpointing, packed
rows from DataCollatorWithFlattening, and a compiled training step."""

import pytest
import torch
import transformers
from transformers import DataCollatorWithFlattening

from models import ALL_MODELS, VOCAB, build, padded_batch


def _grads(model, forward=None, **batch):
    """Loss and parameter gradients of one step; ``forward`` (default: the model) computes it,
    e.g. the model under torch.compile."""
    model.train()
    model.zero_grad()
    out = (model if forward is None else forward)(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


def _assert_same_grads(got, want, atol=2e-5):
    (loss, grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=0)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        scale = want_grads[name].abs().max().item() or 1.0
        torch.testing.assert_close(grads[name], want_grads[name], atol=atol * max(scale, 1.0),
                                   rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_gradients_match_eager(name):
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    got = _grads(build(name, "tiled"), input_ids=ids, labels=ids)
    want = _grads(build(name, "eager"), input_ids=ids, labels=ids)
    _assert_same_grads(got, want)


def test_padded_batch_gradients_match_eager():
    ids, mask = padded_batch([13, 6], 13, side="right")
    labels = ids.masked_fill(mask == 0, -100)
    got = _grads(build("mistral", "tiled"), input_ids=ids, attention_mask=mask, labels=labels)
    want = _grads(build("mistral", "eager"), input_ids=ids, attention_mask=mask, labels=labels)
    _assert_same_grads(got, want)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_rows_train_like_separate_documents(flash_kwargs):
    """One row of three documents (DataCollatorWithFlattening): the gradients of the packed
    row are those of sdpa on the same packed row (transformers masks it by position_ids when
    there is no cache; with one, sdpa would see one causal sequence while tiled still follows
    the restarting position_ids), and the reference does keep the documents apart: its loss
    is that of the documents run one by one."""
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 14, 7)]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs,
                                          return_tensors="pt")
    batch = dict(collator([{"input_ids": d} for d in docs]), use_cache=False)
    got = _grads(build("llama", "tiled"), **batch)
    sdpa_batch = {k: v for k, v in batch.items() if not k.startswith(("cu_seq", "max_length"))}
    want = _grads(build("llama", "sdpa"), **sdpa_batch)
    _assert_same_grads(got, want)
    alone = build("llama", "sdpa")
    with torch.no_grad():  # each document's mean loss, weighted by its labelled tokens
        one_by_one = sum(alone(torch.tensor([d]), labels=torch.tensor([d]), use_cache=False
                               ).loss * (len(d) - 1) for d in docs) / sum(len(d) - 1 for d in docs)
    torch.testing.assert_close(want[0], one_by_one, atol=1e-5, rtol=0)


def test_gradient_checkpointing(op_calls):
    """Each layer's attention runs again in the backward (the recompute), with eager's
    gradients."""
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    model = build("llama", "tiled")
    # transformers 5.24 renamed it (the old name warns); 5.17 has only the old one.
    enable = getattr(model, "activation_checkpointing_enable", None) or \
        model.gradient_checkpointing_enable
    enable()
    got = _grads(model, input_ids=ids, labels=ids)
    assert len(op_calls) == 2 * model.config.num_hidden_layers
    _assert_same_grads(got, _grads(build("llama", "eager"), input_ids=ids, labels=ids))


class _Texts(torch.utils.data.Dataset):
    def __init__(self, n=40, length=24):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, VOCAB, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_losses(impl: str, tmp_path) -> list:
    model = build("llama", impl)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / impl), max_steps=20, per_device_train_batch_size=4,
        learning_rate=3e-3, logging_steps=1, report_to=[], seed=0, use_cpu=True,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Texts())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_loss_curve_follows_sdpa(tmp_path):
    tiled, sdpa = _trainer_losses("tiled", tmp_path), _trainer_losses("sdpa", tmp_path)
    assert len(tiled) == len(sdpa) == 20
    assert tiled[-1] < tiled[0], "the loss must fall"
    for step, (a, b) in enumerate(zip(tiled, sdpa)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: tiled {a} vs sdpa {b}"


def test_compiled_training_step_does_not_recompile():
    model = build("llama", "tiled")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @torch.compile(fullgraph=True)
    def loss_of(ids):  # AOTAutograd compiles its backward too
        return model(input_ids=ids, labels=ids).loss

    torch._dynamo.utils.counters.clear()
    losses = []
    for step in range(3):
        ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss = loss_of(ids)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    eager = build("llama", "eager")
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    assert abs(losses[0] - eager(input_ids=ids, labels=ids).loss.item()) < 1e-5


def test_compiled_packed_training_step_from_the_collator():
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s own output (cu_seq_lens_q
    and cu_seq_lens_k as two tensors, position_ids, labels, max_length_q/k) through
    torch.compile(model, fullgraph=True) with AOTAutograd: one graph, which a second batch of
    the same shape (other documents) reuses, and eager's loss and gradients."""
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
    graphs = []

    def counting_aot_eager(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    model, reference = build("llama", "tiled"), build("llama", "tiled")
    compiled = torch.compile(model, fullgraph=True, backend=counting_aot_eager)
    torch._dynamo.reset()
    for seed, lengths in enumerate([(9, 14, 7), (12, 5, 13)]):
        g = torch.Generator().manual_seed(seed)
        docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
        batch = dict(collator([{"input_ids": d} for d in docs]), use_cache=False)
        assert batch["cu_seq_lens_q"] is not batch["cu_seq_lens_k"]
        got = _grads(model, compiled, **batch)
        assert len(graphs) == 1, f"step {seed}: {len(graphs)} graphs"
        _assert_same_grads(got, _grads(reference, **batch))
    torch._dynamo.reset()
