"""Whether the backward must be bitwise reproducible run to run.

By default it follows ``torch.use_deterministic_algorithms``; :func:`set_deterministic`
overrides that for this package. Deterministic, dQ comes from its own kernel and an additive
mask's gradient is summed by torch in a fixed order; otherwise the dK/dV kernel may add them
up with TMA reduce-adds (faster; the order of the adds, and so the last bits, vary run to run).
The forward is always deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch

_override: Optional[bool] = None


def set_deterministic(enabled: Optional[bool]) -> None:
    """``True``: the backward is bitwise reproducible; ``False``: it may add in any order even
    under ``torch.use_deterministic_algorithms(True)``; ``None`` (the default): follow
    torch's setting."""
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _override = enabled


def deterministic() -> bool:
    """Whether the backward must be bitwise reproducible now."""
    if _override is not None:
        return _override
    return torch.are_deterministic_algorithms_enabled()
