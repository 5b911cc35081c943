"""Continuous batching on "tiled": ``generate_batch``'s greedy tokens equal eager's (fp32, CPU;
continuous_batching_runs.py) with every attention call on the packed-requests op, in one batch
and with prompts split into chunks; on a transformers that has no route, a clear error.

transformers 5.17 and 5.18 serve "tiled"; newer releases do not. Where the installed one does not,
the runs go to a subprocess on the transformers 5.17 that .ci/install.sh puts in
``.venv/transformers-5.17`` (``HTA_TRANSFORMERS_517`` names another folder)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

import hf_tiled_attention as hta
from hf_tiled_attention import serving

from models import SLIDING_MODELS, build, make_config

REPO = pathlib.Path(__file__).resolve().parents[1]
OLD_TRANSFORMERS = pathlib.Path(os.environ.get("HTA_TRANSFORMERS_517",
                                               REPO / ".venv" / "transformers-5.17"))
MODELS = ["llama", "qwen3", "phi3", "gemma3", "afmoe"] + SLIDING_MODELS


def _runs(names: list[str], max_batch_tokens: int | None = None) -> list[dict]:
    if serving.serves_custom_attention():
        from continuous_batching_runs import run
        return [run(name, max_batch_tokens=max_batch_tokens) for name in names]
    args = []
    if max_batch_tokens is not None:
        args.append(f"--max-batch-tokens={max_batch_tokens}")
    return _in_old_transformers(args + names)


def _in_old_transformers(args: list[str]) -> list[dict]:
    """continuous_batching_runs.py's JSON lines, run on transformers 5.17."""
    if not (OLD_TRANSFORMERS / "transformers").is_dir():
        pytest.fail(f"no transformers 5.17 at {OLD_TRANSFORMERS} (bash .ci/install.sh puts it "
                    f"there) and the installed one has no continuous-batching route")
    command = [sys.executable, str(REPO / "integration_tests" / "continuous_batching_runs.py")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(OLD_TRANSFORMERS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command + args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("max_batch_tokens", [None, 24], ids=["one-batch", "chunked-prefill"])
def test_generate_batch_matches_eager(max_batch_tokens):
    names = MODELS if max_batch_tokens is None else ["llama", "qwen2", "gemma2", "gpt_oss"]
    runs = _runs(names, max_batch_tokens)
    assert [r["model"] for r in runs] == names
    for r in runs:
        assert r["tiled"] == r["eager"], r["model"]
        assert len(r["tiled"]) == 6 and all(len(t) == 10 for t in r["tiled"])
        # Every layer of every step ran the packed-requests op (2 layers per step).
        assert r["calls"] >= 2 * 10 and r["calls"] % 2 == 0, r
        # Full-attention layers read the cache in place once requests have cached keys.
        sliding_only = r["model"] == "mistral"
        assert (r["paged"] == 0) == sliding_only, r


def test_inputs_padded_as_for_cuda_graphs_match_eager():
    """transformers' inputs as it pads them when it captures CUDA graphs (static sizes, the
    padding requests' slots the cache's trash slots, ``max_seqlen_q`` the padded count), run
    without the graphs: each version's route gives eager's tokens (the same arguments the GPU
    test with graphs replays; Llama, and Gemma 2's sliding layers)."""
    names = ["llama", "gemma2"]
    if serving.serves_custom_attention():
        from continuous_batching_runs import run
        runs = [run(name, padded=True) for name in names]
    else:
        runs = _in_old_transformers(["--padded"] + names)
    for r in runs:  # "paged|tiled": full-attention layers read the paged cache in place
        assert r["tiled"] == r["eager"], r["model"]
        assert r["calls"] >= 20 and r["paged"] > 0, r
    if not serving.serves_custom_attention():  # the Hub-kernel route (a gathered cache)
        pytest.importorskip("kernels")
        from continuous_batching_runs import run
        for name in names:
            r = run(name, implementation=hta.flash_kernel(), padded=True)
            assert r["tiled"] == r["eager"] and r["calls"] >= 20, r


def test_manager_api_matches_eager():
    """The manager API (``init_continuous_batching``, ``add_request`` while it runs,
    ``get_result``) on each version's route: "paged|tiled" on transformers 5.17 (here or in a
    subprocess), the Hub-kernel name on newer ones."""
    names = ["llama", "gemma2"]
    if serving.serves_custom_attention():
        from continuous_batching_runs import run
        runs = [run(name, manager=True) for name in names]
    else:
        runs = _in_old_transformers(["--manager"] + names)
        pytest.importorskip("kernels")
        from continuous_batching_runs import run
        runs += [run(name, implementation=hta.flash_kernel(), manager=True) for name in names]
    assert len(runs) in (2, 4)
    for r in runs:
        assert r["tiled"] == r["eager"], r["model"]
        assert len(r["tiled"]) == 6 and all(len(t) == 10 for t in r["tiled"])
        assert r["calls"] >= 2 * 10 and r["calls"] % 2 == 0, r


def test_hub_kernel_decode_steps_read_the_block_table():
    """transformers 5.19+ hands the block table of decode-only steps (``flash_attn_with_kvcache``)
    only to names it reads as FlashAttention 2 or 3 (r".*flash.*2" or 3): the Hub-kernel name
    is one, and with those steps on (transformers turns them off without CUDA; passed by here)
    models whose layers are all full attention read the cache in place on every decode step,
    with eager's tokens."""
    if serving.serves_custom_attention():
        pytest.skip("transformers 5.17-5.18 serve 'tiled' itself, reading the cache in place")
    pytest.importorskip("kernels")
    from transformers.utils.generic import is_flash_attention_requested
    name = hta.flash_kernel()
    assert is_flash_attention_requested(requested_attention_implementation=name, version=[2, 3])
    from continuous_batching_runs import NEW_TOKENS, run
    for model in ("llama", "qwen3"):
        r = run(model, implementation=name, block_table=True)
        assert r["tiled"] == r["eager"], model
        # every step after the one prefill step is decode-only: one block-table call per layer
        layers = build(model, "eager").config.num_hidden_layers
        assert r["paged"] == (NEW_TOKENS - 1) * layers, r


@pytest.mark.parametrize("max_batch_tokens", [None, 24], ids=["one-batch", "chunked-prefill"])
def test_hub_kernel_route_matches_eager(max_batch_tokens):
    """The route of transformers 5.19+: the tiled kernels loaded as a Hub kernel (the `kernels`
    package reading hub_kernel/) under a FlashAttention name; the cache is gathered for it."""
    if serving.serves_custom_attention():
        pytest.skip("transformers 5.17-5.18 serve 'tiled' itself (test above); their Hub-kernel "
                    "route is not this one")
    pytest.importorskip("kernels")
    from continuous_batching_runs import run
    name = hta.flash_kernel()
    # (gpt-oss names its own FlashAttention kernels, `_compatible_flash_implementations`, and
    # transformers loads the first of them instead of any other flash name)
    # (DeepSeek V3: values with a head dim of their own, multi-head latent attention)
    for model in (["llama", "gemma2", "qwen2", "mistral", "deepseek_v3"]
                  if max_batch_tokens is None else ["llama", "qwen2"]):
        r = run(model, max_batch_tokens=max_batch_tokens, implementation=name)
        assert r["tiled"] == r["eager"], model
        assert r["calls"] >= 20 and r["calls"] % 2 == 0 and r["paged"] == 0, r


def test_hub_kernel_route_in_generate():
    """The same name in an ordinary generate(): eager's tokens (batched FlashAttention calls)."""
    if serving.serves_custom_attention():
        pytest.skip("transformers 5.17-5.18: tested through 'paged|tiled'")
    pytest.importorskip("kernels")
    from continuous_batching_runs import greedy_one_by_one, prompts
    requests = prompts()[:3]
    assert greedy_one_by_one(build("gemma2", hta.flash_kernel()), requests) == \
        greedy_one_by_one(build("gemma2", "eager"), requests)


def test_newer_transformers_get_a_clear_error():
    model = build("llama", "tiled")
    if serving.serves_custom_attention():
        hta.check_serving(model)  # no error where the route exists
        return
    with pytest.raises(RuntimeError, match=r"attn_implementation=hf_tiled_attention\.flash_kernel"
                                           r"\(\).*transformers 5\.17 or 5\.18"):
        hta.check_serving(model)
    hta.check_serving(build("llama", hta.flash_kernel()))  # the Hub-kernel route passes


def test_unserved_features_are_refused():
    with pytest.raises(ValueError, match=r"chunked attention \(Llama 4\).*attention_chunk_size"):
        serving.check_served_features(make_config("llama4"))
    serving.check_served_features(make_config("gemma2"))  # softcap and windows are served


def test_unserved_model_fails_before_its_first_token():
    """The requests of a model the route cannot serve fail at the first forward (transformers'
    warm-up, before any request runs) with the error naming the feature and the alternative."""
    result = _refusal("llama", bidirectional=True)
    assert result["tokens"] == [[], []]
    for error in result["errors"]:
        assert "bidirectional attention (config.use_bidirectional_attention)" in error
        assert "attn_implementation='sdpa'" in error


def _refusal(name: str, bidirectional: bool = False) -> dict:
    if serving.serves_custom_attention():
        from continuous_batching_runs import refusal
        return refusal(name, bidirectional)
    [result] = _in_old_transformers(["--refusal", name] + ["bidirectional"] * bidirectional)
    return result


def test_latent_attention_gets_a_clear_error_on_the_paged_route():
    """transformers 5.17's paged cache has one head dim for keys and values, so a model whose
    keys and values differ (DeepSeek V3's latent attention) fails there on every attention
    (eager included): with an error naming the head dims and the routes that serve it."""
    result = _refusal("deepseek_v3")
    assert result["tokens"] == [[], []]
    for error in result["errors"]:
        assert "keys have 32 and its values 16 (multi-head latent attention)" in error
        assert "hf_tiled_attention.flash_kernel()" in error


def test_paged_name_needs_the_cache():
    model = build("llama", "tiled")
    attention = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(ValueError, match="attn_implementation='tiled'"):
        serving.paged_tiled_attention(attention, q, q[:, :2], q[:, :2], None, scaling=0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_generate_batch_in_cuda_graphs_on_the_kernel(name):
    """A server that asks transformers 5.17-5.18 for CUDA graphs (``use_cuda_graph=True``) gets
    its steps captured with our launches and replayed: eager's tokens (fp32; Gemma 2 with its
    sliding layers, whose window the cache gathers), the kernel captured in the graphs and
    steps replayed."""
    if not serving.serves_custom_attention():
        pytest.skip("this transformers has no continuous-batching route (the CPU test runs "
                    "transformers 5.17 in a subprocess)")
    from continuous_batching_runs import run
    r = run(name, device="cuda", cuda_graphs=True)
    assert r["tiled"] == r["eager"], name
    assert r["paged"] > 0 and r["replays"] > 0, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gpt_oss"])
def test_generate_batch_on_the_kernel(name):
    """On the GPU (fp32: the kernel's three-TF32 products; transformers 5.17-5.18 capture no
    CUDA graph for "paged|tiled" unless asked): eager's tokens, every layer on the kernel."""
    if not serving.serves_custom_attention():
        pytest.skip("this transformers has no continuous-batching route (the CPU test runs "
                    "transformers 5.17 in a subprocess)")
    from continuous_batching_runs import run
    for budget in (None, 24):
        r = run(name, device="cuda", max_batch_tokens=budget)
        assert r["tiled"] == r["eager"], (name, budget)
        assert r["calls"] >= 20 and r["paged"] > 0, r


def test_model_with_its_own_flash_kernels_is_refused_on_newer_transformers():
    if serving.serves_custom_attention():
        pytest.skip("transformers 5.17-5.18 serve gpt-oss through 'paged|tiled' (test above)")
    with pytest.raises(RuntimeError, match=r"gives GptOssForCausalLM its own kernels"):
        hta.check_serving(build("gpt_oss", "tiled"))


def test_transformers_serve_runs_on_the_kernels(tmp_path):
    """``transformers serve --continuous-batching --attn-implementation
    hf-tiled-attention/flash2-tiled`` (the README's command line, LOCAL_KERNELS from ``python -m
    hf_tiled_attention.hub_kernel``) on a tiny Llama saved to a folder: three concurrent chat
    requests get eager's greedy tokens, and every layer of every step ran the packed-requests
    op (counted in the model's process: serve_runs.py)."""
    if serving.serves_custom_attention():
        pytest.skip("transformers 5.17-5.18: `transformers serve` cannot load 'tiled' (the "
                    "server's model manager takes only its own names or Hub kernels, and its "
                    "Hub kernels need kernels 0.16)")
    from transformers.utils.import_utils import is_serve_available
    if not is_serve_available():
        pytest.fail("transformers serve needs its extras: pip install 'transformers[serving]' "
                    "(in the package's test extras)")
    import serve_runs
    folder, counts = tmp_path / "model", tmp_path / "calls.txt"
    serve_runs.save(folder)
    with socket.socket() as probe:  # a free port
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    kernel_dirs = subprocess.run([sys.executable, "-m", "hf_tiled_attention.hub_kernel"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, LOCAL_KERNELS=kernel_dirs)
    command = [sys.executable, str(REPO / "integration_tests" / "serve_runs.py"), "serve",
               str(counts), str(folder), "--continuous-batching", "--attn-implementation",
               hta.serving.FLASH_KERNEL, "--device", "cpu", "--port", str(port)]
    server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    prompts = [[5, 9, 17, 33, 4], [7, 3, 60, 61, 62, 63, 99, 12, 40], [8, 100]]
    new_tokens = 8
    try:
        base = f"http://localhost:{port}"
        _wait_for(server, f"{base}/v1/models", timeout=240)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda ids: _chat(base, str(folder), ids, new_tokens),
                                    prompts))
    finally:
        log = _stop(server)
    model = build("llama", "eager")
    for ids, reply in zip(prompts, replies):
        prompt = torch.tensor([ids])
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert reply == [f"w{t}" for t in want], (ids, reply, want, log[-3000:])
    calls = counts.read_text().split() if counts.exists() else []
    # 2 layers a step; each request's prompt and new tokens take at least new_tokens steps
    assert calls.count("varlen") >= 2 * new_tokens and calls.count("varlen") % 2 == 0, \
        (calls, log[-3000:])


def _stop(server: subprocess.Popen) -> str:
    """Stops the server and its model process (one process group); returns its output."""
    for stop in (signal.SIGTERM, signal.SIGKILL):
        if server.poll() is None:
            try:
                os.killpg(server.pid, stop)
            except ProcessLookupError:
                pass
        try:
            return server.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            continue
    return ""


def _wait_for(server: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"transformers serve exited ({server.returncode}): "
                        f"{server.communicate()[0][-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"transformers serve did not answer {url} within {timeout} s")


def _chat(base: str, model: str, ids: list[int], new_tokens: int) -> list[str]:
    """One chat request (greedy: the model folder's generation config); the reply's words."""
    body = {"model": model, "max_tokens": new_tokens,
            "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in ids)}]}
    request = urllib.request.Request(f"{base}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.loads(response.read())
    return reply["choices"][0]["message"]["content"].split()
