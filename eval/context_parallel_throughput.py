"""Context-parallel training: tokens/s per GPU and peak memory per GPU against sequence length,
and the longest sequence that trains, for `tiled` (hf_tiled_attention.context_parallel) beside
torch's own context parallelism with SDPA. Run under torchrun, one process per GPU:

    torchrun --nproc-per-node 8 eval/context_parallel_throughput.py  # 8-layer Llama-3-8B, Mistral-7B
    torchrun --nproc-per-node 8 eval/context_parallel_throughput.py --backends tiled --max-seq 1048576

Every process builds the same model (random weights from one seed; bf16 on the GPU), shards it
with FSDP2 (``fully_shard`` per layer; ``--sync ddp`` replicates it instead) and trains it
with AdamW on one sequence per step, lengths doubling from ``--min-seq`` to ``--max-seq``.
Batchings: ``plain`` (one sequence, B=1) and ``packed`` (one row of documents of 256-4096
tokens, position ids restarting per document, as train_throughput.py's packed batching).
Backends: ``tiled`` (shard_batch + context_parallel: balanced by visible pairs, the keys each
rank's rows can see exchanged per layer) and ``sdpa_cp`` (torch.distributed.tensor.experimental
.context_parallel: ring attention over SDPA's flash / efficient / cuDNN kernels, head-and-tail
load balance; causal without a mask only, so not for packed rows, and CUDA only). FlexAttention
with context parallelism exists in torch only as private API (``_ContextParallel``,
``_create_cp_block_mask``), which transformers' flex_attention function does not go through: its
rows are recorded as skipped with that reason.

A step is shard + forward + backward + optimizer step; ``ms`` is the slowest rank's median over
``--reps`` steps after one warm-up, ``tokens_per_s_per_gpu`` the sequence's tokens per second
divided by the ranks, ``peak_gib`` the largest rank's peak allocated memory. A rank that runs
out of memory writes an ``oom`` row and ends the run (the others wait in a collective it will
not join, and torchrun stops them): the longest sequence that trains is the last ``ok`` row
before it; run the next backend or batching with ``--backends`` / ``--batchings``. Without a
GPU: gloo, fp32, the tiny model at a few hundred tokens (a smoke run: the times say nothing).
Results: eval/results/<gpu>/context-parallel/context_parallel.csv and environment.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hf_tiled_attention  # noqa: E402,F401  (registers attn_implementation="tiled")
from hf_tiled_attention import context_parallel, shard_batch  # noqa: E402
from eval.common import ResultsWriter, output_dir  # noqa: E402
from eval.models import build_config  # noqa: E402

COLUMNS = ["model", "layers", "backend", "batching", "ranks", "seq", "tokens_per_s_per_gpu",
           "ms", "peak_gib", "loss", "status", "reason"]
BACKENDS = ["tiled", "sdpa_cp", "flex_cp"]
BATCHINGS = ["plain", "packed"]
FLEX_REASON = ("torch's FlexAttention context parallelism is private API (_ContextParallel, "
               "_create_cp_block_mask) that transformers' flex_attention does not go through")


def make_batch(batching: str, seq: int, vocab: int, device, scale: int) -> dict:
    """One row of ``seq`` tokens, the same on every rank (a fixed seed)."""
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(3, vocab, (1, seq), generator=gen)
    if batching == "plain":
        return dict(input_ids=ids.to(device), labels=ids.to(device))
    positions, labels, start = [], ids.clone(), 0
    while start < seq:
        n = min(int(torch.randint(256 // scale, 4096 // scale + 1, (1,), generator=gen)),
                seq - start)
        positions.append(torch.arange(n))
        labels[0, start] = -100  # a document's first token is not predicted from the last one's
        start += n
    return dict(input_ids=ids.to(device), labels=labels.to(device),
                position_ids=torch.cat(positions)[None].to(device))


def skip_reason(backend: str, batching: str, on_gpu: bool, window, seq: int) -> str:
    if backend == "flex_cp":
        return FLEX_REASON
    if backend == "sdpa_cp" and not on_gpu:
        return ("torch's context parallelism reroutes SDPA's flash / efficient / cuDNN kernels, "
                "which need CUDA")
    if backend == "sdpa_cp" and batching == "packed":
        return ("torch's context parallelism gives SDPA a causal rule without a mask: packed "
                "documents need one")
    if backend == "sdpa_cp" and window is not None and seq > window:
        return (f"torch's context parallelism gives SDPA a causal rule without a mask: the "
                f"{window}-token sliding window needs one")
    return ""


def tiled_step(model, batch: dict, window) -> torch.Tensor:
    # (Mistral-7B's layers all have its window: the layout balances that window's pairs)
    sharded = shard_batch(batch, window=window)
    with context_parallel(sharded):
        loss = model(**sharded.inputs).loss
        loss.backward()
    return sharded.global_loss(loss)


def sdpa_cp_step(model, batch: dict, mesh) -> torch.Tensor:
    from torch.distributed.tensor.experimental import context_parallel as torch_cp
    ids = batch["input_ids"].clone()  # sharded in place by torch's context manager
    labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    positions = torch.arange(ids.shape[1], device=ids.device)[None].clone()
    with torch_cp(mesh, buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1],
                  no_restore_buffers={ids, labels, positions}):
        loss = model(input_ids=ids, labels=labels, shift_labels=labels, position_ids=positions,
                     use_cache=False).loss
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def timed_steps(step, model, optimizer, reps: int, on_gpu: bool) -> tuple[float, float, float]:
    """(slowest rank's median ms, loss, largest rank's peak GiB) over ``reps`` steps after one
    warm-up."""
    times, loss = [], float("nan")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    for rep in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = float(step(model))
        optimizer.step()
        if on_gpu:
            torch.cuda.synchronize()
        if rep:
            times.append((time.perf_counter() - start) * 1e3)
    stats = torch.tensor([statistics.median(times),
                          torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0],
                         device="cuda" if on_gpu else "cpu")
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return float(stats[0]), loss, float(stats[1])


def build_model(shape: str, layers: int, dtype, device, sync: str):
    from transformers import AutoModelForCausalLM
    config = build_config(shape, layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="tiled")
    model.train()
    if sync == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh), config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="eval/models.py shapes (default: llama3-8b mistral-7b on GPUs, "
                             "tiny-llama on the CPU)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    parser.add_argument("--batchings", nargs="+", default=BATCHINGS, choices=BATCHINGS)
    parser.add_argument("--min-seq", type=int, default=None)
    parser.add_argument("--max-seq", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sync", choices=["fsdp2", "ddp"], default="fsdp2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("context_parallel: run under torchrun, e.g. torchrun --nproc-per-node 8 "
                         "eval/context_parallel_throughput.py")
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        dtype, scale = torch.bfloat16, 1
    else:
        dist.init_process_group("gloo")
        device, dtype, scale = torch.device("cpu"), torch.float32, 64
        torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.simplefilter("ignore")
    shapes = args.shapes or (["llama3-8b", "mistral-7b"] if on_gpu else ["tiny-llama"])
    min_seq = args.min_seq or (16384 if on_gpu else 128)
    max_seq = args.max_seq or (1048576 if on_gpu else 256)
    if rank == 0 and not on_gpu:
        print("context_parallel: no CUDA GPU here; gloo, fp32, a tiny model at a few hundred "
              "tokens through the CPU reference path (a smoke run: numbers say nothing about GPU "
              "speed).", flush=True)
    results = None
    if rank == 0:
        out_dir = output_dir(args.out, "context-parallel")
        results = ResultsWriter(out_dir, "context_parallel", COLUMNS, argv)
    mesh = None
    if on_gpu:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (world,))
    for shape in shapes:
        model, config = build_model(shape, args.layers, dtype, device, args.sync)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for backend in args.backends:
            for batching in args.batchings:
                seq = min_seq
                while seq <= max_seq:
                    row = dict(model=shape, layers=args.layers, backend=backend,
                               batching=batching, ranks=world, seq=seq, status="ok", reason="")
                    reason = skip_reason(backend, batching, on_gpu,
                                         getattr(config, "sliding_window", None), seq)
                    if reason:
                        row.update(status="skipped", reason=reason)
                        _report(results, row)
                        break
                    batch = make_batch(batching, seq, config.vocab_size, device, scale)
                    if backend == "tiled":
                        module = model.module if hasattr(model, "module") else model
                        module.set_attn_implementation("tiled")
                        window = getattr(config, "sliding_window", None)
                        step = lambda m, b=batch, w=window: tiled_step(m, b, w)  # noqa: E731
                    else:
                        module = model.module if hasattr(model, "module") else model
                        module.set_attn_implementation("sdpa")
                        step = lambda m, b=batch: sdpa_cp_step(m, b, mesh)  # noqa: E731
                    try:
                        ms, loss, peak = timed_steps(step, model, optimizer, args.reps, on_gpu)
                    except torch.OutOfMemoryError as exc:
                        _out_of_memory(rank, row, exc, results)
                    except Exception as exc:  # a backend refusing this point, on every rank
                        row.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:300])
                        _report(results, row)
                        optimizer.zero_grad(set_to_none=True)
                        break
                    row.update(ms=f"{ms:.1f}", loss=f"{loss:.4f}",
                               tokens_per_s_per_gpu=f"{seq / ms * 1e3 / world:.1f}",
                               peak_gib=f"{peak:.2f}" if on_gpu else "")
                    _report(results, row)
                    seq *= 2
        del model, optimizer
        if on_gpu:
            torch.cuda.empty_cache()
    if results is not None:
        longest = longest_trained(results.rows)
        for point, seq in longest.items():
            print(f"context_parallel: longest sequence trained, {point}: {seq}", flush=True)
        print(f"context_parallel: {results.finish(extra={'longest_ok': longest})}", flush=True)
    dist.destroy_process_group()
    return 0


def longest_trained(rows: list) -> dict:
    """``"model backend batching" -> longest seq with an ok step`` (of the lengths tried)."""
    longest = {}
    for row in rows:
        if row["status"] == "ok":
            point = f"{row['model']} {row['backend']} {row['batching']}"
            longest[point] = max(longest.get(point, 0), int(row["seq"]))
    return longest


def _report(results, row: dict) -> None:
    if results is None:
        return
    results.add(row)
    line = (f"context_parallel {row['model']:10s} {row['backend']:8s} {row['batching']:7s} "
            f"S={row['seq']:8d} x{row['ranks']} {row['status']:8s}")
    if row.get("tokens_per_s_per_gpu"):
        line += f" {row['tokens_per_s_per_gpu']:>10s} tokens/s/GPU {row['ms']:>9s} ms"
    if row.get("peak_gib"):
        line += f" peak {row['peak_gib']} GiB"
    if row.get("loss"):
        line += f" loss {row['loss']}"
    print(f"{line} {row['reason'][:90]}".rstrip(), flush=True)


def _out_of_memory(rank: int, row: dict, exc: Exception, results) -> None:
    """Record the row (rank 0 writes the CSV; another rank says it on stderr) and end the run:
    the other ranks wait in a collective this one will not join."""
    row.update(status="oom", reason=f"rank {rank}: " + str(exc).split("\n")[0][:160])
    if results is not None:
        _report(results, row)
        results.finish()
    print(f"context_parallel: rank {rank} ran out of memory at S={row['seq']} "
          f"({row['backend']}, {row['batching']}); the longest sequence that trained is the last "
          "ok row before it. Ending the run.", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
