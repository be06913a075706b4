"""The contract between ``compiled_hooks``, which writes the traced graph, and ``passes``, which
rewrites it: every mark, custom op and switch the passes read is named here, and the passes
import them from here only. Each is defined where it is written: the marks and the regions'
switch in :mod:`.marks`, each op in the feature that owns and registers it.

What the hooks leave in Inductor's post-grad graph, and the passes rely on:

- **A comm hook's chain** around each functional collective (``_c10d_functional``)::

      start -> [scale | cast | view]* -> collective -> wait_tensor -> [scale | cast | view]* -> end

  ``scale`` multiplies or divides by a Python number, ``cast`` converts between floating
  dtypes, ``view`` reshapes; every node strictly inside the chain has one user
  (``passes.core.chains`` matches it; a collective with anything else around it is left alone).
- **A data_parallel block** (:mod:`compiled_hooks.fsdp.gather`): every traced node of one
  parameter's gather and of its gradient's reduction carries ``meta["custom"][BLOCK]``, the
  name of its block (``""`` for the root), forward and backward; with ``hybrid_shard`` the
  replicas' all-reduce chain after a reduce-scatter carries the same mark.
- **The int8 path** (:mod:`compiled_hooks.int8`): every collective that carries packed int8
  rows is traced under ``meta["custom"][INT8]`` (True); the passes take a collective for one
  by the mark and its int8 input. Compiled autograd drops the marks from the backward it
  compiles: in a graph with no mark, the int8 input alone. The error-feedback residuals are
  graph inputs that the graph updates in place: functionalization reads the input and writes
  the new value back with a ``copy_`` into it at the graph's end, so the receive side of an
  int8 collective holds no side effect. A packed collective's result (int8 blocks behind their
  4-byte scales) is read only by :data:`DEQUANTIZE_PACKED`, which takes any strides, so the
  passes may bucket it.
- **PowerSGD** counts each hook call with :data:`POWERSGD_COUNT` (a side effect), whose use
  marks the all-reduces of its factors.
- **ZeRO's sharded update** reads this rank's index in a group with :data:`GROUP_RANK`.
- **Blocks as regions** (:mod:`compiled_hooks.fsdp.regions`): inside
  :func:`compile_blocks_once`, a traced ``data_parallel`` root runs each block as an
  ``invoke_subgraph`` region on its gathered parameters; the gathers and reductions stay outside
  it, and a traced gather runs under no checkpoint, its nodes marked ``meta["custom"][RESHARD]``
  (its ``reshard_after_forward``). The passes turn the switch on with the joint-graph rewrites
  that keep it (``passes.recompute_gathers`` tags the gathers; ``passes.forward_region_inputs``).
- **A block's bucket copies** (:mod:`.bucket_copies`): the passes write a block bucket's
  copy-in as :data:`BUCKET_PACK` and an all-gather bucket's copy-out as :data:`BUCKET_UNPACK`;
  gloo's all-to-all forms copy with them too; a reduce-scatter's local sum is :data:`RANK_SUM`
  (:mod:`.rank_sum`), which takes over a sender's division by :func:`exact_predivisor`.
- **The rank guard**: :data:`CHECK_RANKS`, inserted by ``passes.insert_rank_guard``, runs
  :func:`compiled_hooks.rank_guard.check`.

Switches: :func:`compile_blocks_once`, which the passes turn on; :data:`VERIFY_ENV` and
:data:`CHECK_RANKS_ENV`, which they read from the environment, parsed by :func:`env_flag`.
"""

from __future__ import annotations

import os

from .bucket_copies import BUCKET_PACK, BUCKET_UNPACK
from .int8.ops import DEQUANTIZE_PACKED
from .marks import BLOCK, INT8, RESHARD, blocks_compile_once, compile_blocks_once
from .powersgd.ops import POWERSGD_COUNT
from .rank_guard import CHECK_RANKS
from .rank_sum import RANK_SUM, exact_predivisor
from .zero.group_rank import GROUP_RANK

__all__ = [
    "BLOCK",
    "BUCKET_PACK",
    "BUCKET_UNPACK",
    "INT8",
    "CHECK_RANKS",
    "CHECK_RANKS_ENV",
    "DEQUANTIZE_PACKED",
    "GROUP_RANK",
    "POWERSGD_COUNT",
    "RANK_SUM",
    "RESHARD",
    "VERIFY_ENV",
    "env_flag",
    "exact_predivisor",
    "compile_blocks_once",
    "blocks_compile_once",
]

VERIFY_ENV = "PASSES_VERIFY"  # check every rewrite (passes.core.verify)
CHECK_RANKS_ENV = "PASSES_CHECK_RANKS"  # insert the rank guard (passes.insert_rank_guard)

_ON, _OFF = ("1", "true"), ("0", "false", "")


def env_flag(name: str, default: bool = False) -> bool:
    """The on/off environment variable ``name``: ``1``/``true`` on, ``0``/``false``/empty off
    (any case), ``default`` when unset; anything else is a ``ValueError`` naming it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected 1, 0, true or false")
