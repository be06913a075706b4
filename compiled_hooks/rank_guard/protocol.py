"""The rank-divergence guard at run time: ``torch.ops.compiled_hooks.check_ranks(record)``.

:func:`passes.insert_rank_guard` puts one call of this op at the start of every compiled graph
that communicates, with the graph's record: per process group, the collectives it issues in
order (op, reduce op or source, dtype, shape; source line). Ranks that compiled different
graphs issue different collectives and hang or abort inside the backend; this op turns that
into :class:`RankDivergenceError`, raised before the divergent graph issues anything.

Protocol, per process group, over the default group's store (never through a collective):

* Every rank counts the collectives its guarded graphs issue on the group (their *position*).
* The first time a rank runs a graph with a record it has not agreed on with the others, it
  publishes the record at its current position and waits until every other rank has published
  what *it* will issue from that position: either the same check (the usual case: every rank
  runs the new graph) or, written by the other rank's watchdog thread, the rest of the graph
  that rank is already running (a recompile on one rank only). It compares, and either records
  the graph as agreed or publishes a verdict and raises. Ranks may reach the check minutes
  apart (one compiles, another hits the FX graph cache): a check waits up to the group's
  timeout, as a collective would.
* After that, the graph's check is a set lookup and two counter updates: no store access,
  no host synchronisation.
* A watchdog thread per process polls one counter per group in the store every
  ``POLL_SECONDS``; it answers other ranks' checks and picks up verdicts. A rank already
  blocked in a collective of an agreed graph when another rank finds the divergence is released
  when a checking rank's process exits (gloo: the connection closes; nothing else releases a
  blocked gloo collective) or by aborting its group (NCCL). It logs the verdict, raises it from
  its next guarded graph, and ``passes.install()`` used as a context manager re-raises the
  backend's error as the verdict.

What it cannot see: collectives outside compiled graphs (eager code, FSDP2's own
collectives), graphs compiled without the passes (other backends), symbolic sizes that
differ at run time, and two agreed graphs run in different orders on different ranks.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import logging
import threading
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._dynamo.utils import counters

from .. import compat

__all__ = [
    "RankDivergenceError",
    "agreed_records",
    "check",
    "issued_collectives",
    "unraised_verdict",
]

log = logging.getLogger("passes.rank_guard")  # under the passes' log: TORCH_LOGS="passes" shows it
POLL_SECONDS = 0.2  # watchdog period; also the longest a check waits between store reads
_PREFIX = "compiled_hooks/rank_guard"


class RankDivergenceError(RuntimeError):
    """Ranks of a process group would issue different collectives (raised on every rank)."""


@dataclasses.dataclass(eq=False)
class _Group:
    name: str
    pg: dist.ProcessGroup
    members: list[int]  # global ranks
    me: int
    store: dist.Store
    timeout: float
    issued: int = 0  # collectives of guarded graphs started on this group
    history: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=32)
    )
    agreed: set = dataclasses.field(default_factory=set)  # signatures checked with every rank
    open: set = dataclasses.field(default_factory=set)  # positions other ranks check at
    answered: set = dataclasses.field(default_factory=set)
    events_seen: int = 0
    verdict: str | None = None
    raised: bool = False  # the verdict has been raised on this rank

    def key(self, *parts: object) -> str:
        return "/".join((_PREFIX, self.name, *map(str, parts)))

    def learn(self, message: str) -> None:
        """Record the verdict once, and count this rank among those who know it."""
        if self.verdict is None:
            self.verdict = message
            self.store.add(self.key("acks"), 1)

    def publish(self, message: str) -> None:
        """Make ``message`` the group's verdict unless another rank's came first, and learn the
        one that stands, so every rank raises the same text."""
        self.learn(self.store.compare_set(self.key("verdict"), "", message).decode())
        self.store.add(self.key("events"), 1)

    def read_verdict(self) -> bool:
        """Learn the verdict another rank published, if there is one."""
        if not self.store.check([self.key("verdict")]):
            return False
        self.learn(self.store.get(self.key("verdict")).decode())
        return True

    def error(self) -> RankDivergenceError:
        self.raised = True
        return RankDivergenceError(self.verdict)


_lock = threading.Lock()  # guards _groups (the main thread adds, the watchdog reads)
_groups: dict[str, _Group | None] = {}
_plans: dict[str, list[tuple[_Group, list]]] = {}  # agreed record -> its groups' entries
_world: dist.ProcessGroup | None = None  # the default group the state above belongs to
_watchdog: threading.Thread | None = None
_stopping = threading.Event()


def unraised_verdict() -> RankDivergenceError | None:
    """The divergence this rank's watchdog learned of and no guard has raised here yet, as the
    error to raise; None if there is none."""
    with _lock:
        group = next(
            (g for g in _groups.values() if g is not None and g.verdict and not g.raised), None
        )
    return None if group is None else group.error()


def issued_collectives() -> int:
    """The collectives of guarded graphs this rank has started, over every group it compares
    on."""
    with _lock:
        return sum(g.issued for g in _groups.values() if g is not None)


def agreed_records() -> list[str]:
    """The records (see :mod:`passes.insert_rank_guard`) every rank has agreed on, in the order
    this rank first checked them; each is a valid argument of :func:`check`."""
    return list(_plans)


def check(record: str) -> None:
    """What ``torch.ops.compiled_hooks.check_ranks(record)`` (:data:`.op.CHECK_RANKS`) does:
    check ``record`` (JSON, see :mod:`passes.insert_rank_guard`) against the other ranks."""
    global _world
    if compat.default_group() is not _world:  # a new default group: group names start over
        with _lock:
            _groups.clear()
            _plans.clear()
            _world = compat.default_group()
    plan = _plans.get(record)
    if plan is None:
        plan = _check(record)
    for group, entries in plan:  # the fast path: bookkeeping the watchdog answers from
        if group.verdict is not None:
            raise group.error()
        group.history.append((group.issued, entries))
        group.issued += len(entries)


def _comparable(entry: list) -> list:
    return entry[:3]  # op, agreeing arguments, input dtype and shape; not the source line


def _group(name: str) -> _Group | None:
    with _lock:
        if name in _groups:
            return _groups[name]
    try:
        pg = compat.resolve_process_group(name)
    except Exception as e:
        raise RuntimeError(
            f"rank guard: the compiled graph communicates on process group {name!r}, which this "
            f"process does not know (destroyed?): {e}"
        ) from None
    group = None
    # else nothing to compare with
    if pg.size() > 1 and str(c10d.get_backend(pg)).lower() != "fake":
        group = _Group(
            name,
            pg,
            dist.get_process_group_ranks(pg),
            dist.get_rank(),
            compat.default_store(),
            compat.group_timeout(pg).total_seconds(),
        )
    with _lock:
        return _groups.setdefault(name, group)


def _check(record: str) -> list[tuple[_Group, list]]:
    start = time.perf_counter()
    plan = []
    for name, entries in sorted(json.loads(record).items()):
        group = _group(name)
        if group is None:
            continue
        if group.verdict is not None:
            raise group.error()
        signature = json.dumps([_comparable(e) for e in entries])
        if signature not in group.agreed:
            _start_watchdog()
            _exchange(group, entries)
            group.agreed.add(signature)
        plan.append((group, entries))
    _plans[record] = plan
    counters["rank_guard"]["graphs checked"] += 1
    counters["rank_guard"]["check us"] += round((time.perf_counter() - start) * 1e6)
    return plan


_NEW = "first run of a new graph"


def _exchange(group: _Group, entries: list) -> None:
    """Publish ``entries`` at this rank's position, wait for every other rank's, compare."""
    pos, store = group.issued, group.store
    store.set(group.key(pos, group.me), json.dumps({"entries": entries, "how": _NEW}))
    store.append(group.key("open"), f"{pos},")  # type: ignore[attr-defined]  # not in the stub
    store.add(group.key("events"), 1)
    answers, how = {group.me: entries}, {group.me: _NEW}
    deadline = time.monotonic() + group.timeout
    pending = [q for q in group.members if q != group.me]
    while pending:
        time.sleep(min(POLL_SECONDS, 0.005 * len(answers)))
        for q in list(pending):
            if store.check([group.key(pos, q)]):
                answer = json.loads(store.get(group.key(pos, q)))
                answers[q], how[q] = answer["entries"], answer["how"]
                pending.remove(q)
        if group.read_verdict():  # another rank found a divergence elsewhere
            raise group.error()
        if pending and time.monotonic() > deadline:
            group.publish(
                f"rank guard: rank(s) {pending} of process group {group.name!r} did not reach "
                f"collective #{pos} on it within {group.timeout:.0f} s (the group's timeout), "
                f"where rank {group.me} waits to start a new graph with {_describe(entries[0])}"
            )
            raise group.error()
    message = _compare(group, pos, answers, how)
    if message is not None:
        group.publish(message)
        _wait_for_acks(group)
        raise group.error()


def _describe(entry: list) -> str:
    op, agreeing, inputs = entry[:3]
    tensors = [inputs] if isinstance(inputs[0], str) else inputs  # one tensor or a coalesced list
    shapes = ", ".join(f"{dtype}{list(shape)}" for dtype, shape in tensors)
    args = f"({', '.join(agreeing)})" if agreeing else ""
    return f"{op}{args} {shapes}" + (f"  at {entry[3]}" if entry[3] else "")


def _compare(group: _Group, pos: int, answers: dict[int, list], how: dict[int, str]) -> str | None:
    """The verdict on ``answers`` (rank -> its collectives from ``pos`` on), the same text on
    every rank; None when they agree over the positions they all cover."""
    ranks = sorted(answers)
    shortest = min(len(a) for a in answers.values())
    # a rank with nothing to show (it passed the position long ago) differs at the position itself
    i = next(
        (
            i
            for i in range(shortest)
            if len({json.dumps(_comparable(answers[q][i])) for q in ranks}) > 1
        ),
        None if shortest else 0,
    )
    if i is None:
        return None
    lines = [
        f"  rank {q}: {_describe(answers[q][i]) if i < len(answers[q]) else '(unknown)'}   "
        f"({how[q]})"
        for q in ranks
    ]
    running = [q for q in ranks if how[q] != _NEW]
    issued = (
        f"Rank(s) {running} already issued it (a graph checked earlier) and wait in it until a "
        "checking rank exits (gloo) or the group is aborted (NCCL)."
        if running
        else "No rank issued it."
    )
    return (
        f"rank guard: the ranks of process group {group.name!r} would issue different "
        f"collectives. First difference at collective #{pos + i} on that group (counting those of "
        "guarded graphs):\n"
        + "\n".join(lines)
        + f"\n{issued} Ranks that compiled different graphs (a branch on the rank "
        "or on rank-local data, a shape that differs, a recompile on some ranks only) must not "
        "run them."
    )


def _wait_for_acks(group: _Group) -> None:
    """Give every rank's watchdog a moment to read the verdict before this rank raises (and
    perhaps exits, taking the store with it if it hosts it)."""
    deadline = time.monotonic() + 10 * POLL_SECONDS + 2
    while time.monotonic() < deadline and group.store.add(group.key("acks"), 0) < len(
        group.members
    ):
        time.sleep(POLL_SECONDS / 4)


def _start_watchdog() -> None:
    global _watchdog
    if _watchdog is None or not _watchdog.is_alive():
        _stopping.clear()
        _watchdog = threading.Thread(target=_watch, name="rank-guard-watchdog", daemon=True)
        _watchdog.start()


@atexit.register
def _stop_watchdog() -> None:
    """At exit, let the watchdog finish its store call first: a daemon thread still inside one
    while the process tears the store down aborts the process ("terminate called without an
    active exception", seen once in CI on rank 0, which hosts the TCPStore)."""
    _stopping.set()
    if _watchdog is not None:
        _watchdog.join(timeout=10 * POLL_SECONDS)


def _watch() -> None:
    dead: set = set()
    while not _stopping.wait(POLL_SECONDS):
        if compat.default_group() is not _world:
            return  # the default group the watched groups belong to is gone (destroyed or replaced)
        with _lock:
            groups = [g for g in _groups.values() if g is not None and g not in dead]
        for group in groups:
            try:
                _poll(group)
            except Exception:
                # the group or its store is gone: nothing left to watch
                log.debug("rank guard: stops watching group %s", group.name, exc_info=True)
                dead.add(group)


def _poll(group: _Group) -> None:
    """Answer other ranks' checks at positions this rank has started; pick up the verdict."""
    if group.verdict is not None:
        return
    store = group.store
    events = store.add(group.key("events"), 0)
    if events == group.events_seen and not group.open - group.answered:
        return
    group.events_seen = events
    if group.read_verdict():
        log.error("%s", group.verdict)  # this rank may be blocked in a collective: say it here too
        if str(c10d.get_backend(group.pg)).lower() == "nccl":
            group.pg.abort()  # NCCL: releases a collective waiting for a rank that will not come
        return
    if store.check([group.key("open")]):
        group.open = {int(c) for c in store.get(group.key("open")).decode().split(",") if c}
    # read issued first: history is appended first
    issued, history = (
        group.issued,
        list(group.history),
    )
    for pos in sorted(group.open - group.answered):
        if pos >= issued:
            # not there yet: this rank will check there itself, or start a graph covering it
            continue
        answer = {"entries": [], "how": f"passed collective #{pos} long ago"}
        for start, entries in history:
            if start <= pos < start + len(entries):
                answer = {
                    "entries": entries[pos - start :],
                    "how": "running a graph checked earlier",
                }
        if not store.check([group.key(pos, group.me)]):
            store.set(group.key(pos, group.me), json.dumps(answer))
        group.answered.add(pos)
