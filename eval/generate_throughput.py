"""Generation speed of whole models: `generate()` with `tiled` against `sdpa` and `eager`.

    python eval/generate_throughput.py          # Llama-3-8B and Mistral-7B shapes, all 32 layers
    python eval/generate_throughput.py --shapes llama3-8b --batch 1 8 --prompt 1024 --cache dynamic
    python eval/generate_throughput.py --shapes llama3-8b --points 1x1024 1x8192 8x2048 --reps 5

Models are built from configs with random weights (no download), bf16, one per backend with the
same weights. For each (model, cache, batch, prompt length) every backend runs greedy
`generate()` on the same random prompts, `--new-tokens` new tokens each (no early stop):

* ``ttft_ms``: time to first token, the median of ``generate(max_new_tokens=1)`` (the prefill);
* ``tokens_per_s``: new tokens per second after the first, ``batch * (new_tokens - 1)`` over the
  median time of the full call minus the time to first token (the decode steps);
* ``vs_sdpa``, ``vs_sdpa_low``, ``vs_sdpa_high``: the median over reps of the backend's
  tokens/s over sdpa's in the same rep (a rep's tokens/s: its full call's time minus the
  smaller of its own and the median time to first token), and a 95% interval for it
  (common.median_interval; blank under 6 reps). Whether a difference is more than the host's
  noise: an interval that holds 1.0 does not tell the two apart.

The backends take turns rep by rep, so slow phases of the host fall on all of them alike (and
each rep's ratio compares runs seconds apart).

``tiled_fp8_cache`` (asked for with ``--backends``) is "tiled" generating into the FP8 KV cache
(``Fp8DynamicCache`` / ``Fp8StaticCache``: e4m3 rows, read by the decode kernel).

``--cache static`` is ``cache_implementation="static"``: transformers compiles the decode step
(torch.compile, CUDA graphs) on the first call, which the warm-up absorbs. ``eager`` runs only
where its O(S^2) attention scores fit (``skipped`` otherwise); a run out of memory is ``oom``.
Results: eval/results/<gpu>/generate/generate.csv, environment.json and generate.png. Without a
GPU a tiny model runs through the CPU reference path (numbers say nothing about speed).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention  # noqa: E402,F401  (registers attn_implementation="tiled")
from eval.common import (ResultsWriter, label_lengths, median_interval, progress,  # noqa: E402
                         output_dir, results_dir, save_figure)
from eval.models import (FP8_CACHE_BACKEND, SHAPES, build_config, build_models,  # noqa: E402
                         model_device)

BACKENDS = ["tiled", "sdpa", "eager"]  # and, asked for by name, FP8_CACHE_BACKEND
CACHES = ["dynamic", "static"]
COLUMNS = ["model", "layers", "backend", "cache", "batch", "prompt", "new_tokens", "ttft_ms",
           "tokens_per_s", "vs_sdpa", "vs_sdpa_low", "vs_sdpa_high", "peak_gib", "status",
           "reason"]
# eager keeps (B, Hq, S, S) scores in bf16 and their fp32 softmax: run it only where that fits
# in this share of the GPU's memory.
EAGER_SCORE_SHARE = 0.4


def timed_generate(model, ids, new_tokens: int, cache: str, fp8_cache: bool = False) -> float:
    """Seconds of one greedy generate() call of exactly ``new_tokens`` new tokens
    (``fp8_cache``: into a new FP8 cache of the ``cache`` kind, made inside the timed call)."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   **cache_arguments(model, ids.shape[1] + new_tokens, cache, fp8_cache))
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def cache_arguments(model, length: int, cache: str, fp8_cache: bool) -> dict:
    """generate()'s cache arguments: transformers' cache of the ``cache`` kind, or an FP8 cache
    of that kind for ``length`` tokens."""
    if not fp8_cache:
        return dict(cache_implementation=cache)
    if cache == "dynamic":
        return dict(past_key_values=hf_tiled_attention.Fp8DynamicCache(config=model.config))
    return dict(past_key_values=hf_tiled_attention.Fp8StaticCache(config=model.config,
                                                                  max_cache_len=length))


@torch.inference_mode()
def measure(models: dict, ids, new_tokens: int, cache: str, warmup: int,
            reps: int) -> dict:
    """Per backend (time to first token ms, new tokens/s after the first, peak GiB, its
    per-rep ratio to sdpa's: :func:`paired_ratio`), or the first line of its out-of-memory
    error. The backends take turns rep by rep (tiled, sdpa, eager, tiled, ...), so a slow
    phase of the host (whose run-to-run swings exceed the backends' difference: perf-notes
    step 22) falls on all of them alike."""
    firsts = {name: [] for name in models}
    fulls = {name: [] for name in models}
    peaks = dict.fromkeys(models, 0.0)
    failed: dict = {}

    def run(name, count):
        try:
            if ids.is_cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            timings = []
            for _ in range(count):
                # The full run first: without a warm-up the first call's one-time costs fall
                # on it, not on the prefill subtracted from it.
                fp8 = name == FP8_CACHE_BACKEND
                full = timed_generate(models[name], ids, new_tokens, cache, fp8)
                timings.append((timed_generate(models[name], ids, 1, cache, fp8), full))
            if ids.is_cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() / 2**30)
            return timings
        except torch.cuda.OutOfMemoryError as exc:
            failed[name] = str(exc).splitlines()[0][:120]
            return []

    for name in models:  # warm-up (compiles the static cache's decode step)
        run(name, warmup)
    for _ in range(reps):
        for name in models:
            if name not in failed:
                for first, full in run(name, 1):
                    firsts[name].append(first)
                    fulls[name].append(full)

    ran = [name for name in models if name not in failed]
    prefill = {name: statistics.median(firsts[name]) for name in ran}

    def rate(name, full, first):
        decode = decode_seconds(full, first, prefill[name])
        if decode <= 0:
            raise RuntimeError(f"generate: {name}'s {new_tokens}-token run took no longer than "
                               "its prefill; raise --new-tokens")
        return ids.shape[0] * (new_tokens - 1) / decode

    rates = {name: [rate(name, full, first) for full, first in zip(fulls[name], firsts[name])]
             for name in ran}
    results = {}
    for name in models:
        if name in failed:
            results[name] = failed[name]
            continue
        results[name] = (prefill[name] * 1e3,
                         rate(name, statistics.median(fulls[name]), prefill[name]),
                         peaks[name], paired_ratio(rates, name))
    return results


def decode_seconds(full: float, first: float, median_first: float) -> float:
    """A timed generate() run's decode time: the whole run less the smaller of its own prefill
    (``first``, timed beside it) and the median prefill. A slow prefill sample (a busy host)
    would leave the decode time near zero, and a run in a quiet phase of the host can take less
    in all than the median prefill, taken partly in busy phases (a CPU runner's swings reach
    20x: 61 ms for a whole run against a 116 ms median prefill). The median over runs of this
    is never below the median run less the median prefill."""
    return full - min(first, median_first)


def paired_ratio(rates: dict, name: str, baseline: str = "sdpa"):
    """(median, 95% interval or None) over reps of ``rates[name][r] / rates[baseline][r]``:
    each rep's two runs took turns seconds apart, so the host's slow phases, which move either
    backend's own rate by more than their difference, cancel in the ratio. None for the
    baseline itself or when it did not run."""
    if name == baseline or baseline not in rates:
        return None
    ratios = [mine / theirs for mine, theirs in zip(rates[name], rates[baseline])]
    return statistics.median(ratios), median_interval(ratios)


def eager_fits(config, batch: int, prompt: int) -> bool:
    if not torch.cuda.is_available():
        return True
    scores = batch * config.num_attention_heads * prompt * prompt * (2 + 4)
    return scores <= EAGER_SCORE_SHARE * torch.cuda.get_device_properties(0).total_memory


def plot(rows: list[dict], out_dir: Path) -> Path:
    """Tokens/s and time to first token against the prompt length, a row per (model, cache,
    batch)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    groups = sorted({(r["model"], r["cache"], r["batch"]) for r in ok})
    fig, axes = plt.subplots(max(len(groups), 1), 2, figsize=(11, 2.8 * max(len(groups), 1)),
                             squeeze=False)
    on_gpu = any(r["peak_gib"] for r in ok)
    for (model, cache, batch), (ax_rate, ax_ttft) in zip(groups, axes):
        sel = [r for r in ok if (r["model"], r["cache"], r["batch"]) == (model, cache, batch)]
        for backend in BACKENDS + [FP8_CACHE_BACKEND]:
            pts = sorted((r["prompt"], float(r["tokens_per_s"]), float(r["ttft_ms"]))
                         for r in sel if r["backend"] == backend)
            if pts:
                ax_rate.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
                ax_ttft.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=backend)
        title = f"{model} {cache} cache, batch {batch}"
        prompts = sorted({r["prompt"] for r in sel})
        for ax, ylabel in ((ax_rate, "new tokens/s"), (ax_ttft, "time to first token (ms)")):
            ax.set(xscale="log", xlabel="prompt tokens", ylabel=ylabel, title=title)
            label_lengths(ax, prompts)
            ax.legend(fontsize=7)
    return save_figure(fig, out_dir / "generate.png", dpi=70, measured_on_gpu=on_gpu)


def _batch_and_prompt(text: str) -> tuple[int, int]:
    """``"8x2048"`` -> ``(8, 2048)``."""
    batch, _, prompt = text.partition("x")
    if not (batch.isdigit() and prompt.isdigit() and int(batch) > 0 and int(prompt) > 0):
        raise SystemExit(f"--points takes BATCHxPROMPT pairs of positive numbers such as "
                         f"8x2048, got {text!r}")
    return int(batch), int(prompt)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the config-built models (default: all 32; 2 on a CPU)")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, nargs="+", default=None, help="prompt tokens")
    parser.add_argument("--points", nargs="+", default=None, metavar="BATCHxPROMPT",
                        help="(batch, prompt) pairs such as 1x1024 8x2048, instead of every "
                             "--batch with every --prompt")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache", nargs="+", default=CACHES, choices=CACHES)
    parser.add_argument("--backends", nargs="+", default=BACKENDS,
                        choices=BACKENDS + [FP8_CACHE_BACKEND])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the plot from the --out folder's generate.csv")
    args = parser.parse_args(argv)
    if args.replot:
        folder = args.out or results_dir("generate")
        with open(folder / "generate.csv") as f:
            rows = [{**r, "batch": int(r["batch"]), "prompt": int(r["prompt"])}
                    for r in csv.DictReader(f)]
        print(f"plot: {plot(rows, folder)}")
        return 0
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens must be at least 2 (the rate is taken after the first "
                         f"token), got {args.new_tokens}")
    if min(args.batch or [1]) < 1 or min(args.prompt or [1]) < 1 or args.reps < 1:
        raise SystemExit("--batch, --prompt and --reps take positive numbers")
    pairs = None if args.points is None else [_batch_and_prompt(text) for text in args.points]
    if pairs is not None and (args.batch or args.prompt):
        raise SystemExit("--points names the (batch, prompt) pairs: leave out --batch and "
                         "--prompt")
    on_gpu, device, dtype = model_device("generate")
    shapes = args.shapes or (["llama3-8b", "mistral-7b"] if on_gpu else ["tiny-llama"])
    batches = args.batch or ([1, 8, 32] if on_gpu else [1, 2])
    prompts = args.prompt or ([1024, 8192, 32768] if on_gpu else [32, 64])
    layers = args.layers or (32 if on_gpu else 2)
    warnings.simplefilter("ignore")
    out_dir = output_dir(args.out, "generate")
    results = ResultsWriter(out_dir, "generate", COLUMNS, argv)
    pairs = pairs or [(batch, prompt) for batch in batches for prompt in prompts]
    points = [(shape, cache, batch, prompt) for shape in shapes for cache in args.cache
              for batch, prompt in pairs]
    models, built = None, None
    for shape, cache, batch, prompt in progress(points, desc="generate"):
        if built != shape:
            models = None  # free the previous shape's weights first
            if on_gpu:
                torch.cuda.empty_cache()
            config = build_config(shape, layers)
            models, built = build_models(args.backends, config, dtype, device), shape
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(3, config.vocab_size, (batch, prompt), generator=gen).to(device)
        runnable = {name: model for name, model in models.items()
                    if name != "eager" or eager_fits(config, batch, prompt)}
        measured = measure(runnable, ids, args.new_tokens, cache, args.warmup, args.reps)
        for backend in models:
            row = dict(model=shape, layers=layers, backend=backend, cache=cache, batch=batch,
                       prompt=prompt, new_tokens=args.new_tokens, ttft_ms="", tokens_per_s="",
                       vs_sdpa="", vs_sdpa_low="", vs_sdpa_high="", peak_gib="", status="ok",
                       reason="")
            result = measured.get(backend)
            if result is None:
                row.update(status="skipped", reason="eager's O(S^2) attention scores do not fit")
            elif isinstance(result, str):
                row.update(status="oom", reason=result)
            else:
                ttft, rate, peak, ratio = result
                row.update(ttft_ms=f"{ttft:.1f}", tokens_per_s=f"{rate:.1f}",
                           peak_gib=f"{peak:.2f}" if on_gpu else "")
                if ratio is not None:
                    median, interval = ratio
                    row["vs_sdpa"] = f"{median:.3f}"
                    if interval is not None:
                        row.update(vs_sdpa_low=f"{interval[0]:.3f}",
                                   vs_sdpa_high=f"{interval[1]:.3f}")
            results.add(row)
            print(_console_line(row), flush=True)
        if on_gpu:
            torch.cuda.empty_cache()
    csv_path = results.finish(extra={"dtype": str(dtype)})
    print(f"csv: {csv_path}\nplot: {plot(results.rows, out_dir)}")
    return 0


def _console_line(row: dict) -> str:
    """A row as a reader can check it: the tokens/s is the median over reps, and the ratio to
    sdpa the median of each rep's own ratio (the backends take turns rep by rep), which need
    not equal the ratio of the two medians."""
    point = (f"generate {row['model']} {row['cache']} b{row['batch']} p{row['prompt']} "
             f"+{row['new_tokens']} {row['backend']:8s}")
    if row["status"] != "ok":
        return f"{point} {row['status']}: {row['reason']}"
    line = f"{point} {row['tokens_per_s']} tokens/s (median of reps), ttft {row['ttft_ms']} ms"
    if row["peak_gib"]:
        line += f", peak {row['peak_gib']} GiB"
    if row["vs_sdpa"]:
        line += f"; vs sdpa, the median of per-rep ratios: {row['vs_sdpa']}x"
        if row["vs_sdpa_low"]:
            line += f" (95% interval {row['vs_sdpa_low']}-{row['vs_sdpa_high']})"
    return line


if __name__ == "__main__":
    raise SystemExit(main())
