"""Compile-native FSDP: ``data_parallel(module, mesh)`` shards a module's parameters as DTensors
and gathers them on use with functional collectives, so ``torch.compile`` traces forward and
backward, collectives included, as one graph (the SimpleFSDP design).

- Parameters are ``nn.Parameter(DTensor)``: ``Shard(0)`` (``"fully_shard"``), ``Replicate()``
  (``"replicate"``) or ``(Replicate(), Shard(0))`` on a (replicate, shard) mesh
  (``"hybrid_shard"``). ``state_dict()``, ``torch.distributed.checkpoint`` and ``torch.optim``
  see the shards, as with FSDP2; outside the root's forward, ``module.weight`` is that DTensor.
- Inside the root's forward, reading a parameter gathers it (:mod:`.gather`): cast to
  ``param_dtype``, all-gather, and in backward the gradient goes through the comm hook, by
  default the reduce-scatter (all-reduce for ``"replicate"``) in ``reduce_dtype``, and comes
  back in the parameter's dtype as the DTensor gradient of the shard.
- A parameter held by several modules (tied embeddings) stays one parameter: it is gathered
  once per forward and its gradient, the sum over its uses, is reduced once.
- Blocks: the parameters of one block are gathered together (the passes bucket them), and the
  root holds the rest. Each block's floating-point inputs are cast to ``param_dtype``, like
  FSDP2's ``cast_forward_inputs``. By default (:func:`default_blocks`) the blocks are the
  layers of the outermost layer stacks; a model with parameters in several modules and no
  stack found gets a warning naming ``blocks=``.
- Activation checkpointing: a recompute (eager: a read while autograd runs a backward) gathers
  again with ``reshard_after_forward=True`` and reuses the forward's gathered parameter with
  ``False``; compiled, the partitioner does the same (see :mod:`.gather`).
- Tensor parallelism: a DTensor parameter of a sibling mesh dimension (``mesh["tp"]`` beside
  ``mesh["dp"]``) is sharded as FSDP2 shards it, on the joined mesh; it is gathered over the
  data-parallel group to its tensor-parallel local tensor and read as the tensor-parallel
  DTensor, so the module's own collectives stay DTensor's.
- ``gather_dtype=torch.int8`` gathers int8 blocks and fp32 scales instead of ``param_dtype``
  values (ZeRO++'s qwZ, :mod:`.gather`), in forward and in the reshard mode's re-gather; the
  shards stay at full precision and the optimizer steps them.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from .. import compat
from ..hook_kind import hook_kind
from ..hooks import allreduce_hook, reduce_scatter_hook
from ..quantized_state import QuantizedState
from ..state import DefaultState, LowPrecisionState
from .fsdp2 import ALREADY, ROOT_ONLY
from .gather import Layout, Reduction, TensorParallel, gather

__all__ = ["data_parallel", "default_blocks", "DataParallelState", "MODES"]

MODES = {"fully_shard": 1, "replicate": 1, "hybrid_shard": 2}  # mode -> mesh dimensions
_CLASSES: dict[tuple[type, frozenset, bool], type] = {}


class DataParallelState:
    """What ``data_parallel`` attaches to the root as ``module._data_parallel``."""

    def __init__(
        self,
        mode: str,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        reshard: bool,
        gather_dtype: torch.dtype | None = None,
    ):
        self.mode, self.mesh, self.mp_policy, self.reshard = mode, mesh, mp_policy, reshard
        self.shard_group = None if mode == "replicate" else mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mode != "fully_shard" else None
        hook_group = self.replicate_group if mode == "replicate" else self.shard_group
        assert hook_group is not None, "replicate has a replicate group, the others a shard group"
        self.reduction = Reduction(
            self.shard_group,
            mp_policy.param_dtype,
            mp_policy.reduce_dtype,
            allreduce_hook if mode == "replicate" else reduce_scatter_hook,
            DefaultState(hook_group),
            gather_dtype=gather_dtype,
        )
        if self.replicate_group is not None and mode == "hybrid_shard":
            self.reduction.replica_hook, self.reduction.replica_state = (
                allreduce_hook,
                DefaultState(self.replicate_group),
            )
        self.comm_hook: Callable[..., Any] | None = None
        self.comm_hook_state: Any = None
        # Per running root forward (empty outside one, where reads give the DTensor), the shared
        # parameters gathered so far (gathered once per forward): a dict made and dropped inside
        # the root's forward, so Dynamo keeps no tensor of it.
        self.gathered: list[dict[str, torch.Tensor]] = []
        self.started = False  # a forward ran: the (compiled) reduction is fixed
        # reshard_after_forward=False, eager: the gathered parameters a recompute reuses
        self.kept: dict[str, torch.Tensor] = {}


class _Managed(Protocol):
    """A module ``data_parallel`` manages: the attributes it sets on each."""

    _parameters: dict[str, Any]
    _data_parallel_root: DataParallelState
    _data_parallel: DataParallelState  # the root's
    _data_parallel_layouts: dict[str, Layout]
    _data_parallel_shared: set[str]


def _managed(module: nn.Module) -> _Managed:
    """``module``, typed as what :func:`data_parallel` made of it."""
    return module  # type: ignore[return-value]  # the attributes are set at run time


def _read_parameter(module: _Managed, name: str) -> torch.Tensor:
    """What ``module.<name>`` reads: the gathered parameter inside the root's forward and in an
    activation checkpoint's recompute (eager: a read while autograd runs a backward), the
    sharded DTensor elsewhere."""
    param = module._parameters[name]
    dp = module._data_parallel_root
    layout = module._data_parallel_layouts[name]
    if dp.gathered:
        gathered = dp.gathered[-1]
        if layout.name in gathered:
            return gathered[layout.name]
        full = gather(param.to_local(), layout, dp.reduction, dp.reshard)
        if not dp.reshard:
            _keep(dp, layout.name, full)
        full = _as_read(full, layout)
        if layout.name in module._data_parallel_shared:  # one gather, one reduction of the sum
            gathered[layout.name] = full
        return full
    if not torch.compiler.is_compiling() and compat.in_backward():
        kept = dp.kept.get(layout.name)
        return _as_read(gather(param.to_local(), layout, dp.reduction, dp.reshard, kept), layout)
    return param


def _as_read(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The gathered ``full`` as the module reads it: under tensor parallelism, the DTensor
    whose local tensor it is (whose backward gives the gradient in the tensor-parallel
    placements, a partial one reduced over the tensor-parallel group by DTensor)."""
    tp = layout.tensor_parallel
    if tp is None:
        return full
    return DTensor.from_local(full, tp.mesh, tp.placements, shape=tp.shape, stride=tp.stride)


def _keep(dp: DataParallelState, name: str, full: torch.Tensor) -> None:
    """``reshard_after_forward=False``, eager: hold the gathered ``full`` for a recompute until
    autograd has reduced its gradient (compiled, the partitioner saves it instead)."""
    if torch.compiler.is_compiling() or full.grad_fn is None:
        return
    dp.kept[name] = full
    ref = weakref.ref(full)

    def drop(*_: Any) -> None:
        if dp.kept.get(name) is ref():  # not a later forward's
            del dp.kept[name]

    full.grad_fn.register_hook(drop)


def _root_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The root's forward: parameter reads gather while it runs (see :func:`_read_parameter`)."""
    dp = _managed(self)._data_parallel
    dp.started = True
    dp.gathered.append({})
    try:
        # the original class's forward (the class swapped in derives from it)
        output = super(type(self), self).forward(*args, **kwargs)  # type: ignore[misc]
    finally:
        dp.gathered.pop()
    dtype = dp.mp_policy.output_dtype
    if dtype is None:
        return output
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        output,
    )


def _parameter_property(name: str) -> property:
    return property(lambda self: _read_parameter(self, name))


def _swap_class(module: nn.Module, names: Iterable[str], root: bool) -> None:
    """Give ``module`` a subclass whose parameter attributes read through
    :func:`_read_parameter` and, for the root, whose forward is :func:`_root_forward` (one
    subclass per original class, parameter names and role)."""
    key = (type(module), frozenset(names), root)
    if key not in _CLASSES:
        attrs: dict[str, Any] = {n: _parameter_property(n) for n in key[1]}
        if root:
            attrs["forward"] = _root_forward
        _CLASSES[key] = type(f"DataParallel{type(module).__name__}", (type(module),), attrs)
    module.__class__ = _CLASSES[key]


def _is_stack(container: nn.Module, layers: dict[str, nn.Module]) -> bool:
    """Whether ``container``, whose children with parameters are ``layers``, is a stack of layers.

    A list or a sequence always is. A dict is one when it holds two or more layers keyed by
    index (torchtitan's ``layers["0"]``) or all of one class; otherwise it is a namespace of a
    model's parts (nanoGPT's ``transformer``: ``wte``, ``wpe``, ``h``, ``ln_f``), and the search
    goes on inside it."""
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return True
    if not isinstance(container, nn.ModuleDict) or len(layers) < 2:
        return False
    return all(k.isdigit() for k in layers) or len({type(m) for m in layers.values()}) == 1


def default_blocks(module: nn.Module) -> dict[str, nn.Module]:
    """The blocks :func:`data_parallel` uses without ``blocks=``: path -> block.

    The children with parameters of every outermost stack of layers, in registration order. A
    stack is an ``nn.ModuleList`` or ``nn.Sequential``, or an ``nn.ModuleDict`` with two or more
    children with parameters, keyed by index or all of one class (see :func:`_is_stack`);
    subclasses count. The search walks down from ``module``, which may be a stack itself
    (``nn.Sequential(a, b)`` gives ``{"0": a, "1": b}``), and does not enter a stack it found.

    ::

        torchtitan Llama  layers (ModuleDict of TransformerBlock)  -> layers.0, layers.1, ...
        HF GPT-2          transformer.h (ModuleList)               -> transformer.h.0, ...
        HF Llama          model.layers (ModuleList)                -> model.layers.0, ...
        nanoGPT           transformer (ModuleDict of mixed parts)
                            .h (ModuleList)                        -> transformer.h.0, ...
    """
    blocks: dict[str, nn.Module] = {}

    def has_parameters(m: nn.Module) -> bool:
        return any(True for _ in m.parameters())

    def visit(prefix: str, m: nn.Module) -> None:
        children = list(m.named_children())
        layers = {n: c for n, c in children if has_parameters(c)}
        if _is_stack(m, layers):
            blocks.update((prefix + n, c) for n, c in layers.items())
            return
        for n, c in children:
            visit(f"{prefix}{n}.", c)

    visit("", module)
    return blocks


def _warn_no_blocks(module: nn.Module) -> None:
    """Warn when ``module`` spreads its parameters over several modules and no block was found:
    every parameter is then gathered with the root."""
    holders = [m for m in module.modules() if any(p is not None for p in m._parameters.values())]
    if len(holders) <= 1:
        return
    warnings.warn(
        f"data_parallel: no blocks found in {type(module).__name__} (no nn.ModuleList, "
        "nn.Sequential or nn.ModuleDict of layers): all parameters are gathered "
        "together with the root, so the whole model is gathered at once in forward and backward "
        "and no gather overlaps another block's compute. Pass blocks=[...] (for example the "
        "transformer layers), or blocks=[] to gather everything with the root without this "
        "warning.",
        UserWarning,
        stacklevel=3,
    )


def _check(
    module: nn.Module, mesh: DeviceMesh, mode: str, mp_policy: Any, reshard: Any, gather_dtype: Any
) -> None:
    name = "data_parallel"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{name}: expected an nn.Module, got {type(module).__name__}")
    if mode not in MODES:
        raise ValueError(f"{name}: mode must be one of {sorted(MODES)}, got {mode!r}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{name}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != MODES[mode]:
        layout = "a 2-D (replicate, shard) mesh" if mode == "hybrid_shard" else "a 1-D mesh"
        raise ValueError(f"{name}: mode {mode!r} needs {layout}, got a {mesh.ndim}-D mesh")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{name}: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__}"
        )
    if not isinstance(reshard, bool):
        raise TypeError(f"{name}: reshard_after_forward must be a bool, got {reshard!r}")
    if gather_dtype not in (None, torch.int8):
        raise ValueError(
            f"{name}: gather_dtype must be None (gather in mp_policy.param_dtype) or torch.int8, "
            f"got {gather_dtype!r}"
        )
    if gather_dtype is not None and mode == "replicate":
        raise ValueError(f"{name}: mode 'replicate' gathers nothing, so it takes no gather_dtype")
    for path, m in module.named_modules():
        what = f"submodule {path!r}" if path else "the module"
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"{name}: {what} is already wrapped by FSDP2 (fully_shard / replicate)"
            )
        if hasattr(m, "_data_parallel_root"):
            raise ValueError(f"{name}: {what} is already wrapped by data_parallel")
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"{name}: the parameters are on several devices {sorted(map(str, devices))}; move the "
            "module to one device first"
        )
    if devices and next(iter(devices)).type != mesh.device_type:
        raise ValueError(
            f"{name}: the parameters are on {next(iter(devices))} but the mesh is a "
            f"{mesh.device_type!r} mesh"
        )
    for path, p in module.named_parameters():
        if isinstance(p, DTensor):
            _check_tensor_parallel(path, p, mesh)
    if mode != "replicate":
        for path, p in module.named_parameters():
            if p.dim() == 0:
                raise ValueError(
                    f"{name}: parameter {path!r} is a scalar, which cannot be sharded on dim 0; "
                    "make it a 1-element tensor"
                )


def _check_tensor_parallel(path: str, p: DTensor, mesh: DeviceMesh) -> None:
    """A DTensor parameter is tensor-parallel on a mesh of its own, whose dimensions and
    ``mesh``'s are sibling dimensions of one named root mesh."""
    where = f"data_parallel: parameter {path!r} is a DTensor on {p.device_mesh}"
    fix = (
        "build one mesh, init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), "
        "parallelize the model over mesh['tp'] and pass mesh['dp'] here"
    )
    if any(placement.is_partial() for placement in p.placements):
        raise ValueError(
            f"{where} with placements {p.placements}: a Partial parameter has no values to "
            "shard; redistribute it to Replicate() or Shard first"
        )
    if mesh.mesh_dim_names is None or p.device_mesh.mesh_dim_names is None:
        raise ValueError(f"{where}; both meshes need named dimensions: {fix}")
    try:
        compat.concatenate_meshes([mesh, p.device_mesh])
    except RuntimeError as e:
        raise ValueError(
            f"{where}, which is not a sibling dimension of the data-parallel mesh {mesh}: {fix}"
        ) from e


def _cast_inputs(dtype: torch.dtype) -> Callable[..., Any]:
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


_PLACEMENTS: dict[str, tuple[Placement, ...]] = {
    "fully_shard": (Shard(0),),
    "replicate": (Replicate(),),
    "hybrid_shard": (Replicate(), Shard(0)),
}


def _shard(
    p: torch.Tensor, mesh: DeviceMesh, mode: str, name: str, block: str
) -> tuple[nn.Parameter, Layout]:
    """This rank's shard of ``p`` as a parameter, and where its rows live. A plain ``p`` is
    sharded on ``mesh``; a tensor-parallel DTensor ``p`` as FSDP2 shards it: its local tensor
    is split on dim 0 over the shard dimension of ``mesh``, on the mesh joining ``mesh`` with
    its own (``_StridedShard`` where tensor parallelism already splits dim 0). No
    communication."""
    placements = _PLACEMENTS[mode]
    shards = 1 if mode == "replicate" else mesh.size(mesh.ndim - 1)
    if not isinstance(p, DTensor):
        dt = distribute_tensor(p.detach(), mesh, list(placements), src_data_rank=None)
        full, tp = p, None
    else:
        full = p.to_local().detach()
        tp = TensorParallel(p.device_mesh, tuple(p.placements), p.shape, p.stride())
        if mode != "replicate":
            split = math.prod(  # tensor parallelism's pieces of dim 0
                p.device_mesh.size(i)
                for i, placement in enumerate(p.placements)
                if isinstance(placement, Shard) and placement.dim == 0
            )
            shard: Placement = compat.StridedShard(0, split_factor=split) if split > 1 else Shard(0)
            placements = (*placements[:-1], shard)
            pieces = torch.chunk(full, shards, dim=0)
            index = mesh.get_local_rank(mesh.ndim - 1)
            local = pieces[index] if index < len(pieces) else full[:0]
        else:
            local = full
        joined = compat.concatenate_meshes([mesh, p.device_mesh])
        dt = DTensor.from_local(
            local.clone(), joined, (*placements, *tp.placements), shape=p.shape, stride=p.stride()
        )
    rows = 0 if mode == "replicate" else math.ceil(full.shape[0] / shards)
    local_rows = dt.to_local().shape[0] if p.dim() else 0
    layout = Layout(name, full.shape, rows, local_rows, block, tp)
    return nn.Parameter(dt, requires_grad=p.requires_grad), layout


def data_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    mode: str = "fully_shard",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    blocks: Iterable[nn.Module] | None = None,
    gather_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard ``module`` over ``mesh`` in place and return it; see the module docstring.

    ``blocks``: the modules whose parameters are gathered together and whose inputs are cast
    (default: :func:`default_blocks`, the layers of the outermost layer stacks).
    ``gather_dtype``: ``torch.int8`` to gather int8 blocks of 256 values with an fp32 scale
    each (about 0.27x of fp32's bytes, 0.53x of bf16's) and dequantize to ``param_dtype`` on
    use; each value within ``absmax / 254`` of its block, the gradient passed to the shard as is.
    None (default): gather in ``param_dtype``. No communication happens here: every rank must
    hold the same initial parameters, as FSDP2 assumes.
    """
    _check(module, mesh, mode, mp_policy, reshard_after_forward, gather_dtype)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    paths = {m: p for p, m in module.named_modules()}
    if blocks is None:
        block_map = default_blocks(module)
        if not block_map:
            _warn_no_blocks(module)
    else:
        block_map = {}
        for b in blocks:
            if b not in paths or b is module:
                raise ValueError(
                    f"data_parallel: block {type(b).__name__} is not a submodule of the module"
                )
            block_map[paths[b]] = b
    dp = DataParallelState(mode, mesh, mp_policy, reshard_after_forward, gather_dtype)
    sharded: dict[int, tuple[nn.Parameter, Layout]] = {}
    uses: dict[int, int] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                uses[id(p)] = uses.get(id(p), 0) + 1
    for path, m in module.named_modules(remove_duplicate=False):
        names = [n for n, p in m._parameters.items() if p is not None]
        if not names or hasattr(m, "_data_parallel_layouts"):
            continue
        layouts, shared = {}, set()
        for n in names:
            p = m._parameters[n]
            if id(p) not in sharded:
                owners = [b for b in block_map if path == b or path.startswith(b + ".")]
                block = max(owners, key=len, default="")
                sharded[id(p)] = _shard(p, mesh, mode, f"{path}.{n}" if path else n, block)
            new, layout = sharded[id(p)]
            m._parameters[n] = new
            layouts[n] = layout
            if uses[id(p)] > 1:
                shared.add(layout.name)
        managed = _managed(m)
        (
            managed._data_parallel_layouts,
            managed._data_parallel_shared,
            managed._data_parallel_root,
        ) = (
            layouts,
            shared,
            dp,
        )
        _swap_class(m, names, root=m is module)
    for m in module.modules():
        _managed(m)._data_parallel_root = dp
    root = _managed(module)
    root._data_parallel = dp
    if not hasattr(module, "_data_parallel_layouts"):  # a root without parameters of its own
        root._data_parallel_layouts, root._data_parallel_shared = {}, set()
        _swap_class(module, [], root=True)
    if mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs:
        for m in [module, *block_map.values()]:
            m.register_forward_pre_hook(_cast_inputs(mp_policy.param_dtype), with_kwargs=True)
    return module


def is_data_parallel(module: nn.Module) -> bool:
    return hasattr(module, "_data_parallel_root")


def _replica_state(state: DefaultState, group: dist.ProcessGroup) -> DefaultState:
    """A state like ``state`` over the replicas' ``group`` (its own error feedback, if any)."""
    if isinstance(state, QuantizedState):
        return QuantizedState(
            group,
            bits=state.bits,
            block_size=state.block_size,
            error_feedback=state.error_feedback,
        )
    if isinstance(state, LowPrecisionState):
        return LowPrecisionState(group, state.parameter_type)
    return DefaultState(group)


def register_comm_hook(module: nn.Module, state: DefaultState, hook: Callable[..., Any]) -> None:
    """Reduce the gradients of a ``data_parallel`` root through ``hook`` (FSDP1's rules: root
    only, once, before the first forward). ``"fully_shard"`` and ``"hybrid_shard"`` call
    ``hook(state, grad, output)`` with ``state`` over the shard group; ``"hybrid_shard"`` then
    all-reduces the shard across the replicas with the same hook's ``hook(state, grad)`` form
    (``allreduce_hook`` for ``reduce_scatter_hook``) over the replicate group, so the result is
    averaged over all ranks. ``"replicate"`` calls ``hook(state, grad)``. A hook that takes
    ``param=`` (``int8_compress_hook``) gets the parameter's fully qualified name."""
    name = "register_comm_hook"
    dp = getattr(module, "_data_parallel", None)
    if dp is None:
        raise AssertionError(ROOT_ONLY)
    if not isinstance(state, DefaultState):
        raise TypeError(
            f"{name}: state must be a DefaultState or LowPrecisionState, got {type(state).__name__}"
        )
    if dp.comm_hook is not None:
        raise AssertionError(ALREADY)
    if dp.started:
        raise RuntimeError(
            f"{name}: register the hook before the first forward; compiled graphs already hold "
            "the default reduction"
        )
    kind = hook_kind(hook, name)
    replica_hook = None
    if dp.mode == "replicate":
        ok, need, group = (
            kind.all_reduce,
            "hook(state, grad) (an all-reduce hook)",
            dp.replicate_group,
        )
    else:
        ok, need, group = (
            kind.reduce_scatter,
            "hook(state, grad, output) (a reduce-scatter hook)",
            dp.shard_group,
        )
        if dp.mode == "hybrid_shard":
            replica_hook = (
                allreduce_hook
                if kind.fn is reduce_scatter_hook
                else (hook if kind.all_reduce else None)
            )
            if replica_hook is None:
                ok, need = False, "a hook that also reduces as hook(state, grad), for the replicas"
    if not ok:
        raise TypeError(
            f"{name}: {kind.name!r} cannot reduce a {dp.mode!r} module, which calls {need}"
        )
    if state.world_size != dist.get_world_size(group):
        built = "the mesh group"
        if dp.mode == "hybrid_shard":
            built = "mesh.get_group(1), the shard group"
        raise ValueError(
            f"{name}: the state's group has {state.world_size} ranks but the module reduces over "
            f"a group of {dist.get_world_size(group)}; build the state with {built}"
        )
    low_precision = isinstance(state, LowPrecisionState)
    if low_precision and dp.mp_policy.reduce_dtype is not None:
        raise ValueError(
            f"{name}: the MixedPrecisionPolicy casts gradients to {dp.mp_policy.reduce_dtype} "
            "before the hook; a compression hook compresses by itself, so leave reduce_dtype "
            "unset."
        )
    r = dp.reduction
    r.hook, r.state, r.per_parameter = kind.fn, state, kind.per_parameter
    if replica_hook is not None:
        r.replica_hook = replica_hook
        r.replica_state = _replica_state(state, dp.replicate_group)
    dp.comm_hook, dp.comm_hook_state = hook, state
