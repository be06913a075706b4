"""Pure, traceable optimizer updates for :mod:`compiled_hooks.zero`, with hyperparameters as
tensors.

:func:`update` is ``update(param, grad, state, s, rule) -> (new_param, new_state)`` on tensors of
any shape: no in-place writes, no Python branches on tensor values. ``state`` maps the names
torch.optim uses (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) to tensors of the
parameter's shape. Two things drive it:

- ``rule`` (:class:`Rule`): the Python-level shape of the update (which optimizer, whether SGD
  keeps a momentum buffer, whether weight decay is added to the gradient). It is fixed per
  parameter group when the optimizer is built; the traced code branches on it.
- ``s``: one member's row of :func:`step_scalars`, float64 tensors read when the graph runs: the
  step number *after* this update (1 on the first step), Adam's bias terms and every
  hyperparameter of :data:`COLUMNS`. A learning-rate schedule changes these values, never the
  graph.

The formulas are those of torch.optim's single-tensor implementations (``foreach=False``), with
every scalar torch computes in Python (``1 - beta1``, ``lr / (1 - beta1**t)``, ``1 - lr * wd``)
computed in float64 and then cast to the parameter's dtype, as torch's kernels cast a Python
scalar, so results agree to rounding (within 1e-6 relative after several steps in fp32; not bit
for bit, since torch's kernels fuse differently).

Every update is ``new = param * decay - scale * direction``, where only ``direction`` reads the
gradient and the state; :func:`direction_rule` says when ``direction`` does not read the
parameter, so ZeRO can compute it on the owner alone (see :mod:`compiled_hooks.zero`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "COLUMNS",
    "DIRECTION_COLUMNS",
    "UNSUPPORTED",
    "Rule",
    "apply",
    "check_change",
    "direction_rule",
    "group_hyperparameters",
    "rule_of",
    "state_names",
    "step_scalars",
    "table_row",
    "update",
]

Hp = dict[str, Any]
State = dict[str, torch.Tensor]

# the hyperparameters that enter the traced step as tensors, one table column each
COLUMNS = ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "dampening")
# step_scalars' columns: the step, Adam's two bias terms, then COLUMNS
SCALARS = ("step", "step_size", "bias_correction2_sqrt") + COLUMNS
_AT = {name: i for i, name in enumerate(SCALARS)}


def _s(s: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    value = s[_AT[name]]
    return value if dtype is None else value.to(dtype)


@dataclass(frozen=True)
class Rule:
    """What a traced update branches on, per parameter group, fixed when the optimizer is built.

    ``momentum``: SGD keeps a momentum buffer (``momentum != 0``); ``coupled_decay``: weight decay
    is added to the gradient (Adam's and SGD's ``weight_decay != 0``); ``decoupled``: AdamW."""

    optimizer_class: type
    momentum: bool = False
    nesterov: bool = False
    coupled_decay: bool = False
    decoupled: bool = False


UNSUPPORTED = {
    "maximize": False,
    "amsgrad": False,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}


def group_hyperparameters(optimizer_class: type, defaults: Hp, group: Hp) -> Hp:
    """A parameter group's hyperparameters (``group``'s over ``defaults``, the keyword arguments
    the optimizer was built with), completed and validated by ``optimizer_class`` itself;
    options the traced updates do not implement are refused with ``ValueError``."""
    if optimizer_class not in DIRECTIONS:
        raise TypeError(
            "ZeroOptimizer supports torch.optim.SGD, Adam and AdamW, got "
            f"{getattr(optimizer_class, '__name__', optimizer_class)}"
        )
    accepted = set(inspect.signature(optimizer_class).parameters) - {"params"}
    # a group may hold other keys
    given = {
        **defaults,
        **{k: v for k, v in group.items() if k in accepted},
    }
    # torch's own argument checks
    probe = optimizer_class([torch.zeros(1, requires_grad=True)], **given)
    hp = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
    for name, default in UNSUPPORTED.items():
        if name in hp and hp[name] not in (default, False, None):
            raise ValueError(
                f"ZeroOptimizer: {optimizer_class.__name__}({name}={hp[name]!r}) is not supported"
            )
    for name in ("lr", "weight_decay", "eps", "momentum", "dampening"):
        if isinstance(hp.get(name), torch.Tensor):
            hp[name] = float(hp[name])
    return hp


def rule_of(optimizer_class: type, hp: Hp) -> Rule:
    if optimizer_class is torch.optim.SGD:
        return Rule(
            optimizer_class,
            momentum=hp["momentum"] != 0,
            nesterov=hp["nesterov"],
            coupled_decay=hp["weight_decay"] != 0,
        )
    # Adam's flag makes it AdamW
    if optimizer_class is torch.optim.AdamW or hp.get("decoupled_weight_decay"):
        return Rule(optimizer_class, decoupled=True)
    return Rule(optimizer_class, coupled_decay=hp["weight_decay"] != 0)


def table_row(hp: Hp) -> list[float]:
    """A group's values of :data:`COLUMNS` (0 where the optimizer has no such hyperparameter)."""
    beta1, beta2 = hp.get("betas", (0.0, 0.0))
    values = {**hp, "beta1": beta1, "beta2": beta2}
    return [float(values.get(name, 0.0)) for name in COLUMNS]


def check_change(optimizer_class: type, rule: Rule, hp: Hp, group: int) -> None:
    """Raise ``ValueError`` if the hyperparameters ``hp`` of group ``group`` (just changed, e.g.
    by a scheduler) need another :class:`Rule`: the traced step was built for this one."""
    new = rule_of(optimizer_class, hp)
    if new != rule:
        changed = [
            f"{name} {getattr(rule, name)} -> {getattr(new, name)}"
            for name in ("momentum", "nesterov", "coupled_decay")
            if getattr(rule, name) != getattr(new, name)
        ]
        raise ValueError(
            f"ZeroOptimizer: parameter group {group} changed its update's form "
            f"({', '.join(changed)}: momentum and weight_decay may change but not become 0 or "
            "stop being 0, nesterov may not change); the step is built for the form the group "
            "had when the optimizer was built"
        )
    for name, default in UNSUPPORTED.items():
        if name in hp and hp[name] not in (default, False, None):
            raise ValueError(
                f"ZeroOptimizer: parameter group {group}: {name}={hp[name]!r} is not supported"
            )


def step_scalars(table: torch.Tensor, steps: torch.Tensor, bias_terms: bool = True) -> torch.Tensor:
    """``[len(steps), len(SCALARS)]`` float64: per member, its step number, Adam's two bias
    terms (``lr / (1 - beta1**t)``, ``sqrt(1 - beta2**t)``) and its group's row of the
    hyperparameter ``table`` (rows of :data:`COLUMNS`).

    Computed once for a bucket of parameters, so that a compiled update reads a few scalars per
    parameter: computed inside each parameter's update, Inductor's CPU kernels evaluate the two
    float64 powers once per vector of 8 elements. ``exp(t * log(beta))`` rather than
    ``beta**t``: Inductor keeps a result with ``exp`` that has several readers in a buffer of its
    own instead of inlining it into each reader; the two agree to float64 rounding (``beta = 0``
    gives ``exp(-inf) = 0`` for ``t >= 1``, as ``0**t``). ``bias_terms=False`` (SGD): ``lr`` and 1
    in their place."""
    lr, beta1, beta2 = (table[:, COLUMNS.index(name)] for name in ("lr", "beta1", "beta2"))
    if not bias_terms:
        return torch.cat([torch.stack([steps, lr, torch.ones_like(lr)], dim=1), table], dim=1)
    bias_correction1 = 1 - torch.exp(steps * torch.log(beta1))
    bias_correction2 = 1 - torch.exp(steps * torch.log(beta2))
    return torch.cat(
        [torch.stack([steps, lr / bias_correction1, bias_correction2.sqrt()], dim=1), table], dim=1
    )


def _sgd_direction(g: torch.Tensor, state: State, s: torch.Tensor, rule: Rule):
    if rule.momentum:
        momentum = _s(s, "momentum", g.dtype)
        # torch starts the buffer as a copy of the first gradient (undamped)
        buf = torch.where(
            _s(s, "step") == 1,
            g,
            state["momentum_buffer"] * momentum + (1 - _s(s, "dampening")).to(g.dtype) * g,
        )
        state = {"momentum_buffer": buf}
        g = g + momentum * buf if rule.nesterov else buf
    return g, state


def _adam_direction(g: torch.Tensor, state: State, s: torch.Tensor, rule: Rule):
    beta2 = _s(s, "beta2")
    exp_avg = torch.lerp(state["exp_avg"], g, (1 - _s(s, "beta1")).to(g.dtype))
    exp_avg_sq = state["exp_avg_sq"] * beta2.to(g.dtype) + (1 - beta2).to(g.dtype) * g * g
    denom = exp_avg_sq.sqrt() / _s(s, "bias_correction2_sqrt", g.dtype) + _s(s, "eps", g.dtype)
    return exp_avg / denom, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _scale(s: torch.Tensor, rule: Rule, dtype: torch.dtype) -> torch.Tensor:
    """What multiplies the direction: Adam's ``lr / (1 - beta1**t)``, SGD's ``lr``."""
    return _s(s, "lr" if rule.optimizer_class is torch.optim.SGD else "step_size", dtype)


def apply(p: torch.Tensor, direction: torch.Tensor, s: torch.Tensor, rule: Rule) -> torch.Tensor:
    """``p * decay - scale * direction`` (``decay = 1 - lr * wd`` for AdamW, else none)."""
    if rule.decoupled:
        p = p * (1 - _s(s, "lr") * _s(s, "weight_decay")).to(p.dtype)
    return p - _scale(s, rule, p.dtype) * direction


def update(p: torch.Tensor, g: torch.Tensor, state: State, s: torch.Tensor, rule: Rule):
    """``(new_param, new_state)``: the whole update of ``p``."""
    if rule.coupled_decay:
        g = g + _s(s, "weight_decay", g.dtype) * p
    direction, state = DIRECTIONS[rule.optimizer_class](g, state, s, rule)
    return apply(p, direction, s, rule), state


DIRECTIONS: dict[type, Callable[..., tuple[torch.Tensor, State]]] = {
    torch.optim.SGD: _sgd_direction,
    torch.optim.Adam: _adam_direction,
    torch.optim.AdamW: _adam_direction,
}
# the COLUMNS each direction reads
DIRECTION_COLUMNS = {
    torch.optim.SGD: ("momentum", "dampening"),
    torch.optim.Adam: ("beta1", "beta2", "eps"),
    torch.optim.AdamW: ("beta1", "beta2", "eps"),
}


def direction_rule(rule: Rule) -> Callable[..., tuple[torch.Tensor, State]] | None:
    """``direction(grad, state, s, rule)`` where the update with ``rule`` reads the parameter
    only in :func:`apply` (AdamW; Adam and SGD without weight decay; theirs adds ``wd * param``
    to the gradient); ``None`` otherwise. Lets ZeRO compute the direction on the owner alone
    and apply it on every rank."""
    return None if rule.coupled_decay else DIRECTIONS[rule.optimizer_class]


def state_names(rule: Rule) -> tuple[str, ...]:
    """The per-element state tensors the update keeps."""
    if rule.optimizer_class is torch.optim.SGD:
        return ("momentum_buffer",) if rule.momentum else ()
    return ("exp_avg", "exp_avg_sq")
