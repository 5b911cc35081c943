"""Experiment (session 55, for the next H200 session): the paged decode read with 32-bit
addresses where the cache allows them.

    python .pending/experiments/paged_entry_width.py
    POINTS="[(64, 1024), (256, 4096)]" python .pending/experiments/paged_entry_width.py

On the H200 (session 55, main 05a0074) the one-launch block-table read (`paged-pages`) reached
0.74-0.82x the copy rate where a step reads >= 256 MB, 0.81-0.89 of the same kernel's time on
K/V already in request order (`gathered`, 0.83-1.00x); on an H100 (session 51) it was 0.92-0.97
of `gathered`. The two differ in the slot loads and in the entry: a paged launch always takes
the 64-bit entry (varlen._kernel: `wide = constants[PAGED] or ...`), the packed one the 32-bit
entry below 2**31 elements, and 64-bit addresses once cost the packed decode a quarter of its
rate (varlen_kernel.py, the comment on `Wide`). The kernel body is shared, so the 32-bit
entry runs the paged constants as they are (its cubin compiles for sm_90 with them: checked on
the CPU, session 55). Compiled at their real widths for sm_90 (session 56, perf-notes step
77), the 64-bit entry loads K/V with cp.async (`LDGSTS`, no TMA), the 32-bit one by TMA as the
gathered kernel does, with the same steady key loop. This times, in one process, the same
launch on each entry (order alternated, CUDA graph replay), checks their outputs equal bit for
bit, and prints the `gathered` call and the copy rate for scale. It names both entries
directly, so it runs on main and with paged-32bit-entry.mbox applied alike. That series is
the change: `wide = any(a.numel() >= 2 ** 31 for a in arrays)` in varlen._kernel (the cache
past 2**31 elements keeps the 64-bit entry: test_arrays_past_2_31_elements).
Points: (requests, keys), one query each, 32/8 heads, D=128, bf16, pages of 256 shuffled.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from eval.paged_decode_bench import decode_step  # noqa: E402
from hf_tiled_attention import varlen  # noqa: E402
from hf_tiled_attention import varlen_kernel as K  # noqa: E402
from hf_tiled_attention.launch import launch_each  # noqa: E402
from hf_tiled_attention.timing import graph_replay_ms  # noqa: E402


PAGE = 256
points = eval(os.environ.get("POINTS", "[(32, 2048), (64, 1024), (128, 1024), (256, 1024), "
                                       "(32, 4096), (128, 2048), (256, 4096)]"))
for requests, keys in points:
    q, ck, cv, slots, cu_q, cu_k = decode_step(requests, keys, 32, 8, 128, PAGE, "cuda",
                                               torch.bfloat16)
    assert ck.numel() < 2 ** 31
    kf, vf = ck[slots], cv[slots]
    scale = q.shape[-1] ** -0.5
    outs = {"64-bit": torch.full_like(q, float("nan")), "32-bit": torch.full_like(q, float("nan"))}
    entries = {}
    for name, out in outs.items():
        parts = varlen.launches(q, ck, cv, cu_q, cu_k, 1, scale, None, None, None, slots, out,
                                key_pages=PAGE)
        # one decode launch: the 64-bit entry before paged-32bit-entry.mbox, the 32-bit after
        assert [p[0] for p in parts] in ([K.varlen_decode_paged_kernel],
                                         [K.varlen_decode_kernel]), parts
        kernel = K.varlen_decode_kernel if name == "32-bit" else K.varlen_decode_paged_kernel
        parts = [(kernel, grid, args) for _, grid, args in parts]
        entries[name] = parts

    def run(parts):
        return lambda: launch_each(q.device, parts)

    for parts in entries.values():
        run(parts)()
    torch.cuda.synchronize()
    same = torch.equal(outs["64-bit"], outs["32-bit"])
    gathered = varlen.varlen_attention(q, kf, vf, cu_q, cu_k, 1)
    err = (outs["32-bit"].float() - gathered.float()).abs().max().item()
    mb = 2 * kf.numel() * kf.element_size() / 1e6
    copy_ms = graph_replay_ms(lambda: (kf.clone(), vf.clone()), calls=10)
    times = {name: [] for name in entries}
    for order in (("64-bit", "32-bit"), ("32-bit", "64-bit")):
        for name in order:
            times[name].append(graph_replay_ms(run(entries[name]), calls=20))
    times["gathered"] = [graph_replay_ms(
        lambda: varlen.varlen_attention(q, kf, vf, cu_q, cu_k, 1, out=outs["32-bit"]),
        calls=20)]
    for name, ms in times.items():
        best = min(ms)
        print(f"R={requests} keys={keys} ({mb:.0f} MB) {name}: {best * 1e3:.1f} us "
              f"(runs {', '.join(f'{m * 1e3:.1f}' for m in ms)}), {copy_ms / best:.3f}x copy",
              flush=True)
    print(f"R={requests} keys={keys}: outputs equal bit for bit {same}, 32-bit vs gathered "
          f"max err {err:.1e}", flush=True)
