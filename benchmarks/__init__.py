"""The benchmarks, each a module run from the repository root: ``python -m benchmarks.<name>``
(``--help`` for its options). What several share is :mod:`benchmarks.common`."""
