"""Serving many requests: transformers' continuous batching on `tiled` against `sdpa` and `eager`.

    python eval/serve_throughput.py                      # Llama-3-8B and Mistral-7B shapes, 8 layers
    python eval/serve_throughput.py --shapes llama3-8b --concurrency 32 256 --reps 2
    python eval/serve_throughput.py --gguf /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf

Each point serves ``--concurrency`` requests at once through a ``ContinuousBatchingManager``
(``model.init_continuous_batching``; the API under ``generate_batch``): random prompts of
``--prompt`` MIN MAX tokens and ``--new-tokens`` MIN MAX new tokens per request (uniform,
seeded; greedy, no early stop), all added at the start. Every backend serves the same requests
with a cache of the same size (room for all of them) and the same token budget per step, with
transformers' own choices otherwise: 5.17 and 5.18 capture CUDA graphs only for attention
names containing "flash", so none for `tiled` ("paged|tiled"), `sdpa` or `eager` (these two get
a dense mask over the batch). ``tiled+graphs`` (GPU default) is `tiled` served with
``ContinuousBatchingConfig(use_cuda_graph=True)``, the setting a server may pass, whose steps
transformers replays from graphs (no host work per layer):

* ``tokens_per_s``: new tokens of all requests over the wall time from the first request added
  to the last one finished;
* ``ttft_ms`` / ``ttft_p90_ms``: median / 90th percentile over requests of the time from a
  request's arrival to its first new token;
* ``peak_gib``: the GPU's peak allocated memory during the run (the cache included);
* ``vs_sdpa``: tokens/s over sdpa's, the median over reps (backends take turns rep by rep);
* ``same_as_sdpa``: the share of new tokens before a request's first difference from sdpa's
  (greedy; bf16 rounding makes near-ties flip, so read it beside eager's).

transformers 5.17 and 5.18 serve `tiled` (newer ones admit no other attention to continuous
batching: hf_tiled_attention/serving.py); under a newer one this script runs itself again
with the transformers 5.17 that .ci/install.sh puts in .venv/transformers-5.17.
Results: eval/results/<gpu>/serve/serve.csv, environment.json, serve.png. Without a GPU a tiny
model serves a few short requests through the CPU reference path (numbers say nothing).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import hf_tiled_attention  # noqa: E402,F401  (registers "tiled" and "paged|tiled")
from hf_tiled_attention import serving  # noqa: E402
from eval.common import ResultsWriter, output_dir, save_figure  # noqa: E402
from eval.models import (GRAPHS_BACKEND, IMPLEMENTATIONS, SHAPES, build_config,  # noqa: E402
                         build_models, model_device)

BACKENDS = ["tiled", "sdpa", "eager"]
GPU_BACKENDS = ["tiled", GRAPHS_BACKEND, "sdpa", "eager"]  # no graphs on a CPU: not run there
COLUMNS = ["model", "layers", "backend", "attention", "cuda_graphs", "concurrency", "prompt",
           "new_tokens", "tokens_per_s", "ttft_ms", "ttft_p90_ms", "peak_gib", "vs_sdpa",
           "same_as_sdpa", "status", "reason"]
OLD_TRANSFORMERS = REPO / ".venv" / "transformers-5.17"


def workload(count: int, prompt: tuple[int, int], new: tuple[int, int], vocab: int,
             seed: int) -> list[tuple[list[int], int]]:
    """``count`` (prompt ids, new tokens) pairs, uniform in the given ranges."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*new))
            for _ in range(count)]


def batching_config(requests, block_size: int, max_batch_tokens: int, graphs: bool = False):
    """Room in the cache for every request at once, the same for every backend; ``graphs``:
    CUDA graphs asked for (else transformers decides)."""
    from transformers.generation import ContinuousBatchingConfig
    blocks = sum(-(-(len(p) + n) // block_size) + 1 for p, n in requests) + 8
    return ContinuousBatchingConfig(block_size=block_size, num_blocks=blocks,
                                    max_batch_tokens=max_batch_tokens,
                                    use_cuda_graph=True if graphs else None)


@torch.inference_mode()
def serve(model, requests, config) -> dict:
    """One run of the manager over ``requests``: tokens per request, tokens/s, times to first
    token, peak memory, the attention it ran and whether it captured CUDA graphs."""
    from transformers import GenerationConfig
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=max(n for _, n in requests))
    on_gpu = model.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    manager = model.init_continuous_batching(generation_config=generation,
                                             continuous_batching_config=config)
    attention = model.config._attn_implementation
    manager.start()
    try:
        start = time.perf_counter()
        ids = [manager.add_request(prompt, max_new_tokens=new, record_timestamps=True)
               for prompt, new in requests]
        finished = {}
        while len(finished) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous-batching thread stopped (its log says why)")
            elif result.is_finished():
                if result.error:
                    raise RuntimeError(result.error)
                finished[result.request_id] = result
        elapsed = time.perf_counter() - start
        graphs = manager.continuous_batching_config.use_cuda_graph
    finally:
        manager.stop(block=True)
    outputs = [finished[i] for i in ids]
    ttfts = sorted((r.timestamps[0] - r.created_time) * 1e3 for r in outputs)
    return {
        "tokens": [list(r.generated_tokens) for r in outputs],
        "tokens_per_s": sum(len(r.generated_tokens) for r in outputs) / elapsed,
        "ttft_ms": statistics.median(ttfts),
        "ttft_p90_ms": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0,
        "attention": attention,
        "cuda_graphs": "/".join("yes" if g else "no" for g in graphs) if graphs else "no",
    }


def same_share(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """New tokens before each request's first difference, over all new tokens."""
    same = 0
    for mine, theirs in zip(tokens, reference):
        for a, b in zip(mine, theirs):
            if a != b:
                break
            same += 1
    return same / max(1, sum(len(t) for t in reference))


def measure(models: dict, requests, configs: dict, reps: int) -> dict:
    """Per backend its runs (the backends take turns, each with its batching config), or the
    first line of its error."""
    runs = {name: [] for name in models}
    failed = {}
    for name, model in models.items():  # warm-up: kernels compile, graphs of small batches
        try:
            serve(model, requests[:4], configs[name])
        except Exception as exc:  # noqa: BLE001 (out of memory, or a refusal: recorded)
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    for _ in range(reps):
        for name, model in models.items():
            if name in failed:
                continue
            try:
                runs[name].append(serve(model, requests, configs[name]))
            except Exception as exc:  # noqa: BLE001
                failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return runs, failed


def plot(rows: list[dict], out_dir: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    models = sorted({r["model"] for r in ok}) or ["none"]
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3 * len(models)), squeeze=False)
    backends = sorted({r["backend"] for r in ok})
    # one colour per backend in every panel (a model not run with every backend keeps them)
    colours = dict(zip(backends, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for model, (ax_rate, ax_ttft) in zip(models, axes):
        for backend in backends:
            pts = sorted((int(r["concurrency"]), float(r["tokens_per_s"]), float(r["ttft_ms"]))
                         for r in ok if r["model"] == model and r["backend"] == backend)
            if pts:
                style = dict(marker="o", label=backend, color=colours[backend])
                ax_rate.plot([p[0] for p in pts], [p[1] for p in pts], **style)
                ax_ttft.plot([p[0] for p in pts], [p[2] for p in pts], **style)
        for ax, ylabel in ((ax_rate, "new tokens/s"), (ax_ttft, "median time to first token (ms)")):
            ax.set(xscale="log", xlabel="concurrent requests", ylabel=ylabel, title=model)
            ax.legend(fontsize=7)
    return save_figure(fig, out_dir / "serve.png", dpi=70, measured_on_gpu=any(
        float(r["peak_gib"] or 0) for r in ok))


def _rerun_on_old_transformers(argv: list[str]) -> int:
    import transformers
    if not (OLD_TRANSFORMERS / "transformers").is_dir():
        print(f"serve_throughput: transformers {transformers.__version__} cannot serve 'tiled' "
              f"(5.17 and 5.18 can), and {OLD_TRANSFORMERS} does not hold 5.17 (bash "
              f".ci/install.sh puts it there)", file=sys.stderr)
        return 1
    print(f"serve_throughput: transformers {transformers.__version__} cannot serve 'tiled'; "
          f"running again on the transformers 5.17 in {OLD_TRANSFORMERS}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(OLD_TRANSFORMERS), os.environ.get("PYTHONPATH", "")]))
    import subprocess
    return subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv],
                          env=env).returncode


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES))
    parser.add_argument("--gguf", type=Path, default=None,
                        help="a real model (a GGUF file, e.g. the perplexity eval's SmolLM2)")
    parser.add_argument("--layers", type=int, default=None, help="default 8 (2 on a CPU)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--new-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--backends", nargs="+", default=None,
                        help=f"default {' '.join(GPU_BACKENDS)} on a GPU, else "
                             f"{' '.join(BACKENDS)}")
    parser.add_argument("--eager-up-to", type=int, default=64,
                        help="eager serves only up to this many concurrent requests (its "
                             "attention weights over the whole batch)")
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not serving.serves_custom_attention():
        return _rerun_on_old_transformers(argv)
    on_gpu, device, dtype = model_device("serve_throughput")
    if on_gpu:
        shapes = args.shapes or (["llama3-8b", "mistral-7b"] if args.gguf is None else [])
        layers = args.layers or 8
        concurrency = args.concurrency or [32, 64, 128, 256]
        prompt, new = tuple(args.prompt or (128, 4096)), tuple(args.new_tokens or (64, 512))
        budget = args.max_batch_tokens or 8192
    else:
        shapes = args.shapes or ["tiny-llama"]
        layers = args.layers or 2
        concurrency = args.concurrency or [4]
        prompt, new = tuple(args.prompt or (8, 40)), tuple(args.new_tokens or (3, 8))
        budget = args.max_batch_tokens or 256
    backends = args.backends or (GPU_BACKENDS if on_gpu else BACKENDS)
    out_dir = output_dir(args.out, "serve")
    writer = ResultsWriter(out_dir, "serve", COLUMNS, [sys.argv[0], *argv])
    sources = [(shape, build_config(shape, layers)) for shape in shapes]
    if args.gguf is not None:
        sources.append((args.gguf.name, args.gguf))
    for label, source in sources:
        models = _models(backends, source, dtype, device)
        vocab = next(iter(models.values())).config.vocab_size
        model_layers = next(iter(models.values())).config.num_hidden_layers
        for count in concurrency:
            requests = workload(count, prompt, new, vocab, args.seed)
            configs = {n: batching_config(requests, args.block_size, budget,
                                          graphs=n == GRAPHS_BACKEND) for n in models}
            chosen = {n: m for n, m in models.items() if n != "eager" or count <= args.eager_up_to}
            runs, failed = measure(chosen, requests, configs, args.reps)
            base = runs.get("sdpa") or []
            for name in models:
                row = dict(model=label, layers=model_layers, backend=name, concurrency=count,
                           prompt=f"{prompt[0]}-{prompt[1]}", new_tokens=f"{new[0]}-{new[1]}")
                if name not in chosen:
                    row.update(status="skipped", reason=f"eager above --eager-up-to "
                                                         f"{args.eager_up_to}")
                elif name in failed:
                    row.update(status="failed", reason=failed[name])
                else:
                    mine = runs[name]
                    row.update(status="ok", attention=mine[0]["attention"],
                               cuda_graphs=mine[0]["cuda_graphs"],
                               tokens_per_s=f"{statistics.median(r['tokens_per_s'] for r in mine):.1f}",
                               ttft_ms=f"{statistics.median(r['ttft_ms'] for r in mine):.1f}",
                               ttft_p90_ms=f"{statistics.median(r['ttft_p90_ms'] for r in mine):.1f}",
                               peak_gib=f"{max(r['peak_gib'] for r in mine):.2f}")
                    if base and name != "sdpa":
                        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mine, base)]
                        row.update(vs_sdpa=f"{statistics.median(ratios):.3f}",
                                   same_as_sdpa=f"{same_share(mine[0]['tokens'], base[0]['tokens']):.3f}")
                writer.add(row)
                print(f"serve {label} x{count} {name}: {row['status']} "
                      f"{row.get('tokens_per_s', '')} tok/s, ttft {row.get('ttft_ms', '')} ms, "
                      f"peak {row.get('peak_gib', '')} GiB, vs sdpa {row.get('vs_sdpa', '-')}, "
                      f"same as sdpa {row.get('same_as_sdpa', '-')} {row.get('reason', '')}",
                      flush=True)
        del models
        if on_gpu:
            torch.cuda.empty_cache()
    path = writer.finish()
    plot(writer.rows, out_dir)
    print(f"serve_throughput: {path}")
    return 0


def _models(backends, source, dtype, device) -> dict:
    """One model per backend with the same weights: built from a config, or a GGUF file."""
    if not isinstance(source, Path):
        return build_models(backends, source, dtype, device)
    from transformers import AutoModelForCausalLM
    return {name: AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=dtype,
        attn_implementation=IMPLEMENTATIONS.get(name, name)).to(device).eval() for name in backends}


if __name__ == "__main__":
    sys.exit(main())
