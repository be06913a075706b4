"""Redraw a benchmark's PNG from its ``--json`` file (:func:`benchmarks.common.results.plot`).

python -m benchmarks.plot RESULTS.json OUT.png     # needs pip install -e ".[bench]"
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common.results import plot, plot_path


def main() -> None:
    parser = argparse.ArgumentParser(description="Redraw a benchmark's PNG from its --json file.")
    parser.add_argument("results")
    parser.add_argument("png", type=plot_path)
    cli = parser.parse_args()
    with open(cli.results) as f:
        plot(json.load(f), cli.png)


if __name__ == "__main__":
    main()
