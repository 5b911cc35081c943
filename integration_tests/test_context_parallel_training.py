"""CPU: context parallelism with transformers models on spawned gloo ranks (world sizes 2 and
4): a training step of tiny Llama (left padding whose rows see no key, input embeddings),
Mistral (sliding window), Gemma 2 (softcap, windows), gpt-oss (sinks), Qwen2 (mixed layers,
gradient checkpointing) and packed rows (position_ids with FSDP2 and a balanced layout,
cu_seq_lens with DDP) gives the one-process logits, loss and gradients (context_parallel_runs.py);
different batches on the ranks, a length the layout cannot split and a mask laid over local
positions are refused; ContextParallelTrainer's losses and weights after two steps equal the
one-process Trainer's."""

import sys
from pathlib import Path

import pytest

from context_parallel_runs import REFUSALS, logged_losses, trainer_setup, _weight_sum
from models import build

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from spawned_ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
REFUSAL_MESSAGES = {
    "different-batches": r"were given different batches \(input_ids differ\)",
    "not-divisible": r"multiple of {multiple} \({world} ranks x 2 chunks per rank\), got 30",
    "local-overlay": r"chunked_overlay.* reads tensors laid over this rank's positions",
}


@pytest.mark.parametrize("world", [2, 4])
def test_training_step_equals_one_process(world):
    import re
    ranks = run_ranks("context_parallel_runs:model_results", world)
    failures = [error for result in ranks for name, error in result.items()
                if not name.startswith("refused:") and error]
    assert not failures, "\n".join(failures)
    for name in REFUSALS:
        pattern = REFUSAL_MESSAGES[name].format(multiple=2 * world, world=world)
        for result in ranks:
            assert re.search(pattern, result[f"refused:{name}"]), result[f"refused:{name}"]


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
