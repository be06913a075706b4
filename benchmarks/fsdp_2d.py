"""2-D training steps, FSDP over ``dp`` and tensor parallelism over ``tp``: compile-native
``data_parallel`` against FSDP2 and a SimpleFSDP-style compile, each on the same TP plan.

    python -m benchmarks.fsdp_2d                   # 4 CPU ranks over loopback, dp=2 x tp=2

The model: the Llama of ``benchmarks/common/llama.py`` (HuggingFace's layout) at width 256, 8 heads
(4 key/value heads), MLP width 704, 4 layers (``--layers``), vocabulary 2048; batch 8 x 64
tokens, fp32; torchtitan's TP plan (``examples.llama.parallelize_tp``) over ``mesh["tp"]``
first, then each configuration shards over ``mesh["dp"]``, each layer a block, resharding after
forward:

- FSDP2 + TP, eager: ``fully_shard`` on each layer and the root;
- SimpleFSDP-style + TP, compiled: each TP local tensor sharded on ``dp`` as a ``Shard(0)``
  DTensor, redistributed to ``Replicate`` on every read and re-wrapped as the TP DTensor
  (torchtitan's ``replicate_compute`` for 2-D), compiled whole with Inductor's FSDP bucketing;
- ``data_parallel`` + TP, compiled whole, without and with ``passes.install()``.

Steps (forward + backward + SGD) are interleaved, the order rotated every step; medians on
rank 0. Collectives and MB per step per group (``dp``, ``tp``): eager, counted as FSDP2 and
DTensor dispatch them; compiled, read from the graph Inductor compiles, after the passes (a
last custom pass records each collective's group and size). MB is each collective's full size
(an all-gather's output, a reduce-scatter's, all-reduce's or all-to-all's input). Over loopback
communication is nearly free and the 4 ranks share 2 cores: the step times say what the
compute and the collectives' CPU work cost here, not how a real cluster would rank them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import passes
from benchmarks.common import results
from benchmarks.common.launch import add_smoke_argument, apply_smoke, launch
from benchmarks.common.llama import Config, LlamaForCausalLM, parallelize_tp
from benchmarks.common.models import Tagged
from benchmarks.common.simple_fsdp import INDUCTOR_FSDP_BUCKETING, Average
from compiled_hooks import compat
from compiled_hooks.fsdp import data_parallel
from passes.pipeline import Pipeline, default_pipeline


def llama_config(layers: int) -> Config:
    return Config(vocab=2048, dim=256, heads=8, kv_heads=4, hidden=704, layers=layers)


MB = 2**20
# a collective's op name -> (index of the tensor that holds its full size, times the group size)
_FUNCTIONAL = {
    "all_gather_into_tensor": (0, True),
    "reduce_scatter_tensor": (0, False),
    "all_reduce": (0, False),
    "all_to_all_single": (0, False),
}


def simple_fsdp_tp(model: nn.Module, dp) -> nn.Module:
    """SimpleFSDP's 2-D design: each parameter's TP local tensor a ``Shard(0)`` DTensor on
    ``dp``, all-gathered on every read and re-wrapped on its TP mesh."""
    world = dp.size()

    def read(self: nn.Module, name: str) -> torch.Tensor:
        full = self._parameters[name].redistribute(placements=[Replicate()])
        local = Average.apply(full.to_local(grad_placements=[Partial()]), world)
        tp = self._tp[name]
        if tp is None:
            return local
        mesh, placements, shape, stride = tp
        return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)

    for m in list(model.modules()):
        names = [n for n, p in m._parameters.items() if p is not None]
        if not names:
            continue
        m._tp = {}
        for n in names:
            p = m._parameters[n]
            local = p.to_local() if isinstance(p, DTensor) else p
            m._tp[n] = (
                (p.device_mesh, p.placements, p.shape, p.stride())
                if isinstance(p, DTensor)
                else None
            )
            m._parameters[n] = nn.Parameter(
                distribute_tensor(local.detach(), dp, [Shard(0)], src_data_rank=None)
            )
        m.__class__ = type(
            f"Simple{type(m).__name__}",
            (type(m),),
            {n: property(lambda self, n=n: read(self, n)) for n in names},
        )
    return model


class _Count(TorchDispatchMode):
    """Eager: every c10d and functional collective dispatched, as (group name, op, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            index, gathers = _FUNCTIONAL[name]
            t, group = args[index], args[-1]
            size = dist.get_world_size(_group(group)) if gathers else 1
            self.calls.append((group, name, t.numel() * t.element_size() * size))
        elif func.namespace == "c10d" and name.endswith("_"):
            script = next(a for a in args if isinstance(a, torch.ScriptObject))
            group = dist.ProcessGroup.unbox(script)  # the first ScriptObject argument
            tensors = [a[0] if isinstance(a, list) else a for a in args]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            # an all-gather's output; a reduce-scatter's input; an all-reduce's tensor
            full = tensors[1 if "reduce_scatter" in name else 0]
            self.calls.append((group.group_name, name, full.numel() * full.element_size()))
        return func(*args, **(kwargs or {}))


def _group(name: str) -> dist.ProcessGroup:
    return compat.resolve_process_group(name)


def recording_pass(calls: list[tuple[str, str, int]]):
    """A last post-grad pass: appends each collective of the graph as (group, op, bytes)."""

    def record(graph: torch.fx.Graph) -> bool:
        for n in graph.nodes:
            op = getattr(n.target, "__name__", "").split(".")[0]
            if getattr(n.target, "namespace", None) != "_c10d_functional" or op not in _FUNCTIONAL:
                continue
            index, gathers = _FUNCTIONAL[op]
            value, group = n.args[index].meta["val"], n.args[-1]
            size = dist.get_world_size(_group(group)) if gathers else 1
            calls.append((group, op, value.numel() * value.element_size() * size))
        return False

    return record


class Run:
    def __init__(self, name: str, index: int, dp, tp, config: Config):
        self.name, self.times, self.calls = name, [], []
        torch.manual_seed(0)
        net = Tagged(parallelize_tp(LlamaForCausalLM(config), tp), index)
        self.pipeline: Pipeline | None = None
        if name.startswith("FSDP2"):
            for layer in net.model.model.layers:
                fully_shard(layer, mesh=dp)
            self.step_fn = fully_shard(net, mesh=dp)
        else:
            if name.startswith("SimpleFSDP"):
                simple_fsdp_tp(net, dp)
            else:
                data_parallel(net, dp)
            self.step_fn = torch.compile(net, fullgraph=True)
            record = recording_pass(self.calls)
            stages = list(default_pipeline().passes) if "passes" in name else []
            self.pipeline = Pipeline([*stages, record])
        self.model = net
        self.opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def context(self) -> contextlib.AbstractContextManager:
        """The pipeline installed (compiled configurations), with Inductor's FSDP bucketing for
        the SimpleFSDP-style one."""
        stack = contextlib.ExitStack()
        if self.pipeline is not None:
            if self.name.startswith("SimpleFSDP"):
                stack.enter_context(torch._inductor.config.patch(INDUCTOR_FSDP_BUCKETING))
            stack.enter_context(passes.install(self.pipeline))
        return stack

    def step(self, tokens: torch.Tensor) -> None:
        with self.context():
            self.step_fn(tokens).float().square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()


NAMES = [
    "FSDP2 + TP eager",
    "SimpleFSDP-style + TP compiled (Inductor FSDP bucketing)",
    "data_parallel + TP compiled",
    "data_parallel + TP compiled + passes",
]
SMOKE = [NAMES[0], NAMES[3]]  # what the report needs: FSDP2 first, then ours


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    torch._inductor.config.fx_graph_cache = False  # the recording pass must run
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    groups = {dp.get_group().group_name: "dp", tp.get_group().group_name: "tp"}
    config = llama_config(args.layers)
    names = SMOKE if args.smoke else NAMES
    runs = [Run(name, i, dp, tp, config) for i, name in enumerate(names)]
    g = torch.Generator().manual_seed(dp.get_local_rank())
    batches = [torch.randint(0, config.vocab, (8, 64), generator=g) for _ in range(4)]
    for run in runs:  # compile, and count the eager run's collectives of one step
        if run.pipeline is None:
            with _Count() as counter:
                run.step(batches[0])
            run.calls.extend(counter.calls)
        else:
            run.step(batches[0])
    for i in range(args.steps):
        order = runs[i % len(runs) :] + runs[: i % len(runs)]
        for run in order:
            dist.barrier()
            start = time.perf_counter()
            run.step(batches[i % len(batches)])
            run.times.append((time.perf_counter() - start) * 1e3)
    if rank != 0:
        return True
    rows = []
    base = statistics.median(runs[0].times)
    for run in runs:
        per_group: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for group, _, nbytes in run.calls:
            entry = per_group[groups.get(group, group)]
            entry[0] += 1
            entry[1] += nbytes / MB
        median = statistics.median(run.times)
        rows.append(
            {
                "config": run.name,
                "median_ms": median,
                "vs_fsdp2": median / base,
                "dp_collectives": per_group["dp"][0],
                "dp_mb": per_group["dp"][1],
                "tp_collectives": per_group["tp"][0],
                "tp_mb": per_group["tp"][1],
            }
        )
    print(
        f"dp={world_size // 2} x tp=2, gloo over loopback, 1 thread a rank; {args.steps} "
        f"interleaved steps, medians on rank 0; torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(
        "| config | step (ms) | vs FSDP2 + TP | dp collectives | dp MB | tp collectives | tp MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['config']} | {r['median_ms']:.1f} | {r['vs_fsdp2']:.2f}x | "
            f"{r['dp_collectives']} | {r['dp_mb']:.1f} | {r['tp_collectives']} | {r['tp_mb']:.1f} |"
        )
    table = results.table("2-D step", rows, ratio="vs_fsdp2")
    results.write(args, "fsdp_2d", "loopback, dp=2 x tp=2", [table])
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4, help="the Llama's layers")
    add_smoke_argument(parser)
    results.add_output_arguments(parser)
    parser.set_defaults(world_size=4, link=None)
    launch(_worker, apply_smoke(parser.parse_args(), layers=1))


if __name__ == "__main__":
    main()
