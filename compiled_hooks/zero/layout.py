"""Where ZeRO puts things: pure functions of sizes, owners and the world size, the same on every
rank, so every rank plans the same buckets and traces the same graph.

- :func:`assign_whole_parameters`: which rank owns each parameter (whole parameters).
- :func:`plan_buckets`: the buckets the ZeRO hooks reduce, in gradient-ready order.
- :func:`owner_rows`: a bucket laid out owner-major, one row per rank.
- :func:`lay_out_state`: where each rank keeps the state of what it owns, by bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BALANCE_SLACK",
    "Assignment",
    "OwnerRows",
    "Run",
    "StateLayout",
    "assign_whole_parameters",
    "lay_out_state",
    "owner_rows",
    "plan_buckets",
    "rows_balanced",
]

# Whole parameters: how far a bucket's longest owner row may exceed an equal share
BALANCE_SLACK = 0.05

Piece = tuple[int, int]  # (offset in a rank's state buffers, elements)


def rows_balanced(longest: int, total: int, world_size: int) -> bool:
    """Whether owner rows of ``total`` elements (or bytes), the longest ``longest``, are within
    ``BALANCE_SLACK`` of equal."""
    return world_size * longest <= (1 + BALANCE_SLACK) * total


@dataclass(frozen=True)
class Assignment:
    """Whole parameters: ``owner[i]`` owns parameter ``i``, whose state starts at ``offset[i]``
    in its owner's buffers (before :func:`lay_out_state` moves it); ``load[r]``: rank ``r``'s
    elements."""

    owner: list[int]
    offset: list[int]
    load: list[int]


def assign_whole_parameters(numels: list[int], world_size: int) -> Assignment:
    """Parameters of ``numels``, given in gradient-ready order: largest first (stable), each to
    the least-loaded rank (lowest rank on ties); within its owner's buffers a parameter's offset
    follows gradient-ready order, so the parameters one rank owns in a bucket sit side by side."""
    owner, load = [0] * len(numels), [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = min(range(world_size), key=lambda r: load[r])
        owner[i] = r
        load[r] += numels[i]
    offset, end = [0] * len(numels), [0] * world_size
    for i, r in enumerate(owner):
        offset[i], end[r] = end[r], end[r] + numels[i]
    return Assignment(owner, offset, load)


def plan_buckets(
    nbytes: list[int],
    owners: list[int] | None,
    world_size: int,
    first_cap: int,
    cap: int,
    order: list[int] | None = None,
) -> list[list[int]]:
    """The ZeRO hooks' buckets over parameters of ``nbytes``, each listed in the order its
    members are laid out: parameters in reverse ``order`` (the module's parameter order, default
    the optimizer's; its reverse is DDP's guess at gradient-ready order) packed up to ``cap``
    bytes (the first up to ``first_cap``, as DDP does). With whole parameters (``owners`` given) a
    bucket goes on the wire as owner rows
    padded to the longest, so a full bucket closes only where its rows are within
    ``BALANCE_SLACK`` of equal, or once it holds twice its cap. ``owners=None``
    (``shard_buckets``): every bucket is balanced."""
    buckets: list[list[int]] = []
    current: list[int] = []
    rows = [0] * world_size
    for i in reversed(range(len(nbytes)) if order is None else order):
        current.append(i)
        rows[owners[i] if owners is not None else 0] += nbytes[i]
        size, limit = sum(rows), cap if buckets else first_cap
        balanced = owners is None or rows_balanced(max(rows), size, world_size)
        if size >= limit and (balanced or size >= 2 * limit):
            buckets.append(current)
            current, rows = [], [0] * world_size
    return buckets + ([current] if current else [])


@dataclass(frozen=True)
class OwnerRows:
    """A bucket laid out owner-major (row r: the members rank r owns, in bucket order, padded
    to the longest row): each member's ``(row, offset in the row)``, and each row's length."""

    place: list[tuple[int, int]]
    lengths: list[int]

    @property
    def length(self) -> int:
        return max(self.lengths)


def owner_rows(numels: list[int], owners: list[int], world_size: int) -> OwnerRows:
    place, used = [], [0] * world_size
    for numel, r in zip(numels, owners):
        place.append((r, used[r]))
        used[r] += numel
    return OwnerRows(place, used)


@dataclass(frozen=True)
class Run:
    """A planned bucket's run of state: elements ``start .. start + length`` of every rank's
    buffers hold that rank's owner row (each member at its place); ``lengths``: the rows'
    lengths where they differ (the shorter rows' tails hold other state), else ``None``."""

    start: int
    length: int
    place: list[tuple[int, int]]
    lengths: list[int] | None


@dataclass(frozen=True)
class StateLayout:
    """See :func:`lay_out_state`."""

    runs: dict[tuple[int, ...], Run]
    pieces: list[list[Piece]]
    size: int


def lay_out_state(
    numels: list[int], owner: list[int], buckets: list[list[int]], world_size: int
) -> StateLayout:
    """Whole parameters: where each rank keeps the optimizer state of the parameters it owns,
    given the buckets the ZeRO hooks reduce (each in its owner-major order, :func:`owner_rows`).
    The same on every rank.

    - ``runs``: a bucket whose owner rows are within ``BALANCE_SLACK`` of equal gets a
      :class:`Run`, so the sharded update reads and writes one slice at an offset the same on
      every rank.
    - ``pieces[i]``: where parameter ``i``'s state lies in its owner's buffers, in order. A
      planned bucket's member is one piece in its run; the others' members fill their owner's
      free tails, then follow the runs, split where a tail ends.
    - ``size``: the buffers' length, ``max(loads)`` as with no runs at all: runs are planned only
      while their lengths sum to at most that (the most padded dropped first), and then every
      rank's state fits. So the layout costs no state memory::

          rank 0: [ b0 row 0 ........ | b1 row 0 .. p p | b2 row 0 ...... | p ]
          rank 1: [ b0 row 1 ..... q q | b1 row 1 ....... | b2 row 1 .. q q | q q ]
                    (p, q: rank 0's and rank 1's members of unbalanced buckets)
    """
    load = [0] * world_size
    for i, r in enumerate(owner):
        load[r] += numels[i]
    candidates = []  # (members, rows)
    for members in buckets:
        rows = owner_rows([numels[i] for i in members], [owner[i] for i in members], world_size)
        if rows_balanced(rows.length, sum(rows.lengths), world_size):
            candidates.append((members, rows))
    while sum(rows.length for _, rows in candidates) > max(load):
        candidates.remove(
            max(candidates, key=lambda c: world_size * c[1].length - sum(c[1].lengths))
        )
    runs: dict[tuple[int, ...], Run] = {}
    pieces: list[list[Piece]] = [[] for _ in numels]
    start = 0
    # per rank: (lo, hi), in order
    free: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for members, rows in candidates:
        for i, (_, at) in zip(members, rows.place):
            pieces[i] = [(start + at, numels[i])]
        for r in range(world_size):
            free[r].append((start + rows.lengths[r], start + rows.length))
        uneven = rows.lengths if len(set(rows.lengths)) > 1 else None
        runs[tuple(members)] = Run(start, rows.length, rows.place, uneven)
        start += rows.length
    for r in range(world_size):
        free[r].append((start, start + sum(numels)))
    in_runs = {i for key in runs for i in key}
    for members in buckets:
        for i in members:
            if i in in_runs:
                continue
            need, holes = numels[i], free[owner[i]]
            while need:
                lo, hi = holes[0]
                n = min(need, hi - lo)
                if n:
                    pieces[i].append((lo, n))
                need -= n
                holes[0] = (lo + n, hi)
                if lo + n == hi:
                    holes.pop(0)
            if not pieces[i]:  # an empty parameter
                pieces[i] = [(0, 0)]
    size = max([start] + [lo + n for ps in pieces for lo, n in ps])
    return StateLayout(runs, pieces, size)
