"""EAGLE-3 draft heads on rank 0 of the tensor-parallel target (docs/eagle3.md)."""

from hetero_run.runtime.eagle3.drafter import Eagle3Drafter
from hetero_run.runtime.eagle3.load import EAGLE3_PREFIX, load_eagle3, read_head

__all__ = ["EAGLE3_PREFIX", "Eagle3Drafter", "load_eagle3", "read_head", "is_eagle3"]


def is_eagle3(drafter) -> bool:
    """Whether a `Drafter` (or None) is an EAGLE-3 head (never one with sequence slots: asking
    those for `model` would take a slot)."""
    if getattr(drafter, "network", None) is not None:
        return False
    return isinstance(getattr(drafter, "model", None), Eagle3Drafter)
