"""Where int8 gradients pay on this machine: int8 + passes against bf16 + passes on mlp-8x1024,
in ``ddp_sync.py`` and ``fsdp_step.py``, at several link rates.

    python -m benchmarks.link_sweep                       # 250mbit 500mbit 1gbit 2gbit, both
    python -m benchmarks.link_sweep --send-ns 2.0 --receive-ns 0.8 --bf16-ns 0.5
                                                          # and the projection beside each point

Each point is one run of the benchmark with ``--link RATE`` (two ranks in two network
namespaces joined by a shaped veth pair; needs root, ``ip`` and ``tc``, else the benchmark says
so and runs over loopback), running the configurations its own report needs and the int8 row
(``--configs``), its medians read back from its ``--json``. The rows compared:

- ``ddp_sync``: "compiled + int8 hook + passes" against "compiled + bf16 hook + passes";
- ``fsdp_step`` (bf16 parameters): "data_parallel keep + int8 + passes" (int8 both ways)
  against "data_parallel keep + passes".

"int8 pays at" lists the rates where the int8 row's median step is below the bf16 row's: the
measured points, nothing interpolated. With the codec's nanoseconds per value (``--send-ns``,
``--receive-ns``, ``--bf16-ns``: ``quantize_cost.py`` on this machine), each ``ddp_sync`` point
also gets what ``projection.py`` predicts for int8 minus bf16 per step (serialized, 2 ranks, the
model's parameters), beside the measured difference of the two medians; the projection models
the communication alone, so the error says how much the compute and its overlap move it.
``--plot`` draws step time against link rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

from benchmarks.common import results
from benchmarks.common.launch import ROOT, link_bytes_per_s, link_rate, module_command
from benchmarks.common.models import MODELS, SMOKE_MODEL
from benchmarks.projection import project

MODEL = "mlp-8x1024"
# benchmark -> (its bf16 row, its int8 row, its options for the model)
ROWS = {
    "ddp_sync": (
        "compiled + bf16 hook + passes",
        "compiled + int8 hook + passes",
        ["--models", MODEL],
    ),
    "fsdp_step": (
        "data_parallel keep + passes",
        "data_parallel keep + int8 + passes",
        ["--models", MODEL, "--param-dtypes", "bf16"],
    ),
}


def run_point(benchmark: str, rate: str, steps: int, smoke: bool) -> dict[str, float]:
    """One run of ``benchmark`` on a ``rate`` link: the median step of each of its rows."""
    _, int8, model = ROWS[benchmark]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        size = ["--smoke"] if smoke else ["--steps", str(steps), *model]
        cmd = module_command(benchmark, "--link", rate, *size)
        print(f"\n$ {' '.join(cmd[1:])} --configs '{int8}'", flush=True)
        subprocess.run([*cmd, "--configs", int8, "--json", out], check=True, timeout=3600, cwd=ROOT)
        with open(out) as f:
            (table,) = json.load(f)["tables"]
    return {row["config"]: row["median_ms"] for row in table["rows"]}


def params(model: str) -> int:
    """An MLP of ``ddp_sync.MODELS``: its linear layers' weights and biases."""
    _, width, depth, _ = MODELS[model]
    return depth * width * (width + 1)


def bytes_per_s(rate: str) -> float:
    link = link_bytes_per_s(rate)
    assert link is not None, "link_rate accepts only rates"
    return link


def projected_ms(model: str, rate: str, send_ns: float, receive_ns: float, bf16_ns: float) -> float:
    """``projection.py``'s int8 minus bf16 communication time per step, serialized, 2 ranks."""
    p = project(params(model), 2, bytes_per_s(rate), send_ns, receive_ns, False, bf16_ns)
    return (p.int8 - p.bf16) * 1e3


def sweep(args: argparse.Namespace) -> list[dict]:
    rows = []
    for benchmark in args.benchmarks:
        bf16, int8, _ = ROWS[benchmark]
        for rate in args.rates:
            medians = run_point(benchmark, rate, args.steps, args.smoke)
            row = {
                "config": f"{benchmark} at {rate}",
                "benchmark": benchmark,
                "gbit_s": bytes_per_s(rate) * 8 / 1e9,
                "bf16_ms": medians[bf16],
                "median_ms": medians[int8],
                "int8_over_bf16": medians[int8] / medians[bf16],
                "measured_diff_ms": medians[int8] - medians[bf16],
                "projected_diff_ms": None,
            }
            if args.send_ns is not None and benchmark == "ddp_sync":
                row["projected_diff_ms"] = projected_ms(
                    args.model, rate, args.send_ns, args.receive_ns, args.bf16_ns
                )
            rows.append(row)
    return rows


def report(rows: list[dict], model: str) -> None:
    print(
        f"\n{model}, int8 + passes against bf16 + passes, 2 ranks, one run per point; "
        f"{time.strftime('%Y-%m-%d')}\n"
    )
    print(
        "| benchmark | link (Gbit/s) | bf16 + passes (ms) | int8 + passes (ms) | int8 / bf16 | "
        "int8 - bf16 measured (ms) | projected (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        projected = "-" if r["projected_diff_ms"] is None else f"{r['projected_diff_ms']:+.1f}"
        print(
            f"| {r['benchmark']} | {r['gbit_s']:g} | {r['bf16_ms']:.1f} | {r['median_ms']:.1f} | "
            f"{r['int8_over_bf16']:.2f}x | {r['measured_diff_ms']:+.1f} | {projected} |"
        )
    for benchmark in dict.fromkeys(r["benchmark"] for r in rows):
        points = [r for r in rows if r["benchmark"] == benchmark]
        pays = [f"{r['gbit_s']:g} Gbit/s" for r in points if r["int8_over_bf16"] < 1]
        not_yet = [f"{r['gbit_s']:g} Gbit/s" for r in points if r["int8_over_bf16"] >= 1]
        print(
            f"\n{benchmark}: int8 pays at {', '.join(pays) or 'no rate measured'}; "
            + (f"not at {', '.join(not_yet)}." if not_yet else "that is, at every rate measured.")
        )
    errors = [
        abs(r["projected_diff_ms"] - r["measured_diff_ms"])
        for r in rows
        if r["projected_diff_ms"] is not None
    ]
    if errors:
        print(
            f"projection against the measured difference: off by {min(errors):.1f} to "
            f"{max(errors):.1f} ms per step"
        )


def plot(rows: list[dict], model: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for benchmark in dict.fromkeys(r["benchmark"] for r in rows):
        points = sorted((r for r in rows if r["benchmark"] == benchmark), key=lambda r: r["gbit_s"])
        x = [r["gbit_s"] for r in points]
        ax.plot(x, [r["bf16_ms"] for r in points], "o-", label=f"{benchmark}: bf16 + passes")
        ax.plot(x, [r["median_ms"] for r in points], "s--", label=f"{benchmark}: int8 + passes")
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Gbit/s)")
    ax.set_ylabel("median step (ms)")
    ax.set_title(f"{model}, 2 ranks, {time.strftime('%Y-%m-%d')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates", nargs="+", type=link_rate, default=["250mbit", "500mbit", "1gbit", "2gbit"]
    )
    parser.add_argument("--benchmarks", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--send-ns", type=float, help="ns per value: int8 quantize, feedback")
    parser.add_argument("--receive-ns", type=float, help="ns per value: int8 dequantize and sum")
    parser.add_argument("--bf16-ns", type=float, default=0.0, help="ns per value: bf16 cast")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="each benchmark's --smoke at the first rate only: checks that the sweep works",
    )
    results.add_output_arguments(parser)
    args = parser.parse_args()
    if (args.send_ns is None) != (args.receive_ns is None):
        parser.error("--send-ns and --receive-ns go together (the projection needs both)")
    args.model = SMOKE_MODEL if args.smoke else MODEL
    if args.smoke:
        args.rates = args.rates[:1]
    rows = sweep(args)
    report(rows, args.model)
    where = f"2 ranks on shaped links: {', '.join(args.rates)}"
    table = results.table(f"{args.model}: int8 against bf16", rows, ratio="int8_over_bf16")
    results.write(argparse.Namespace(json=args.json, plot=None), "link_sweep", where, [table])
    if args.plot:
        plot(rows, args.model, args.plot)


if __name__ == "__main__":
    main()
