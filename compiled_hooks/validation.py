"""Checks every hook runs before it issues a collective.

A wrong-sized collective does not raise in gloo: it aborts the process. So everything a
hook can know locally (types, dtypes, devices, sizes) is checked here first, and a bad
call raises ``TypeError``/``ValueError`` naming the argument. All checks read only
static tensor metadata, so under ``torch.compile`` they become guards, not graph breaks.
"""

from __future__ import annotations

import torch

from .state import DefaultState, LowPrecisionState


def check_state(hook: str, state: object, low_precision: bool = False) -> None:
    expected = LowPrecisionState if low_precision else DefaultState
    if not isinstance(state, expected):
        raise TypeError(f"{hook}: state must be a {expected.__name__}, got {type(state).__name__}.")
    if state.process_group is None:
        raise ValueError(
            f"{hook}: state.process_group is None; build the state with an explicit ProcessGroup."
        )


def check_tensor(hook: str, name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{hook}: {name} must be a torch.Tensor, got {type(t).__name__}.")
    # Dynamo refuses to read .layout in an autograd.Function's backward (where data_parallel
    # calls the hooks); every tensor it traces there is strided.
    if not torch.compiler.is_compiling() and t.layout != torch.strided:
        raise TypeError(f"{hook}: {name} must be a dense (strided) tensor, got layout {t.layout}.")
    if not t.is_floating_point():
        raise TypeError(f"{hook}: {name} must be a floating-point tensor, got dtype {t.dtype}.")
    if t.is_leaf and t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{hook}: {name} is a leaf that requires grad; the hook writes its result into it in "
            "place. Pass the gradient (param.grad), not the parameter."
        )


def check_dtype(hook: str, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(
            f"{hook}: {name} has dtype {t.dtype} but the result is {dtype}; pass a {dtype} tensor "
            "(the hook writes in place and never changes a tensor's dtype)."
        )


def check_shard(hook: str, grad: torch.Tensor, output: torch.Tensor, world_size: int) -> None:
    if output.device != grad.device:
        raise ValueError(f"{hook}: output is on {output.device} but grad is on {grad.device}.")
    if grad.numel() != world_size * output.numel():
        raise ValueError(
            f"{hook}: reduce-scatter needs grad.numel() == world_size * output.numel(), got "
            f"grad.numel()={grad.numel()}, world_size={world_size}, "
            f"output.numel()={output.numel()}."
        )
