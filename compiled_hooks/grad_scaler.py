"""ShardedGradScaler without host synchronisation, traceable by torch.compile.

Same constructor, methods, scale rules and misuse errors as
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``. What differs is where the
decisions are made:

- ``unscale_`` multiplies the gradients by ``1 / scale`` and sets a per-device inf/nan flag
  with plain tensor ops, then combines the flags across ranks with a functional ``all_reduce``
  (sum, as the original), so every rank holds the same flag;
- ``step`` always runs ``optimizer.step()`` and then keeps, with ``torch.where``, either the
  new or the old values of every parameter and optimizer-state tensor: with the flag set,
  parameters and state are exactly what they were, as if the step was skipped. No ``.item()``.
  State the step creates (first step) falls back to zeros, which is what SGD (momentum,
  ``dampening=0``), Adam and AdamW create on their first real step; optimizers whose first
  state is not zeros are refused;
- ``update`` applies the growth/backoff rule with ``torch.where`` on the scale and growth
  tracker tensors.

``get_scale()`` and ``state_dict()`` return Python numbers like the original, so they read
the device (call them outside the compiled step). The cost of ``step`` is one copy of the
parameters and optimizer state for the duration of the step. Under ``torch.compile`` the
optimizer's step runs without torch.optim's wrapper (whose deliberate graph breaks would end a
``fullgraph`` compile), so optimizer step pre/post hooks do not run there.
"""

from __future__ import annotations

import enum
import inspect
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

__all__ = ["ShardedGradScaler"]

_ZERO_FIRST_STATE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 gradients and parameters), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``optimizer.step()``. Under torch.compile, the step without torch.optim's wrappers, which
    insert deliberate graph breaks around it (and run step hooks and profiler ranges); it runs
    under ``no_grad`` as the wrapper would."""
    if torch.compiler.is_compiling():
        with torch.no_grad():
            return inspect.unwrap(type(optimizer).step)(optimizer, *args, **kwargs)
    return optimizer.step(*args, **kwargs)


class ShardedGradScaler:
    """Gradient scaling for mixed-precision training on many ranks; see the module docstring.

    ``process_group=None`` means the default group at the time of use (the original's default,
    ``dist.group.WORLD``, is read when torch is imported).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if growth_factor <= 1.0:
            raise ValueError(f"The growth factor must be > 1.0, got {growth_factor}.")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"The backoff factor must be in (0, 1), got {backoff_factor}.")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}.")
        self._device = device
        self._enabled = enabled
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self.process_group = process_group
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(self._fresh_state)

    @staticmethod
    def _fresh_state() -> dict[str, Any]:
        return {"stage": _Stage.READY, "found_inf": None}

    # --- scale ----------------------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        self._scale = torch.full((1,), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full(
            (1,), self._init_growth_tracker, dtype=torch.int32, device=device
        )

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply ``outputs`` (a tensor or nested list/tuple of tensors) by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            assert self._scale is not None, "made by _lazy_init"
            return (outputs * self._scale.to(outputs.device)).type(outputs.dtype)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _check_initialized(self, what: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(
                f"Attempted {what} but the scale is not initialized: call scale() first."
            )
        return self._scale

    # --- unscale --------------------------------------------------------------------------

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record on every rank
        whether any rank found an inf or nan."""
        if not self._enabled:
            return
        scale = self._check_initialized("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = scale.double().reciprocal().float()
        grads: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("ShardedGradScaler: sparse gradients are not supported.")
                g = _local(p.grad)
                grads[g.device].append(g)
        found = torch.zeros((1,), dtype=torch.float32, device=scale.device)
        with torch.no_grad():
            for device, gs in grads.items():
                # before unscaling
                bad = torch.stack([(~torch.isfinite(g)).any() for g in gs]).any()
                torch._foreach_mul_(gs, inv_scale.to(device).reshape(()))
                found = found + bad.to(device=scale.device, dtype=torch.float32)
        pg = self.process_group if self.process_group is not None else dist.group.WORLD
        if pg is not None and dist.get_world_size(pg) > 1:
            found = fcol.all_reduce(found, "sum", pg)
        state["found_inf"] = found
        state["stage"] = _Stage.UNSCALED

    # --- step -----------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``, undone on every rank if any rank found an inf or nan."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if not isinstance(optimizer, _ZERO_FIRST_STATE):
            raise TypeError(
                "ShardedGradScaler.step supports "
                f"{', '.join(c.__name__ for c in _ZERO_FIRST_STATE)}; got "
                f"{type(optimizer).__name__}, whose skipped steps could not be undone exactly."
            )
        if isinstance(optimizer, torch.optim.SGD) and any(
            g.get("dampening", 0) != 0 for g in optimizer.param_groups
        ):
            raise ValueError(
                "ShardedGradScaler.step: SGD with dampening != 0 is not supported (its first "
                "momentum buffer is not zeros, so a skipped first step could not be undone)."
            )
        self._check_initialized("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        skip = (state["found_inf"] > 0).reshape(())

        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        old_params = [_local(p).detach().clone() for p in params]
        old_state = {
            id(p): {
                k: v.detach().clone()
                for k, v in optimizer.state[p].items()
                if isinstance(v, torch.Tensor)
            }
            for p in params
        }
        result = _optimizer_step(optimizer, *args, **kwargs)
        with torch.no_grad():
            for p, old in zip(params, old_params):
                new = _local(p)
                new.copy_(torch.where(skip.to(new.device), old, new))
            for p in params:
                before = old_state[id(p)]
                for k, v in optimizer.state[p].items():
                    if isinstance(v, torch.Tensor):
                        # None: created by this step; an untouched optimizer starts from zeros
                        was = before.get(k)
                        was = torch.zeros_like(v) if was is None else was
                        v_local = _local(v)
                        v_local.copy_(torch.where(skip.to(v_local.device), _local(was), v_local))
        state["stage"] = _Stage.STEPPED
        return result

    # --- update ---------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off if any step this iteration was skipped, grow it after
        ``growth_interval`` clean iterations; or set it to ``new_scale``."""
        if not self._enabled:
            return
        scale = self._check_initialized("update")
        tracker = self._growth_tracker
        assert tracker is not None, "made with the scale"
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError(
                        "new_scale must be a float or a 1-element tensor with requires_grad=False."
                    )
                scale.copy_(new_scale.to(scale.device).reshape(1))
            else:
                scale.fill_(float(new_scale))
        else:
            found = [
                s["found_inf"]
                for s in self._per_optimizer_states.values()
                if s["found_inf"] is not None
            ]
            if not found:
                raise RuntimeError("No inf checks were recorded prior to update.")
            bad = torch.stack([f.to(scale.device) for f in found]).sum(0) > 0
            grown = tracker + 1
            grow = grown >= self._growth_interval
            bigger = scale * self._growth_factor
            grow_ok = grow & torch.isfinite(bigger)
            new = torch.where(
                bad, scale * self._backoff_factor, torch.where(grow_ok, bigger, scale)
            )
            new_tracker = torch.where(bad | grow, torch.zeros_like(tracker), grown)
            scale.copy_(new)
            tracker.copy_(new_tracker)
        self._per_optimizer_states = defaultdict(self._fresh_state)

    # --- queries and checkpoints (these read the device) ------------------------------------

    def get_scale(self) -> float:
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def _get_growth_tracker(self) -> int:
        return (
            self._init_growth_tracker
            if self._growth_tracker is None
            else int(self._growth_tracker.item())
        )

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def state_dict(self) -> dict[str, Any]:
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._scale is not None and self._growth_tracker is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
