"""A benchmark's results as data (``--json PATH``) and as a picture (``--plot PATH``).

Every benchmark prints Markdown tables; with these options rank 0 also writes them as JSON::

    {"benchmark": "ddp_sync", "date": "...", "machine": "...", "torch": "...", "where": "...",
     "tables": [{"title": "mlp-8x1024", "columns": [...], "rows": [{...}, ...],
                 "bound_ms": 81.5, "value": "median_ms", "ratio": "vs_best_peer"}]}

and a PNG: one panel per table, a bar per configuration (its ``value``, e.g. the median step),
labelled with its ratio, and the table's bound as a dashed line where it has one.
``python -m benchmarks.plot RESULTS.json OUT.png`` redraws a PNG from a JSON file.
matplotlib is needed for plots only: ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
import time
from typing import Any


def plot_path(path: str) -> str:
    """``--plot``'s value, refused while parsing (not after the run) without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError('needs matplotlib: pip install -e ".[bench]"') from None
    return path


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        type=plot_path,
        help="draw the results as a PNG (rank 0; needs matplotlib)",
    )


def machine() -> str:
    """The host in a few words: CPU model, cores, memory, and the GPU if one is visible."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = ""
    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    import torch

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {os.cpu_count()} cores{memory}{gpu}"


def table(
    title: str,
    rows: list[dict[str, Any]],
    *,
    value: str = "median_ms",
    ratio: str | None = None,
    bound_ms: float | None = None,
    note: str = "",
) -> dict[str, Any]:
    """One table: ``rows`` are dicts with a ``config`` key and the same keys in every row."""
    if not rows or any("config" not in r or value not in r for r in rows):
        raise ValueError(f"table {title!r}: every row needs 'config' and {value!r}")
    return {
        "title": title,
        "columns": list(rows[0]),
        "rows": rows,
        "value": value,
        "ratio": ratio,
        "bound_ms": bound_ms,
        "note": note,
    }


def write(
    args: argparse.Namespace, benchmark: str, where: str, tables: list[dict[str, Any]]
) -> None:
    """Write ``--json`` and ``--plot`` if asked (call on rank 0 only)."""
    if not (getattr(args, "json", None) or getattr(args, "plot", None)):
        return
    import torch

    results = {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "torch": torch.__version__,
        "where": where,
        "argv": sys.argv[1:],
        "tables": tables,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"results written to {args.json}", flush=True)
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}", flush=True)


def plot(results: dict[str, Any], path: str) -> None:
    """Draw ``results`` as a PNG at ``path`` (its argument parsed by :func:`plot_path`, which
    checks for matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = results["tables"]
    heights = [0.9 + 0.38 * len(t["rows"]) for t in tables]
    fig, axes = plt.subplots(
        len(tables),
        1,
        figsize=(9, sum(heights) + 0.8),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, t in zip(axes[:, 0], tables):
        names = [r["config"] for r in t["rows"]][::-1]
        values = [r[t["value"]] for r in t["rows"]][::-1]
        bars = ax.barh(
            names,
            values,
            color=[
                "#4c72b0" if "passes" in n or "compiled ZeRO" in n else "#a0a0a0" for n in names
            ],
        )
        if t["ratio"]:
            labels = [
                f"{v:.1f}" + ("" if r[t["ratio"]] is None else f"  ({r[t['ratio']]:.2f}x)")
                for v, r in zip(values, t["rows"][::-1])
            ]
            ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
        if t.get("bound_ms"):
            ax.axvline(t["bound_ms"], color="#c44e52", linestyle="--", linewidth=1)
            ax.text(t["bound_ms"], -0.45, " bound", color="#c44e52", fontsize=8, va="bottom")
        ax.set_title(textwrap.fill(t["title"], 90), fontsize=9, loc="left")
        ax.set_xlim(0, max(values + [t.get("bound_ms") or 0]) * 1.3)
        ax.set_xlabel(t["value"].replace("_ms", " (ms)").replace("_", " "), fontsize=8)
        ax.tick_params(labelsize=8)
    fig.suptitle(
        f"{results['benchmark']}: {results['where']}\n{results['date']}, {results['machine']}, "
        f"torch {results['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
