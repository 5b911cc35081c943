import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))          # semantics.py
sys.path.insert(0, str(Path(__file__).parent.parent))   # the eval/ scripts


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU with the cuTile toolchain")


@pytest.fixture(autouse=True)
def _quiet_reference_warning(recwarn):
    """The reference path warns once per process; tests that care check for it explicitly."""
    yield
