"""Start a benchmark's two ranks: spawned over loopback, or on a bandwidth-bound link.

Over loopback communication is nearly free, so gradient communication shows its cost only on a
link with a bandwidth limit, the regime of multi-node data parallelism. ``--link RATE`` (tc rate
syntax: ``2gbit``, ``500mbit``) runs the two ranks on one machine, each in its own network
namespace, joined by a veth pair shaped with ``tc ... tbf`` to RATE in each direction. That
needs root, ``ip`` and ``tc``; without them the benchmark says why and runs over loopback.

    parser = argparse.ArgumentParser(); add_link_argument(parser); parser.set_defaults(world_size=2)
    launch(worker, parser.parse_args())   # worker(rank, world_size, args) -> bool in a gloo group

``describe_link()`` is the line a benchmark prints so its table says where it was measured.
``add_smoke_argument`` / ``apply_smoke`` give a step benchmark its ``--smoke`` run.
The group is gloo's on CPU: under torchrun, or on the link, each rank joins from the environment;
otherwise ``args.world_size`` ranks (default 2) are spawned over loopback. A worker returning
False makes its process exit with code 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_RATE = re.compile(r"^\d+(\.\d+)?[kmg]?bit$")
_LINK_ENV = "BENCH_LINK"  # set in the ranks started on a shaped link: its rate


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def module_command(name: str, *args: str) -> list[str]:
    """The command that runs the benchmark ``name`` (``python -m benchmarks.<name>``); run it
    with ``cwd=ROOT``, the repository root, where ``benchmarks`` imports."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def this_command() -> list[str]:
    """The command that started this process, to start it again (from :data:`ROOT`)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None:  # python -m benchmarks.<name>
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    return [sys.executable, *sys.argv]


def link_rate(text: str) -> str:
    """argparse type: a tc rate in bits per second (``2gbit``, ``500mbit``)."""
    if not _RATE.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a rate such as 2gbit, 500mbit or 100kbit"
        )
    return text


def link_bytes_per_s(link: str | None) -> float | None:
    """The link's rate in bytes per second (``"2gbit"`` -> 2.5e8); None for loopback."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])bit", (link or "").lower())
    if not match:
        return None
    return float(match.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)] / 8


# bytes per element of the dtypes the profiler names in a collective's recorded inputs
_ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "signed char": 1}


def itemsize(profiler_dtype: str) -> int:
    """Bytes per element of a dtype as ``torch.profiler`` names it (4 for one not listed)."""
    return _ITEMSIZE.get(profiler_dtype, 4)


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs, each after a barrier, the first run left
    out (warm-up)."""
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def interleaved_median_ms(steps: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median wall time of each of ``steps``, run one of each in turn for ``rounds`` rounds (the
    configurations of a benchmark side by side, as the machine drifts)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def add_link_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--link",
        type=link_rate,
        metavar="RATE",
        help="run the two ranks on a link shaped to RATE (e.g. 2gbit; needs root, ip and tc)",
    )


def add_smoke_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run, to check that the script works (the slow tier of the tests runs "
        "it): one small model, 2 steps, only the configurations its report needs; not a "
        "measurement",
    )


def add_configs_argument(parser: argparse.ArgumentParser, configs: list[str]) -> None:
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=configs,
        metavar="CONFIG",
        help="run these configurations besides those the report needs (default: every one; "
        "with --smoke, only those the report needs): " + "; ".join(configs),
    )


def chosen_configs(args: argparse.Namespace, configs: list[str], needed: list[str]) -> list[str]:
    """The configurations to run, in ``configs``' order: every one, or ``needed`` (what the
    script's report reads) with ``--smoke``; with ``--configs``, ``needed`` and those."""
    if args.configs is None and not args.smoke:
        return list(configs)
    wanted = {*needed, *(args.configs or ())}
    return [c for c in configs if c in wanted]


def apply_smoke(args: argparse.Namespace, **smallest: object) -> argparse.Namespace:
    """With ``--smoke``: 2 steps and ``smallest`` (a script's smallest model) in place of the
    parsed options; the script keeps only the configurations its report needs."""
    if args.smoke:
        vars(args).update(steps=2, **smallest)
    return args


def describe_link() -> str:
    """Where this group's ranks talk: call inside the group."""
    rate = os.environ.get(_LINK_ENV)
    if rate:
        return f"2 ranks on a {rate} link (veth pair between two network namespaces, tc tbf)"
    return f"{dist.get_world_size()} ranks over loopback"


def link_problem() -> str | None:
    """Why a shaped link cannot be set up here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    return None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class LinkUnavailable(RuntimeError):
    """The shaped link could not be set up (the message says which command failed)."""


def run_on_link(rate: str, argv: list[str]) -> int:
    """Run ``argv`` as ranks 0 and 1 on a ``rate`` link; rank 0 prints here. Returns the exit code
    (nonzero when either rank failed; rank 1's output is then printed too). Raises
    ``LinkUnavailable`` when the namespaces, the veth pair or the shaping cannot be made."""
    tag = f"bl{os.getpid() % 100000}"
    ns, dev = (f"{tag}a", f"{tag}b"), (f"v{tag}a", f"v{tag}b")
    subnet = f"10.78.{os.getpid() % 200 + 1}"
    addr = (f"{subnet}.1", f"{subnet}.2")
    try:
        try:
            _make_link(rate, ns, dev, addr)
        except subprocess.CalledProcessError as e:
            raise LinkUnavailable(f"{' '.join(e.cmd)}: {e.stderr.strip()}") from None
        env = dict(
            os.environ,
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=addr[0],
            MASTER_PORT="29631",
            **{_LINK_ENV: rate},
        )
        with tempfile.NamedTemporaryFile("w+", prefix="rank1-", suffix=".log") as log:
            rank1 = subprocess.Popen(
                ["ip", "netns", "exec", ns[1], *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=dict(env, RANK="1", GLOO_SOCKET_IFNAME=dev[1]),
            )
            rc0 = subprocess.call(
                ["ip", "netns", "exec", ns[0], *argv],
                cwd=ROOT,
                env=dict(env, RANK="0", GLOO_SOCKET_IFNAME=dev[0]),
            )
            rc1 = rank1.wait()
            if rc1 != 0:
                log.seek(0)
                print(
                    f"rank 1 failed (exit {rc1}); its output:\n{log.read()[-6000:]}",
                    file=sys.stderr,
                )
        return rc0 or rc1
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _make_link(rate: str, ns: tuple[str, str], dev: tuple[str, str], addr: tuple[str, str]) -> None:
    for n in ns:
        _sh("ip", "netns", "add", n)
    _sh("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
    for n, d, a in zip(ns, dev, addr):
        _sh("ip", "link", "set", d, "netns", n)
        _sh("ip", "-n", n, "addr", "add", f"{a}/24", "dev", d)
        _sh("ip", "-n", n, "link", "set", d, "up")
        _sh("ip", "-n", n, "link", "set", "lo", "up")
        _sh(
            "tc",
            "-n",
            n,
            "qdisc",
            "add",
            "dev",
            d,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "512kb",
            "latency",
            "50ms",
        )


def _in_group(
    rank: int, world_size: int, port: int | None, worker: Callable[..., bool], args: Any
) -> None:
    """``worker(rank, world_size, args)`` in a gloo group; exit code 1 when it returns False."""
    if port is None:  # torchrun, or the shaped link: rank and rendezvous from the environment
        dist.init_process_group("gloo")
    else:
        torch.set_num_threads(1)  # the spawned ranks share this machine's cores
        # as torchrun says it: every rank on this host (the passes' gloo defaults read it)
        os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    try:
        ok = worker(dist.get_rank(), dist.get_world_size(), args)
        dist.barrier()  # gloo aborts a process whose peer tore the group down first
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def launch_ranks(worker: Callable[..., bool], args: argparse.Namespace) -> None:
    """Under torchrun (or on the link) run this rank; otherwise spawn ``args.world_size`` (2)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _in_group(-1, -1, None, worker, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world_size = getattr(args, "world_size", None) or 2
    mp.spawn(_in_group, args=(world_size, port, worker, args), nprocs=world_size)


def launch(
    worker: Callable[[int, int, argparse.Namespace], bool], args: argparse.Namespace
) -> None:
    """Run ``worker(rank, world_size, args)`` on every rank, over ``args.link`` when given."""
    if "RANK" not in os.environ and getattr(args, "link", None):
        problem = link_problem()
        if problem is None:
            try:
                sys.exit(run_on_link(args.link, this_command()))
            except LinkUnavailable as e:
                problem = f"could not set up the link ({e})"
        print(f"--link {args.link}: {problem}; measuring over loopback instead", flush=True)
    torch.set_num_threads(1)  # the two ranks share this machine's cores (spawned ranks set it too)
    launch_ranks(worker, args)
