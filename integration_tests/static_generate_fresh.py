"""Run by test_gpu.py in a fresh process: its first "tiled" call is a compiled static-cache
generate() at batch 1 after a 1100-token prompt (the decode step's key splits, inside CUDA
graphs), twice, on a tiny Llama; prints "static generate ok" and the new tokens."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import build, padded_batch  # noqa: E402


def main() -> None:
    model = build("llama", "tiled").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = padded_batch([1100], 1100, "left", seed=8, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False, pad_token_id=0, cache_implementation="static")
    torch.cuda.synchronize()
    print("static generate ok", out[0, -12:].tolist())


if __name__ == "__main__":
    main()
