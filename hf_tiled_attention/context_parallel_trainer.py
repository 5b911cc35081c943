"""transformers' ``Trainer`` with context parallelism over all its processes.

    from hf_tiled_attention.context_parallel_trainer import ContextParallelTrainer
    trainer = ContextParallelTrainer(model=model, args=args, train_dataset=..., data_collator=...)
    trainer.train()            # under torchrun / accelerate launch, model on attn "tiled"

Every process gets the same batches (the Trainer would give each its own), cuts each one with
:func:`~hf_tiled_attention.batch_sharding.shard_batch` and runs the forward and backward
inside :func:`~hf_tiled_attention.context_parallel.context_parallel`. The Trainer wraps the
model in DDP (or FSDP, as configured) over the same processes; each process's loss divides by
its share of the accumulated batches' label count, so that gradient average is the one-process
gradient and the logged loss (the processes' mean) the one-process loss. Evaluation runs
unsharded, each process on its own batches.
"""

from __future__ import annotations

from transformers import Trainer

from .batch_sharding import label_count, shard_batch
from .context_parallel import active_shards, context_parallel
from .transformers_backend import is_tiled

__all__ = ["ContextParallelTrainer"]


class ContextParallelTrainer(Trainer):
    """A ``Trainer`` whose processes train on shares of the same sequences.
    ``context_parallel_group``: the process group (default: every process); ``ignore_index``:
    the label the loss skips (transformers' causal-LM loss: -100)."""

    # The loss is normalised over the whole accumulated batch here (see get_batch_samples).
    loss_is_scaled_for_ga = True

    def __init__(self, *args, context_parallel_group=None, ignore_index: int = -100, **kwargs):
        super().__init__(*args, **kwargs)
        implementation = getattr(getattr(self.model, "config", None), "_attn_implementation",
                                 None)
        if not is_tiled(implementation):
            raise ValueError(
                f"ContextParallelTrainer needs the model's attention on 'tiled' "
                f"(attn_implementation='tiled'), got {implementation!r}: another "
                "implementation attends only within each process's share of the sequence")
        self.context_parallel_group = context_parallel_group
        self.ignore_index = ignore_index
        self._accumulated_tokens = None

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        # accelerate shards the batches over the processes; here each needs all of them (its
        # sampler is seeded alike on every process, and shard_batch checks the batches agree).
        sharded = getattr(dataloader, "batch_sampler", None)
        if sharded is None or not hasattr(sharded, "num_processes"):
            raise ValueError("ContextParallelTrainer needs a map-style train_dataset (one whose "
                             "batches accelerate draws by index)")
        sharded.num_processes, sharded.process_index = 1, 0
        return dataloader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        # The label count of all the batches one optimizer step accumulates (every process
        # holds all of them): the loss of each divides by it.
        self._accumulated_tokens = sum(label_count(batch, self.ignore_index)
                                       for batch in batches)
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = self._prepare_inputs(inputs)
        sharded = shard_batch(inputs, self.context_parallel_group,
                              global_tokens=self._accumulated_tokens,
                              ignore_index=self.ignore_index)
        with context_parallel(sharded):  # the backward too (checkpointed layers recompute)
            return super().training_step(model, sharded.inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if active_shards() is None:  # evaluation: the Trainer's own
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # shard_batch's inputs carry shift_labels and this process's share of the label count.
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

