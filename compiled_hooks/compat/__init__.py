"""The torch internals this distribution relies on across releases, each read in this package and
nowhere else: the names in :data:`OWNED` (FSDP2's in :mod:`.fsdp2`, ``invoke_subgraph``'s in
:mod:`.regions`, pipelining's in :mod:`.pipeline`, autograd's and DDP's in :mod:`.autograd`,
AOTAutograd's cache key of a DTensor in :mod:`.dtensor_cache`; all re-exported here).

The packages support torch 2.11 to 2.15 (:data:`SUPPORTED`). They rely on names that torch
does not promise to keep: functional collectives, FSDP2's parameter groups, Inductor's
custom-pass hook, compiled autograd's entry point, c10d's group registry, the schema of an
``invoke_subgraph`` call. Each is read here only, by feature detection (never by version
strings), so a release that moves one fails in one place (``tests/test_compat.py``: every name
resolves, and no other module reads the internals in :data:`OWNED`). A few private names that
are torch's working interface and the same on every supported release are read where they are
used, outside this claim: ``torch._ops.OpOverload`` (an op's class), Inductor's
``stable_topological_sort`` and ``comms.sink_waits``, Dynamo's ``counters``, AOTAutograd's
config, and the test helpers' fake process group. What differs across the supported range:

=================================  ===============================================================
functional all-gather and          ``all_gather_single`` / ``reduce_scatter_single`` from 2.13;
reduce-scatter                     before, ``all_gather_tensor`` / ``reduce_scatter_tensor`` (the
                                   same ops; 2.13 keeps them as aliases that warn when called
                                   eagerly)
FSDP2 parameter groups of          ``FSDPState._fsdp_param_groups`` (a list) from 2.13;
a module                           ``_fsdp_param_group`` (one group or None) in 2.11
FSDP2 mixed-precision policy       ``FSDPParamGroup.mp_policy`` through 2.14; in 2.15 only per
of a group                         parameter (``FSDPParam.mp_policy``), which every release has
Inductor's custom post-grad pass   one pass or a list of them from 2.13; one pass in 2.11 (several
                                   become one ``CustomGraphPass`` that runs them in order)
=================================  ===============================================================

A feature that a release lacks outright raises :class:`UnsupportedTorch` where it is used,
naming the feature, the torch it needs and the torch running.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch._guards as _guards
import torch._inductor.config as inductor_config
import torch._inductor.custom_graph_pass as _custom_graph_pass
import torch._logging._internal as _logging_internal
import torch._subclasses.fake_tensor as _fake_tensor
import torch.distributed as dist
import torch.distributed._functional_collectives as _fcol
import torch.distributed.distributed_c10d as _c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import placement_types as _placement_types

from .autograd import (
    compiled_autograd_enabled,
    ddp_first_bucket_bytes,
    ddp_uses_python_reducer,
    in_backward,
    python_reducer,
    queue_backward_callback,
    run_post_accumulate_grad_hooks,
    set_python_reducer,
    to_local_keeps_none_gradients,
)
from .dtensor_cache import dtensor_cache_key, key_dtensors_by_rank
from .fsdp2 import (
    FSDP_GROUPS,
    FSDPGroupLayout,
    FSDPReduceScatter,
    fsdp_accumulated_grad,
    fsdp_all_reduce_grads,
    fsdp_group_layout,
    fsdp_group_reduce_dtypes,
    fsdp_is_root,
    fsdp_param_groups,
    fsdp_take_over_all_reduce,
)
from .pipeline import pipeline_stage_state, root_mesh
from .regions import region_inputs_kept, region_schemas_reused

__all__ = [
    "SUPPORTED",
    "OWNED",
    "UnsupportedTorch",
    "resolved",
    "all_gather_single",
    "reduce_scatter_single",
    "fake_mode",
    "traced",
    "all_gather_into",
    "resolve_process_group",
    "group_size_by_name",
    "in_backward",
    "queue_backward_callback",
    "run_post_accumulate_grad_hooks",
    "fake_tensor_cache_off",
    "register_log",
    "StridedShard",
    "concatenate_meshes",
    "default_group",
    "default_store",
    "group_timeout",
    "compiled_autograd_enabled",
    "python_reducer",
    "set_python_reducer",
    "ddp_uses_python_reducer",
    "ddp_first_bucket_bytes",
    "to_local_keeps_none_gradients",
    "inductor_config",
    "CustomGraphPass",
    "custom_post_pass",
    "set_custom_post_pass",
    "post_passes",
    "post_pass_setting",
    "region_schemas_reused",
    "region_inputs_kept",
    "root_mesh",
    "pipeline_stage_state",
    "key_dtensors_by_rank",
    "dtensor_cache_key",
    "FSDPReduceScatter",
    "FSDPGroupLayout",
    "fsdp_is_root",
    "fsdp_param_groups",
    "fsdp_accumulated_grad",
    "fsdp_group_reduce_dtypes",
    "fsdp_group_layout",
    "fsdp_all_reduce_grads",
    "fsdp_take_over_all_reduce",
]

SUPPORTED = ">=2.11,<2.16"  # pyproject.toml requires torch in this range (tests/test_compat.py)

# The internals only this module reads (tests/test_compat.py scans the packages for them).
# Not reduce_scatter_tensor: that is also the name of the functional op, which every release has.
OWNED = (
    "_get_root_mesh",
    "STATE_KEY",
    "_state_ctx",
    "_root_post_backward_final_callback",
    "unsharded_accumulated_grad",
    "_unsharded_param",
    "SubgraphLowering",
    "bw_donated_idxs",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_tensor",
    "_resolve_process_group",
    "_get_group_size_by_name",
    "_get_default_store",
    "_world",
    "compiled_autograd",
    "optimize_ddp",
    "_use_python_reducer",
    "post_grad_custom_post_pass",
    "custom_graph_pass",
    "CustomGraphPass",
    "_fully_shard",
    "_get_fsdp_state",
    "_fsdp_param_groups",
    "_fsdp_param_group",
    "fsdp_params",
    "mesh_info",
    "_all_reduce_hook",
    "all_reduce_grads",
    "_is_root",
    "_current_graph_task_id",
    "_StridedShard",
    "_concatenate",
    "detect_fake_mode",
    "_higher_order_ops",
    "gen_schema",
    "_bucket_config",
    "_execution_engine",
    "_post_accumulate_grad_hooks",
    "disable_fake_tensor_cache",
    "register_log",
    "_stable_hash_for_caching",
    "_local_tensor",
    "maybe_unwrap_fake_script_object",
    "_ToTorchTensor",
)


class UnsupportedTorch(RuntimeError):
    """A feature the running torch release does not have."""

    def __init__(self, feature: str, needs: str):
        super().__init__(
            f"{feature} needs torch {needs}; this is torch {torch.__version__} (compiled-hooks "
            f"supports torch{SUPPORTED})"
        )


def _first(owner: Any, *names: str) -> str | None:
    """The first of ``names`` that ``owner`` has, None if it has none."""
    return next((name for name in names if hasattr(owner, name)), None)


# Functional collectives ---------------------------------------------------------------------

_ALL_GATHER = _first(_fcol, "all_gather_single", "all_gather_tensor")
_REDUCE_SCATTER = _first(_fcol, "reduce_scatter_single", "reduce_scatter_tensor")


def _collective(name: str | None, feature: str) -> Callable[..., torch.Tensor]:
    if name is None:
        raise UnsupportedTorch(f"the functional {feature}", SUPPORTED)
    return getattr(_fcol, name)


def all_gather_single(t: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
    """``_functional_collectives.all_gather_single``: the ranks' ``t`` joined along
    ``gather_dim`` (rank-major), traced as ``_c10d_functional.all_gather_into_tensor`` and its
    wait. ``t`` is made contiguous first (2.11's form refuses any other).

    Eager, a device tensor on gloo goes through c10d's ``all_gather_into_tensor`` instead, and
    the result is complete on return: gloo runs the functional form as ``allgather_coalesced``,
    which has no device form and reads the device pointer as host memory (the process faults).
    :func:`traced`, the functional form is the one: Inductor cannot lower c10d's.
    """
    gather = _collective(_ALL_GATHER, "all_gather_single")
    t = t.contiguous()
    if not traced(t) and _gathers_off_host_on_gloo(t, group):
        size = dist.get_world_size(group)
        out = t.new_empty((size * t.shape[0], *t.shape[1:]))
        all_gather_into(out, t, group)
        return out if gather_dim == 0 else torch.cat(out.chunk(size), dim=gather_dim)
    return gather(t, gather_dim, group)


# c10d's all-gather into one tensor: ``all_gather_single`` from 2.13 (the old name warns there).
_C10D_ALL_GATHER = _first(dist, "all_gather_single", "all_gather_into_tensor")


def all_gather_into(
    output: torch.Tensor, t: torch.Tensor, group: Any, async_op: bool = False
) -> Any:
    """c10d's all-gather of every rank's ``t`` into ``output`` (rank-major along dim 0); the
    ``Work`` with ``async_op``."""
    return getattr(dist, _C10D_ALL_GATHER or "all_gather_into_tensor")(
        output, t, group=group, async_op=async_op
    )


def _gathers_off_host_on_gloo(t: torch.Tensor, group: Any) -> bool:
    """Whether gloo would all-gather ``t``, a tensor not in host memory, for ``group`` (a
    ``ProcessGroup``; the other group forms answer False)."""
    if t.device.type == "cpu" or not isinstance(group, dist.ProcessGroup):
        return False
    backend = str(dist.get_backend(group))
    return backend == "gloo" or f"{t.device.type}:gloo" in backend


def reduce_scatter_single(
    t: torch.Tensor, reduce_op: str, scatter_dim: int, group: Any
) -> torch.Tensor:
    """``_functional_collectives.reduce_scatter_single``: this rank's block of the reduction
    of the ranks' ``t`` along ``scatter_dim``, traced as
    ``_c10d_functional.reduce_scatter_tensor`` and its wait."""
    return _collective(_REDUCE_SCATTER, "reduce_scatter_single")(t, reduce_op, scatter_dim, group)


def fake_mode(tensors: Any) -> Any:
    """The fake mode of ``tensors`` (fake tensors, or any while a fake mode is active, as
    AOTAutograd traces); None for real tensors outside one."""
    return _guards.detect_fake_mode(tensors)


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is being traced: Dynamo is compiling, or ``t`` is fake (AOTAutograd's trace
    of a custom op's kernel, where torch 2.11 says it is not compiling)."""
    return torch.compiler.is_compiling() or fake_mode(t) is not None


def fake_tensor_cache_off(mode: Any) -> contextlib.AbstractContextManager[None]:
    """``mode``'s cache of fake results off in the block (a pass's new nodes, computed once)."""
    return _fake_tensor.disable_fake_tensor_cache(mode)


def register_log(name: str) -> None:
    """Make ``name`` a log that ``TORCH_LOGS`` turns on, like torch's own."""
    _logging_internal.register_log(name, name)


# DTensor -------------------------------------------------------------------------------------

# FSDP2's placement for dim 0 of a parameter that tensor parallelism already shards on dim 0
StridedShard = _placement_types._StridedShard


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """The mesh spanning the dimensions of ``meshes`` (sibling dimensions of one root mesh, as
    FSDP2 joins its mesh with a tensor-parallel one); raises ``RuntimeError`` for meshes of
    different roots or overlapping dimensions. No communication."""
    return DeviceMesh._concatenate(meshes)


# c10d's group registry ----------------------------------------------------------------------


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective names (raises for an unknown name)."""
    return _c10d._resolve_process_group(group_name)  # type: ignore[arg-type]  # a str NewType


def group_size_by_name(group_name: str) -> int:
    return _c10d._get_group_size_by_name(group_name)  # type: ignore[arg-type]  # a str NewType


def default_group() -> dist.ProcessGroup | None:
    """The default process group, None before ``init_process_group`` (no error)."""
    return _c10d._world.default_pg


def default_store() -> dist.Store:
    """The default group's store."""
    return _c10d._get_default_store()


def group_timeout(pg: dist.ProcessGroup) -> datetime.timedelta:
    """How long ``pg``'s collectives wait before they fail: its CPU backend's timeout, or the
    default collective timeout where the backend has no options (a fake or custom one)."""
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - no backend for CPU, or one without options
        return _c10d.default_pg_timeout


# Inductor's custom post-grad pass -----------------------------------------------------------

CustomGraphPass = _custom_graph_pass.CustomGraphPass
_LISTS = hasattr(_custom_graph_pass, "get_custom_graph_passes")  # Inductor runs a list of passes


class _InOrder(CustomGraphPass):
    """Several custom passes as the one pass a release without lists takes. Its ``uuid()`` is
    None, so Inductor bypasses its FX graph cache, unless every pass has a uuid of its own."""

    def __init__(self, passes: list[Any]):
        self.passes = tuple(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> str | None:
        ids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        return None if None in ids else hashlib.sha256(repr(ids).encode()).hexdigest()


def custom_post_pass() -> Any:
    """What Inductor runs after its own post-grad passes (see :func:`post_passes`)."""
    return inductor_config.post_grad_custom_post_pass


def set_custom_post_pass(value: Any) -> None:
    inductor_config.post_grad_custom_post_pass = value


def post_passes(setting: Any) -> list[Any]:
    """The passes a custom-pass setting runs, in order: None, one pass, or several."""
    if setting is None:
        return []
    if isinstance(setting, (list, tuple)):
        return list(setting)
    if isinstance(setting, _InOrder):
        return list(setting.passes)
    return [setting]


def post_pass_setting(passes: list[Any]) -> Any:
    """The custom-pass setting that runs ``passes`` in order (inverse of :func:`post_passes`)."""
    if len(passes) <= 1:
        return passes[0] if passes else None
    return list(passes) if _LISTS else _InOrder(passes)


# What resolved ------------------------------------------------------------------------------


def resolved() -> dict[str, str]:
    """What each version-dependent name resolved to on the running torch."""
    return {
        "torch": torch.__version__,
        "all_gather_single": f"torch.distributed._functional_collectives.{_ALL_GATHER}",
        "all_gather_into": f"torch.distributed.{_C10D_ALL_GATHER}",
        "reduce_scatter_single": f"torch.distributed._functional_collectives.{_REDUCE_SCATTER}",
        "fsdp_param_groups": f"FSDPState.{FSDP_GROUPS}",
        "fsdp_group_reduce_dtypes": "FSDPParam.mp_policy.reduce_dtype",
        "compiled_autograd_enabled": "torch._dynamo.compiled_autograd._enable",
        "custom_post_pass": (
            "torch._inductor.config.post_grad_custom_post_pass"
            + (" (a list)" if _LISTS else " (one pass)")
        ),
    }
