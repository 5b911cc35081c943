"""Issue 46 experiment (perf-notes steps 58-59): the FP8 cache's decode step transposed, with V
handed keys-contiguous, against main's step over the cache's rows and the bf16 kernel.

Needs the package patched with ``fp8-cache-transposed-step.diff`` (beside this file: the
kernel's TRANSPOSED constant and schedule.FP8_CACHE_TRANSPOSED, default off):

    git apply .pending/experiments/fp8-cache-transposed-step.diff
    python .pending/experiments/fp8_cache_transposed_decode.py            # GPU: times, errors
    python .pending/experiments/fp8_cache_transposed_decode.py --cubins   # sm_90 step loops

Step 59 counted sm_90 instructions per whole 64-key step: main's (lean) step 938, transposed
with both MMAs in e4m3 (two parts each) and V keys-contiguous 596, one part each 500, and
predicted 1.4-1.5x the bf16 kernel if the step stays bound by instructions. Only a timing says
whether it does (the transposed softmax reduces over keys across the warpgroup's four warps:
15-16 block barriers a step, which a count does not price). What this decides: whether the
FP8 cache is worth layers of its own that keep V transposed in blocks of 64 keys.

Each variant runs the decode launches (decode kernel, and the merge with split keys) from a
CUDA graph; the transposed ones get V as ``(B, Hkv, D, S)`` e4m3 and its scales as
``(B, Hkv, S)``, both made before timing (what such a cache would hold). The query is rotated
as the keys before timing too (decode_step's small matmul, the same for every variant).
``bf16`` is the bf16 kernel over bf16 K/V (tiled_attention) from a graph as well. Error:
relative RMS against the fp64 definition on the bf16 K/V, first batch row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_tiled_attention import fp8_cache_attention as attention  # noqa: E402
from hf_tiled_attention import memo, tiled_attention  # noqa: E402
from hf_tiled_attention.fp8_cache import quantize_keys, quantize_rows, split_rows  # noqa: E402

# name -> (transposed, query rows a tile, QK^T parts (0: 16-bit), PV parts)
VARIANTS = {
    "main": (False, 64, 0, 2),
    "t-qk16-pv8x2": (True, 16, 0, 2),
    "t-qk8x2-pv8x2": (True, 16, 2, 2),
    "t-qk8x1-pv8x1": (True, 16, 1, 1),
}


def use(variant: str) -> bool:
    """Point the decode plan at a variant's constants; True where V goes keys-contiguous."""
    transposed, rows, qk_parts, pv_parts = VARIANTS[variant]
    attention.FP8_CACHE_TRANSPOSED, attention.FP8_CACHE_ROWS = transposed, rows
    attention.FP8_CACHE_QK_PARTS, attention.FP8_CACHE_PV_PARTS = qk_parts, pv_parts
    memo.clear_caches()
    return transposed


def launches(query, key_rows, value_rows, transposed: bool, values_t, scales_t, sm_count):
    """(out, [(kernel, grid, arguments)]) of a decode step, V swapped for the keys-contiguous
    copy in the transposed variants (the decode kernel's arguments 3 and 4)."""
    scale = query.shape[-1] ** -0.5 / query.shape[-1]   # the rotated query's (decode_step)
    out, _, made = attention.decode_launches(query, key_rows, value_rows, None, True, scale,
                                             0, 0.0, key_rows.shape[2] - query.shape[2],
                                             sm_count=sm_count)
    if transposed:
        kernel, grid, args = made[0]
        made[0] = (kernel, grid, args[:3] + (values_t, scales_t) + args[5:])
    return out, made


def rel_err(out, q, k, v) -> float:
    out, q, k, v = out[:1], q[:1], k[:1], v[:1]
    group = q.shape[1] // k.shape[1]
    kd, vd = (t.double().repeat_interleave(group, 1) for t in (k, v))
    want = torch.softmax((q.double() @ kd.transpose(2, 3)) * q.shape[-1] ** -0.5, -1) @ vd
    return ((out.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def step_loops(arch: str) -> None:
    """Instructions per step loop of each variant's decode cubin (B=8, 32/8, D=128, 16k)."""
    from eval.inspect_cubin import report
    from hf_tiled_attention.fp8 import export_kernel_cubin
    q = torch.empty(8, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    rows = torch.empty(8, 8, 16384, 144, dtype=torch.uint8, device="meta")
    values_t = torch.empty(8, 8, 128, 16384, dtype=torch.float8_e4m3fn, device="meta")
    scales_t = torch.empty(8, 8, 16384, dtype=torch.float32, device="meta")
    for variant in VARIANTS:
        _, made = launches(q, rows, rows, use(variant), values_t, scales_t, 132)
        info = report(export_kernel_cubin(made[0][0], made[0][2], arch))
        loops = [(loop["instructions"], loop["mma"], loop["LDL"]) for loop in info["mma_loops"]]
        print(f"{variant:15s} registers {info.get('reg')}, stack {info.get('stack')} B; step "
              f"loops (instructions, MMAs, spill reloads): {loops}", flush=True)


def timed(batches, keys_list, dim=128, heads=(32, 8)) -> None:
    import cuda.tile as ct

    from hf_tiled_attention.fp8_cache import key_rotation
    from hf_tiled_attention.launch import current_stream
    from hf_tiled_attention.op import sm_count
    from hf_tiled_attention.timing import graph_replay_ms
    device = torch.device("cuda", torch.cuda.current_device())  # launch.py wants an index
    for batch in batches:
        for keys in keys_list:
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(batch, heads[0], 1, dim, generator=g, device=device,
                            dtype=torch.bfloat16)
            k, v = (torch.randn(batch, heads[1], keys, dim, generator=g, device=device,
                                dtype=torch.bfloat16) for _ in range(2))
            k_rows, v_rows = quantize_keys(k), quantize_rows(v)
            values, scales = split_rows(v_rows)
            values_t, scales_t = values.transpose(-1, -2).contiguous(), scales.contiguous()
            q_rot = q @ key_rotation(dim, device, q.dtype)
            bf16_ms = graph_replay_ms(lambda: tiled_attention(q, k, v, is_causal=True))
            print(f"B={batch} keys={keys} bf16: {bf16_ms:.4f} ms", flush=True)
            for variant in VARIANTS:
                transposed = use(variant)
                out, made = launches(q_rot, k_rows, v_rows, transposed, values_t, scales_t,
                                     sm_count(device))

                def step():  # the stream asked per call: graph capture runs on its own
                    for kernel, grid, args in made:
                        ct.launch(current_stream(device), grid, kernel, args)
                step()
                err = rel_err(out, q, k, v)
                ms = graph_replay_ms(step)
                print(f"B={batch} keys={keys} {variant}: {ms:.4f} ms, {bf16_ms / ms:.3f}x bf16,"
                      f" rel err {err:.2e}", flush=True)
            del q, k, v, k_rows, v_rows, values_t, scales_t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cubins", action="store_true", help="sm_90 step loops, no GPU")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--keys", type=int, nargs="+", default=[16384, 65536])
    args = parser.parse_args(argv)
    if not hasattr(attention, "FP8_CACHE_TRANSPOSED"):
        raise SystemExit("apply fp8-cache-transposed-step.diff first (see the docstring)")
    if args.cubins:
        step_loops("sm_90")
    else:
        timed(args.batch, args.keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
