"""FSDP and this package's communication hooks.

- :func:`data_parallel` (:mod:`._data_parallel`): compile-native FSDP, the whole sharded step in
  one ``torch.compile`` graph, its gradient reduction a comm hook.
- FSDP2 (``fully_shard``, ``replicate``) modules run the hooks through FSDP2's hook points
  (:mod:`.fsdp2`).

:func:`register_comm_hook` and :func:`get_comm_hook` take either kind of root.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import fsdp2 as _fsdp2
from . import native_hook as _native_hook
from ._data_parallel import MODES, DataParallelState, data_parallel, is_data_parallel
from .blocks import default_blocks
from .fsdp2 import ALREADY, ROOT_ONLY, HookAllReduce, HookReduceScatter
from .root import DataParallelModule, data_parallel_state

__all__ = [
    "data_parallel",
    "default_blocks",
    "register_comm_hook",
    "get_comm_hook",
    "is_data_parallel",
    "data_parallel_state",
    "DataParallelState",
    "DataParallelModule",
    "MODES",
    "HookReduceScatter",
    "HookAllReduce",
    "ROOT_ONLY",
    "ALREADY",
]


def register_comm_hook(
    module: torch.nn.Module, state: Any, hook: Callable[..., Any], *, compile: bool = False
) -> None:
    """Reduce the gradients of ``module`` through ``hook``, with FSDP1's rules (root only,
    once). ``module`` is a :func:`data_parallel` root, where the hook is traced into the
    compiled backward, or a root FSDP2 module, where ``compile=True`` compiles the hook on its
    own (see :mod:`.fsdp2`)."""
    if is_data_parallel(module):
        if compile:
            raise ValueError(
                "register_comm_hook: compile=True is for FSDP2 modules; a data_parallel module's "
                "hook is compiled with the module"
            )
        _native_hook.register_comm_hook(module, state, hook)
    else:
        _fsdp2.register_comm_hook(module, state, hook, compile=compile)


def get_comm_hook(module: torch.nn.Module) -> tuple[Callable[..., Any] | None, Any]:
    """``(hook, state)`` registered for this module (``(None, None)`` by default)."""
    dp = data_parallel_state(module)
    if dp is not None:
        return dp.comm_hook, dp.comm_hook_state
    return _fsdp2.get_comm_hook(module)
