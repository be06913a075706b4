"""What the rank-divergence guard costs: the main example's training step with and without it.

    python -m benchmarks.rank_guard [--steps 300]     # 2 CPU ranks over gloo

Three copies of the main example (its transformer, compiled DDP + ``bf16_compress_hook`` + the
passes, AdamW): one compiled with ``passes.install(check_ranks=True)`` and two without (the
second is a control: how far two unguarded copies differ is the noise floor of the ratio);
their steps are interleaved (the order rotates every step) so that machine noise hits all
alike. Reported on rank 0: median step time of each and the ratios to the first unguarded
copy; the compile-time cost of the guard
(the pass, and the first run's exchange with the other rank, which waits for that rank to
arrive); and the guard's steady-state cost per call, timed directly. Compiled autograd would
serve both copies the backward graph it compiled first (it caches by structure), so each copy
gets one more one-element parameter, of shape (1,), (1, 1) or (1, 1, 1): the same work, three
graphs. The run checks that only the guarded copy runs guarded graphs (the guard's
collective count grows only on its steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import compiled_hooks as ch
import passes
from benchmarks.common.launch import launch
from benchmarks.common.models import TinyTransformer, batch, loss_fn
from compiled_hooks import rank_guard


class Copy:
    def __init__(self, name: str, guard: bool, extra_dims: int):
        torch.manual_seed(0)
        self.name, self.guard, self.net = name, guard, TinyTransformer()
        self.net.register_parameter("extra", torch.nn.Parameter(torch.zeros((1,) * extra_dims)))
        _, self.model = ch.compile_ddp(
            self.net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook
        )
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-3)
        for p in self.net.parameters():
            p.grad = torch.zeros_like(p)
        self.pipeline = passes.default_pipeline(check_ranks=guard)
        self.times: list[float] = []

    def step(self, step: int) -> float:
        tokens, targets = batch(dist.get_rank(), step)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        with passes.install(self.pipeline), ch.compiled_autograd():
            (loss_fn(self.model, tokens, targets) + 0 * self.net.extra.sum()).backward()
        self.opt.step()
        return time.perf_counter() - t0


def fast_path_us(calls: int = 20000) -> float:
    """Steady-state cost of one guard call (an agreed record), in microseconds."""
    record = rank_guard.agreed_records()[0]
    op = torch.ops.compiled_hooks.check_ranks.default
    t0 = time.perf_counter()
    for _ in range(calls):
        op(record)
    return (time.perf_counter() - t0) / calls * 1e6


def run(rank: int, world_size: int, args) -> bool:
    copies = [
        Copy("without guard", False, 1),
        Copy("with guard", True, 2),
        Copy("without guard (control)", False, 3),
    ]
    compile_s = {}
    for c in copies:
        t0 = time.perf_counter()
        c.step(0)
        c.step(1)  # compiled autograd may compile a second graph per model on its second step
        compile_s[c.name] = time.perf_counter() - t0
    guarded_per_step = set()
    for step in range(2, args.steps + 2):
        k = step % len(copies)
        for c in copies[k:] + copies[:k]:
            before = rank_guard.issued_collectives()
            c.times.append(c.step(step))
            grew = rank_guard.issued_collectives() - before
            if bool(grew) != c.guard:
                raise RuntimeError(
                    f"step {step}: the copy {c.name!r} {'did not run' if c.guard else 'ran'} a "
                    "guarded graph"
                )
            if grew:
                guarded_per_step.add(grew)
    per_call = fast_path_us()
    if rank == 0:
        medians = {c.name: statistics.median(c.times) * 1e3 for c in copies}
        base = medians["without guard"]
        print(
            f"rank guard overhead, main example, {world_size} ranks, {args.steps} interleaved "
            "steps each (medians, rank 0):"
        )
        for name, ms in medians.items():
            print(
                f"  {name:26s} {ms:7.2f} ms/step   {ms / base:.4f}x   compile (first two steps) "
                f"{compile_s[name]:.1f} s"
            )
        print(
            f"  guarded collectives per step: {sorted(guarded_per_step)}; one guard call (agreed "
            f"graph) costs {per_call:.2f} us (timed over 20000 calls), "
            f"{per_call / 1e3 / base:.3%} of a step"
        )
        print(
            "  compile-time cost: insert_rank_guard "
            f"{counters['rank_guard']['pass us'] / 1e3:.1f} ms, first-run exchange "
            f"{counters['rank_guard']['check us'] / 1e3:.1f} ms "
            f"({counters['rank_guard']['graphs checked']} graph(s) checked, including the wait "
            "for the other rank)"
        )
        print(json.dumps({"medians_ms": medians, "call_us": per_call}))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="interleaved steps of each copy")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    launch(run, parser.parse_args())


if __name__ == "__main__":
    main()
