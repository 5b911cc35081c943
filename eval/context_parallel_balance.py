"""Context parallelism's load balance and key-exchange volume, ranks simulated in one process.

    python eval/context_parallel_balance.py                     # S 32k/128k, 2/4/8 ranks
    python eval/context_parallel_balance.py --seq 131072 --ranks 8 --documents lognormal

For each sequence length, rank count, document mix and layout (contiguous slices, head-and-tail
chunks, chunks balanced by the visible pairs of full causal attention with 2-16 chunks per rank, and
``pairs-auto``, the fewest of those within 10% of the mean, counting the row's window: what
shard_batch(window=...) picks) it counts, per rank, the
visible (query, key) pairs of causal attention (full, and with a sliding window) and the rows of
its key buffer (the keys its queries can see, which it holds or receives:
hf_tiled_attention.key_exchange), and reports max/mean over the ranks. ``kv_mib`` is the key
buffer's keys and values of one layer for the Llama-3-8B / Mistral-7B shape (8 kv heads, head
dim 128, bf16), on the busiest rank: what a layer keeps for its backward. These are counts, the
same on any machine. On a GPU (``--time``) each simulated rank's attention forward + backward
is also timed on its shard (bf16, 32/8 heads, D=128; the key buffer taken from the whole
sequence), ``ms_max`` / ``ms_mean`` over the ranks.

Document mixes (one row): ``none`` (one sequence), ``uniform`` (lengths 256-4096 uniformly, as
train_throughput.py's packed batching), ``lognormal`` (median 2048, sigma 1, 64 to S/2), and
``one-long`` (half the sequence is one document, between uniform ones).
Results: eval/results/<gpu>/context-parallel/balance.csv and environment.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_tiled_attention.key_exchange import KeyRule, plan_exchange  # noqa: E402
from hf_tiled_attention.shard_layout import (SequenceLayout, document_bounds,  # noqa: E402
                                             least_chunks_layout, position_work)
from eval.common import ResultsWriter, output_dir  # noqa: E402

COLUMNS = ["seq", "ranks", "documents", "window", "layout", "chunks_per_rank",
           "pairs_max_over_mean",
           "buffer_rows_max", "buffer_rows_mean", "received_rows_max", "kv_mib", "ms_max",
           "ms_mean", "status", "reason"]
DOCUMENT_MIXES = ["none", "uniform", "lognormal", "one-long"]
LAYOUTS = ["contiguous", "head_tail", "pairs-2", "pairs-4", "pairs-8", "pairs-16", "pairs-auto"]
# One key and one value row of one layer: 8 kv heads x head dim 128 x 2 bytes (bf16).
KV_ROW_BYTES = 2 * 8 * 128 * 2


def document_ids(mix: str, seq: int) -> torch.Tensor | None:
    """(1, S) document ids of one packed row (None: one sequence)."""
    if mix == "none":
        return None
    gen = torch.Generator().manual_seed(0)

    def uniform() -> int:
        return int(torch.randint(256, 4097, (1,), generator=gen))

    lengths, total = [], 0
    while total < seq:
        if mix == "uniform":
            n = uniform()
        elif mix == "lognormal":
            # median e^7.625 ~ 2048
            n = int(torch.empty(1).log_normal_(mean=7.625, std=1.0, generator=gen))
            n = max(64, min(n, seq // 2))
        elif mix == "one-long":  # uniform ones, then the long one once a quarter is filled
            long_done = any(n >= seq // 2 for n in lengths)
            n = seq // 2 if total >= seq // 4 and not long_done else uniform()
        else:
            raise ValueError(mix)
        n = min(n, seq - total)
        lengths.append(n)
        total += n
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                   torch.tensor(lengths))[None]


def make_layout(name: str, seq: int, ranks: int, docs, window) -> SequenceLayout:
    if name == "contiguous":
        return SequenceLayout.contiguous(seq, ranks)
    if name == "head_tail":
        return SequenceLayout.head_tail(seq, ranks)
    if name == "pairs-auto":  # what shard_batch(window=...) picks
        return least_chunks_layout(position_work(seq, docs, window=window), ranks)
    return SequenceLayout.balanced(position_work(seq, docs), ranks, int(name.split("-")[1]))


def shard_stats(layout: SequenceLayout, docs, window) -> dict:
    """Per-rank visible pairs and key-buffer rows: max/mean and the busiest rank's K/V MiB."""
    work = position_work(layout.seq_len, docs, window=window)
    doc_start = doc_end = None
    if docs is not None:
        doc_start, doc_end = document_bounds(docs)
    rule = KeyRule(True, window, doc_start, doc_end)
    plans = [plan_exchange(layout, r, rule) for r in range(layout.world_size)]
    rows = [len(p.buffer_positions) for p in plans]
    return dict(chunks_per_rank=len(layout.chunks[0]),
                pairs_max_over_mean=f"{layout.imbalance(work):.3f}",
                buffer_rows_max=max(rows), buffer_rows_mean=f"{statistics.mean(rows):.0f}",
                received_rows_max=max(sum(p.recv_splits) for p in plans),
                kv_mib=f"{max(rows) * KV_ROW_BYTES / 2**20:.0f}", plans=plans)


def time_shards(layout: SequenceLayout, docs, window, plans) -> tuple[float, float]:
    """Each simulated rank's attention forward + backward on the GPU: (max, mean) ms."""
    from hf_tiled_attention.key_exchange import gathered_keys
    from hf_tiled_attention.sharded_attention import SequenceShards, attend_runs
    from hf_tiled_attention.timing import median_ms
    seq, device = layout.seq_len, "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 32, seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 8, seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    times = []
    for rank, plan in enumerate(plans):
        shards = SequenceShards(layout, rank, None, None if docs is None else docs.to(device))
        plan = plan.to(device)
        q_r = shards.shard(q, 2).detach().requires_grad_()
        keys, values = (t.detach().requires_grad_() for t in gathered_keys(k, v, plan))

        def step():
            out, _ = attend_runs(q_r, keys, values, shards, plan, is_causal=True,
                                 scale=None, window=window, softcap=None, sinks=None,
                                 score_mod=None, mask_mod=None, return_lse=False)
            out.backward(torch.ones_like(out))
        times.append(median_ms(step, cuda=True, warmup=2, reps=5))
    return max(times), statistics.mean(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--documents", nargs="+", default=DOCUMENT_MIXES, choices=DOCUMENT_MIXES)
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, choices=LAYOUTS)
    parser.add_argument("--windows", type=int, nargs="+", default=[0, 4096],
                        help="sliding windows (0: full causal attention)")
    parser.add_argument("--time", action="store_true", help="time each shard's kernels (GPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the counts are many small index operations: threads only contend
    if args.time and not torch.cuda.is_available():
        raise SystemExit("--time needs a CUDA GPU (the counts need none)")
    out_dir = output_dir(args.out, "context-parallel")
    results = ResultsWriter(out_dir, "balance", COLUMNS, argv)
    for seq in args.seq:
        for mix in args.documents:
            docs = document_ids(mix, seq)
            for ranks in args.ranks:
                for window in args.windows:
                    for name in args.layouts:
                        row = dict(seq=seq, ranks=ranks, documents=mix, window=window,
                                   layout=name, status="ok", reason="")
                        try:
                            layout = make_layout(name, seq, ranks, docs, window or None)
                        except ValueError as exc:  # the sequence does not divide
                            row.update(status="skipped", reason=str(exc)[:120])
                            results.add(row)
                            continue
                        stats = shard_stats(layout, docs, window or None)
                        plans = stats.pop("plans")
                        row.update(stats)
                        if args.time:
                            ms_max, ms_mean = time_shards(layout, docs, window or None, plans)
                            row.update(ms_max=f"{ms_max:.3f}", ms_mean=f"{ms_mean:.3f}")
                        results.add(row)
                        print(f"balance S={seq:6d} N={ranks} {mix:9s} W={window:4d} {name:10s} "
                              f"pairs max/mean {row['pairs_max_over_mean']:>6s}  key rows max "
                              f"{row['buffer_rows_max']:>6d}  K/V {row['kv_mib']:>4s} MiB  "
                              f"{row.get('ms_max', '')}", flush=True)
    print(f"context_parallel_balance: {results.finish()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
