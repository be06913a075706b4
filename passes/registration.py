"""Registering a :class:`~passes.pipeline.Pipeline` with Inductor, and the scheduling that
keeps the order the passes made.

:func:`install` registers the pipeline as ``torch._inductor.config.post_grad_custom_post_pass``
(after Inductor's own post-grad passes, see :mod:`passes.pipeline`) and, unless the process set
``reorder_for_compute_comm_overlap`` itself, sets :data:`KEEP_SCHEDULE`:

- ``reorder_for_compute_comm_overlap = True`` with
  ``reorder_for_compute_comm_overlap_passes = [sink_waits_outside_blocks]``: Inductor's
  ``sink_waits``, but not in a ``data_parallel`` graph (see the function);
- ``reorder_for_peak_memory = False``: that ordering moves every wait right after its
  collective, and in a ZeRO backward every collective after the whole backward compute.

It turns on ``data_parallel``'s block regions (:mod:`compiled_hooks.fsdp.regions`: a whole-model
compile traces, partitions and generates each distinct block once) and registers
:func:`~passes.recompute_gathers.recompute_gathers` and
:func:`~passes.forward_region_inputs.forward_region_inputs` as Inductor's
``joint_custom_pre_pass``, which keep ``reshard_after_forward`` for the gathers, which run
under no checkpoint there, and across the regions. A
``joint_custom_pre_pass`` already set runs first. While installed, ``invoke_subgraph``
computes a region call's schema once per subgraph and kind of operands
(:func:`compiled_hooks.compat.region_schemas_reused`), not once per call, and Inductor lowers a
region with no donated input (:func:`compiled_hooks.compat.region_inputs_kept`).

It also sets :data:`CACHE_AUTOGRAD_FUNCTIONS`: AOTAutograd's cache takes graphs that hold a
custom ``autograd.Function`` (as every ``data_parallel`` graph does: its gather). Dynamo traces
the function's forward and backward into the graph, which is what the cache key hashes; without
it, every such graph is compiled again in every process, whatever the caches hold.

``sink_waits`` also holds an interleaved ZeRO step's broadcasts, and every collective after
them, to the end of the backward (Inductor issues collectives in the graph's order).
Inductor's ``raise_comms`` is not used: it issues collectives ahead of nodes they do not
depend on, the rank guard's check among them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch._functorch.config as functorch_config

from compiled_hooks import compat
from compiled_hooks.graph_contract import compile_blocks_once
from compiled_hooks.rank_guard import RankDivergenceError, unraised_verdict

from .core.cache_key import cache_key
from .core.marks import block_of
from .forward_region_inputs import forward_region_inputs
from .pipeline import Pipeline, default_pipeline
from .recompute_gathers import recompute_gathers

__all__ = [
    "Installation",
    "install",
    "KEEP_SCHEDULE",
    "CACHE_AUTOGRAD_FUNCTIONS",
    "sink_waits_outside_blocks",
]


def sink_waits_outside_blocks(snodes: list[Any]) -> list[Any]:
    """The Inductor scheduling pass ``install()`` runs: Inductor's ``sink_waits`` (every wait
    after every node ready without it, so independent compute runs while collectives are in
    flight), except in a graph that computes ``data_parallel`` blocks, whose order it keeps:
    there ``sink_waits`` would issue every block's all-gather at the start, whatever the
    prefetch depth."""
    from torch._inductor import comms

    for snode in snodes:
        for inner in snode.get_nodes():
            if inner.node is not None and any(
                block_of(origin) is not None for origin in inner.node.origins
            ):
                return snodes
    return comms.sink_waits(snodes)


# The Inductor options install() sets (and restores): its communication scheduling with the pass
# above, and its peak-memory ordering off.
KEEP_SCHEDULE = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [sink_waits_outside_blocks],
    "reorder_for_peak_memory": False,
}


# The AOTAutograd option install() sets (and restores).
CACHE_AUTOGRAD_FUNCTIONS = {"autograd_cache_allow_custom_autograd_functions": True}


class _JointPass(compat.CustomGraphPass):
    """:func:`recompute_gathers`, then :func:`forward_region_inputs` (which copies the tags it
    set), after the joint passes ``previous`` set before install (None, one pass or a list:
    :func:`compiled_hooks.compat.post_passes`'s settings)."""

    def __init__(self, previous: Any):
        self.previous = previous

    def __call__(self, graph: Any) -> None:
        for joint_pass in compat.post_passes(self.previous):
            joint_pass(graph)
        recompute_gathers(graph)
        forward_region_inputs(graph)

    def uuid(self) -> str | None:
        before = compat.post_passes(self.previous)
        if not all(isinstance(p, compat.CustomGraphPass) for p in before):
            return None  # Inductor bypasses its cache for a pass without a uuid, as always
        ids = [p.uuid() for p in before]
        if None in ids:
            return None
        return f"{ids}:{cache_key([recompute_gathers, forward_region_inputs], {}, False)}"


def install(
    pipeline: Pipeline | None = None,
    verify: bool | None = None,
    check_ranks: bool | None = None,
    options: dict[str, Any] | None = None,
) -> Installation:
    """Register ``pipeline`` (default: :func:`~passes.pipeline.default_pipeline`) with
    Inductor, and return the :class:`Installation`.

    As a context manager it is taken out again on exit::

        with passes.install():
            torch.compile(step)(...)

    As a plain call it stays installed for the process (``.restore()`` undoes it).
    ``options={"bucket_cap_mb": 10}`` installs the default pipeline with those options (an
    option no pass takes is refused by name, before any compile); ``verify=True`` with
    differential verification; ``check_ranks=True`` with the rank-divergence guard
    (:mod:`compiled_hooks.rank_guard`)."""
    return Installation(pipeline, verify, check_ranks, options)


class Installation:
    """A pipeline registered with Inductor (see :func:`install`), until :meth:`restore`.

    Custom post-grad passes already set in ``torch._inductor.config.post_grad_custom_post_pass``
    stay: the pipeline runs after them (the setting holds both, see
    :func:`compiled_hooks.compat.post_pass_setting`), and on exit only the pipeline is taken
    out, so the setting is what it was. A pipeline already installed (an outer ``install``) is
    replaced for the duration, not run twice. A custom pass that is not a ``CustomGraphPass``
    with a ``uuid()`` makes Inductor bypass its FX graph cache, as always.

    With the guard, the context manager also re-raises the error of a rank that was blocked in a
    collective when another rank found the divergence (the backend's "connection closed" or
    timeout) as that ``RankDivergenceError``.
    """

    def __init__(
        self,
        pipeline: Pipeline | None = None,
        verify: bool | None = None,
        check_ranks: bool | None = None,
        options: dict[str, Any] | None = None,
    ):
        if pipeline is None:
            pipeline = default_pipeline(verify=verify, check_ranks=check_ranks, **(options or {}))
        elif verify is not None or check_ranks is not None or options is not None:
            given = (
                "verify="
                if verify is not None
                else "check_ranks="
                if check_ranks is not None
                else "options="
            )
            raise ValueError(f"install: pass {given} to the Pipeline you give, or give no pipeline")
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"install: expected a passes.Pipeline, got {type(pipeline).__name__}")
        self.pipeline = pipeline
        self.previous = compat.custom_post_pass()
        others = [p for p in compat.post_passes(self.previous) if not isinstance(p, Pipeline)]
        self.installed = compat.post_pass_setting([*others, pipeline])
        compat.set_custom_post_pass(self.installed)
        self.caching: Any = functorch_config.patch(
            {k: v for k, v in CACHE_AUTOGRAD_FUNCTIONS.items() if hasattr(functorch_config, k)}
        )
        self.caching.__enter__()
        joint = compat.inductor_config.joint_custom_pre_pass
        if isinstance(joint, _JointPass):  # an outer install's
            joint = joint.previous
        self.joint = compat.inductor_config.patch(joint_custom_pre_pass=_JointPass(joint))
        self.joint.__enter__()
        self.regions: Any = contextlib.ExitStack()
        self.regions.enter_context(compile_blocks_once())
        self.regions.enter_context(compat.region_schemas_reused())
        self.regions.enter_context(compat.region_inputs_kept())
        self.scheduling = None
        if not compat.inductor_config.reorder_for_compute_comm_overlap:
            self.scheduling = compat.inductor_config.patch(KEEP_SCHEDULE)
            self.scheduling.__enter__()

    def restore(self) -> None:
        current = compat.custom_post_pass()
        if current is self.installed:
            compat.set_custom_post_pass(self.previous)
        else:  # changed while installed: take out only this pipeline
            rest = [p for p in compat.post_passes(current) if p is not self.pipeline]
            compat.set_custom_post_pass(compat.post_pass_setting(rest))
        if self.scheduling is not None:
            self.scheduling.__exit__(None, None, None)
            self.scheduling = None
        if self.caching is not None:
            self.caching.__exit__(None, None, None)
            self.caching = None
        if self.regions is not None:
            self.regions.close()
            self.joint.__exit__(None, None, None)
            self.regions = None

    def __enter__(self) -> Pipeline:
        return self.pipeline

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.restore()
        if (
            self.pipeline.check_ranks
            and isinstance(exc, RuntimeError)
            and not isinstance(exc, RankDivergenceError)
        ):
            # The rank that found the divergence waits until every rank's watchdog has read the
            # verdict before it raises (and exits, which is what releases a blocked gloo rank).
            error = unraised_verdict()
            if error is not None:
                raise error from exc
