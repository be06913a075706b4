"""FX graph passes over Inductor's post-grad graph for gradient collectives.

Filled by the graph-passes work (``fold_collective_scaling``, ``fuse_collective_casts``,
``Pipeline``, ``install``); nothing is registered with Inductor yet.
"""

__all__: list[str] = []
