"""ZeRO-1 for compiled (and eager) DDP: a sharded optimizer whose step runs inside the gradient
hooks, with a graph that is the same on every rank. Unlike the eager original
(``ddp_zero_hook`` on ``ZeroRedundancyOptimizer(overlap_with_ddp=True)``), the bucket layout is
fixed when the optimizer is built, so parameters change from the first step, on any backend.

The design is in docs/zero.md: how the graph stays the same on every rank, the two layouts and
what each rank computes, the schedules, checkpoints and numerics.

Modules, by role: :mod:`.layout` (where things go: pure functions), :mod:`.buckets` (a bucket on
the wire), :mod:`.storage` (the two storage strategies), :mod:`.optim_math` (the traced
updates), :mod:`.optimizer` (``ZeroOptimizer``, a ``torch.optim.Optimizer``),
:mod:`.checkpoint` (state dicts), :mod:`.flat_shard` (a rank's slice as checkpoint chunks),
:mod:`.hooks` (the step inside DDP's backward).
"""

from .hooks import ZeroStep, hook_with_zero_step, hook_with_zero_step_interleaved
from .layout import assign_whole_parameters, lay_out_state, plan_buckets
from .optimizer import ZeroOptimizer

__all__ = [
    "ZeroOptimizer",
    "ZeroStep",
    "assign_whole_parameters",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "lay_out_state",
    "plan_buckets",
]
