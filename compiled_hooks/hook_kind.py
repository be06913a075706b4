"""What a communication hook is, decided once from its signature, for every adapter.

DDP (:func:`compiled_hooks.ddp_comm_hook`), FSDP (:func:`compiled_hooks.fsdp.register_comm_hook`)
and ZeRO (:func:`compiled_hooks.zero.hook_with_zero_step`) each accept some kinds of hook and
refuse the others before any collective; they all ask :func:`hook_kind`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["HookKind", "hook_kind", "give_reduce_async", "reduce_async_of", "mark_wrapper"]


@dataclass(frozen=True)
class HookKind:
    """How ``fn`` can be called.

    - ``all_reduce``: as ``hook(state, grad)``, reducing a whole gradient in place
      (``allreduce_hook``, the compression hooks);
    - ``reduce_scatter``: as ``hook(state, grad, output)``, leaving this rank's shard in
      ``output`` (``reduce_scatter_hook``, the compression hooks);
    - ``per_parameter``: it takes ``param=`` and keeps state per parameter (``powerSGD_hook``);
    - ``grad_bucket``: a DDP comm hook, ``hook(state, bucket: GradBucket) -> Future`` (torch's
      ``ddp_comm_hooks``), which only DDP's C++ reducer can call;
    - ``reduce_async``: its form for DDP's C++ reducer (``hook.reduce_async``), if any.

    ``fn`` is the hook itself: for a :func:`compiled_hooks.ddp_comm_hook` wrapper, the hook it
    wraps."""

    fn: Callable[..., Any]
    name: str
    all_reduce: bool
    reduce_scatter: bool
    per_parameter: bool
    grad_bucket: bool
    reduce_async: Callable[..., Any] | None


def hook_kind(hook: Any, caller: str) -> HookKind:
    """Classify ``hook``; ``TypeError`` naming ``caller`` if it is not callable."""
    if not callable(hook):
        raise TypeError(f"{caller}: hook must be callable, got {type(hook).__name__}.")
    fn = getattr(hook, "tensor_hook", hook)  # mark_wrapper(ddp_comm_hook(h), h): h
    params = inspect.signature(fn).parameters
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    required, accepted = sum(p.default is p.empty for p in positional), len(positional)
    return HookKind(
        fn=fn,
        name=getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn))),
        all_reduce=required <= 2 <= accepted,
        reduce_scatter=required <= 3 <= accepted,
        per_parameter="param" in params,
        grad_bucket=len(positional) >= 2 and positional[1].name == "bucket",
        reduce_async=reduce_async_of(fn),
    )


def give_reduce_async(hook: Callable[..., Any], reduce_async: Callable[..., Any]) -> None:
    """Make ``reduce_async(state, grad) -> Future`` the form of ``hook`` for DDP's C++ reducer,
    public as ``hook.reduce_async`` and read by :func:`hook_kind`."""
    setattr(hook, "reduce_async", reduce_async)  # noqa: B010 - a function object's attribute


def reduce_async_of(hook: Callable[..., Any]) -> Callable[..., Any] | None:
    """The form :func:`give_reduce_async` gave ``hook``, if any (cheap: no signature read)."""
    return getattr(hook, "reduce_async", None)


def mark_wrapper(wrapper: Callable[..., Any], hook: Callable[..., Any]) -> None:
    """Mark ``wrapper`` as calling ``hook``, which :func:`hook_kind` then classifies."""
    setattr(wrapper, "tensor_hook", hook)  # noqa: B010 - a function object's attribute
