"""The rank guard's custom op (namespace ``compiled_hooks``), registered on import:
``check_ranks(record)``, which ``passes.insert_rank_guard`` puts at a graph's start, runs
:func:`.protocol.check`. It has a side effect: never dead-code eliminated."""

from __future__ import annotations

import torch

from .protocol import check

__all__ = ["CHECK_RANKS"]


@torch.library.custom_op("compiled_hooks::check_ranks", mutates_args=())
def _check_ranks(record: str) -> None:
    check(record)


@_check_ranks.register_fake
def _(record: str) -> None:
    return None


CHECK_RANKS = torch.ops.compiled_hooks.check_ranks.default
torch.fx.node.has_side_effect(CHECK_RANKS)  # the check matters though nothing reads a result
