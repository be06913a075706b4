"""ZeRO-1 for compiled (and eager) DDP: a sharded optimizer whose step runs inside the gradient
hooks, with a graph that is the same on every rank.

The eager original (``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook`` on top of
``ZeroRedundancyOptimizer(overlap_with_ddp=True)``) learns DDP's bucket layout at run time, so
its first iterations update nothing, and it needs NCCL. Here the layout is fixed when the
optimizer is built, so parameters change from the first step, on any backend.

Rank independence. Ranks that trace different graphs issue collectives in different orders
(gloo aborts with "collective mismatch" or hangs), so nothing traced branches on the rank: the
rank is *data*, read when the graph runs by ``torch.ops.compiled_hooks.group_rank``.

Gradients are reduced in buckets (DDP's: its C++ reducer's own buckets in eager mode; in
compiled mode, gradients packed in gradient-ready order up to DDP's ``bucket_cap_mb``, the
first up to 1 MB), one ``hook`` call per bucket, so a step issues about as many collectives as
DDP plus one broadcast per rank per bucket:

- ``shard_buckets=False``: whole parameters, assigned greedily by size (largest first, ties in
  gradient-ready order) to the least-loaded rank. A bucket is laid out owner-major: row r holds
  the gradients of the members rank r owns, every row padded to the longest (the hooks close a
  full bucket where its rows are nearly equal, see :class:`ZeroStep`); each rank reads its own
  row of the averaged bucket. Where the optimizer reads the parameter only as
  ``param * decay - scale * direction`` (AdamW; Adam and SGD without weight decay), the
  bucket's rows are balanced and its members' groups agree on what the direction reads (betas
  and eps; momentum and dampening), the state is laid out by the hooks' buckets
  (:meth:`ZeroOptimizer.plan_buckets`, :func:`~.layout.lay_out_state`: each bucket's run of
  state holds this rank's row, at the same offset on every rank; the shorter rows' tails hold
  other members' state, so no memory is added), and the optimizer compute is sharded: each rank
  computes the direction for its own row only, every rank's row of directions is broadcast
  from that rank, and every rank applies them with each member's own learning rate::

      g = hook(owner_major(grads))[rank]            # one all_reduce (avg) per bucket, own row read
      u, s[run] = direction(g, s[run], step)        # this rank's row only (its length: where)
      p <- p * decay - scale * cat(broadcast(u, src=r) for r)[owner(p), place(p)]

  Otherwise (Adam's or SGD's weight decay adds ``wd * param`` to the gradient; an unbalanced
  bucket; buckets of eager DDP's C++ reducer) every rank computes the update of every member
  from its row (right on the member's owner; elsewhere thrown away: the state, at the same
  offset on every rank in its owner's buffer, is kept only where ``owner == rank``, a
  ``torch.where`` on the rank), and every rank's own row of *new values* is broadcast.
  Reading only the own row lets ``passes`` reduce just that row: ``all_to_all_weight_update``
  (gloo) and ``shard_weight_update`` (NCCL) turn the all_reduce + broadcasts into an exchange
  that moves the bytes of one all_reduce.
- ``shard_buckets=True``: every parameter is split evenly (flat, padded to a multiple of N);
  the bucket is reduced rank-major (this rank's slice of the bucket holds its slice of every
  member), each rank updates its slices (selected with ``group_rank``) and the bucket's slices
  are broadcast from every rank and concatenated, rewritten by the same passes.

In both layouts the averaged gradient is not written back: in compiled DDP ``param.grad`` keeps
this rank's local gradient.

Both schedules of the original: :func:`hook_with_zero_step` updates after the last gradient
(python reducer: a final autograd callback; C++ reducer: the last bucket), and
:func:`hook_with_zero_step_interleaved` updates each bucket as soon as its gradients are
reduced. ``passes.interleave_zero_broadcasts`` schedules the compiled graph accordingly.

Modules, by role: :mod:`.layout` (where things go: pure functions), :mod:`.optim_math` (the
traced updates), :mod:`.optimizer` (``ZeroOptimizer``, a ``torch.optim.Optimizer``),
:mod:`.checkpoint` (a rank's slice as checkpoint chunks), :mod:`.hooks` (the step inside DDP's
backward).
"""

from .hooks import ZeroStep, hook_with_zero_step, hook_with_zero_step_interleaved
from .layout import assign_whole_parameters, lay_out_state, plan_buckets
from .optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer", "ZeroStep", "assign_whole_parameters", "hook_with_zero_step",
           "hook_with_zero_step_interleaved", "lay_out_state", "plan_buckets"]
