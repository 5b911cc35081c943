"""Dev: where the host time of a batch-1 decode layer goes, on the real host (tiled vs sdpa)."""
import statistics, sys, time, warnings
import torch
import torch.nn.functional as F
sys.path.insert(0, "."); sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
warnings.filterwarnings("ignore")
import hf_tiled_attention as hta
from hf_tiled_attention import op, launch, memo, autotune, schedule as sch
from hf_tiled_attention.transformers_backend import tiled_attention_forward
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from eval.models import build_config, build_models
from eval.generate_throughput import timed_generate
import cuda.tile as ct

PROMPTS = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1024,8192").split(",")]

def per_call_us(fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    runs = []
    for r in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)

# in-situ timers and capture
acc = {}
captured = {}
def timed(name, fn, capture=False):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
        if capture and args[1].shape[2] == 1 and name not in captured:
            captured[name] = (args, kwargs)
        return out
    return wrapper

AttentionInterface.register("tiled", timed("tiled", tiled_attention_forward, True))
AttentionInterface.register("sdpa", timed("sdpa", sdpa_attention_forward, True))
mask_fns = {n: AttentionMaskInterface._global_mapping[n] for n in ("tiled", "sdpa")}
for n, f in mask_fns.items():
    AttentionMaskInterface.register(n, timed("mask_" + n, f))

torch.manual_seed(0)
config = build_config("llama3-8b", 32)
models = build_models(["tiled", "sdpa"], config, torch.bfloat16, "cuda")
variants = {"tiled": (models["tiled"], None), "sdpa": (models["sdpa"], None),
            "tiled_splits1": (models["tiled"], sch.Schedule(kv_splits=1))}

def gen(model, override, ids, n):
    if override is None:
        return timed_generate(model, ids, n, "dynamic")
    with sch.use_schedule(override):
        return timed_generate(model, ids, n, "dynamic")

with torch.inference_mode():
    for prompt in PROMPTS:
        ids = torch.randint(10, 1000, (1, prompt), device="cuda")
        for name, (m, o) in variants.items():
            gen(m, o, ids, 8)
        res = {n: [] for n in variants}
        insitu = {n: [] for n in variants}
        for rep in range(5):
            for name, (m, o) in variants.items():
                t1 = gen(m, o, ids, 1)
                acc.clear()
                t65 = gen(m, o, ids, 65)
                res[name].append((t65 - t1) / 64 * 1000)
                a = dict(acc)
                insitu[name].append({k: v / 65 / 32 * 1e6 for k, v in a.items()})
        for name in variants:
            v = sorted(res[name])
            fn_key = "sdpa" if name == "sdpa" else "tiled"
            fn_us = statistics.median(d.get(fn_key, 0) for d in insitu[name])
            mask_us = statistics.median(d.get("mask_" + fn_key, 0) for d in insitu[name]) * 32
            print(f"prompt {prompt} {name}: step ms median {v[2]:.3f} all {[round(x, 2) for x in v]}"
                  f" | in-situ attention fn {fn_us:.1f} us/layer, mask fn {mask_us:.1f} us/forward",
                  flush=True)

    # pieces, replaying layer 0's captured decode call (prompt = last one)
    (targs, tkw), (sargs, skw) = captured["tiled"], captured["sdpa"]
    module, q, k, v, tmask = targs[:5]
    smask = sargs[4]
    print("captured: q", tuple(q.shape), q.stride(), "k", tuple(k.shape), "tiled mask",
          type(tmask).__name__, "sdpa mask", None if smask is None else tuple(smask.shape),
          "kwargs", sorted(tkw), flush=True)
    rows = {}
    rows["adapter tiled"] = per_call_us(lambda: tiled_attention_forward(*targs, **tkw))
    rows["adapter sdpa"] = per_call_us(lambda: sdpa_attention_forward(*sargs, **skw))
    rows["F.sdpa builtin (gqa)"] = per_call_us(lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=smask, enable_gqa=True, scale=tkw.get("scaling")))
    scale = tkw["scaling"]
    diag = k.shape[2] - 1
    rows["op.attention"] = per_call_us(lambda: op.attention(
        q, k, v, None, causal=True, scale=scale, window=None, softcap=None, diag_offset=diag,
        return_lse=False, key_mask_table=True))
    rows["op._forward"] = per_call_us(lambda: op._forward(
        q, k, v, None, True, scale, None, None, diag, op._NO_OVERRIDES, False, True, None))
    plan = list(op._plans.values())[-1]
    print("plan grid", plan.grid, "splits", plan.kv_splits, "merge grid", plan.merge_grid)
    rows["run_kernel"] = per_call_us(lambda: launch.run_kernel(plan, q, k, v, None))
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)
    rows["launch_arrays"] = per_call_us(lambda: launch.launch_arrays(plan, q, k, v, None, stream))
    arrays = launch.launch_arrays(plan, q, k, v, None, stream)
    attn_args = arrays.attention + plan.scalars + (plan.variant.constant_values,)
    kern = plan.kernel
    rows["ct.launch attention"] = per_call_us(lambda: ct.launch(stream, plan.grid, kern, attn_args))
    if arrays.merge is not None:
        margs = arrays.merge + (plan.kv_splits,) + plan.merge
        mk = plan.merge_kernel
        rows["ct.launch merge"] = per_call_us(lambda: ct.launch(stream, plan.merge_grid, mk, margs))
    class CAI:
        __slots__ = ("__cuda_array_interface__",)
        def __init__(self, t):
            self.__cuda_array_interface__ = t.__cuda_array_interface__
    try:
        cai_args = tuple(CAI(a) if isinstance(a, torch.Tensor) else
                         (tuple(CAI(x) for x in a) if isinstance(a, tuple) and a and isinstance(a[0], torch.Tensor) else a)
                         for a in attn_args)
        rows["ct.launch attention (CAI objects)"] = per_call_us(lambda: ct.launch(stream, plan.grid, kern, cai_args))
    except Exception as e:
        print("CAI launch failed:", type(e).__name__, e)
    try:
        rows["ct.launch attention (PDL)"] = per_call_us(lambda: ct.launch(stream, plan.grid, kern, attn_args, programmatic_dependent_launch=True))
    except Exception as e:
        print("PDL launch failed:", type(e).__name__, e)
    import tiny_kernel
    a = torch.zeros(64, device="cuda")
    rows["ct.launch tiny 1 array"] = per_call_us(lambda: ct.launch(stream, (1, 1, 1), tiny_kernel.one_array, (a,)))
    nine = tuple(torch.zeros(64, device="cuda") for _ in range(9))
    rows["ct.launch tiny 9 arrays"] = per_call_us(lambda: ct.launch(stream, (1, 1, 1), tiny_kernel.nine_arrays, nine))
    cai9 = tuple(CAI(x) for x in nine)
    try:
        rows["ct.launch tiny 9 arrays (CAI)"] = per_call_us(lambda: ct.launch(stream, (1, 1, 1), tiny_kernel.nine_arrays, cai9))
    except Exception as e:
        print("CAI tiny failed:", e)
    shape, strides = q.shape, arrays.out.stride()
    rows["torch.empty_strided out"] = per_call_us(lambda: torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device))
    rows["torch.empty lse"] = per_call_us(lambda: torch.empty((1, 32, 1), dtype=torch.float32, device=q.device))
    dev = q.device
    rows["kernel_available"] = per_call_us(lambda: op.kernel_available(dev))
    rows["torch.cuda.current_device"] = per_call_us(torch.cuda.current_device)
    rows["torch._C._cuda_getDevice"] = per_call_us(torch._C._cuda_getDevice)
    rows["may_keep_device_memory"] = per_call_us(lambda: memo.may_keep_device_memory(True, dev))
    rows["autotune.state"] = per_call_us(autotune.state)
    rows["active_override"] = per_call_us(sch.active_override)
    rows["hash(_NO_OVERRIDES)"] = per_call_us(lambda: hash(op._NO_OVERRIDES))
    rows["launch_device"] = per_call_us(lambda: launch.launch_device(dev))
    rows["getCurrentRawStream"] = per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0))
    rows["functorch check"] = per_call_us(torch._C._are_functorch_transforms_active)
    rows["is_compiling"] = per_call_us(torch.compiler.is_compiling)
    rows["out.transpose.contiguous"] = per_call_us(lambda: arrays.out.transpose(1, 2).contiguous())
    rows["check_inputs"] = per_call_us(lambda: hta.checks.check_inputs(q, k, v))
    for name, us in rows.items():
        print(f"{name:40s} {us:7.2f} us/call", flush=True)
