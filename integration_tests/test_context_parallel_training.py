"""CPU: context parallelism with transformers models on spawned gloo ranks (world sizes 2 and
4): a training step of tiny Llama (left padding whose rows see no key, input embeddings),
Mistral (sliding window), Gemma 2 (softcap, windows), gpt-oss (sinks), Qwen2 (mixed layers,
gradient checkpointing) and packed rows (position_ids with FSDP2 and a balanced layout,
cu_seq_lens with DDP) and lengths no layout cuts evenly (padded by shard_batch) gives the one-process logits, loss and
gradients (context_parallel_runs.py); misuses are refused on every rank: different batches, one
rank's bad batch, a layout shorter than the batch, a mask laid over local positions, a model on
sdpa inside the context or its loss averaged without one, "tiled" given sharded inputs outside
the context or inside another batch's; ContextParallelTrainer's losses and weights after two
steps (packed rows of ordinary lengths) equal the one-process Trainer's, and it refuses a model
on another attention implementation."""

import sys
from pathlib import Path

import pytest
import torch

from context_parallel_runs import REFUSALS, logged_losses, trainer_setup, _weight_sum
from models import build

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from spawned_ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
REFUSAL_MESSAGES = {
    "different-batches": r"were given different batches \(input_ids differ\)",
    "one-rank-refuses": r"does not know how to split \['pixel_values'\]",
    "layout-too-short": r"layout is for 32 positions over {world} ranks; the batch has 34",
    "local-overlay": r"chunked_overlay.* reads tensors laid over this rank's positions",
    "sdpa-inside-context": r"no attention over the sharded sequence ran inside this block",
    "tiled-outside-context": r"got shard_batch's inputs .* outside context_parallel",
    "another-batch's-context": r"inputs of another shard_batch than the active",
    "sdpa-global-loss": r"no attention over the sharded sequence ran for this batch",
}


@pytest.mark.parametrize("world", [2, 4])
def test_training_step_equals_one_process(world):
    import re
    ranks = run_ranks("context_parallel_runs:model_results", world)
    failures = [error for result in ranks for name, error in result.items()
                if not name.startswith("refused:") and error]
    assert not failures, "\n".join(failures)
    for name in REFUSALS:
        pattern = REFUSAL_MESSAGES[name].format(world=world)
        for rank, result in enumerate(ranks):
            assert re.search(pattern, result[f"refused:{name}"]), result[f"refused:{name}"]
            if name == "one-rank-refuses" and rank < world - 1:  # the peers say whose batch
                assert f"rank {world - 1} of the group refused its batch" in \
                    result[f"refused:{name}"]


def test_trainer_equals_one_process_trainer(tmp_path):
    from transformers import Trainer
    sharded = run_ranks("context_parallel_runs:trainer_run", 2, str(tmp_path / "cp"))
    model = build("llama", "tiled")
    trainer = Trainer(model=model, **trainer_setup(str(tmp_path / "one")))
    trainer.train()
    want_losses, want_weights = logged_losses(trainer), _weight_sum(model)
    assert len(want_losses) == 2
    for losses, weights in sharded:
        assert losses == pytest.approx(want_losses, rel=1e-5, abs=0)
        assert weights == pytest.approx(want_weights, rel=1e-6, abs=1e-6)


def test_trainer_refuses_a_model_on_another_implementation(tmp_path):
    from hf_tiled_attention.context_parallel_trainer import ContextParallelTrainer
    with pytest.raises(ValueError, match=r"needs the model's attention on 'tiled' .* got 'sdpa'"):
        ContextParallelTrainer(model=build("llama", "sdpa"), **trainer_setup(str(tmp_path)))


def _grads(model, **batch):
    model.train()
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                         if p.grad is not None}


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_one_rank_pads_and_routes_the_calls(packed, device):
    """Context parallelism in this process as one rank (gloo, world 1): shard_batch pads an odd
    length (packed: documents of 50, 40 and 37 tokens), the model's "tiled" calls are routed
    over the sharded sequence (on the GPU: the kernels, fp32 as TF32x3), and the loss and
    gradients are the unsharded step's."""
    import torch.distributed as dist
    from transformers import DataCollatorWithFlattening

    import hf_tiled_attention as hta
    if packed:
        g = torch.Generator().manual_seed(6)
        docs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (50, 40, 37)]
        batch = dict(DataCollatorWithFlattening(return_tensors="pt")(
            [{"input_ids": d} for d in docs]))
    else:
        ids = torch.randint(3, 128, (2, 127), generator=torch.Generator().manual_seed(7))
        batch = dict(input_ids=ids, labels=ids)
    batch = {k: v.to(device) for k, v in batch.items()}
    want_loss, want = _grads(build("mistral", "tiled").to(device), **batch, use_cache=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = hta.shard_batch(batch)
        assert sharded.shards.layout.seq_len > sharded.seq_len  # padded
        model = build("mistral", "tiled").to(device)
        with hta.context_parallel(sharded):
            loss, grads = _grads(model, **sharded.inputs)
        assert sharded.shards.calls == model.config.num_hidden_layers
    finally:
        dist.destroy_process_group()
    tolerance = 1e-5 if device == "cpu" else 2e-3
    assert abs(loss - want_loss) <= tolerance * max(abs(want_loss), 1.0)
    for key in want:
        scale = max(want[key].abs().max().item(), 1e-3)
        assert (grads[key] - want[key]).abs().max().item() <= tolerance * scale, key
