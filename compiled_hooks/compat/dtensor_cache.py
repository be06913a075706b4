"""AOTAutograd's cache key of a DTensor graph input, made this rank's own. Part of
:mod:`compiled_hooks.compat`, which re-exports every name here; read them through ``compat``.

From torch 2.13, AOTAutograd keys a DTensor input by ``DTensor._stable_hash_for_caching()``: the
spec (the mesh's layout over the whole job, the placements, the global shape), ``requires_grad``
and, from 2.15, the local tensor's device. That is one key on every rank that holds the same
spec, while the graph AOTAutograd makes of the input is the rank's own:

- its local shard's shape: ``Shard(0)`` of 13 rows is 7 rows on rank 0 and 6 on rank 1;
- the names of its mesh's groups, which its collectives are traced with: the ``"dp"`` submesh
  of pipeline rank 0 and of pipeline rank 1 have the same layout and different groups.

So ranks that share a cache dir load each other's graphs: a shard of the other rank's shape
fails an ``assert_size_stride``, a group name of the other rank's fails to resolve, or names
another group. :func:`key_dtensors_by_rank` adds what this rank holds to the key: the local
tensor's shape, stride and device, the mesh's ranks, this rank's coordinate in them and the
names of the mesh's groups. torch 2.11 has no such key: its cache refuses every graph that
traces ``to_local`` (docs/fsdp.md, restarts), so there is nothing to add.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch._library.fake_class_registry as _fake_classes
from torch.distributed.tensor import DTensor

__all__ = ["key_dtensors_by_rank", "dtensor_cache_key"]

_BY_RANK = "_compiled_hooks_by_rank"  # set on the key function that adds the rank's facts
# a traced DTensor's mesh may be a fake script object (2.13 on); 2.11 has neither, nor the key
_real_object: Callable[[Any], Any] = getattr(
    _fake_classes, "maybe_unwrap_fake_script_object", lambda obj: obj
)


def _rank_facts(t: DTensor) -> str:
    """What of ``t`` is this rank's alone: its local tensor's layout and its mesh's groups."""
    local = t._local_tensor
    mesh = _real_object(t.device_mesh)
    groups = tuple(mesh.get_group(d).group_name for d in range(mesh.ndim))
    return repr(
        (
            tuple(local.shape),
            tuple(local.stride()),
            str(local.device),
            mesh.mesh.tolist(),
            mesh.get_coordinate(),
            groups,
        )
    )


def dtensor_cache_key(t: DTensor) -> str | None:
    """The key AOTAutograd's cache gives the DTensor ``t`` on this torch (None: it keys none)."""
    key: Callable[[], str] | None = getattr(t, "_stable_hash_for_caching", None)
    return None if key is None else key()


def key_dtensors_by_rank() -> None:
    """From here on, AOTAutograd's cache key of a DTensor also holds this rank's facts (see the
    module docstring); a second call changes nothing."""
    spec_key: Any = getattr(DTensor, "_stable_hash_for_caching", None)
    if spec_key is None or getattr(spec_key, _BY_RANK, False):
        return

    def by_rank(self: DTensor) -> str:
        data = spec_key(self) + _rank_facts(self)
        return hashlib.blake2b(data.encode(), digest_size=16).hexdigest()

    setattr(by_rank, _BY_RANK, True)
    DTensor._stable_hash_for_caching = by_rank  # type: ignore[method-assign]
