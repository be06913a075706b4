"""The key under which Inductor's FX graph cache keeps a graph the pipeline rewrote: a
cached graph is reused only where the same passes, with the same options and sources, would
rewrite it the same way."""

from __future__ import annotations

import hashlib
import inspect
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .groups import ranks_on_one_host

__all__ = ["cache_key"]

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent  # passes/, the framework included


def cache_key(
    passes: Sequence[Callable[..., bool]], options: dict[str, Any], check_ranks: bool
) -> str:
    """A hash of this package's source, each pass's name and source, the options, the rank
    guard switch, the job's host layout (the gloo rewrites' default piece size follows it) and
    torch's version."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        h.update(path.read_bytes())
    for p in passes:
        h.update(f"{getattr(p, '__module__', '')}.{getattr(p, '__qualname__', repr(p))}".encode())
        try:
            h.update(inspect.getsource(p).encode())
        except (OSError, TypeError):
            h.update(repr(p).encode())
    h.update(repr(sorted(options.items())).encode())
    h.update(f"check_ranks={check_ranks}".encode())
    # the default all_to_all piece size follows the job's hosts (resolve_chunk_bytes)
    h.update(f"ranks_on_one_host={ranks_on_one_host()}".encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()
