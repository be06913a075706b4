"""Pure, traceable optimizer updates for :mod:`compiled_hooks.zero`.

Each update is ``update(param, grad, state, step, hp) -> (new_param, new_state)`` on tensors of
any shape: no in-place writes, no Python branches on tensor values, so one traced graph serves
every rank and every step. ``step`` is the row of :func:`step_scalars` for the step number
*after* this update (1 on the first step); ``state`` maps the names torch.optim uses (``momentum_buffer``,
``exp_avg``, ``exp_avg_sq``) to tensors of the parameter's shape. The formulas are those of
torch.optim's single-tensor implementations (``foreach=False``), with the bias corrections
computed in float64 like torch's Python floats, so results agree to rounding (within 1e-6
relative after several steps in fp32; not bit for bit, since torch's kernels fuse differently).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["UPDATES", "delta_rule", "state_names", "hyperparameters", "step_scalars"]

Hp = dict[str, Any]
State = dict[str, torch.Tensor]


def step_scalars(hp: Hp, steps: torch.Tensor) -> torch.Tensor:
    """``[len(steps), 3]`` float64: per step number, the step itself and Adam's two bias
    terms (``lr / (1 - beta1**t)``, ``sqrt(1 - beta2**t)``; SGD reads only the step).

    Computed once for a bucket of parameters, so that a compiled update reads three scalars per
    parameter: computed inside each parameter's update, Inductor's CPU kernels evaluate the two
    float64 powers once per vector of 8 elements. ``exp(t * log(beta))`` rather than
    ``beta**t``: Inductor keeps a result with ``exp`` that has several readers in a buffer of its
    own instead of inlining it into each reader; the two agree to float64 rounding."""
    beta1, beta2 = hp.get("betas", (0.0, 0.0))
    bias_correction1 = 1 - torch.exp(steps * math.log(beta1)) if beta1 > 0 else torch.ones_like(steps)
    bias_correction2 = 1 - torch.exp(steps * math.log(beta2)) if beta2 > 0 else torch.ones_like(steps)
    return torch.stack([steps, hp["lr"] / bias_correction1, bias_correction2.sqrt()], dim=1)


def _sgd_delta(g: torch.Tensor, state: State, step: torch.Tensor, hp: Hp):
    if hp["momentum"] != 0:
        # torch starts the buffer as a copy of the first gradient (undamped)
        buf = torch.where(step[0] == 1, g, state["momentum_buffer"] * hp["momentum"] + (1 - hp["dampening"]) * g)
        state = {"momentum_buffer": buf}
        g = g + hp["momentum"] * buf if hp["nesterov"] else buf
    return hp["lr"] * g, state


def _sgd(p: torch.Tensor, g: torch.Tensor, state: State, step: torch.Tensor, hp: Hp):
    if hp["weight_decay"] != 0:
        g = g + hp["weight_decay"] * p
    delta, state = _sgd_delta(g, state, step, hp)
    return p - delta, state


def _adam_delta(g: torch.Tensor, state: State, step: torch.Tensor, hp: Hp):
    (beta1, beta2), eps = hp["betas"], hp["eps"]
    exp_avg = torch.lerp(state["exp_avg"], g, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
    step_size, bias_correction2_sqrt = step[1].to(g.dtype), step[2].to(g.dtype)
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    return step_size * (exp_avg / denom), {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _adam(p: torch.Tensor, g: torch.Tensor, state: State, step: torch.Tensor, hp: Hp, decoupled: bool = False):
    wd = hp["weight_decay"]
    if wd != 0:
        if decoupled:
            p = p * (1 - hp["lr"] * wd)
        else:
            g = g + wd * p
    delta, state = _adam_delta(g, state, step, hp)
    return p - delta, state


def _adamw(p, g, state, step, hp):
    return _adam(p, g, state, step, hp, decoupled=True)


UPDATES: dict[type, Callable[..., tuple[torch.Tensor, State]]] = {
    torch.optim.SGD: _sgd,
    torch.optim.Adam: _adam,
    torch.optim.AdamW: _adamw,
}


def delta_rule(optimizer_class: type, hp: Hp) -> tuple[float, Callable[..., tuple[torch.Tensor, State]]] | None:
    """``(decay, delta)`` where ``optimizer_class``'s update with ``hp`` reads the parameter only
    as ``new = param * decay - delta(grad, state, step, hp)`` (the same arithmetic as
    :data:`UPDATES`): AdamW, and Adam or SGD without weight decay (theirs adds ``wd * param`` to
    the gradient). ``None`` otherwise. Lets ZeRO compute ``delta`` on the owner alone and apply
    it to the parameter on every rank."""
    wd = hp["weight_decay"]
    if optimizer_class is torch.optim.AdamW:
        return 1 - hp["lr"] * wd, _adam_delta
    if wd != 0:
        return None
    return 1.0, _adam_delta if optimizer_class is torch.optim.Adam else _sgd_delta


_UNSUPPORTED = {"maximize": False, "amsgrad": False, "capturable": False, "differentiable": False, "fused": None}


def state_names(optimizer_class: type, hp: Hp) -> tuple[str, ...]:
    """The per-element state tensors ``optimizer_class`` keeps with hyperparameters ``hp``."""
    if optimizer_class is torch.optim.SGD:
        return ("momentum_buffer",) if hp["momentum"] != 0 else ()
    return ("exp_avg", "exp_avg_sq")


def hyperparameters(optimizer_class: type, defaults: Hp) -> Hp:
    """``defaults`` completed and validated by ``optimizer_class`` itself; options the traced
    updates do not implement are refused with ``ValueError``."""
    if optimizer_class not in UPDATES:
        raise TypeError(
            f"ZeroOptimizer supports torch.optim.SGD, Adam and AdamW, got {getattr(optimizer_class, '__name__', optimizer_class)}"
        )
    probe = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)  # torch's own argument checks
    hp = dict(probe.defaults)
    for name, default in _UNSUPPORTED.items():
        if name in hp and hp[name] not in (default, False, None):
            raise ValueError(f"ZeroOptimizer: {optimizer_class.__name__}({name}={hp[name]!r}) is not supported")
    if isinstance(hp["lr"], torch.Tensor):
        raise ValueError("ZeroOptimizer: a tensor lr is not supported; pass a float")
    return hp
