import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (bf16/fp16 parity on the cuTile kernel)")
    # The op warns (RuntimeWarning) when it runs its pure-PyTorch reference path (CPU here).
    config.addinivalue_line("filterwarnings",
                            "ignore:hf_tiled_attention.*reference path:RuntimeWarning")
    warnings.filterwarnings("ignore", message="hf_tiled_attention.*reference path",
                            category=RuntimeWarning)
    # transformers 5.24 renamed `past_key_values` to `cache`; the tests use the name both accept.
    config.addinivalue_line("filterwarnings", "ignore:`past_key_values` is deprecated:FutureWarning")
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:torch.jit")


@pytest.fixture
def op_calls(monkeypatch):
    """The (mask, mods) of each call the transformers adapter makes to the op, in order."""
    from hf_tiled_attention import transformers_backend

    seen = []
    real = transformers_backend._op_attention

    def spy(query, key, value, mask, **kwargs):
        seen.append((mask, kwargs.get("mods")))
        return real(query, key, value, mask, **kwargs)

    monkeypatch.setattr(transformers_backend, "_op_attention", spy)
    return seen


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
