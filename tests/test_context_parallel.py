"""CPU: context parallelism at the op level (hf_tiled_attention.sharded_attention).

Each rank's rows of the output and LSE, and every gradient (q, k, v, sinks, a learnable
captured table), equal the whole-sequence call's within fp32 rounding, for the cases of
context_parallel_cases.py (causal, windows within and across chunks, bidirectional, packed
documents, padding with rows that see no key, softcap, sinks, GQA, mods with captured tensors,
head-and-tail / balanced / contiguous layouts): with one process playing every rank, and with
2 and 4 spawned gloo processes exchanging keys for real. Then the layouts, the exchange plans
against brute force, and the errors."""

import pytest
import torch

from context_parallel_cases import CPU_TOLERANCE, SHARD_CASES, check_simulated_ranks
from spawned_ranks import run_ranks
from hf_tiled_attention.key_exchange import KeyRule, plan_exchange
from hf_tiled_attention.shard_layout import (BALANCE_TARGET, MIN_CHUNK_LEN, SequenceLayout,
                                             document_bounds, least_chunks_layout,
                                             position_work)
from hf_tiled_attention.sharded_attention import SequenceShards, sharded_attention

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
EMPTY_ROW_CASES = {c.name for c in SHARD_CASES if c.padding or c.documents == "gap"}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", SHARD_CASES, ids=lambda c: c.name)
def test_simulated_ranks_equal_the_whole_sequence(case, world):
    empty = check_simulated_ranks(case, world, "cpu", torch.float32, CPU_TOLERANCE)
    assert (empty > 0) == (case.name in EMPTY_ROW_CASES), empty


@pytest.mark.parametrize("world", [2, 4])
def test_spawned_ranks_equal_the_whole_sequence(world):
    """All cases in one spawn per world size (starting the processes is most of the time),
    and sharded_attention under torch.compile against eager."""
    ranks = run_ranks("context_parallel_cases:spawned_rank_results", world)
    failures = [error for result in ranks for error, _ in result.values() if error]
    assert not failures, "\n".join(failures)
    for name in EMPTY_ROW_CASES:  # some rank had rows that see no key
        assert sum(result[name][1] for result in ranks) > 0, name


# --- layouts -----------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_head_tail_balances_causal_pairs_exactly(world):
    seq = 16 * world
    work = position_work(seq)
    assert SequenceLayout.head_tail(seq, world).imbalance(work) == 1.0
    assert SequenceLayout.contiguous(seq, world).imbalance(work) > 1.2
    assert SequenceLayout.balanced(work, world, 2) == SequenceLayout.head_tail(seq, world)


def test_least_chunks_layout_takes_the_fewest_chunks_that_balance():
    seq, world = 16384, 4
    assert least_chunks_layout(position_work(seq), world) == SequenceLayout.head_tail(seq, world)
    # One long document and short ones: head-and-tail leaves a rank far above the mean.
    ids = torch.cat([torch.zeros(8192, dtype=torch.int32),
                     torch.arange(1, 33, dtype=torch.int32).repeat_interleave(256)])[None]
    work = position_work(seq, ids)
    assert SequenceLayout.head_tail(seq, world).imbalance(work) > 1.3
    layout = least_chunks_layout(work, world)
    chunks = len(layout.chunks[0])
    assert chunks > 2 and layout.imbalance(work) <= BALANCE_TARGET
    assert SequenceLayout.balanced(work, world, chunks // 2).imbalance(work) > BALANCE_TARGET
    # Chunks shorter than MIN_CHUNK_LEN are not tried beyond two per rank.
    short = least_chunks_layout(position_work(MIN_CHUNK_LEN * 4, ids[:, -MIN_CHUNK_LEN * 4:]), 2)
    assert len(short.chunks[0]) == 2


def test_positions_owners_and_shard_agree():
    layout = SequenceLayout.balanced(position_work(60), 3, 4)
    rank_of, row_of = layout.owners()
    seen = torch.zeros(60, dtype=torch.int64)
    for rank in range(3):
        held = layout.positions(rank)
        assert torch.equal(rank_of[held], torch.full_like(held, rank))
        assert torch.equal(row_of[held], torch.arange(len(held)))
        assert torch.equal(layout.shard(torch.arange(60)[None], rank, 1)[0], held)
        runs = layout.runs(rank)
        assert sum(run.length for run in runs) == layout.local_len
        seen[held] += 1
    assert torch.equal(seen, torch.ones(60, dtype=torch.int64))


def test_document_bounds_match_brute_force():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 3, 3], [0, 1, 1, 1, 2, 2, 2, -1]])
    start, end = document_bounds(ids)
    for p in range(8):
        starts = [min(j for j in range(8) if row[j] == row[p] and all(row[j:p + 1] == row[p]))
                  for row in ids]
        ends = [max(j for j in range(8) if all(row[p:j + 1] == row[p])) + 1 for row in ids]
        assert (int(start[p]), int(end[p])) == (min(starts), max(ends))


@pytest.mark.parametrize("causal, window, documents", [
    (True, None, False), (True, 5, False), (True, 13, True), (False, None, True),
    (False, 4, False), (True, None, True)])
@pytest.mark.parametrize("layout_kind", ["head_tail", "balanced", "contiguous"])
def test_each_run_gets_every_key_its_rows_can_see(causal, window, documents, layout_kind):
    seq, world = 48, 4
    ids = torch.tensor([0] * 5 + [1] * 21 + [2] * 14 + [3] * 8)[None] if documents else None
    layout = {"head_tail": SequenceLayout.head_tail(seq, world),
              "contiguous": SequenceLayout.contiguous(seq, world),
              "balanced": SequenceLayout.balanced(position_work(seq, ids), world, 3)}[layout_kind]
    pos = torch.arange(seq)
    visible = torch.ones(seq, seq, dtype=torch.bool)
    if causal:
        visible &= pos[None] <= pos[:, None]
    if window is not None:
        visible &= (pos[:, None] - pos[None]).abs() < window
    if ids is not None:
        visible &= ids[0][:, None] == ids[0][None]
    rule = KeyRule(causal, window, *(document_bounds(ids) if ids is not None else (None, None)))
    plans = [plan_exchange(layout, rank, rule) for rank in range(world)]
    for rank, plan in enumerate(plans):
        for run, (first, count, key_lo) in zip(layout.runs(rank), plan.run_keys):
            seen = visible[run.start:run.end].any(0).nonzero().flatten()
            assert key_lo <= int(seen.min()) and int(seen.max()) < key_lo + count
            assert torch.equal(plan.buffer_positions[first:first + count],
                               torch.arange(key_lo, key_lo + count))
        for other in range(world):  # what one rank sends another receives
            assert plan.send_splits[other] == plans[other].recv_splits[rank]
    assert any(p.exchanged for p in plans) == any(sum(p.recv_splits) for p in plans)


# --- errors ------------------------------------------------------------------------------

def test_sequence_not_divisible_names_the_multiple():
    with pytest.raises(ValueError, match=r"multiple of 8 \(4 ranks x 2 chunks per rank\), "
                                         r"got 100.*pad_to_multiple_of=8"):
        SequenceLayout.head_tail(100, 4)
    with pytest.raises(ValueError, match="multiple of 12"):
        SequenceLayout.balanced(position_work(100), 4, 3)


def test_shards_of_the_wrong_length_name_the_argument():
    layout = SequenceLayout.head_tail(32, 2)
    shards = SequenceShards(layout, 0)
    q, k = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    with pytest.raises(ValueError, match=r"query has 32 positions, but rank 0's shard of the "
                                         r"32-position sequence holds 16"):
        sharded_attention(torch.randn(1, 2, 32, 16), k, k, shards)
    with pytest.raises(ValueError, match="key has 8 positions"):
        sharded_attention(q, k[:, :, :8], k[:, :, :8], shards)
    with pytest.raises(ValueError, match="no process group"):
        sharded_attention(q, k, k, shards, is_causal=True)
    with pytest.raises(ValueError, match=r"document_ids must be a \(B, S\) tensor over the "
                                         r"whole sequence, S = 32, got \(1, 16\)"):
        SequenceShards(layout, 0, document_ids=torch.zeros(1, 16, dtype=torch.int32))
    with pytest.raises(TypeError, match="key_padding must be a bool tensor"):
        SequenceShards(layout, 1, key_padding=torch.ones(1, 32))
    with pytest.raises(ValueError, match="rank 2 is not in the layout's 2 ranks"):
        SequenceShards(layout, 2)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="same number"):
        SequenceLayout(12, ((0, 1), (2,)))
    with pytest.raises(ValueError, match="each once"):
        SequenceLayout(12, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="ascending"):
        SequenceLayout(12, ((1, 0), (2, 3)))



def test_masks_made_for_local_positions_are_refused():
    """transformers' masks are made for this rank's positions: a dense one, a 4-D tensor, a
    cache offset or flash-attention kwargs cannot be read back in global terms."""
    from hf_tiled_attention.layer_call import read_call
    from hf_tiled_attention.context_parallel import attend_layer
    from hf_tiled_attention.transformers_mask import TiledMask
    shards = SequenceShards(SequenceLayout.head_tail(32, 2), 0)
    q = torch.randn(1, 2, 16, 16)
    module = torch.nn.Module()
    dense = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    cases = [
        (TiledMask(False, None, 0, dense=dense), {}, "dense mask over this rank's positions"),
        (dense, {}, "Tensor attention_mask made for this rank's positions"),
        (TiledMask(True, None, 3), {}, "without a cache: pass use_cache=False"),
        (None, {"cu_seq_lens_q": torch.tensor([0, 16])}, "cu_seq_lens_q/k in the model's kwargs"),
        (None, {"position_bias": torch.zeros(1, 2, 16, 16)}, "does not take a position_bias"),
    ]
    for mask, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            attend_layer(read_call(module, q, q, mask, None, kwargs, sharded=True), q, q, q,
                         shards)


def test_shard_batch_names_what_it_cannot_split():
    from hf_tiled_attention.context_parallel import shard_batch
    ids = torch.zeros(1, 32, dtype=torch.long)
    with pytest.raises(ValueError, match=r"does not know how to split \['pixel_values'\]"):
        shard_batch({"input_ids": ids, "pixel_values": torch.zeros(1, 3)})
    with pytest.raises(ValueError, match="needs input_ids"):
        shard_batch({"labels": ids})
