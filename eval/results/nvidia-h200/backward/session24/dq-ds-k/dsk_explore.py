"""Dev (session 24, perf-notes step 47; not the repo's harness): dq_add with dQ as dS K at
64-row dK/dV steps (``dq-ds-k-form.patch`` applied to a5de37c), against the two-kernel pass,
cuDNN and FA2 (``../../dq-add/bwd_explore.py``'s timing: CUDA events, median of 20 after 3
warm-ups, one process). Run from the repository root with PYTHONPATH at the tree to time: the
patched tree, then a5de37c as it is (``.dev/old`` in ``../dev-calls/call1.sh``: a copy of the
package, the (K^T dS^T)^T form), whose D=128 configs are dropped (step 46 timed them).

    python dsk_explore.py compile D CONFIG CAUSAL
    python dsk_explore.py time OUT.json"""
import importlib.util, sys
import cuda.tile  # (fail here, not on the reference path)
from pathlib import Path
import hf_tiled_attention as hta
from hf_tiled_attention.schedule import BackwardSchedule, backward_schedule, set_backward_schedule
import dataclasses

_spec = importlib.util.spec_from_file_location(
    "bwd_explore", Path.cwd() / "eval/results/nvidia-h200/backward/dq-add/bwd_explore.py")
explore = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(explore)

def R(d, **kw): return dataclasses.replace(backward_schedule(d), **kw)
# name -> (schedule or None for the table, deterministic)
CONFIGS = {
    128: {"det": (None, True), "det128x64": (R(128, kv_queries=64), True),
          "add128x64": (R(128, kv_queries=64, dq_add=True), False)},
    64: {"det": (None, True), "add": (None, False)},
}
if "/.dev/old/" in hta.__file__:  # the old tree: its D=128 numbers are session 23's
    CONFIGS.pop(128)
POINTS = [(d, b, s, 32, 8 if d == 128 else 32, c) for d in CONFIGS
          for b, s in ((16, 1024), (4, 4096), (1, 16384)) for c in (True, False)]

def use(d, name):
    sched, det = CONFIGS[d][name]
    hta.set_deterministic(det)
    set_backward_schedule(sched)

def compile_one(d, name, causal):
    """One variant with the timed points' head counts (GROUP is a compile-time constant)."""
    import torch
    use(d, name)
    q, k, v, do = explore.inputs(d, 1, 256, 32, 8 if d == 128 else 32)
    out = hta.tiled_attention(q, k, v, is_causal=causal)
    torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize(); print("compiled", d, name, causal, flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_one(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"); sys.exit()
    explore.CONFIGS, explore.POINTS, explore.use = CONFIGS, POINTS, use
    explore.main(sys.argv[1:])
