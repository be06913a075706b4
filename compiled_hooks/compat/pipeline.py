"""What torch's pipelining reads of an FSDP2 module beyond ``FSDPModule``'s methods, and the
device mesh's root. Part of :mod:`compiled_hooks.compat`, which re-exports every name here;
read them through ``compat``.

torch 2.11 and 2.13's ``PipelineStage.perform_reduce_grad`` finalizes an FSDP2 stage through
its composable state: ``fully_shard.state(module)._state_ctx.all_states``, each state's
parameter groups' ``post_backward()`` (``_fsdp_param_groups`` from 2.13, ``_fsdp_param_group``
in 2.11), then ``_root_post_backward_final_callback()``. torch 2.15 calls
``finalize_backward(async_op=True)`` on the module instead.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch.distributed._composable.contract  # noqa: F401  (the module, for its STATE_KEY)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn import Module

__all__ = ["root_mesh", "pipeline_stage_state"]

_CONTRACT = sys.modules["torch.distributed._composable.contract"]


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself when it was not)."""
    return mesh._get_root_mesh()


class _StageState:
    """The composable state torch 2.11 and 2.13's ``PipelineStage`` reads of a stage module:
    one parameter group, whose ``post_backward`` is ``finalize``."""

    def __init__(self, finalize: Callable[[], object]):
        group = types.SimpleNamespace(post_backward=finalize)
        self._state_ctx = types.SimpleNamespace(all_states=[self])
        self._fsdp_param_groups = [group]
        self._fsdp_param_group = group

    def _root_post_backward_final_callback(self) -> None:
        return None


def pipeline_stage_state(module: Module, finalize: Callable[[], object]) -> None:
    """Make ``fully_shard.state(module)`` the state torch 2.11 and 2.13's ``PipelineStage`` reads
    to finalize a stage: it calls ``finalize()`` once."""
    states = module.__dict__.setdefault(_CONTRACT.STATE_KEY, {})
    states[fully_shard.__wrapped__] = _StageState(finalize)  # type: ignore[attr-defined]
