"""The marks that traced code writes into a graph for the passes to read, and the switch that
runs ``data_parallel`` blocks as regions (:mod:`.graph_contract` says what each means to the
passes). The code that writes a mark imports it from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["BLOCK", "INT8", "compile_blocks_once", "blocks_compile_once"]

BLOCK = "data_parallel_block"  # the key of a data_parallel node's block in meta["custom"]
INT8 = "int8_collective"  # the key, in meta["custom"], of a collective of packed int8 rows

_BLOCKS_ONCE = [False]


@contextlib.contextmanager
def compile_blocks_once() -> Iterator[None]:
    """Run the blocks of every ``data_parallel`` root traced inside as regions
    (:mod:`.fsdp.regions`)."""
    outer, _BLOCKS_ONCE[0] = _BLOCKS_ONCE[0], True
    try:
        yield
    finally:
        _BLOCKS_ONCE[0] = outer


def blocks_compile_once() -> bool:
    return _BLOCKS_ONCE[0]
