"""CPU: the README's op example runs as written (through the reference path here)."""

import re
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
