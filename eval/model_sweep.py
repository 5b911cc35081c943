"""Which transformers architectures run on "tiled": every causal-LM model type of the installed
transformers, built tiny with random weights, tiled against eager (CPU, fp32).

For each model type (one subprocess each: a crash, a hang or a huge allocation stays contained)
it builds one tiny config (the usual size fields shrunk; fields an architecture does not have
are ignored by it), runs a left-padded batch through eager, and then through "tiled" with the
same weights, and greedy-generates a few tokens with both. A row's ``status``:

* ``match``: logits on the non-pad positions within 1e-4 of eager (or within twice sdpa's own
  distance from eager, ``sdpa_logit_diff``, where that is larger: fp32 rounding adds up over
  a recurrent model's many attention calls), and the same generated tokens
  (``tokens_equal`` empty where eager itself cannot generate from this batch);
* ``differs``: it ran, but the logits or tokens differ (a bug: nothing may be silently wrong);
* ``refused``: hf_tiled_attention raised its own clear error (a head dim it has no kernel
  for, a model whose code uses the mask as a tensor, ...), recorded in ``message``;
* ``error``: any other error under "tiled" (a bug of ours where the model declares
  ``_supports_attention_backend``, in ``attention_backend``; otherwise the model cannot take a
  registered attention function at all);
* ``bypassed``: it ran without ever calling the "tiled" attention function (the model has its
  own attention code), so nothing of ours was compared;
* ``untested``: the tiny config did not even run with eager (the architecture needs fields
  this generic config does not set, or is not a plain text model), so nothing was compared.

    python eval/model_sweep.py                        # all (about 30 min on 2 CPU cores)
    python eval/model_sweep.py --models llama bloom   # some

Writes ``model_sweep.csv`` and ``environment.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eval.common import RESULTS_ROOT, ResultsWriter  # noqa: E402

COLUMNS = ["model_type", "status", "max_logit_diff", "sdpa_logit_diff", "tokens_equal",
           "attention_calls", "attention_backend", "message"]
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
            tie_word_embeddings=False, sliding_window=6,
            # the same sizes under other architectures' names
            n_embd=64, n_layer=2, n_head=4, d_model=64, num_layers=2, num_heads=4,
            ffn_hidden_size=128, moe_intermediate_size=32, num_experts=2, num_local_experts=2,
            num_experts_per_tok=1, n_routed_experts=2)
# Multi-head latent attention (DeepSeek V2/V3, GLM-4.7-Flash, LongCat; configs with
# kv_lora_rank): a key per query head, and query/key heads (rope + nope parts) wider than values'
MLA = dict(num_key_value_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
           kv_lora_rank=32, q_lora_rank=32, n_group=1, topk_group=1, first_k_dense_replace=1)
# Hybrid models (linear-attention or Mamba layers beside attention ones) whose first two
# layers hold no attention layer (eager then fails in the cache): the tiny sizes with one,
# tried in turn after the plain ones fail.
HYBRID = [dict(layer_types=["linear_attention", "full_attention"]), dict(attn_layer_indices=[1]),
          dict(num_hidden_layers=4), dict(num_hidden_layers=8)]
ATOL = 1e-4
NEW_TOKENS = 6
MEMORY_LIMIT = 12 * 2**30  # bytes of address space per model
TIME_LIMIT = 180  # seconds per model
# Errors hf_tiled_attention raises on purpose name the implementation or the argument.
OWN_ERRORS = ("attn_implementation='tiled'", "head dim must be", "must have the same shape",
              "sinks must")


def _one(model_type: str) -> dict:
    """Compare tiled with eager for one model type (run in its own process)."""
    import torch
    import transformers

    from hf_tiled_attention.transformers_backend import tiled_attention_forward

    calls = []

    def counted(*args, **kwargs):  # "tiled", counting its calls
        calls.append(1)
        return tiled_attention_forward(*args, **kwargs)

    transformers.AttentionInterface.register("tiled", counted)
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    row = dict(model_type=model_type, max_logit_diff="", sdpa_logit_diff="", tokens_equal="",
               attention_backend="", message="")
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (2, 14), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding

    def build(impl: str, weights=None):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=impl).eval()
        if weights is not None:
            model.load_state_dict(weights)
        return model

    def generate(model):
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)

    with torch.no_grad():
        first_error = None
        for extra in [{}] + HYBRID:
            try:
                sizes = {**TINY, **extra}
                config = transformers.AutoConfig.for_model(model_type, **sizes)
                if hasattr(config, "kv_lora_rank"):
                    config = transformers.AutoConfig.for_model(model_type, **{**sizes, **MLA})
                eager = build("eager")
                logits_e = eager(ids, attention_mask=mask).logits
                break
            except Exception as error:  # noqa: BLE001  (any failure: the config is not for it)
                first_error = first_error or error
        else:
            return dict(row, status="untested", message=_first_line(first_error))
        row["attention_backend"] = type(eager)._supports_attention_backend
        keep = mask.bool()
        tolerance = ATOL
        try:  # fp32 noise of this model: sdpa against eager
            logits_s = build("sdpa", eager.state_dict())(ids, attention_mask=mask).logits
            sdpa_diff = (logits_s[keep] - logits_e[keep]).abs().max().item()
            row["sdpa_logit_diff"] = f"{sdpa_diff:.2e}"
            tolerance = max(ATOL, 2 * sdpa_diff)
        except Exception:  # noqa: BLE001  (no sdpa for this model: the fixed bound)
            pass
        tokens_e = None
        if eager.can_generate():
            try:
                tokens_e = generate(eager)
            except Exception:  # noqa: BLE001  (eager cannot generate here: compare logits only)
                pass
        try:
            tiled = build("tiled", eager.state_dict())
            logits_t = tiled(ids, attention_mask=mask).logits
            tokens_t = None if tokens_e is None else generate(tiled)
        except Exception as error:  # noqa: BLE001
            own = any(marker in str(error) for marker in OWN_ERRORS)
            return dict(row, status="refused" if own else "error", message=_first_line(error))
    diff = (logits_t[keep] - logits_e[keep]).abs().max().item()
    same = None if tokens_e is None else torch.equal(tokens_t, tokens_e)
    row.update(max_logit_diff=f"{diff:.2e}", tokens_equal="" if same is None else same,
               attention_calls=len(calls))
    if not calls:
        return dict(row, status="bypassed")
    return dict(row, status="match" if diff <= tolerance and same is not False else "differs")


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _in_subprocess(model_type: str) -> dict:
    try:
        done = subprocess.run([sys.executable, __file__, "--one", model_type],
                              capture_output=True, text=True, timeout=TIME_LIMIT,
                              preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        return dict(model_type=model_type, status="untested",
                    message=f"took over {TIME_LIMIT} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return dict(model_type=model_type, status="untested",
                message=f"process ended with {done.returncode}: {tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", help="model types (default: every causal LM)")
    parser.add_argument("--out", type=Path, default=RESULTS_ROOT / "model-sweep",
                        help="results folder (default: eval/results/model-sweep)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one)))
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


    models = args.models or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    writer = ResultsWriter(out, "model_sweep", COLUMNS, argv)
    counts: dict = {}
    bugs = []  # ours: wrong results, or an error in a model that takes attention functions
    for model_type in models:
        row = _in_subprocess(model_type)
        if row["status"] == "differs" or (row["status"] == "error"
                                          and row.get("attention_backend") is True):
            bugs.append(model_type)
        writer.add({column: row.get(column, "") for column in COLUMNS})
        counts[row["status"]] = counts.get(row["status"], 0) + 1
        print(f"{model_type:32s} {row['status']:9s} {row.get('max_logit_diff', '')} "
              f"{row.get('message', '')[:90]}", flush=True)
    writer.finish({"counts": counts})
    print(f"{len(models)} model types: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    if bugs:
        print("wrong or failing under tiled: " + " ".join(bugs))
    return 1 if bugs else 0


if __name__ == "__main__":
    raise SystemExit(main())
