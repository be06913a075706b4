"""Autograd's engine, compiled autograd, DDP's reducer and DTensor's ``to_local`` backward, as
torch's internals give them. Part of :mod:`compiled_hooks.compat`, which re-exports every name
here; read them through ``compat``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import Any, Final

import torch
from torch.autograd import Variable

__all__ = [
    "in_backward",
    "queue_backward_callback",
    "run_post_accumulate_grad_hooks",
    "compiled_autograd_enabled",
    "python_reducer",
    "set_python_reducer",
    "ddp_uses_python_reducer",
    "ddp_first_bucket_bytes",
    "to_local_keeps_none_gradients",
]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (an activation
    checkpoint's recompute runs inside one)."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward ends (call it inside one)."""
    Variable._execution_engine.queue_callback(callback)


def run_post_accumulate_grad_hooks(t: torch.Tensor) -> None:
    """Run the post-accumulate-grad hooks registered on ``t``, as autograd runs them after it
    accumulates into ``t.grad``."""
    for hook in (t._post_accumulate_grad_hooks or {}).values():
        hook(t)


_PYTHON_REDUCER: Final = "python_reducer"


def compiled_autograd_enabled(
    compiler_fn: Callable[..., Any],
) -> contextlib.AbstractContextManager[None]:
    """Backward passes in the block run under compiled autograd, with ``compiler_fn``."""
    return torch._dynamo.compiled_autograd._enable(compiler_fn)


def python_reducer() -> bool:
    """Whether Dynamo compiles DDP with the python reducer (``optimize_ddp = "python_reducer"``)."""
    return torch._dynamo.config.optimize_ddp == _PYTHON_REDUCER


def set_python_reducer() -> None:
    """Make DDP models built from now on use the python reducer, which compiled autograd traces."""
    torch._dynamo.config.optimize_ddp = _PYTHON_REDUCER


def ddp_uses_python_reducer(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    return bool(ddp._use_python_reducer)


def ddp_first_bucket_bytes(ddp: torch.nn.parallel.DistributedDataParallel) -> int:
    """The bytes of ``ddp``'s first gradient bucket (its bucket cap where torch keeps none
    apart)."""
    config = getattr(ddp, "_bucket_config", None)
    return int(getattr(config, "first_bucket_bytes_cap", ddp.bucket_bytes_cap))


class _Context:
    materialize = True

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize = value


@functools.cache
def to_local_keeps_none_gradients() -> bool:
    """Whether ``DTensor.to_local()``'s backward passes on a gradient that is None as None (from
    torch 2.13): torch 2.11's makes it zeros, so a parameter whose gathered copy a traced backward
    gives no gradient gets a gradient of zeros, where a None skips its optimizer step. Read by
    running the function's forward on a stand-in."""
    from torch.distributed.tensor._api import _ToTorchTensor

    ctx, local = _Context(), torch.zeros(1)
    stand_in = types.SimpleNamespace(_spec=None, _local_tensor=local)
    try:
        _ToTorchTensor.forward(ctx, stand_in, None)  # type: ignore[arg-type]
    except Exception:  # a forward that reads more of a DTensor: assume zeros
        return False
    return not ctx.materialize
