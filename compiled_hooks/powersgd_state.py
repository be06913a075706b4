"""Deprecated alias of :mod:`compiled_hooks.powersgd.state` (moved there)."""

import warnings

from .powersgd.state import PowerSGDState, Slot, random_q, should_compress

__all__ = ["PowerSGDState", "Slot", "random_q", "should_compress"]

warnings.warn(
    "compiled_hooks.powersgd_state moved to compiled_hooks.powersgd.state",
    DeprecationWarning,
    stacklevel=2,
)
