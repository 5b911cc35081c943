"""GPU parity (marker `gpu`; skipped without CUDA): bf16/fp16 logits against eager and sdpa,
and greedy generation checked by teacher forcing. Self-contained, tiny models, a few seconds."""

import math

import pytest
import torch

from models import build, padded_batch

pytestmark = pytest.mark.gpu

# Max abs logit error allowed beyond eager-vs-sdpa's own disagreement.
BASE_TOL = {torch.float16: 2e-2, torch.bfloat16: 1e-1}


def _on_gpu(name, impl, dtype):
    return build(name, impl).to(device="cuda", dtype=dtype)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma2", "phi3", "gpt_oss"])
def test_logits_vs_eager_and_sdpa(name, side, dtype):
    ids, mask = padded_batch([70, 130, 33], 130, side, seed=1, device="cuda")
    keep = mask.bool()
    tiled = _logits(_on_gpu(name, "tiled", dtype), ids, mask)[keep]
    fp32 = _logits(build(name, "eager").to("cuda"), ids, mask)[keep]
    eager = _logits(_on_gpu(name, "eager", dtype), ids, mask)[keep]
    assert torch.isfinite(tiled).all()
    ref_err = (eager - fp32).abs().max().item()
    err = (tiled - fp32).abs().max().item()
    assert err <= 2 * ref_err + BASE_TOL[dtype], (err, ref_err)
    if name not in ("gemma2", "gpt_oss"):  # sdpa has no softcap, and no sinks
        sdpa = _logits(_on_gpu(name, "sdpa", dtype), ids, mask)[keep]
        assert (tiled - sdpa).abs().max().item() <= 2 * ref_err + BASE_TOL[dtype]


def _generated_steps(model, ids, mask, new: int, cache: str):
    """Greedy generate() of exactly ``new`` tokens: (sequences, the logits of each step)."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True, cache_implementation=cache)
    return out.sequences, torch.stack(out.logits, 1).float()


def _teacher_forced(name, dtype, sequences, mask, prompt: int, new: int, eos: int):
    """The logits eager gives each generated step from the whole sequence at once, with the
    token that min_new_tokens forbids (EOS) out of the running."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], new)], 1)
    with torch.no_grad():
        logits = _on_gpu(name, "eager", dtype)(sequences, attention_mask=full_mask).logits
    steps = logits.float()[:, prompt - 1:-1]
    steps[..., eos] = -math.inf
    return steps


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_greedy_generate_teacher_forced(name, cache):
    """Each token tiled picks greedily (bf16) has, in fp32 eager teacher-forced on the same
    sequence, a logit within bf16's own noise of the best allowed one: twice eager bf16's
    largest logit error on that sequence, plus BASE_TOL. (A tiny random model has near-ties,
    and gpt-oss's top-1 expert routing turns a rounding difference into a different expert:
    a fixed bound failed on bf16 noise that fp32 shows is not the kernel's; perf-notes.)"""
    dtype = torch.bfloat16
    ids, mask = padded_batch([40, 17, 29], 40, "left", seed=2, device="cuda")
    tiled = _on_gpu(name, "tiled", dtype)
    new = 24
    with torch.no_grad():
        sequences, _ = _generated_steps(tiled, ids, mask, new, cache)
    eos = tiled.generation_config.eos_token_id
    fp32 = _teacher_forced(name, torch.float32, sequences, mask, ids.shape[1], new, eos)
    noise = (_teacher_forced(name, dtype, sequences, mask, ids.shape[1], new, eos)
             - fp32).nan_to_num(0.0, 0.0, 0.0).abs().max().item()
    chosen = fp32.gather(-1, sequences[:, ids.shape[1]:, None]).squeeze(-1)
    gap = (fp32.max(-1).values - chosen).max().item()
    assert gap <= 2 * noise + BASE_TOL[dtype], (gap, noise)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_oss"])
def test_batch_one_long_prompt_generate_matches_eager(name, cache):
    """Batch 1 after a 1100-token prompt: the static cache's compiled step splits the keys over
    blocks inside CUDA graphs (the key-split path and its merge); the dynamic cache's eager
    calls run unsplit (launch.EAGER_SPLIT_MIN_BYTES). fp32 (the
    kernel's TF32x3 path) so the check is sharp: every step's logits within 2e-3 of eager's
    fp32 teacher-forced ones, and each token eager's own argmax."""
    ids, mask = padded_batch([1100], 1100, "left", seed=7, device="cuda")
    tiled = _on_gpu(name, "tiled", torch.float32)
    new = 16
    with torch.no_grad():
        sequences, steps = _generated_steps(tiled, ids, mask, new, cache)
    eos = tiled.generation_config.eos_token_id
    want = _teacher_forced(name, torch.float32, sequences, mask, ids.shape[1], new, eos)
    steps[..., eos] = -math.inf
    assert (steps - want).nan_to_num(0.0, 0.0, 0.0).abs().max().item() <= 2e-3
    chosen = want.gather(-1, sequences[:, ids.shape[1]:, None]).squeeze(-1)
    assert (want.max(-1).values - chosen).max().item() <= 2e-3


def test_static_generate_first_call_in_a_fresh_process():
    """The regression of issue 18: a process whose first "tiled" call is a compiled
    static-cache generate() at batch 1 (every cache of the package first filled inside a CUDA
    graph's warm-up) must not leave tensors in the graph's memory pool."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("static_generate_fresh.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "static generate ok" in done.stdout


def test_fp16_generate_matches_sdpa():
    """fp16 greedy tokens equal sdpa's up to the first step where sdpa itself has a near tie."""
    ids, mask = padded_batch([20, 12], 20, "left", seed=3, device="cuda")
    new = 8
    outs = {}
    for impl in ("tiled", "sdpa"):
        model = _on_gpu("llama", impl, torch.float16)
        with torch.no_grad():
            outs[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                        min_new_tokens=new, do_sample=False, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype, device="cuda")], 1)
    with torch.no_grad():
        ref = model(outs["sdpa"], attention_mask=full_mask).logits.float()[:, ids.shape[1] - 1:-1]
    top2 = ref.topk(2, dim=-1).values
    near_tie = (top2[..., 0] - top2[..., 1]) < 0.05
    gen_t, gen_s = outs["tiled"][:, ids.shape[1]:], outs["sdpa"][:, ids.shape[1]:]
    for b in range(2):
        diverged = (gen_t[b] != gen_s[b]).nonzero()
        if len(diverged):
            assert near_tie[b, diverged[0, 0]], (gen_t[b], gen_s[b])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_split_across_two_gpus(name, tmp_path):
    """A checkpoint loaded with device_map="auto" over two GPUs (or, if accelerate keeps so
    tiny a model on one, an explicit half-and-half map) runs each layer's attention on its
    own device and matches sdpa loaded the same way."""
    import transformers
    build(name, "eager").save_pretrained(tmp_path)

    def load(impl, device_map):
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, attn_implementation=impl, dtype=torch.bfloat16, device_map=device_map)

    tiled = load("tiled", "auto")
    if len(set(getattr(tiled, "hf_device_map", {}).values())) < 2:  # all on one GPU
        layers = tiled.config.num_hidden_layers
        device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1,
                      "lm_head": 1}
        device_map.update({f"model.layers.{i}": int(i >= layers // 2) for i in range(layers)})
        tiled = load("tiled", device_map)
    else:
        device_map = "auto"
    assert {0, 1} <= {torch.device(d).index if not isinstance(d, int) else d
                      for d in tiled.hf_device_map.values()}, tiled.hf_device_map
    sdpa = load("sdpa", device_map)
    ids, mask = padded_batch([50, 31], 50, "left", seed=3, device="cuda:0")
    keep = mask.bool()
    with torch.no_grad():
        fp32 = _logits(build(name, "eager").to("cuda:0"), ids, mask)[keep]
        got = _logits(tiled, ids, mask).to("cuda:0")[keep]
        ref_err = (_logits(sdpa, ids, mask).to("cuda:0")[keep] - fp32).abs().max().item()
        assert (got - fp32).abs().max().item() <= 2 * ref_err + BASE_TOL[torch.bfloat16]
        out = tiled.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    assert out.shape == (2, 58)


def test_packed_16k_tokens_without_a_dense_mask():
    """A 16k-token packed row (cu_seq_lens, as DataCollatorWithFlattening passes them): each
    document matches its own unpacked fp32 run as closely as sdpa's bf16 run of it does, and
    the forward's extra memory stays far below one dense (1, 1, 16k, 16k) bool mask (256 MiB).
    (bf16 logits of a 5000-token run differ by a bf16 step, 0.125, from the same run inside a
    longer batch: the projections' GEMMs round differently; hence sdpa's error as the scale.)"""

    model = _on_gpu("llama", "tiled", torch.bfloat16)
    fp32 = build("llama", "eager").cuda()
    sdpa = _on_gpu("llama", "sdpa", torch.bfloat16)
    lengths = [3000, 5000, 2384, 6000]
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, 128, (n,), generator=g).cuda() for n in lengths]
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    with torch.no_grad():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        packed = model(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=max(lengths), max_length_k=max(lengths),
                       use_cache=False).logits[0].float()
        peak = torch.cuda.max_memory_allocated() - base
        logits_bytes = packed.numel() * 2
        assert peak - 3 * logits_bytes < 64 * 2**20, f"extra peak {peak / 2**20:.0f} MiB"
        start = 0
        for doc in docs:
            alone = fp32(doc[None], use_cache=False).logits[0]
            ref_err = (sdpa(doc[None], use_cache=False).logits[0].float() - alone).abs().max()
            err = (packed[start:start + len(doc)] - alone).abs().max()
            assert err <= 2 * ref_err + BASE_TOL[torch.bfloat16], (start, err, ref_err)
            start += len(doc)


def _train_grads(model, **batch):
    model.train()
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                         if p.grad is not None}


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_training_gradients_on_the_kernels(name):
    """fp32 training step on the backward kernels (TF32x3) against eager's, with padding."""
    ids, mask = padded_batch([150, 97], 150, "right", seed=3, device="cuda")
    labels = ids.masked_fill(mask == 0, -100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    loss, grads = _train_grads(build(name, "tiled").to("cuda"), **batch)
    want_loss, want = _train_grads(build(name, "eager").to("cuda"), **batch)
    assert abs(loss - want_loss) < 1e-4
    for key in want:
        scale = max(want[key].abs().max().item(), 1e-3)
        err = (grads[key] - want[key]).abs().max().item()
        assert err <= 2e-3 * scale, (key, err, scale)


def test_bf16_packed_training_step_matches_sdpa():
    """bf16, one packed row of documents (position ids restarting, no dense mask) against sdpa
    on the same row: the loss and the gradient norms agree within bf16 noise."""
    from transformers import DataCollatorWithFlattening
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (300, 41, 700, 180)]
    batch = dict(DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": d} for d in docs]))
    batch = {k: v.to("cuda") for k, v in batch.items()}
    loss, grads = _train_grads(_on_gpu("llama", "tiled", torch.bfloat16), **batch)
    want_loss, want = _train_grads(_on_gpu("llama", "sdpa", torch.bfloat16), **batch)
    exact_loss, exact = _train_grads(build("llama", "eager").to("cuda"), **batch)
    assert abs(loss - exact_loss) <= 2 * abs(want_loss - exact_loss) + 2e-2
    for key in exact:
        ref_err = (want[key] - exact[key]).norm().item()
        err = (grads[key] - exact[key]).norm().item()
        assert err <= 2 * ref_err + 1e-2 * exact[key].norm().item(), (key, err, ref_err)

