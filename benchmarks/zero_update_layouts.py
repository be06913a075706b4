"""How a rank can update only its half in ZeRO's whole-parameter step: compiled AdamW over the
benchmark transformer's 3.2M parameters (52 tensors), as one update, against the
rank-independent ways of updating only this rank's half.

    python -m benchmarks.zero_update_layouts

One process, one thread, each variant compiled with Inductor, medians of ``--calls`` calls
(default 12):

- all: the whole flat update (what every rank computes where the sharded update does not apply);
- gather: this rank's elements through an index table read at run time (``flat[table[rank]]``
  and ``index_put_`` back), so the graph is the same on every rank;
- window: a contiguous window at a run-time offset (``flat[start + arange(L)]``, masked);
- unbacked window: the same window read as ``narrow(flat, 0, start.item(), L)`` (an unbacked
  offset: needs ``torch._dynamo.config.capture_scalar_outputs``; the kernels take the offset as
  an argument and stay vectorized), the parameters' owner-major row selected as below;
- per-member unbacked sizes: each member updated over ``numel * is_owner`` elements (an
  unbacked integer from ``.item()``: every member on its owner, none elsewhere), its state in
  place at a static offset, its new values written into the row;
- owner-major row: the bucket laid out as ``[world, L]`` rows and this rank's row selected
  with ``index_select(0, rank)``, the ``cat`` of the parameters included;
- own row, directions (what ``compiled_hooks.zero`` runs where the update reads the parameter only
  as ``param * decay - scale * direction``, AdamW included): the direction over this rank's row, its
  state one slice at a fixed offset (the state laid out by the buckets), no parameter read; and the
  same plus applying both ranks' rows of directions to every parameter (``p * decay - scale * u``),
  the part of the write-back that reads the parameters;
- and torch's eager foreach AdamW over the same tensors, for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compiled_hooks.zero.optim_math import (
    apply,
    direction_rule,
    group_hyperparameters,
    rule_of,
    step_scalars,
    table_row,
    update,
)

HP = group_hyperparameters(
    torch.optim.AdamW, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), {}
)
FORM = rule_of(torch.optim.AdamW, HP)
TABLE = torch.tensor([table_row(HP)], dtype=torch.float64)


def RULE(p, g, state, s):
    return update(p, g, state, s, FORM)


def scalars(steps: torch.Tensor) -> torch.Tensor:
    return step_scalars(TABLE.expand(len(steps), -1), steps)


def median_ms(fn, *args, calls: int = 12, warmup: int = 3) -> float:
    times = []
    for _ in range(warmup + calls):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=3_200_000, help="parameters, all tensors")
    parser.add_argument("--members", type=int, default=52, help="parameter tensors")
    parser.add_argument("--calls", type=int, default=12, help="timed calls of each variant")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._dynamo.config.capture_scalar_outputs = True  # the unbacked variants' .item()
    members, n = args.members, args.numel
    sizes = [n // members] * members
    n, half = sum(sizes), sum(sizes) // 2
    params = [torch.randn(s) for s in sizes]
    flat_p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    steps = torch.ones(members, dtype=torch.float64)
    rank = torch.tensor([0])
    starts = [sum(sizes[:j]) for j in range(members)]
    mine = [j for j in range(members) if j % 2 == 0]
    table = (
        torch.cat([torch.arange(starts[j], starts[j] + sizes[j]) for j in mine])
        .expand(2, -1)
        .contiguous()
    )
    member_of = torch.cat([torch.full((sizes[j],), j) for j in mine]).expand(2, -1).contiguous()

    def update_all(p, g, m, v, steps):
        new, state = RULE(p, g, {"exp_avg": m, "exp_avg_sq": v}, scalars(steps)[0])
        m.copy_(state["exp_avg"])
        v.copy_(state["exp_avg_sq"])
        p.copy_(new)

    def update_gather(params, g, m, v, steps, table, member_of, rank):
        index = table.index_select(0, rank).view(-1)
        step = scalars(steps)[member_of.index_select(0, rank).view(-1)].T
        flat = torch.cat([p.reshape(-1) for p in params])
        new, state = RULE(
            flat[index], g[index], {"exp_avg": m[index], "exp_avg_sq": v[index]}, step
        )
        m.index_put_((index,), state["exp_avg"])
        v.index_put_((index,), state["exp_avg_sq"])
        return new

    def update_window(p, g, m, v, steps, start, length):
        k = torch.arange(half)
        index, keep = (start + k).clamp(max=n - 1), k < length
        old_m, old_v = m[index], v[index]
        new, state = RULE(
            p[index], g[index], {"exp_avg": old_m, "exp_avg_sq": old_v}, scalars(steps)[0]
        )
        m.index_put_((index,), torch.where(keep, state["exp_avg"], old_m))
        v.index_put_((index,), torch.where(keep, state["exp_avg_sq"], old_v))
        return new

    def update_unbacked_window(params, g, m, v, steps, start, rank):
        s = start.item()
        torch._check(s >= 0)
        torch._check(s + half <= n)
        row = (
            torch.cat([p.reshape(-1) for p in params]).view(2, half).index_select(0, rank).view(-1)
        )
        grad = g.view(2, half).index_select(0, rank).view(-1)
        old_m, old_v = m.narrow(0, s, half), v.narrow(0, s, half)
        new, state = RULE(row, grad, {"exp_avg": old_m, "exp_avg_sq": old_v}, scalars(steps)[0])
        old_m.copy_(state["exp_avg"])
        old_v.copy_(state["exp_avg_sq"])
        return new

    def update_members(params, g, m, v, steps, rank):
        is_owner = []
        for r in range(2):
            u = (rank == r).to(torch.int64).sum().item()
            torch._check(u >= 0)
            torch._check(u <= 1)
            is_owner.append(u)
        row, step = g.new_zeros(half), scalars(steps)[0]
        for j, p in enumerate(params):
            k = p.numel() * is_owner[j % 2]  # member j is rank j % 2's, as ``mine`` above
            index = torch.arange(starts[j], starts[j] + k)
            old_m, old_v = m[index], v[index]
            new, state = RULE(
                p.reshape(-1)[:k], g[index], {"exp_avg": old_m, "exp_avg_sq": old_v}, step
            )
            m.index_put_((index,), state["exp_avg"])
            v.index_put_((index,), state["exp_avg_sq"])
            at = sum(sizes[i] for i in range(j % 2, j, 2))  # its place in its owner's row
            row.index_put_((torch.arange(at, at + k),), new)
        return row

    direction = direction_rule(FORM)

    def update_own_row(g, m, v, steps):
        d, state = direction(
            g[:half], {"exp_avg": m[:half], "exp_avg_sq": v[:half]}, scalars(steps)[0], FORM
        )
        m[:half].copy_(state["exp_avg"])
        v[:half].copy_(state["exp_avg_sq"])
        return d

    def update_own_row_and_apply(p, g, m, v, steps, other):
        d = update_own_row(g, m, v, steps)
        p.copy_(apply(p, torch.cat([d, other]), scalars(steps)[0], FORM))

    def update_row(params, g, m, v, steps, rank):
        row = (
            torch.cat([p.reshape(-1) for p in params]).view(2, half).index_select(0, rank).view(-1)
        )
        grad = g.view(2, half).index_select(0, rank).view(-1)
        new, state = RULE(
            row, grad, {"exp_avg": m[:half], "exp_avg_sq": v[:half]}, scalars(steps)[0]
        )
        m[:half].copy_(state["exp_avg"])
        v[:half].copy_(state["exp_avg_sq"])
        return new

    torch_opt = torch.optim.AdamW(
        [torch.nn.Parameter(p.clone()) for p in params],
        lr=HP["lr"],
        weight_decay=HP["weight_decay"],
    )
    for p in torch_opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    rows = [
        (
            "all (every rank, every member: the fallback)",
            n,
            torch.compile(update_all),
            (flat_p, g, m, v, steps),
        ),
        (
            "gather through an index table",
            half,
            torch.compile(update_gather),
            (params, g, m, v, steps, table, member_of, rank),
        ),
        (
            "window at a run-time offset",
            half,
            torch.compile(update_window),
            (flat_p, g, m, v, steps, torch.tensor(1000), torch.tensor(half - 5)),
        ),
        (
            "window at an unbacked offset (`.item()`) + owner-major row",
            half,
            torch.compile(update_unbacked_window),
            (params, g, m, v, steps, torch.tensor(1000), rank),
        ),
        (
            "per-member unbacked sizes",
            half,
            torch.compile(update_members),
            (params, g, m, v, steps, rank),
        ),
        (
            "owner-major row (index_select)",
            half,
            torch.compile(update_row),
            (params, g, m, v, steps, rank),
        ),
        (
            "own row, directions (state slice at a fixed offset)",
            half,
            torch.compile(update_own_row),
            (g, m, v, steps),
        ),
        (
            "own row, directions + both rows applied to every parameter",
            n,
            torch.compile(update_own_row_and_apply),
            (flat_p, g, m, v, steps, torch.randn(n - half)),
        ),
        ("torch AdamW, eager foreach", n, torch_opt.step, ()),
    ]
    print(
        f"AdamW, {members} tensors, {n / 1e6:.1f}M parameters, 1 thread, torch "
        f"{torch.__version__}, {time.strftime('%Y-%m-%d')}\n"
    )
    print("| update | elements | median (ms) |\n|---|---:|---:|")
    for name, elements, fn, inputs in rows:
        print(
            f"| {name} | {elements / 1e6:.1f}M | {median_ms(fn, *inputs, calls=args.calls):.1f} |"
        )


if __name__ == "__main__":
    main()
