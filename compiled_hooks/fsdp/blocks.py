"""The blocks ``data_parallel`` gathers together (:func:`blocks_of`): the user's, or by default
(:func:`default_blocks`) the layers of a model's outermost layer stacks; :func:`warn_no_blocks`
tells a user whose model has none; :func:`cast_inputs` casts a block's inputs;
:func:`plan_block` fixes what a block's traced forward reads."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .layout import Layout
from .regions import block_key

__all__ = [
    "blocks_of",
    "default_blocks",
    "warn_no_blocks",
    "cast_inputs",
    "BlockPlan",
    "plan_block",
]


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


def warn_no_blocks(module: nn.Module) -> None:
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
        stacklevel=4,  # the caller of data_parallel (via blocks_of)
    )


def blocks_of(module: nn.Module, blocks: Iterable[nn.Module] | None) -> dict[str, nn.Module]:
    """``{path: block}`` of ``data_parallel(module, blocks=blocks)``: ``blocks`` by their paths
    in ``module`` (``ValueError`` for one that is not a submodule), or :func:`default_blocks`
    (with :func:`warn_no_blocks` when it finds none)."""
    if blocks is None:
        found = default_blocks(module)
        if not found:
            warn_no_blocks(module)
        return found
    paths = {m: p for p, m in module.named_modules()}
    chosen = {}
    for b in blocks:
        if b not in paths or b is module:
            raise ValueError(
                f"data_parallel: block {type(b).__name__} is not a submodule of the module"
            )
        chosen[paths[b]] = b
    return chosen


def cast_inputs(dtype: torch.dtype) -> Callable[..., Any]:
    """A forward pre-hook (``with_kwargs=True``) that casts the floating-point tensors among a
    module's inputs to ``dtype``, as FSDP2's ``cast_forward_inputs``."""

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """What a block's traced forward reads of the block, fixed by ``data_parallel`` (so Dynamo
    walks no module tree per block): its :func:`.regions.block_key`, every parameter as
    (module, attribute), whether any is tensor-parallel (then the block is no region), and
    whether another module holds one too (then each is gathered on its own); and, so that a
    traced forward loops over none of them, each read's index by ``(id(module), attribute)``
    (as the state's ``region_reads`` finds it), each layout's name and the block's name that
    the layouts carry; and each read's leaf, which ``data_parallel`` links in place."""

    key: int
    reads: tuple[tuple[Any, str], ...]  # the modules as data_parallel made them
    block: str
    tensor_parallel: bool
    shared: bool
    read_index: dict[tuple[int, str], int]
    names: list[str]
    shards: list[Any]  # each read's leaf (.leaves), as data_parallel links them


def plan_block(
    block: nn.Module, reads: tuple[tuple[Any, str], ...], layouts: tuple[Layout, ...], shared: bool
) -> BlockPlan:
    """The :class:`BlockPlan` of ``block``, whose parameters ``data_parallel`` sharded: each
    read ``(module, attribute)`` with its layout, and whether another module holds one too."""
    tensor_parallel = any(layout.tensor_parallel is not None for layout in layouts)
    read_index = {(id(m), n): i for i, (m, n) in enumerate(reads)}
    names = [layout.name for layout in layouts]
    name = layouts[0].block if layouts else ""
    shards: list[Any] = [None] * len(reads)
    return BlockPlan(
        block_key(block), reads, name, tensor_parallel, shared, read_index, names, shards
    )
