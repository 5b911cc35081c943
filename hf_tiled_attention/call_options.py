"""A call's options as one record: everything it asks of the kernels besides its tensors.

:func:`call_options` makes the record once per call, in op (from the public arguments, or from
the registered ops' flat ones, which torch.library requires). It is the launch plans' memo key
(with the tensors' shapes, dtypes and device) and carries the layout of the mask the kernels
read; launch.plan_launch, backward_launch.backward_plan and run_backward take it, and
launch.kernel_constants turns it into the constants of the forward and backward kernels alike.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

from .masks import CompactMask, MaskLayout, ModMask, mask_layout
from .mods import CompiledMods
from .schedule import Schedule

NO_OVERRIDES = Schedule()  # built once: a Schedule validates itself on construction


class CallOptions(NamedTuple):
    """One call's options, normalised (a window or softcap of 0 is None). A NamedTuple, not a
    dataclass: every call makes one and hashes it (its plan lookup), and a tuple costs a
    fraction of a frozen dataclass's host time for both."""
    causal: bool                 # bottom-right aligned (see diag_offset)
    scale: float                 # resolved: 1 / sqrt(D) where the caller gave none
    window: Optional[int]
    softcap: Optional[float]
    diag_offset: int             # query row i sits at key position i + diag_offset
    schedule: Schedule           # the caller's overrides (unset fields: the table's or tuned)
    return_lse: bool
    key_mask_table: bool         # a key-vector mask gets a per-tile table (launch.plan_launch)
    # The translated score_mod / mask_mod, compared by identity: a launch passes their captured
    # tensors, so calls with the same code but other tensors do not share a plan.
    mods: Optional[CompiledMods]
    mask_layout: Optional[MaskLayout]  # of the mask the kernels read (a mask_mod's ModMask)

    @property
    def has_score_mod(self) -> bool:
        return self.mods is not None and hasattr(self.mods.module, "score_mod")

    def without_diagonal(self) -> CallOptions:
        """The record as the kernels' constants see it: the diagonal is a scalar they take at
        run time, so calls that differ only there (decode steps, whose diagonal moves with the
        cache) share one kernel variant and backward plan."""
        return self if self.diag_offset == 0 else self._replace(diag_offset=0)


def call_options(mask: Union[CompactMask, ModMask, None], *, causal: bool, scale: float,
                 window: Optional[int] = None, softcap: Optional[float] = None,
                 diag_offset: int = 0, schedule: Optional[Schedule] = None,
                 return_lse: bool = False, key_mask_table: bool = True,
                 mods: Optional[CompiledMods] = None) -> CallOptions:
    """The :class:`CallOptions` of a call whose kernels read ``mask`` (its CompactMask, a
    mask_mod's ModMask, or None)."""
    # (tuple.__new__: the NamedTuple's own constructor is a Python function, and this runs on
    # every call)
    return tuple.__new__(CallOptions, (
        bool(causal), float(scale), int(window) if window else None,
        float(softcap) if softcap else None, int(diag_offset), schedule or NO_OVERRIDES,
        bool(return_lse), bool(key_mask_table), mods, mask_layout(mask)))
