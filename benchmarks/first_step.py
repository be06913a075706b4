"""The first step: what a job pays to compile before its first training step, cold (an empty
Inductor cache) and warm (a restarted job on the same cache), against the steady step.

    python -m benchmarks.first_step                          # depths 2 4 8 16, every config
    python -m benchmarks.first_step --repeats 3              # medians of 3 rounds
    python -m benchmarks.first_step --depths 2 8 --configs "FSDP2 eager" "FSDP2 per-layer compile"
    python -m benchmarks.first_step --device cuda            # a lent GPU: the 1B Llama

Model: :mod:`benchmarks.common.llama` (HuggingFace's layout) at hidden 256, MLP 512, 8 heads, 4
key/value heads, vocabulary 1024, ``--depths`` layers; a batch of 4 x 64 tokens, fp32 SGD, 2 gloo
ranks over loopback. With ``--device cuda``: one NCCL rank (the lent machines have one GPU) on
``LLAMA_1B`` in bf16 (dim 2048, 18 layers, vocabulary 32000), a batch of 4 x 512 tokens, and
``GPU_CONFIGS``. Configurations:

- FSDP2 eager: ``fully_shard`` per layer and the root;
- FSDP2 per-layer compile: the same, each layer ``.compile()``d (torchtitan's default);
- SimpleFSDP-style whole: ``fsdp_step.simple_fsdp`` compiled whole with Inductor's FSDP
  bucketing (keeps the gathered parameters for backward);
- data_parallel whole + passes: ``data_parallel`` (resharding after forward) compiled whole,
  ``passes.install()``;
- data_parallel keep, whole + passes: the same with ``reshard_after_forward=False``;
- data_parallel per-layer + passes: each layer ``.compile()``d;
- the floor, with no data parallelism (no sharding, no gradient communication: their steady
  steps are no peer's): "no data parallelism, whole + regions" compiles the plain model whole
  with each layer a ``torch.compiler.nested_compile_region``, the least a whole-model compile
  with one compile per distinct block costs; "no data parallelism, per-layer compile" compiles
  each plain layer on its own.

Each (configuration, depth) runs as two jobs of two fresh rank processes each (started as
torchrun would): the first on an empty ``TORCHINDUCTOR_CACHE_DIR`` (cold), the second on the
same directory (warm, a restart); with ``--repeats R``, every pair runs R times, in R rounds
over all the (configuration, depth)s, and the table gives each timing's median over the rounds
(identical cold jobs differ by up to a fifth on these machines). A job times its first step
(forward, backward, optimizer; a barrier on each side) and then the median of ``--steps`` more
(the steady step, reported from the warm job). The cold job's compile time is split by phase,
from Dynamo's ``compilation_time_metrics``: Dynamo's trace (its frame compile less the
backend), AOTAutograd (the backend less Inductor), Inductor (its forward and backward compiles,
code generation and the C++ compiler, less the two that follow), the passes
(``counters["passes"]["pipeline: us"]``) and Inductor's post-grad fake-tensor update, which
propagates again what the post-grad passes changed (in parentheses, the passes' part of it:
:mod:`benchmarks.common.compile_time`). The passes' share counts the pipeline and its part of
the update.
Cache hits are counted (AOTAutograd's and the FX graph cache's). Last, the acceptance ratios
of the issue that asked for this benchmark: cold and warm against FSDP2 per-layer compile's,
the cold first step at the deepest depth over the shallowest, the steady step over FSDP2
eager's, and the passes' share of each compile; and the floors' starts against FSDP2 per-layer
compile's, the bound a whole-model compile meets at best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import socket
import statistics
import subprocess
import tempfile
import time

from benchmarks.common.compile_time import time_fake_tensor_updates
from benchmarks.common.launch import ROOT, module_command
from benchmarks.common.llama import LLAMA_1B, Config

CONFIGS = [
    "FSDP2 eager",
    "FSDP2 per-layer compile",
    "SimpleFSDP-style whole",
    "data_parallel whole + passes",
    "data_parallel keep, whole + passes",
    "data_parallel per-layer + passes",
    "no data parallelism, whole + regions",
    "no data parallelism, per-layer compile",
]
PEER = "FSDP2 per-layer compile"  # the start the acceptance ratios compare with
EAGER = "FSDP2 eager"  # the steady step they compare with
SMOKE = ["FSDP2 eager", "data_parallel whole + passes"]
GPU_CONFIGS = [EAGER, PEER, "data_parallel whole + passes", "no data parallelism, whole + regions"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a job runs on, by ``--device``; its model is ``width`` at each depth."""

    ranks: int
    backend: str
    width: Config
    dtype: str
    tokens: tuple[int, int]
    depths: list[int]
    configs: list[str]


SETUPS = {
    "cpu": Setup(
        ranks=2,
        backend="gloo",
        width=Config(vocab=1024, dim=256, heads=8, kv_heads=4, hidden=512),
        dtype="float32",
        tokens=(4, 64),
        depths=[2, 4, 8, 16],
        configs=CONFIGS,
    ),
    "cuda": Setup(
        ranks=1,
        backend="nccl",
        width=LLAMA_1B,
        dtype="bfloat16",
        tokens=(4, 512),
        depths=[LLAMA_1B.layers],
        configs=GPU_CONFIGS,
    ),
}


def _rank_main(device: str, config: str, depth: int, steps: int, out: str) -> None:
    """One rank of one job (torchrun's environment): build, time the first step and ``steps``
    more; rank 0 writes the result to ``out``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import passes
    from benchmarks.common.llama import LlamaForCausalLM
    from benchmarks.common.models import synchronize
    from benchmarks.common.simple_fsdp import INDUCTOR_FSDP_BUCKETING, simple_fsdp
    from compiled_hooks.fsdp import data_parallel

    setup = SETUPS[device]
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    dist.init_process_group(setup.backend)
    rank = dist.get_rank()
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    config_ = dataclasses.replace(setup.width, layers=depth)
    with torch.device(device):
        net = LlamaForCausalLM(config_).to(getattr(torch, setup.dtype))
    layers = list(net.model.layers)
    options: dict = {}
    installed = "passes" in config
    if config.startswith("FSDP2"):
        for layer in layers:
            fully_shard(layer, mesh=mesh)
            if "compile" in config:
                layer.compile()
        run = fully_shard(net, mesh=mesh)
    elif config.startswith("no data parallelism"):
        for layer in layers:
            if "per-layer" in config:
                layer.compile()
            else:
                region = torch.compiler.nested_compile_region(type(layer).forward)
                layer.forward = region.__get__(layer)  # type: ignore[method-assign]
        run = net if "per-layer" in config else torch.compile(net, fullgraph=True)
    elif config.startswith("SimpleFSDP"):
        run = torch.compile(simple_fsdp(net, mesh, MixedPrecisionPolicy()), fullgraph=True)
        options = INDUCTOR_FSDP_BUCKETING
    else:
        model = data_parallel(net, mesh, reshard_after_forward="keep" not in config)
        if "per-layer" in config:
            for layer in layers:
                layer.compile()
            run = model
        else:
            run = torch.compile(model, fullgraph=True)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    tokens = [
        torch.randint(0, config_.vocab, setup.tokens, generator=g).to(device) for _ in range(4)
    ]

    target = torch.device(device)

    def step(i: int) -> float:
        dist.barrier()
        synchronize(target)
        t0 = time.perf_counter()
        with torch._inductor.config.patch(options):
            if installed:
                with passes.install():
                    run(tokens[i % 4]).square().mean().backward()
            else:
                run(tokens[i % 4]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        synchronize(target)
        dist.barrier()
        return time.perf_counter() - t0

    updating = time_fake_tensor_updates()
    first = step(0)
    steady = [step(i) for i in range(1, steps + 1)]
    if rank == 0:
        from torch._dynamo.utils import compilation_time_metrics, counters

        def total(name: str) -> float:
            return sum(compilation_time_metrics.get(name, []))

        inductor = total("compile_fx.<locals>.fw_compiler_base") + total(
            "compile_fx.<locals>.bw_compiler"
        )
        dynamo = total("_compile.compile_inner") - total("OutputGraph.call_user_compiler")
        compile_s = total("_compile.compile_inner") + total("backward._backward_impl")
        passes_s = counters["passes"]["pipeline: us"] / 1e6
        update_s = updating.total
        result = {
            "config": config,
            "depth": depth,
            "first_s": first,
            "steady_ms": statistics.median(steady) * 1e3 if steady else None,
            "compile_s": compile_s,
            "dynamo_s": dynamo,
            "aot_s": compile_s - dynamo - inductor,
            "inductor_s": inductor - passes_s - update_s,
            "passes_s": passes_s,
            "update_s": update_s,
            "update_passes_s": updating.passes,
            "bookkeeping_s": updating.bookkeeping,
            "caches": {
                k: v
                for group in ("aot_autograd", "inductor")
                for k, v in counters[group].items()
                if "cache_hit" in k or "cache_miss" in k or "cache_bypass" in k
            },
            "graphs": counters["stats"]["unique_graphs"],
        }
        pathlib.Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    config: str, depth: int, steps: int, cache: str, timeout: float, device: str = "cpu"
) -> dict:
    """Fresh rank processes (``SETUPS[device].ranks``) on ``cache``, in torchrun's environment
    for one host: rank 0's result."""
    ranks = SETUPS[device].ranks
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    port = _free_port()
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": cache,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),  # as torchrun says of ranks on one host
        "OMP_NUM_THREADS": "1",
    }
    cmd = module_command("first_step", "--rank-of", device, config, str(depth), str(steps), out)
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(ranks)
    ]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(codes):
        raise JobFailed(f"{config} at depth {depth} failed (exit codes {codes})")
    result = json.loads(pathlib.Path(out).read_text())
    os.unlink(out)
    return result


class JobFailed(RuntimeError):
    """A job's rank exited with an error (gloo aborts a rank now and then as it shuts down)."""


JOBS = ("cold", "warm")


def run_pair(
    config: str, depth: int, steps: int, timeout: float, retries: int, device: str = "cpu"
) -> dict:
    """``{"cold": ..., "warm": ...}``: a cold job on a new cache, then a warm one on it; the pair
    runs again on a new cache, ``retries`` times at most, where a job fails."""
    failure = None
    for _ in range(retries + 1):
        if failure is not None:
            print(f"  {failure}: run again", flush=True)
        with tempfile.TemporaryDirectory(prefix="first_step_cache_") as cache:
            try:
                cold = run_job(config, depth, 0, cache, timeout, device)
                warm = run_job(config, depth, steps, cache, timeout, device)
                return {"cold": cold, "warm": warm}
            except JobFailed as e:
                failure = e
    raise SystemExit(f"first_step: {failure}")


def median_job(jobs: list[dict], kind: str) -> dict:
    """One (configuration, depth)'s ``kind`` job ("cold" or "warm") over its rounds: each timing
    the median of the rounds', the rest (config, caches, graphs) the first round's."""
    results = [job[kind] for job in jobs]
    timings = {
        k: statistics.median(r[k] for r in results)
        for k, v in results[0].items()
        if isinstance(v, float) and all(r[k] is not None for r in results)
    }
    return {**results[0], **timings}


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def report(rows: list[dict], depths: list[int]) -> None:
    print(
        "\n| config | layers | cold first step (s) | warm first step (s) | steady step (ms) "
        "| cold: Dynamo / AOTAutograd / Inductor / passes / fake-tensor update (the passes' "
        "part) (s) | passes' share | warm caches |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---|")
    for r in rows:
        c, w = r["cold"], r["warm"]
        hits = ", ".join(f"{k} {v}" for k, v in sorted(w["caches"].items())) or "-"
        update = c.get("update_s", 0.0)  # not in the rows of an older --json
        ours = c.get("update_passes_s", update)  # older rows: the whole update, an upper bound
        share = (c["passes_s"] + ours) / c["compile_s"] if c["compile_s"] else 0.0
        print(
            f"| {r['config']} | {r['depth']} | {c['first_s']:.1f} | {w['first_s']:.1f} "
            f"| {w['steady_ms']:.0f} | {c['dynamo_s']:.1f} / {c['aot_s']:.1f} / "
            f"{c['inductor_s']:.1f} / {c['passes_s']:.2f} / {update:.2f} ({ours:.2f}) "
            f"| {share:.1%} | {hits} |"
        )
    by = {(r["config"], r["depth"]): r for r in rows}
    print("\nAgainst the peers (ratios of the table's medians):")
    for config in dict.fromkeys(r["config"] for r in rows):
        floor = config.startswith("no data parallelism")
        if not config.startswith("data_parallel") and not floor:
            continue
        for d in depths:
            r, peer, eager = by.get((config, d)), by.get((PEER, d)), by.get((EAGER, d))
            if r is None:
                continue
            cold = ratio(r["cold"]["first_s"], peer and peer["cold"]["first_s"])
            warm = ratio(r["warm"]["first_s"], peer and peer["warm"]["first_s"])
            steady = ratio(r["warm"]["steady_ms"], eager and eager["warm"]["steady_ms"])
            print(
                f"  {config}, {d} layers: cold {cold} and warm {warm} {PEER}'s"
                + ("" if floor else f"; steady {steady} {EAGER}'s")
            )
        lo, hi = by.get((config, min(depths))), by.get((config, max(depths)))
        if lo and hi and lo is not hi:
            print(
                f"  {config}: cold first step at {max(depths)} layers / at {min(depths)}: "
                f"{ratio(hi['cold']['first_s'], lo['cold']['first_s'])}"
            )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["depth"])
        depths = [r["depth"] for r in mine]
        (line,) = ax.plot(depths, [r["cold"]["first_s"] for r in mine], "o-", label=config)
        ax.plot(depths, [r["warm"]["first_s"] for r in mine], "o--", color=line.get_color())
    ax.set_xlabel("layers")
    ax.set_ylabel("first step (s); solid cold, dashed warm")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=sorted(SETUPS), default="cpu", help="cuda: a lent GPU's 1B Llama"
    )
    parser.add_argument("--depths", type=int, nargs="+", help="default: 2 4 8 16 (cuda: 18)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, metavar="CONFIG")
    parser.add_argument("--steps", type=int, default=6, help="steady steps after the first")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of every job; the table gives medians"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a job may take")
    parser.add_argument(
        "--retries", type=int, default=1, help="times a failed (cold, warm) pair runs again"
    )
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--plot", help="draw first step against depth to this PNG (matplotlib)")
    parser.add_argument(
        "--smoke", action="store_true", help="depth 1, FSDP2 eager and data_parallel whole"
    )
    parser.add_argument("--from-json", help="report (and --plot) the rows of an earlier --json")
    parser.add_argument("--rank-of", nargs=5, help=argparse.SUPPRESS)  # a job's rank process
    args = parser.parse_args()
    if args.rank_of:
        device, config, depth, steps, out = args.rank_of
        _rank_main(device, config, int(depth), int(steps), out)
        return
    if args.from_json:
        rows = json.loads(pathlib.Path(args.from_json).read_text())
        report(rows, sorted({r["depth"] for r in rows}))
        if args.plot:
            plot(rows, args.plot)
        return
    setup = SETUPS[args.device]
    args.depths = args.depths or setup.depths
    args.configs = args.configs or setup.configs
    if args.smoke:
        args.depths, args.configs, args.steps = [1], SMOKE, 1
    print(
        f"first_step: depths {args.depths}, {args.repeats} round(s), {setup.ranks} "
        f"{setup.backend} rank(s) on {args.device}, {os.cpu_count()} CPUs"
    )
    runs: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.repeats):  # rounds outermost: a drift of the machine hits all alike
        for depth in args.depths:
            for config in args.configs:
                pair = run_pair(config, depth, args.steps, args.timeout, args.retries, args.device)
                runs.setdefault((config, depth), []).append(pair)
                cold, warm = pair["cold"], pair["warm"]
                print(
                    f"  round {round_ + 1}, {config}, {depth} layers: cold {cold['first_s']:.1f} "
                    f"s, warm {warm['first_s']:.1f} s, steady {warm['steady_ms']:.0f} ms",
                    flush=True,
                )
    rows = [
        {"config": c, "depth": d, "runs": len(jobs), **{k: median_job(jobs, k) for k in JOBS}}
        for (c, d), jobs in runs.items()
    ]
    report(rows, args.depths)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
