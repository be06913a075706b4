"""What a pass decided, counted in ``counters["passes"]`` and logged (logger ``passes``)."""

from __future__ import annotations

import logging

from torch._dynamo.utils import counters
from torch.fx import Node

log = logging.getLogger("passes")


def record(pass_name: str, event: str, node: Node | None = None) -> None:
    """Count ``event`` in ``counters["passes"]`` and log it (logger ``passes``, DEBUG)."""
    counters["passes"][f"{pass_name}: {event}"] += 1
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: %s%s", pass_name, event, f" at {node.name}" if node is not None else "")
