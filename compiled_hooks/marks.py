"""The marks that traced code writes into a graph for the passes to read, and the switch that
runs ``data_parallel`` blocks as regions and leaves its gathers' recompute policy to a joint-graph
pass (:mod:`.graph_contract` says what each means to the passes). The code that writes a mark
imports it from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["BLOCK", "INT8", "RESHARD", "compile_blocks_once", "blocks_compile_once"]

BLOCK = "data_parallel_block"  # the key of a data_parallel node's block in meta["custom"]
INT8 = "int8_collective"  # the key, in meta["custom"], of a collective of packed int8 rows
RESHARD = "data_parallel_reshard"  # the key of an uncheckpointed gather's policy in meta["custom"]

_BLOCKS_ONCE = [False]


@contextlib.contextmanager
def compile_blocks_once() -> Iterator[None]:
    """Run the blocks of every ``data_parallel`` root traced inside as regions
    (:mod:`.fsdp.regions`), and its traced gathers under no checkpoint, marked with
    :data:`RESHARD` for the joint-graph pass that tags them (:mod:`.fsdp.gather`)."""
    outer, _BLOCKS_ONCE[0] = _BLOCKS_ONCE[0], True
    try:
        yield
    finally:
        _BLOCKS_ONCE[0] = outer


def blocks_compile_once() -> bool:
    return _BLOCKS_ONCE[0]
