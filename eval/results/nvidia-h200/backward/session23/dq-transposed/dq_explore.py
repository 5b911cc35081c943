"""Dev script (not the repo's harness; perf-notes step 46): backward latency of candidate
BackwardSchedules with dq_add (dQ made in the dK/dV kernel as (K^T dS^T)^T, TMA reduce-adds)
against the deterministic two-kernel pass, cuDNN and FA2: step 30's ``bwd_explore.py`` (its
timing and modes) with this step's candidates and the 12 bf16 standard points plus D=256.

    python dq_explore.py compile D CONFIG CAUSAL   # one variant per process: fills cuTile's cache
    python dq_explore.py time OUT.json"""
import importlib.util
import sys
from pathlib import Path

from hf_tiled_attention.schedule import BackwardSchedule

_spec = importlib.util.spec_from_file_location(
    "bwd_explore", Path(__file__).resolve().parents[2] / "dq-add" / "bwd_explore.py")
explore = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(explore)


def S(**kw): return BackwardSchedule(**kw)
T64 = dict(kv_keys=64, kv_queries=64, q_rows=64, q_keys=64, kv_warps=4, q_warps=4, kv_occupancy=2, q_occupancy=2)
T128 = dict(kv_keys=128, kv_queries=32, q_rows=128, q_keys=64)
T256 = dict(kv_keys=64, kv_queries=64, q_rows=128, q_keys=32, rows_tile=32)
CONFIGS = {
    64: {"det": None, "add": S(**T64, dq_add=True),
         "add128x64": S(**{**T64, "kv_keys": 128, "kv_warps": 8, "kv_occupancy": 1}, dq_add=True),
         "add128x32": S(**{**T64, "kv_keys": 128, "kv_queries": 32, "kv_warps": 8, "kv_occupancy": 1}, dq_add=True)},
    128: {"det": None, "add": S(**T128, dq_add=True),
          "add128x64": S(**{**T128, "kv_queries": 64}, dq_add=True),
          "add64x64": S(**{**T128, "kv_keys": 64, "kv_queries": 64}, dq_add=True)},
    256: {"det": None, "add": S(**T256, dq_add=True)},
}
POINTS = [(128, 16, 1024, 32, 8, True), (128, 16, 1024, 32, 8, False),
          (128, 4, 4096, 32, 8, True), (128, 4, 4096, 32, 8, False),
          (128, 1, 16384, 32, 8, True), (128, 1, 16384, 32, 8, False),
          (64, 16, 1024, 32, 32, True), (64, 16, 1024, 32, 32, False),
          (64, 4, 4096, 32, 32, True), (64, 4, 4096, 32, 32, False),
          (64, 1, 16384, 32, 32, True), (64, 1, 16384, 32, 32, False),
          (256, 4, 2048, 16, 16, True)]


if __name__ == "__main__":
    explore.CONFIGS, explore.POINTS = CONFIGS, POINTS
    explore.main(sys.argv[1:])
