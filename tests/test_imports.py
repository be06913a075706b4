"""The packages' import structure: ``passes`` -> ``compiled_hooks`` -> torch, no pass module
imports another pass or ``passes.testing``, and no import cycle, function-level imports
included. Read from the sources (every ``import`` statement), not from a run."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("compiled_hooks", "passes")
# Modules of passes that are not a pass: the pipeline, its registration and cache key, shared
# helpers (a leading underscore), the pass declarations, the verifier, graph text and the test
# helpers.
NOT_PASSES = {
    "passes",
    "passes.pipeline",
    "passes.registration",
    "passes.cache_key",
    "passes.verify",
    "passes.graph_text",
    "passes.interface",
    "passes.testing",
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, source: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports anywhere in ``source``."""
    package = name if is_package else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # import a.b.c of a module a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imports(name, path.read_text(), path.name == "__init__.py", set(modules))
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it; empty when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_compiled_hooks_never_imports_passes():
    graph = import_graph()
    assert {
        m: sorted(i for i in imps if i.startswith("passes"))
        for m, imps in graph.items()
        if m.startswith("compiled_hooks") and any(i.startswith("passes") for i in imps)
    } == {}


def test_no_pass_imports_another_pass_or_the_test_helpers():
    graph = import_graph()
    passes = {
        m
        for m in graph
        if m.startswith("passes.")
        and m not in NOT_PASSES
        and not m.rpartition(".")[2].startswith("_")
    }
    assert len(passes) >= 15
    assert {
        m: sorted(graph[m] & (passes | {"passes.testing"}))
        for m in passes
        if graph[m] & (passes | {"passes.testing"})
    } == {}
    production = [m for m in graph if m != "passes.testing"]
    assert [m for m in production if "passes.testing" in graph[m] and m != "passes"] == []


# What of compiled_hooks a production module of passes may import: the contract (the marks, ops
# and switches the hooks write and the passes read), the torch-version shims, the rank guard the
# installation raises from, and the package root (the version).
PASSES_READ = {"compiled_hooks", "compiled_hooks.graph_contract", "compiled_hooks.compat"}
PASSES_READ_ALSO = {
    "passes.registration": {"compiled_hooks.rank_guard"},
    "passes": {"compiled_hooks.rank_guard"},
}


def test_passes_read_the_hooks_through_the_contract_module():
    graph = import_graph()
    reached = {
        m: sorted(
            i
            for i in imps
            if i.startswith("compiled_hooks")
            and i not in PASSES_READ | PASSES_READ_ALSO.get(m, set())
        )
        for m, imps in graph.items()
        if m.startswith("passes") and m != "passes.testing"
    }
    assert {m: i for m, i in reached.items() if i} == {}
    assert any("compiled_hooks.graph_contract" in graph[m] for m in graph if m.startswith("passes"))


def test_no_import_cycle():
    assert _cycle(import_graph()) == []


def test_the_walk_sees_function_level_and_relative_imports():
    graph = import_graph()
    # from . import compat, rank_guard
    assert "compiled_hooks.compat" in graph["compiled_hooks.ops"]
    assert "compiled_hooks.rank_guard" in graph["compiled_hooks.ops"]
    assert "compiled_hooks.compat" in graph["compiled_hooks.fsdp.fsdp2"]  # from .. import compat
    source = "def f():\n    from passes import rank_guard\n    import compiled_hooks.zero.layout\n"
    assert _imports("compiled_hooks.ops", source, False, set(graph)) == {
        "passes",
        "compiled_hooks.zero.layout",
    }
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
