"""Shared by the eval scripts: where results go and the environment record beside them."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import importlib.metadata
import io
import itertools
import json
import math
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_tiled_attention import Schedule

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
# Command-line dtype names of the kernel evals.
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "hf_tiled_attention"


def gpu_slug() -> str:
    """'nvidia-h200' for an NVIDIA H200; 'cpu' without a GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def results_dir(*parts: str) -> Path:
    """This GPU's results folder (``eval/results/nvidia-h200``), or ``parts`` below it."""
    return RESULTS_ROOT.joinpath(gpu_slug(), *parts)


def output_dir(chosen: Path | None, *parts: str) -> Path:
    """Where a run writes, created: ``--out`` when given, else ``results_dir(*parts)``."""
    path = chosen or results_dir(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def tileiras_path() -> str | None:
    """The tileiras binary cuda.tile compiles with: its own lookup (the pip package's
    nvidia/cu13/bin first, which is not on PATH, then PATH and the CUDA toolkit), else PATH."""
    try:
        from cuda.tile._compile import _find_compiler_bin  # private: guarded
        return _find_compiler_bin().path
    except Exception:  # no cuda-tile, no tileiras, or another cuda-tile version's internals
        return shutil.which("tileiras")


def _tileiras_version() -> str:
    path = tileiras_path()
    if path is None:
        return "not found"
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{path} did not run"
    release = re.search(r"release [\d.]+, V[\d.]+", text)  # "release 13.4, V13.4.92"
    return release.group(0) if release else " ".join(text.split())[-80:] or "unknown"


def _driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def source_digest() -> str:
    """sha256 over the package's .py files, by name: recompute it on a checkout to find the commit."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def environment(argv: list[str]) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + shlex.join(argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_tile": _version("cuda-tile"),
        "tileiras": _tileiras_version(),
        "tileiras_path": tileiras_path() or "not found",
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "hf_tiled_attention": _version("hf-tiled-attention"),
        # Which code ran, even from an uninstalled copy without .git (the GPU host's checkout).
        "hf_tiled_attention_source_sha256": source_digest(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), driver=_driver_version(),
                   cudnn=torch.backends.cudnn.version())
    else:
        env.update(gpu="none (CPU reference path)")
    return env


class ResultsWriter:
    """``<job>.csv`` (kernel_sweep.csv, perplexity.csv, prefill.csv) and its entry in
    ``environment.json`` (one entry per job: command, versions, GPU, date).

    The CSV is rewritten after every row, so a run cut short (a time limit on a lent GPU) keeps
    what it measured; the environment entry says ``"complete": false`` until :meth:`finish`.
    ``append``: keep the rows already in the CSV (a sweep measured over several runs); each
    run then gets its own environment entry (``<job>``, ``<job>_run2``, ...).
    """

    def __init__(self, out_dir: Path, job: str, columns: list[str],
                 argv: list[str] | None = None, append: bool = False):
        self.out_dir, self.columns = out_dir, columns
        self.rows: list[dict] = []
        self.path = out_dir / f"{job}.csv"
        self.job = job  # the environment entry
        if append and self.path.exists():
            with open(self.path) as f:
                self.rows = list(csv.DictReader(f))
        if self.rows:
            env_path = out_dir / "environment.json"
            runs = len([k for k in json.loads(env_path.read_text()) if k.startswith(job)]
                       if env_path.exists() else [job])
            self.job = f"{job}_run{runs + 1}"
        self.started = time.time()
        # taken once: it runs tileiras and nvidia-smi
        self.environment = environment(sys.argv if argv is None else argv)
        self._write_environment(complete=False)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)

    def finish(self, extra: dict | None = None) -> Path:
        self._write_environment(**(extra or {}), seconds=round(time.time() - self.started, 1),
                                complete=True)
        return self.path

    def _write_environment(self, **extra) -> None:
        path = self.out_dir / "environment.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[self.job] = {**self.environment, **extra}
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def progress(iterable, **kwargs):
    """A tqdm progress bar on a terminal, none when output goes to a log (its carriage-return
    frames would flood it; the scripts print a line per result row instead)."""
    from tqdm.auto import tqdm
    return tqdm(iterable, disable=None, **kwargs)


def save_figure(fig, path: Path, *, dpi: int, measured_on_gpu: bool) -> Path:
    """Lays out and writes a plot; one of the CPU reference path says it is no speed
    measurement. The PNG has a 256-colour palette: a third of the size of full colour for line
    plots, and results travel to the lent GPU with the working tree, under a size limit."""
    from PIL import Image  # matplotlib's own dependency

    if not measured_on_gpu:
        fig.suptitle("CPU reference path: not a speed measurement")
    fig.tight_layout()
    rendered = io.BytesIO()
    fig.savefig(rendered, dpi=dpi, format="png")
    rendered.seek(0)
    Image.open(rendered).convert("RGB").quantize(colors=256).save(path, optimize=True)
    return path


def label_lengths(ax, lengths, labels=None) -> None:
    """One labelled x tick per measured length on a log axis, without minor-tick clutter."""
    ax.set_xticks(lengths, labels or [str(n) for n in lengths])
    ax.minorticks_off()


def parse_heads(text: str) -> tuple[int, int]:
    """``"32/8"`` -> (Hq, Hkv)."""
    heads_q, heads_kv = (int(x) for x in text.split("/"))
    return heads_q, heads_kv


def field_combinations(specs: list[str], cls: type, parse, flag: str) -> list[dict]:
    """``["tile_m=64,128", "occupancy=1,2"]`` (a repeatable ``flag``'s values) -> the cross
    product of the values, as dicts of ``cls``'s fields (``[]`` without specs);
    ``parse(name, text)`` reads one value."""
    fields = {f.name for f in dataclasses.fields(cls)}
    axes = []
    for spec in specs:
        name, _, values = spec.partition("=")
        if name not in fields or not values:
            raise SystemExit(f"{flag} expects FIELD=V1,V2 with a {cls.__name__} field "
                             f"({', '.join(sorted(fields))}), got {spec!r}")
        axes.append([(name, parse(name, v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else []


def parse_schedules(specs: list[str]) -> list[Schedule | None]:
    """``--schedule tile_m=64,128 --schedule occupancy=1,2`` -> the cross product of Schedules
    (``[None]`` when no spec is given: the default table)."""
    combos = field_combinations(specs, Schedule, Schedule.parse_field, "--schedule")
    return [Schedule(**combo) for combo in combos] or [None]


def first_call(fn, args: tuple, row: dict, refusals: tuple = (RuntimeError,)):
    """Runs a backend once (synchronised on a GPU) and returns its output, or None after
    marking ``row`` ``oom`` or ``unsupported`` (a backend that refuses a shape raises one of
    ``refusals``) with the reason."""
    try:
        out = fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out
    except torch.cuda.OutOfMemoryError as exc:
        row.update(status="oom", reason=str(exc).splitlines()[0][:160])
    except refusals as exc:
        row.update(status="unsupported", reason=" ".join(str(exc).split())[:160])
    return None


def checked(row: dict, err: float, bound: float) -> bool:
    """Records a backend's max abs error in ``row``; False (row marked ``wrong``) past
    ``bound``."""
    row["max_err"] = f"{err:.3g}"
    if not math.isfinite(err) or err > bound:
        row.update(status="wrong", reason=f"max abs err {err:.3g} > {bound}")
        return False
    return True


def median_interval(values: list[float], confidence: float = 0.95):
    """A distribution-free interval for the median of what ``values`` were drawn from: the
    k-th smallest and k-th largest value, k the largest whose coverage (binomial, p = 1/2) is
    at least ``confidence``. None when there are too few values for it (under 6 at 95%)."""
    if not 0 < confidence < 1:
        raise ValueError(f"median_interval: confidence must be in (0, 1), got {confidence!r}")
    n, tail = len(values), (1 - confidence) / 2
    k, below = 0, 0.0  # below: P(at most k-1 of n values fall under the median)
    while k < n:
        exactly_k = math.comb(n, k) / 2 ** n
        if below + exactly_k > tail:
            break
        below += exactly_k
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def timed(row: dict, fn, arg_sets: list, flops: float, warmup: int, reps: int):
    """One call's median latency (``ms``, ``tflops``) and, on a GPU, calls back to back
    (``gpu_ms``, ``gpu_tflops``) into ``row``; returns gpu_ms (None without a GPU)."""
    from hf_tiled_attention.timing import back_to_back_ms, median_ms

    cuda = torch.cuda.is_available()
    ms = median_ms(fn, arg_sets, cuda=cuda, warmup=warmup, reps=reps)
    row.update(ms=f"{ms:.4f}", tflops=f"{flops / ms / 1e9:.4g}")
    if not cuda:
        return None
    gpu_ms = back_to_back_ms(fn, arg_sets, reps=max(1, reps // 5))
    row.update(gpu_ms=f"{gpu_ms:.4f}", gpu_tflops=f"{flops / gpu_ms / 1e9:.4g}")
    return gpu_ms
