"""The one parser of this distribution's on/off environment variables (``PASSES_VERIFY``,
``PASSES_CHECK_RANKS``): ``1``/``true`` is on, ``0``/``false`` or unset (or empty) is off,
case-insensitive; anything else is an error that names the variable."""

from __future__ import annotations

import os

__all__ = ["env_flag"]

_ON, _OFF = ("1", "true"), ("0", "false", "")


def env_flag(name: str, default: bool = False) -> bool:
    """The value of the on/off environment variable ``name`` (``default`` when unset)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected 1, 0, true or false")
