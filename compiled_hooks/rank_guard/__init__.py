"""The rank-divergence guard at run time: the op ``compiled_hooks::check_ranks`` (:mod:`.op`)
that ``passes.insert_rank_guard`` puts at a compiled graph's start, and the protocol it runs
between the ranks (:mod:`.protocol`)."""

from .op import CHECK_RANKS
from .protocol import (
    POLL_SECONDS,
    RankDivergenceError,
    agreed_records,
    check,
    issued_collectives,
    unraised_verdict,
)

__all__ = [
    "CHECK_RANKS",
    "POLL_SECONDS",
    "RankDivergenceError",
    "agreed_records",
    "check",
    "issued_collectives",
    "unraised_verdict",
]
