"""DistributedDataParallel adapter and the one supported way to compile DDP with a hook.

DDP calls a comm hook in two ways:

* C++ reducer (eager DDP, and ``torch.compile(DDP)`` with Dynamo's default
  ``optimize_ddp="ddp_optimizer"``): ``hook(state, bucket: GradBucket) -> Future[Tensor]``,
  once per bucket, in bucket order; the future must hold the bucket's new flat buffer, and
  the backward goes on while it is pending.
* Python reducer (``torch._dynamo.config.optimize_ddp = "python_reducer"``, backward under
  compiled autograd): ``hook(state, (param.grad, param))`` once per parameter, return value
  ignored; the hook must update ``param.grad`` in place. Compiled autograd traces these calls
  into the backward graph, so functional collectives are required.

:func:`ddp_comm_hook` turns a hook of this package (``hook(state, grad)``) into one callable
that serves both. :func:`compile_ddp` and :func:`compiled_autograd` set the flags a compiled
DDP step needs, in the order it needs them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from . import compat
from .hook_kind import hook_kind, mark_wrapper, reduce_async_of

__all__ = ["ddp_comm_hook", "compile_ddp", "compiled_autograd"]


def ddp_comm_hook(hook: Callable[..., Any]) -> Callable[[Any, Any], Any]:
    """Wrap ``hook(state, grad)`` for ``DistributedDataParallel.register_comm_hook(state, ...)``.

    The wrapper's second parameter is named ``bucket`` (DDP checks that name).

    * With a ``GradBucket`` (C++ reducer) it returns a pending future, as torch's own hooks do:
      this package's hooks have an async form (``hook.reduce_async``) that issues the bucket's
      collective and runs the rest (post-division, the cast back) as the future's
      continuation, so DDP goes on with the backward while the bucket is on the wire. Any
      other ``hook(state, grad)`` runs to completion on the bucket's flat buffer, and the
      returned future is already done.
    * With ``(grad, param)`` (python reducer) it runs ``hook`` on ``grad`` in place.

    Hooks that need an ``output`` shard (``reduce_scatter_hook``) are refused: DDP all-reduces.
    A hook with a keyword parameter ``param`` keeps state per parameter
    (:func:`compiled_hooks.powersgd.powerSGD_hook`): it is called once per gradient with its
    parameter (python reducer), or given the whole bucket (its async form).
    """
    kind = hook_kind(hook, "ddp_comm_hook")
    if not kind.all_reduce or kind.grad_bucket:
        raise TypeError(
            f"ddp_comm_hook: {kind.name!r} must be callable as hook(state, grad); DDP all-reduces "
            "whole gradients, so reduce-scatter hooks (which need an output shard) do not apply, "
            "and a DDP comm hook (state, bucket) registers with DDP directly."
        )
    hook = kind.fn
    per_parameter, reduce_async = kind.per_parameter, kind.reduce_async

    # No annotations (and no functools.wraps, which would copy the hook's): DDP accepts only
    # GradBucket / Future[Tensor] ones, and this wrapper also takes (grad, param) tuples.
    def ddp_hook(state, bucket):
        if isinstance(bucket, tuple):  # python reducer: (param.grad, param)
            if per_parameter:
                hook(state, bucket[0], param=bucket[1])
            else:
                hook(state, bucket[0])
            return None
        if not per_parameter:
            return reduce_buffer(hook, state, bucket.buffer())
        if reduce_async is not None:  # it takes the whole bucket
            return reduce_async(state, bucket)
        # views of the bucket's buffer
        for grad, param in zip(bucket.gradients(), bucket.parameters()):
            hook(state, grad, param=param)
        return completed(bucket.buffer())

    # DDP refuses any hook named "bf16_compress_hook" unless CUDA+NCCL is present, and reads
    # __qualname__ for its logs; a distinct name keeps both right.
    ddp_hook.__name__ = f"ddp_{hook.__name__}"
    ddp_hook.__qualname__ = f"ddp_comm_hook({getattr(hook, '__qualname__', hook.__name__)})"
    ddp_hook.__doc__ = hook.__doc__
    # what hook_with_zero_step unwraps: it reduces its own buckets
    mark_wrapper(ddp_hook, hook)
    return ddp_hook


def reduce_buffer(
    hook: Callable[..., Any], state: Any, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """``hook(state, grad)`` on a C++-reducer bucket's flat ``buffer``: its async form
    (``hook.reduce_async``) when it has one, a pending future; else run to completion, a done
    one."""
    reduce_async = reduce_async_of(hook)
    if reduce_async is not None:
        return reduce_async(state, buffer)
    hook(state, buffer)
    return completed(buffer)


def completed(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already done, holding ``t``."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def compile_ddp(
    module: torch.nn.Module,
    state: Any = None,
    hook: Callable[..., Any] | None = None,
    *,
    compile_kwargs: dict[str, Any] | None = None,
    **ddp_kwargs: Any,
) -> tuple[DistributedDataParallel, Callable[..., Any]]:
    """Build DDP in python-reducer mode, register ``hook`` and compile the forward.

    Returns ``(ddp, compiled)``: call ``compiled(...)`` for the forward and run the backward
    inside :func:`compiled_autograd` so the hook's collectives land in the compiled backward
    graph. Sets ``torch._dynamo.config.optimize_ddp = "python_reducer"`` for the process
    (DDP reads it at construction, Dynamo at compile time).

    Example::

        ddp, model = compile_ddp(net, LowPrecisionState(dist.group.WORLD), bf16_compress_hook)
        with compiled_autograd():
            model(x).sum().backward()
    """
    compat.set_python_reducer()
    ddp = DistributedDataParallel(module, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(state, ddp_comm_hook(hook))
    return ddp, torch.compile(ddp, **(compile_kwargs or {}))


@contextlib.contextmanager
def compiled_autograd(**compile_kwargs: Any) -> Iterator[None]:
    """Run backward passes in this block under compiled autograd (``torch.compile`` of the
    autograd graph with ``compile_kwargs``, default Inductor, fullgraph)."""
    if not compat.python_reducer():
        raise RuntimeError(
            "compiled_autograd: set torch._dynamo.config.optimize_ddp = 'python_reducer' before "
            "building DistributedDataParallel (compile_ddp does both); with the C++ reducer DDP's "
            "hooks are not traced by compiled autograd."
        )
    kwargs = {"fullgraph": True, **compile_kwargs}
    with compat.compiled_autograd_enabled(functools.partial(torch.compile, **kwargs)):
        yield
