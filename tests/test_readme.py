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
