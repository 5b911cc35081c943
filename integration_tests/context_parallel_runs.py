"""Training steps of tiny models with context parallelism, run on each spawned rank by
test_context_parallel_training.py: the forward's logits, the loss and every gradient (the
parameters' after DDP's or FSDP2's average over the ranks, and the input embeddings') against
the same model's step on the whole batch in one process, and the refusals."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from transformers import DataCollatorWithFlattening

from hf_tiled_attention import context_parallel, shard_batch
from hf_tiled_attention.shard_layout import SequenceLayout, position_work
from models import VOCAB, build, padded_batch

# fp32 rounding (the sharded and whole-sequence steps add in other orders), relative to the
# largest magnitude of each tensor.
TOLERANCE = 2e-5


def _documents_batch(flash_kwargs: bool, lengths=(5, 13, 9, 5)) -> dict:
    """One packed row of documents (four, 32 tokens), as DataCollatorWithFlattening makes it."""
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs,
                                          return_tensors="pt")
    return dict(collator([{"input_ids": d} for d in docs]))


def _plain_batch(rows: int = 1, seq: int = 32) -> dict:
    ids = torch.randint(3, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(2))
    return dict(input_ids=ids, labels=ids)


def _left_padded_embeds(model) -> dict:
    """Two rows, the first left-padded by 5 (its first rows see no key), as embeddings that
    require grad (the input's gradient is checked too)."""
    return _padded_embeds(model, [27, 32], 32)


def _padded_embeds(model, lengths: list, seq: int) -> dict:
    ids, mask = padded_batch(lengths, seq, side="left")
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    return dict(inputs_embeds=embeds, attention_mask=mask,
                labels=ids.masked_fill(mask == 0, -100))


# (model, batch maker, gradient sync, extra) per case; extra: "checkpointing", a layout kind,
# "use_cache".
CASES = {
    "llama-left-padding-embeds": ("llama", _left_padded_embeds, "ddp", None),
    "mistral-window": ("mistral", lambda m: _plain_batch(), "ddp", None),
    "gemma2-softcap-window": ("gemma2", lambda m: _plain_batch(2), "ddp", None),
    "gpt_oss-sinks": ("gpt_oss", lambda m: _plain_batch(), "ddp", None),
    "qwen2-checkpointing": ("qwen2", lambda m: _plain_batch(), "ddp", "checkpointing"),
    "llama-packed-position_ids-fsdp2": ("llama", lambda m: _documents_batch(False), "fsdp2",
                                        "balanced"),
    "llama-packed-cu_seq_lens": ("llama", lambda m: _documents_batch(True), "ddp", None),
    # Lengths no layout cuts evenly: shard_batch pads them.
    "llama-odd-length": ("llama", lambda m: _plain_batch(2, seq=29), "ddp", None),
    "llama-packed-odd-lengths": ("llama", lambda m: _documents_batch(False, (11, 9, 7)), "ddp",
                                 None),
    "llama-with-a-cache": ("llama", lambda m: _plain_batch(), "ddp", "use_cache"),
    "gemma2-odd-length-padding": ("gemma2", lambda m: _padded_embeds(m, [23, 27], 27), "ddp",
                                  None),
}


def _step(model, batch: dict, sharded=None):
    """(loss, logits) of one forward + backward; with ``sharded``, this rank's share."""
    if sharded is None:
        out = model(**batch, use_cache=False)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach()
    with context_parallel(sharded):
        out = model(**sharded.inputs)
        out.loss.backward()
    return sharded.global_loss(out.loss), out.logits.detach()


def _wrapped(model, sync: str, world: int, embeds: bool):
    if sync == "ddp":  # (given inputs_embeds, the embedding table gets no gradient)
        return torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=embeds)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # (a collective)


def run_case(name: str, rank: int, world: int) -> Optional[str]:
    model_name, make_batch, sync, extra = CASES[name]
    model = build(model_name, "tiled")
    model.train()
    if extra == "checkpointing":
        model.gradient_checkpointing_enable()
    reference = copy.deepcopy(model)
    batch = make_batch(reference)
    want_loss, want_logits = _step(reference, batch)
    want = {n: p.grad for n, p in reference.named_parameters()}
    embeds = batch.get("inputs_embeds")
    want_embeds = None
    if embeds is not None:
        want_embeds, embeds.grad = embeds.grad, None
    layout = None
    if extra == "balanced":  # four chunks per rank, by the documents' visible pairs
        seq = batch["input_ids"].shape[1]
        ids = (torch.diff(batch["position_ids"], prepend=batch["position_ids"][:, :1] - 1)
               != 1).cumsum(-1)
        layout = SequenceLayout.balanced(position_work(seq, ids), world, 4)
    sharded = shard_batch(batch, layout=layout)
    if extra == "use_cache":  # a cache of local keys that nothing reads: the same step
        sharded.inputs["use_cache"] = True
    loss, logits = _step(_wrapped(model, sync, world, embeds is not None), batch, sharded)
    got = {n: _full(p.grad) for n, p in model.named_parameters()}
    problems = []
    real = sharded.positions < sharded.seq_len  # (the rest: shard_batch's padding)
    _compare(problems, "loss", loss, want_loss)
    _compare(problems, "logits", logits[:, real], sharded.shard(want_logits, 1)[:, real])
    if embeds is not None:
        _compare(problems, "inputs_embeds grad", sharded.shard(embeds.grad, 1),
                 sharded.shard(want_embeds, 1))
    for param, grad in want.items():
        _compare(problems, f"{param} grad", got[param], grad)
    return f"rank {rank} {name}: " + "; ".join(problems) if problems else None


def _compare(problems: list, what: str, got, want) -> None:
    if got is None or want is None:
        if (got is None) != (want is None):
            problems.append(f"{what}: one of the two is None")
        return
    scale = max(want.abs().max().item(), 1.0)
    err = (got.double() - want.double()).abs().max().item()
    if not err <= TOLERANCE * scale:
        problems.append(f"{what}: max abs error {err:.3g}")


def refusal(name: str, rank: int, world: int) -> str:
    """The error a misuse raises on this rank (every rank raises, none left waiting in a
    collective the others never join)."""
    try:
        if name == "different-batches":
            batch = _plain_batch()
            batch["input_ids"] = batch["input_ids"] + rank
            shard_batch(batch)
        elif name == "one-rank-refuses":  # only the last rank's batch has an unknown key
            batch = _plain_batch()
            if rank == world - 1:
                batch["pixel_values"] = torch.zeros(1, 3)
            shard_batch(batch)
        elif name == "layout-too-short":
            shard_batch(_plain_batch(seq=34), layout=SequenceLayout.head_tail(32, world))
        elif name == "local-overlay":  # Llama 4's chunk overlay reads a per-row tensor
            model = build("llama4", "tiled")
            sharded = shard_batch(_plain_batch())
            with context_parallel(sharded):
                model(**sharded.inputs)
        elif name == "sdpa-inside-context":  # attends within each rank's positions
            model = build("llama", "sdpa")
            sharded = shard_batch(_plain_batch())
            with context_parallel(sharded):
                model(**sharded.inputs).loss.backward()
        elif name == "tiled-outside-context":
            sharded = shard_batch(_plain_batch())
            build("llama", "tiled")(**sharded.inputs)
        elif name == "another-batch's-context":
            sharded, other = shard_batch(_plain_batch()), shard_batch(_plain_batch())
            with context_parallel(other):
                build("llama", "tiled")(**sharded.inputs)
        elif name == "sdpa-global-loss":  # no context, another implementation
            sharded = shard_batch(_plain_batch())
            sharded.global_loss(build("llama", "sdpa")(**sharded.inputs).loss)
        else:
            raise KeyError(name)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return "no error"


REFUSALS = ("different-batches", "one-rank-refuses", "layout-too-short", "local-overlay",
            "sdpa-inside-context", "tiled-outside-context", "another-batch's-context",
            "sdpa-global-loss")


def model_results(rank: int, world: int) -> dict:
    results = {name: run_case(name, rank, world) for name in CASES}
    results.update({f"refused:{name}": refusal(name, rank, world) for name in REFUSALS})
    return results


def trainer_run(rank: int, world: int, out_dir: str) -> tuple:
    """Two steps of ContextParallelTrainer: the logged losses and a weight's sum after."""
    from hf_tiled_attention.context_parallel_trainer import ContextParallelTrainer
    model = build("llama", "tiled")
    trainer = ContextParallelTrainer(model=model, **trainer_setup(out_dir))
    trainer.train()
    return logged_losses(trainer), _weight_sum(model)


def trainer_setup(out_dir: str) -> dict:
    """The Trainer arguments both the sharded and the one-process runs use: rows of two packed
    documents of ordinary lengths (no row a multiple of 4 tokens long: shard_batch pads), two
    steps of two accumulated rows, the same seed everywhere."""
    from transformers import TrainingArguments
    g = torch.Generator().manual_seed(5)
    data = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()}
            for n in (31, 20, 13, 32, 17, 16, 24, 9)]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=2,
                             gradient_accumulation_steps=2, learning_rate=1e-3,
                             lr_scheduler_type="constant", logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    return dict(args=args, train_dataset=data,
                data_collator=DataCollatorWithFlattening(return_tensors="pt"))


def logged_losses(trainer) -> list:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _weight_sum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))
