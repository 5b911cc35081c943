"""FP8 cache decode knob sweep (sweep-call.sh): one variant per process, its arguments
``keys occupancy k_latency v_latency qk_parts pv_fp8``; processes compile in parallel and time
under a lock (one at a time on the GPU); ``err``: the step's error against the dequantised rows
through the bf16 kernel, first batch row."""
import fcntl
import json
import sys

import torch
from hf_tiled_attention import fp8_cache_attention as A, memo, tiled_attention
from hf_tiled_attention.fp8_cache import quantize_keys, quantize_rows, keys_from_rows, dequantize_rows
from hf_tiled_attention.timing import back_to_back_ms

bf16 = sys.argv[1] == "bf16"
if not bf16:
    keys_n, occ, klat, vlat, qk_parts, pv = (int(x) for x in sys.argv[1:7])
    A.FP8_CACHE_KEYS, A.FP8_CACHE_OCCUPANCY = keys_n, occ
    A.FP8_CACHE_LATENCY, A.FP8_CACHE_QK_PARTS, A.FP8_CACHE_PV_PARTS = (klat, vlat), qk_parts, pv
    memo.clear_caches()
    label = f"keys={keys_n} occ={occ} lat={klat},{vlat} qk_parts={qk_parts} pv_parts={pv}"
else:
    label = "bf16 tiled"
pts = [(1, 65536), (8, 16384), (8, 65536), (32, 16384)]
data = []
g = torch.Generator(device="cuda").manual_seed(0)
for b, n in pts:
    q = torch.randn(b, 32, 1, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, 8, n, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if bf16:  # default arguments: the timing loop calls these after the set-up loop ends
        kr, vr = k, v
        call = lambda q=q, k=k, v=v: tiled_attention(q, k, v, is_causal=True)
    else:
        kr, vr = quantize_keys(k), quantize_rows(v)
        call = lambda q=q, kr=kr, vr=vr: A.decode_step(q, kr, vr, causal=True)
    out = call()
    ref = out[:1] if bf16 else tiled_attention(q[:1], keys_from_rows(kr[:1], q.dtype), dequantize_rows(vr[:1], q.dtype), is_causal=True)
    err = ((out[:1].float() - ref.float()).norm() / ref.float().norm()).item()
    data.append((b, n, q, kr, vr, call, err, kr.nbytes + vr.nbytes))
torch.cuda.synchronize()
with open("/tmp/sweep.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    for b, n, q, kr, vr, call, err, nbytes in data:
        ms = back_to_back_ms(call, [()], reps=50)
        print(json.dumps(dict(variant=label, batch=b, keys=n, ms=round(ms, 4),
                              tbps=round(nbytes / ms / 1e9, 3), err=f"{err:.1e}")), flush=True)
