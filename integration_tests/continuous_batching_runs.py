"""Continuous batching (``generate_batch``) of the tiny test models on "tiled" against "eager":
transformers' continuous batching on it ("paged|eager"; a batch's MoE layers round unlike a
single request's, so gpt-oss's tokens differ from ``generate()``'s one request at a time),
except where "paged|eager" drops an attention feature (Gemma 2's softcap): there eager
``generate()`` one request at a time. Counts the packed-requests kernel's calls. Runs in the test's process where the installed
transformers serves "tiled" (5.17-5.18), else as ``python
integration_tests/continuous_batching_runs.py <models>`` under a transformers 5.17 put first on
``PYTHONPATH`` (test_continuous_batching.py); prints one JSON line per model."""

from __future__ import annotations

import contextlib
import json
import sys
from unittest import mock

import torch
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from hf_tiled_attention import varlen

from models import VOCAB, build

# Requests of different lengths (longer than the models' window of 6), so one batch mixes
# prefill chunks and decode steps once the short ones finish their prompts.
PROMPT_LENGTHS = (5, 17, 33, 9, 26, 12)
NEW_TOKENS = 10


def prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _configs(max_batch_tokens=None, cuda_graphs: bool = False, block_table: bool = False
             ) -> tuple[GenerationConfig, ContinuousBatchingConfig]:
    """Greedy generation (no EOS, a fixed count) and the batching: pages of 16 tokens, so a
    request's keys lie on several pages; a small token budget splits prompts into chunks
    (prefill after a cached part); ``cuda_graphs``: steps captured and replayed (asked for:
    transformers 5.17-5.18 capture none for "paged|tiled" by default); ``block_table``: 5.19+'s
    decode steps on the block table, up to 8 pages a request (:func:`block_table_decode`)."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    page = "page_size" if hasattr(ContinuousBatchingConfig, "page_size") else "block_size"
    pages = {"max_blocks_per_request": 8} if block_table else {}
    return config, ContinuousBatchingConfig(**{page: 16}, num_blocks=64,
                                            max_batch_tokens=max_batch_tokens or 256,
                                            use_cuda_graph=True if cuda_graphs else None,
                                            **pages)


def greedy_batch(model, requests, max_batch_tokens=None, device="cpu",
                 cuda_graphs: bool = False, block_table: bool = False) -> list[list[int]]:
    """Greedy tokens of ``generate_batch``, in request order (:func:`_configs`)."""
    config, batching = _configs(max_batch_tokens, cuda_graphs, block_table)
    results = model.to(device).generate_batch(requests, generation_config=config,
                                               continuous_batching_config=batching)
    ordered = sorted(results.values(), key=lambda r: int(r.request_id.split("_")[-1]))
    return [list(r.generated_tokens) for r in ordered]


def greedy_manager(model, requests, device="cpu", cuda_graphs: bool = False) -> list[list[int]]:
    """Greedy tokens through the manager API (``init_continuous_batching``, ``add_request``,
    ``get_result``), in request order: half the requests added before it starts, the rest
    while it runs, once the first result is out (as a server adds them)."""
    config, batching = _configs(cuda_graphs=cuda_graphs)
    manager = model.to(device).init_continuous_batching(generation_config=config,
                                                        continuous_batching_config=batching)
    first = len(requests) // 2
    results = {}
    manager.start()
    try:
        for index, ids in enumerate(requests):
            if index == first:  # the rest arrive after the first request is done
                while not results:
                    _collect(manager, results)
            manager.add_request(ids, request_id=f"request_{index}", max_new_tokens=NEW_TOKENS)
        while len(results) < len(requests):
            _collect(manager, results)
    finally:
        manager.stop(block=True, timeout=60)
    return [results[f"request_{index}"] for index in range(len(requests))]


def _collect(manager, results: dict) -> None:
    result = manager.get_result(timeout=120)
    if result is None:
        raise RuntimeError("the continuous-batching manager stopped or gave no result in 120 s")
    if result.error:
        raise RuntimeError(f"{result.request_id}: {result.error}")
    if result.is_finished():
        results[result.request_id] = list(result.generated_tokens)


def greedy_one_by_one(model, requests, device="cpu") -> list[list[int]]:
    """Greedy tokens of ``generate()``, each request alone."""
    model = model.to(device)
    tokens = []
    for request in requests:
        ids = torch.tensor([request], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
        tokens.append(out[0, ids.shape[1]:].tolist())
    return tokens


def graph_padding():
    """transformers' inputs as it pads them for CUDA graphs (static sizes: token and key counts
    padded to intervals, the padding requests' ``cu_seq_lens`` flat, their cache slots the
    cache's trash slots, ``max_seqlen_q`` the padded token count), with the graphs themselves
    off: the same arguments reach the attention on any device. (ModelRunner.pad_inputs, which
    transformers sets where graphs or compilation are on.)"""
    from transformers.generation.continuous_batching.model_runner import ModelRunner
    real_init = ModelRunner.__init__

    def padded(runner, *args, **kwargs):
        real_init(runner, *args, **kwargs)
        runner.pad_inputs = True
    return mock.patch.object(ModelRunner, "__init__", padded)


def block_table_decode():
    """transformers 5.19+'s decode steps on the block table (``flash_attn_with_kvcache``) on any
    device: its check that turns them off without CUDA (``ensure_decode_fast_path_is_available``)
    passed by, so the batching's ``max_blocks_per_request`` stands. The same calls reach the
    attention as on a GPU."""
    from transformers.generation.continuous_batching import initialization
    return mock.patch.object(initialization, "ensure_decode_fast_path_is_available",
                             lambda *args, **kwargs: None)


def run(name: str, dtype=torch.float32, device="cpu", max_batch_tokens=None,
        implementation: str = "tiled", manager: bool = False, cuda_graphs: bool = False,
        padded: bool = False, block_table: bool = False) -> dict:
    """Greedy tokens of eager and of ``implementation`` ("tiled", or the tiled kernels' Hub-
    kernel name) under continuous batching for ``name``'s tiny model, the kernel's call count,
    and how many of those calls read the paged cache in place. ``manager``: ``implementation``
    through the manager API, requests arriving while it runs (:func:`greedy_manager`).
    ``cuda_graphs``: ``implementation``'s steps in CUDA graphs (the kernel's Python runs only
    while a graph is captured; ``replays`` counts the steps replayed); ``padded``: its inputs
    padded as for graphs, run without them (:func:`graph_padding`); ``block_table``: decode
    steps on 5.19+'s block table (:func:`block_table_decode`)."""
    requests = prompts()
    eager_model = build(name, "eager").to(dtype)
    if getattr(eager_model.config, "attn_logit_softcapping", None):
        eager = greedy_one_by_one(eager_model, requests, device)
    else:
        eager = greedy_batch(eager_model, requests, max_batch_tokens, device)
    calls = {"calls": 0, "paged": 0, "replays": 0}
    real = varlen.varlen_attention_on_pages  # every packed-requests call ends there
    real_replay = torch.cuda.CUDAGraph.replay

    def counted(*args, **kwargs):
        calls["calls"] += 1
        calls["paged"] += kwargs.get("key_slots") is not None
        return real(*args, **kwargs)

    def counted_replay(graph):
        calls["replays"] += 1
        return real_replay(graph)

    with mock.patch.object(varlen, "varlen_attention_on_pages", counted), \
            mock.patch.object(torch.cuda.CUDAGraph, "replay", counted_replay), \
            graph_padding() if padded else contextlib.nullcontext(), \
            block_table_decode() if block_table else contextlib.nullcontext():
        model = build(name, implementation).to(dtype)
        tiled = greedy_manager(model, requests, device, cuda_graphs) if manager else \
            greedy_batch(model, requests, max_batch_tokens, device, cuda_graphs, block_table)
    return {"model": name, "eager": eager, "tiled": tiled, **calls}


def refusal(name: str, bidirectional: bool = False) -> dict:
    """What ``generate_batch`` gives for a model whose attention the route does not serve
    (``name``'s model, told its attention is bidirectional where ``bidirectional``): the
    requests' errors."""
    model = build(name, "tiled")
    if bidirectional:
        model.config.use_bidirectional_attention = True
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    results = model.generate_batch(prompts()[:2], generation_config=config)
    return {"model": name, "errors": [r.error for r in results.values()],
            "tokens": [list(r.generated_tokens) for r in results.values()]}


if __name__ == "__main__":
    budget = None
    names = sys.argv[1:]
    if names and names[0] == "--refusal":  # --refusal MODEL [bidirectional]
        print(json.dumps(refusal(names[1], bidirectional=names[2:] == ["bidirectional"])),
              flush=True)
        sys.exit(0)
    through_manager = bool(names) and names[0] == "--manager"
    if through_manager:
        names.pop(0)
    pad = bool(names) and names[0] == "--padded"
    if pad:
        names.pop(0)
    if names and names[0].startswith("--max-batch-tokens="):
        budget = int(names.pop(0).split("=", 1)[1])
    for model_name in names:
        print(json.dumps(run(model_name, max_batch_tokens=budget, manager=through_manager,
                             padded=pad)), flush=True)
