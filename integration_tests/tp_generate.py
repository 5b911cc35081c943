"""Run under ``torchrun --nproc-per-node 2``: a saved model loaded with transformers' tensor
parallelism (``DistributedConfig(tp_plan="auto")``: each rank holds half of every layer's
heads), prefill logits and greedy ``generate`` with "tiled" and "sdpa". Rank 0 writes a JSON
report (argv[2]).

    torchrun --nproc-per-node 2 integration_tests/tp_generate.py MODEL_DIR REPORT.json
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import transformers  # noqa: E402

import hf_tiled_attention  # noqa: E402,F401
from hf_tiled_attention.transformers_backend import (tiled_attention_forward,  # noqa: E402
                                                     tiled_mask)


def main() -> None:
    folder, report = sys.argv[1], sys.argv[2]
    heads_seen = set()

    def recording_tiled(module, query, *args, **kwargs):
        heads_seen.add(query.shape[1])  # the query heads of this rank's shard
        return tiled_attention_forward(module, query, *args, **kwargs)

    transformers.AttentionInterface.register("tiled_tp_probe", recording_tiled)
    transformers.masking_utils.AttentionMaskInterface.register("tiled_tp_probe", tiled_mask)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in ("tiled_tp_probe", "sdpa"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation=impl, dtype=torch.float32,
            distributed_config=transformers.DistributedConfig(tp_plan="auto")).eval()
        with torch.no_grad():
            logits = model(ids.to(model.device)).logits.float().cpu()
            tokens = model.generate(ids.to(model.device), max_new_tokens=10, min_new_tokens=10,
                                    do_sample=False, pad_token_id=0).cpu()
        results[impl] = (logits, tokens)
    if int(os.environ.get("RANK", "0")) == 0:
        (logits_t, tokens_t), (logits_s, tokens_s) = results.values()
        Path(report).write_text(json.dumps({
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "heads_seen": sorted(heads_seen),
            "max_logit_diff": (logits_t - logits_s).abs().max().item(),
            "tokens_equal": torch.equal(tokens_t, tokens_s),
        }))
    # transformers opened the process group: close it on every rank, then leave without the
    # interpreter's teardown, where a still-running gloo thread was now and then destroyed
    # ("terminate called without an active exception", SIGABRT after the report was written).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
