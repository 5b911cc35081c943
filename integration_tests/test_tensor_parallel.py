"""Tensor parallelism: transformers' ``DistributedConfig(tp_plan="auto")`` under
``torchrun --nproc-per-node 2`` splits every layer's heads over two processes; "tiled" then
sees half the heads per rank and must give sdpa's greedy tokens (fp32). On the CPU (gloo) here;
on two GPUs (NCCL) with the ``gpu`` marker, skipped where there are fewer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import build

SCRIPT = Path(__file__).resolve().parent / "tp_generate.py"


def _run_torchrun(tmp_path: Path, env_extra: dict) -> dict:
    model_dir, report = tmp_path / "model", tmp_path / "report.json"
    build("llama", "eager").save_pretrained(model_dir)  # 4 query / 2 kv heads
    env = {**os.environ, **env_extra}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(SCRIPT), str(model_dir), str(report)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text())


def _check(result: dict) -> None:
    assert result["world_size"] == 2
    assert result["heads_seen"] == [2], result  # each rank: 2 of the 4 query heads
    assert result["max_logit_diff"] <= 1e-4, result
    assert result["tokens_equal"], result


def test_tensor_parallel_cpu(tmp_path):
    _check(_run_torchrun(tmp_path, {"CUDA_VISIBLE_DEVICES": ""}))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_two_gpus(tmp_path):
    _check(_run_torchrun(tmp_path, {}))
