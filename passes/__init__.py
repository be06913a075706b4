"""FX graph passes over Inductor's post-grad graph for gradient collectives.

Each pass is a plain function ``pass(graph: torch.fx.Graph, **options) -> bool`` (True when it
changed the graph) that follows the contract in docs/passes.md: it rewrites only what it can prove
safe, keeps ``meta["val"]`` valid, is idempotent, and never makes an order of collectives that
depends on the rank. ``install()`` registers a :class:`Pipeline` of them with Inductor.

Logging goes to the ``passes`` logger, registered with torch's logging: ``TORCH_LOGS="passes"``
prints one summary line per compiled graph, ``TORCH_LOGS="+passes"`` every decision as well.
"""

import sys
import warnings
from typing import Any

from compiled_hooks import __version__, compat

compat.register_log("passes")

from compiled_hooks.rank_guard import RankDivergenceError

from . import testing
from .all_gather_as_all_to_all import all_gather_as_all_to_all
from .all_to_all_weight_update import all_to_all_weight_update
from .bucket_block_all_gathers import bucket_block_all_gathers
from .bucket_block_reduce_scatters import bucket_block_reduce_scatters
from .bucket_compressed_collectives import bucket_compressed_collectives
from .bucket_low_rank_factors import bucket_low_rank_factors
from .bucket_quantized_collectives import bucket_quantized_collectives
from .core.interface import PassOrderError
from .core.verify import PassVerificationError
from .fold_collective_scaling import fold_collective_scaling
from .fuse_cat_prologue import fuse_cat_prologue
from .hoist_input_writebacks import hoist_input_writebacks
from .insert_rank_guard import insert_rank_guard
from .interleave_zero_broadcasts import interleave_zero_broadcasts
from .pipeline import Pipeline, default_pipeline
from .prefetch_block_all_gathers import prefetch_block_all_gathers
from .reduce_scatter_as_all_to_all import reduce_scatter_as_all_to_all
from .registration import Installation, install
from .reinplace_broadcasts import reinplace_broadcasts
from .schedule_collectives import schedule_collectives
from .shard_weight_update import shard_weight_update
from .sink_quantized_receives import sink_quantized_receives

__all__ = [
    "__version__",
    "fold_collective_scaling",
    "bucket_compressed_collectives",
    "fuse_cat_prologue",
    "bucket_low_rank_factors",
    "bucket_quantized_collectives",
    "sink_quantized_receives",
    "interleave_zero_broadcasts",
    "schedule_collectives",
    "bucket_block_all_gathers",
    "bucket_block_reduce_scatters",
    "prefetch_block_all_gathers",
    "reinplace_broadcasts",
    "hoist_input_writebacks",
    "shard_weight_update",
    "all_to_all_weight_update",
    "all_gather_as_all_to_all",
    "reduce_scatter_as_all_to_all",
    "insert_rank_guard",
    "RankDivergenceError",
    "Pipeline",
    "default_pipeline",
    "install",
    "Installation",
    "PassVerificationError",
    "PassOrderError",
    "testing",
]

from .core import cache_key, graph_text, interface, verify

# The framework's modules live in passes.core; their former paths import the same modules.
for _module in (cache_key, graph_text, interface, verify):
    sys.modules[f"passes.{_module.__name__.rpartition('.')[2]}"] = _module

_RENAMED = {"fuse_collective_casts": "bucket_compressed_collectives"}


def __getattr__(name: str) -> Any:
    """The passes' former names, for one release: each warns and gives the renamed pass."""
    if name in _RENAMED:
        warnings.warn(
            f"passes.{name} is renamed passes.{_RENAMED[name]}; the old name goes in the next "
            "release",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'passes' has no attribute {name!r}")
