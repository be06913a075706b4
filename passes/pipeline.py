"""Pipeline: the passes as one Inductor custom graph pass, run in order over a graph.

``passes.install`` (:mod:`passes.registration`) registers the pipeline as
``torch._inductor.config.post_grad_custom_post_pass``, the *post* hook, not the pre one,
because there the graph has been through Inductor's own post-grad passes: no-op removal has
normalized it, and ``ddp_fusion`` has already bucketed the uncompressed all_reduces it knows (a
plain division feeding the collective). So ``fold_collective_scaling`` also folds the division
of Inductor's own fp32 buckets, and ``bucket_compressed_collectives`` buckets exactly what
Inductor left: the compressed collectives. After the hook Inductor still runs its stable
topological sort and its fake-tensor update, which check the rewritten graph before code
generation.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from compiled_hooks import compat
from compiled_hooks.graph_contract import CHECK_RANKS_ENV, VERIFY_ENV, env_flag

from .all_gather_as_all_to_all import all_gather_as_all_to_all
from .all_to_all_weight_update import all_to_all_weight_update
from .bucket_block_all_gathers import bucket_block_all_gathers
from .bucket_block_reduce_scatters import bucket_block_reduce_scatters
from .bucket_compressed_collectives import bucket_compressed_collectives
from .bucket_low_rank_factors import bucket_low_rank_factors
from .bucket_quantized_collectives import bucket_quantized_collectives
from .core.cache_key import cache_key
from .core.interface import check_order, interface_of
from .core.marks import check_graph, is_collective
from .core.verify import check_rewrite, copy_graph
from .fold_collective_scaling import fold_collective_scaling
from .fuse_cat_prologue import fuse_cat_prologue
from .hoist_input_writebacks import hoist_input_writebacks
from .insert_rank_guard import insert_rank_guard
from .interleave_zero_broadcasts import interleave_zero_broadcasts
from .prefetch_block_all_gathers import prefetch_block_all_gathers
from .reduce_scatter_as_all_to_all import reduce_scatter_as_all_to_all
from .reinplace_broadcasts import reinplace_broadcasts
from .schedule_collectives import schedule_collectives
from .shard_weight_update import shard_weight_update as shard_weight_update_pass
from .sink_quantized_receives import sink_quantized_receives

__all__ = ["Pipeline", "default_pipeline", "DEFAULT_PASSES", "keep_collective_inputs_dense"]

log = logging.getLogger("passes")

GraphPass = Callable[..., bool]


def _flag(name: str, value: Any, env: str) -> bool:
    """An on/off option: a bool, or None for the environment variable ``env``."""
    if value is None:
        return env_flag(env)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None (from {env}), got {value!r}")
    return value


def _out_of_order(graph: Graph) -> Node | None:
    """The first node that reads a node not before it in ``graph`` (one later, erased, or of
    another graph); None when every input comes first."""
    seen: set = set()
    for node in graph.nodes:
        if not seen.issuperset(node.all_input_nodes):
            return node
        seen.add(node)
    return None


def keep_collective_inputs_dense(graph: Graph) -> None:
    """Mark the node every collective reads ``meta["dislike_padding"]``, so that Inductor lays
    its buffer out dense. Otherwise Inductor's comprehensive padding (on by default on CUDA)
    pads a row stride above 1024 elements to a multiple of 128 bytes, and a bucket
    ``[rows, width]`` is written padded and then copied whole to a dense buffer for the
    collective (docs/passes.md shows the generated code). With the mark the members write the
    collective's buffer dense. Inductor carries the mark back to the nodes that produce it
    through every op but a reduction."""
    for node in graph.nodes:
        if is_collective(node) and isinstance(node.args[0], torch.fx.Node):
            node.args[0].meta["dislike_padding"] = True


def summary(before: dict[str, int], after: dict[str, int], nodes: int, us: int) -> str:
    """One line for a compile: what each pass did (and skipped) between two counter readings."""
    events = [
        f"{k} (x{after[k] - before.get(k, 0)})"
        for k in after
        if not k.endswith(": us") and after[k] != before.get(k, 0)
    ]
    return f"passes: {nodes} nodes, {us / 1e3:.1f} ms: " + ("; ".join(events) or "nothing to do")


def _us(since: float) -> int:
    return round((time.perf_counter() - since) * 1e6)


class Pipeline(compat.CustomGraphPass):
    """Run ``passes`` in order on a graph; ``options`` go to the passes that take them.

    ``Pipeline([fold_collective_scaling, bucket_compressed_collectives], bucket_cap_mb=10)``
    calls ``bucket_compressed_collectives(graph, bucket_cap_mb=10)``. What a pass takes and what
    it must run after is its declaration (:mod:`.interface`): an option no pass takes is a
    ``ValueError`` naming it, and an order that runs a pass before one it must run after is a
    :class:`passes.core.interface.PassOrderError`.
    ``uuid()`` hashes the source of this package, of every pass and the options, so Inductor's
    FX graph cache never serves a graph compiled with other passes or options.

    ``verify=True`` (default: the ``PASSES_VERIFY`` environment variable) checks every rewrite
    with :func:`.verify.check_rewrite` and raises ``PassVerificationError`` on a change of
    values; such a pipeline bypasses the FX graph cache so that every compile is verified.

    After the passes, every pipeline runs its own step, :func:`keep_collective_inputs_dense`:
    no pass, since it changes no node and no value, only how Inductor lays out a collective's
    input (it is not declared, takes no option and cannot be left out).

    ``check_ranks=True`` (default: the ``PASSES_CHECK_RANKS`` environment variable, 1 or 0)
    runs :func:`passes.insert_rank_guard` after the passes: every compiled graph that
    communicates first checks, across the ranks, that they all issue the same collectives
    (:mod:`compiled_hooks.rank_guard`), and raises ``RankDivergenceError`` on every rank otherwise.
    """

    def __init__(
        self,
        passes: Sequence[GraphPass],
        verify: bool | None = None,
        check_ranks: bool | None = None,
        **options: Any,
    ):
        passes = list(passes)
        for p in passes:
            if not callable(p):
                raise TypeError(
                    f"Pipeline: a pass must be callable as pass(graph) -> bool, got {p!r}"
                )
        self.interfaces = [interface_of(p) for p in passes]
        unknown = set(options) - set().union(*(i.option_names for i in self.interfaces))
        if unknown:
            raise ValueError(f"Pipeline: no pass takes option(s) {sorted(unknown)}")
        check_order(self.interfaces)
        self.passes = passes
        self.options = dict(options)
        self.verify = _flag("verify", verify, VERIFY_ENV)
        self.check_ranks = _flag("check_ranks", check_ranks, CHECK_RANKS_ENV)
        if self.check_ranks and not dist.is_initialized():
            raise RuntimeError(
                "check_ranks=True: torch.distributed is not initialized; call "
                "init_process_group() before making the pipeline (the guard compares ranks "
                "through the default group's store)"
            )

    def __call__(self, graph: Graph) -> None:
        self.run(graph)

    def run(self, graph: Graph) -> bool:
        """Run every pass; True when any changed the graph (which is then checked once: every
        input defined before its reader). With ``verify``, every change is linted and checked by
        :func:`passes.core.verify.check_rewrite`. Each pass's time adds to
        ``counters["passes"]["<pass>: us"]``, the whole run's (sort and check included) to
        ``counters["passes"]["pipeline: us"]``."""
        check_graph("Pipeline", graph)
        # Without the cyclic garbage collector: the passes allocate many small objects (nodes,
        # fake tensors) and free almost none, so every collection they trigger is wasted work
        # that walks the whole compiling process's heap (Inductor's graphs and fake tensors):
        # with it on, the pass time grows faster than the graph.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(graph)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self, graph: Graph) -> bool:
        started = time.perf_counter()
        # for the summary line
        counted = dict(counters["passes"]) if log.isEnabledFor(logging.INFO) else None
        # Inductor's own DDP pass (schedule_comm_wait) can hand over a graph whose nodes are not
        # in topological order (Inductor sorts only after the custom pass); sort it first, the
        # same stable way, so the passes see a valid order.
        if _out_of_order(graph) is not None:
            stable_topological_sort(graph)
        changed = False
        for p, interface in zip(self.passes, self.interfaces):
            before = copy_graph(graph) if self.verify else None
            t0 = time.perf_counter()
            changed_now = p(
                graph, **{k: v for k, v in self.options.items() if k in interface.option_names}
            )
            counters["passes"][f"{interface.name}: us"] += _us(t0)
            if changed_now and before is not None:
                graph.lint()
                check_rewrite(interface.name, before, graph)
            changed |= bool(changed_now)
        # Every input defined before its reader: what a rewrite can break. Inductor lints the
        # whole graph after its post-grad passes; verify lints after each pass.
        broken = _out_of_order(graph) if changed and not self.verify else None
        if broken is not None:
            raise RuntimeError(
                f"Pipeline: after the passes, {broken.name} reads a value not defined before it; "
                "Pipeline(..., verify=True) names the pass"
            )
        keep_collective_inputs_dense(graph)
        if self.check_ranks:
            t0 = time.perf_counter()
            changed |= insert_rank_guard(graph)
            counters["rank_guard"]["pass us"] += _us(t0)
        us = _us(started)
        counters["passes"]["pipeline: us"] += us
        if counted is not None:
            log.info("%s", summary(counted, counters["passes"], len(graph.nodes), us))
        return changed

    def uuid(self) -> str | None:
        if self.verify:
            return None  # never cached: a cache hit would skip the verification
        return cache_key(self.passes, self.options, self.check_ranks)

    def __repr__(self) -> str:
        names = ", ".join(getattr(p, "__name__", repr(p)) for p in self.passes)
        opts = "".join(f", {k}={v!r}" for k, v in sorted(self.options.items()))
        opts += ", verify=True" if self.verify else ""
        opts += ", check_ranks=True" if self.check_ranks else ""
        return f"Pipeline([{names}]{opts})"


# The passes of default_pipeline(), in order (docs/passes.md tables what each does and must follow).
DEFAULT_PASSES = (
    all_to_all_weight_update,
    fold_collective_scaling,
    bucket_block_all_gathers,
    bucket_block_reduce_scatters,
    bucket_compressed_collectives,
    bucket_low_rank_factors,
    bucket_quantized_collectives,
    sink_quantized_receives,
    fuse_cat_prologue,
    interleave_zero_broadcasts,
    schedule_collectives,
    prefetch_block_all_gathers,
    reinplace_broadcasts,
    all_gather_as_all_to_all,
    reduce_scatter_as_all_to_all,
    hoist_input_writebacks,
)


def default_pipeline(
    verify: bool | None = None,
    *,
    shard_weight_update: bool = False,
    check_ranks: bool | None = None,
    **options: Any,
) -> Pipeline:
    """A :class:`Pipeline` of :data:`DEFAULT_PASSES` (docs/passes.md lists them in a table that
    ``tests/test_docs.py`` holds to the tuple), ``options`` going to the passes that take
    them (each pass's ``Options``). ``shard_weight_update=True`` runs that pass first (before
    bucketing could merge the all_reduces it rewrites); ``verify`` and ``check_ranks`` as in
    :class:`Pipeline`."""
    passes = list(DEFAULT_PASSES)
    if shard_weight_update:
        passes.insert(0, shard_weight_update_pass)
    return Pipeline(passes, verify=verify, check_ranks=check_ranks, **options)
