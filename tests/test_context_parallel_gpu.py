"""GPU: context parallelism's shards on the cuTile kernels, ranks simulated in one process.

For every case of the CPU tests (context_parallel_cases.py), at 16 times their length (768
positions) and head dim 64 in bf16, each rank's query rows run through the kernels (forward
and backward) against the key buffer its ranks would exchange (taken from the whole sequence:
key_exchange.gathered_keys), with the same helpers as the CPU tests: its rows of the output and
LSE equal the whole-sequence kernel call's, and the ranks' gradients sum to the whole call's
(dq, dk, dv, sinks, a learnable captured table), within bf16 rounding; rows that see no key
are -inf in the LSE on both sides."""

import pytest
import torch

from context_parallel_cases import SHARD_CASES, check_simulated_ranks, scaled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # a learnable mod's reference backward
]
# bf16 outputs and gradients of two kernel calls that add in other orders, relative to the
# largest magnitude (the backward tests' bound against fp64).
BF16_TOLERANCE = 4e-2
EMPTY_ROW_CASES = {c.name for c in SHARD_CASES if c.padding or c.documents == "gap"}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", SHARD_CASES, ids=lambda c: c.name)
def test_kernel_shards_equal_the_whole_sequence(case, world):
    from hf_tiled_attention.op import kernel_available
    assert kernel_available(torch.device("cuda")), "the cuTile kernels must run here"
    empty = check_simulated_ranks(scaled(case, 16, 64), world, "cuda", torch.bfloat16,
                                  BF16_TOLERANCE)
    assert (empty > 0) == (case.name in EMPTY_ROW_CASES), empty
