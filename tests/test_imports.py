"""The packages' import structure: ``passes`` -> ``compiled_hooks`` -> torch, no pass module
imports another pass or ``passes.testing``, and no import cycle, function-level imports
included; no module reads another's private names, the int8 format is defined in
``compiled_hooks.int8`` only, no benchmark imports the tests, and the library's modules and
their docstrings stay short. Read from the sources, not from a run."""

import ast
import pathlib
from typing import cast

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("compiled_hooks", "passes")
# Modules of passes that are not a pass: the package, the pipeline and its installation, the test
# helpers, and what the passes share (passes.core).
NOT_PASSES = {"passes", "passes.pipeline", "passes.registration", "passes.testing"}


def _is_pass(module: str) -> bool:
    return module.startswith("passes.") and module.count(".") == 1 and module not in NOT_PASSES


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
    passes = {m for m in graph if _is_pass(m)}
    assert len(passes) >= 19
    assert all(
        m.startswith("passes.core") for m in graph if m.startswith("passes") and m.count(".") > 1
    )
    assert {
        m: sorted(graph[m] & (passes | {"passes.testing"}))
        for m in passes
        if graph[m] & (passes | {"passes.testing"})
    } == {}
    above = passes | NOT_PASSES  # what passes.core, below every pass, never imports
    core = [m for m in graph if m.startswith("passes.core")]
    assert len(core) >= 10
    assert {m: sorted(graph[m] & above) for m in core if graph[m] & above} == {}
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


def test_fsdp_imports_no_int8_module():
    """``data_parallel`` reaches the int8 state through the hook states' interface and the int8
    weight gather through ``compiled_hooks.weight_gathers``, never by importing ``int8``."""
    graph = import_graph()
    fsdp = {m: imps for m, imps in graph.items() if m.startswith("compiled_hooks.fsdp")}
    assert len(fsdp) >= 10
    assert {m: sorted(i for i in imps if "int8" in i) for m, imps in fsdp.items()} == {
        m: [] for m in fsdp
    }
    mutant = _imports(
        "compiled_hooks.fsdp.gather", "from ..int8.codec import quantize\n", False, set(graph)
    )
    assert mutant == {"compiled_hooks.int8.codec"}


def test_no_import_cycle():
    assert _cycle(import_graph()) == []


def test_the_walk_sees_function_level_and_relative_imports():
    graph = import_graph()
    # from .. import compat; from . import ops
    assert "compiled_hooks.compat" in graph["compiled_hooks.int8.collectives"]
    assert "compiled_hooks.int8.ops" in graph["compiled_hooks.int8.collectives"]
    assert "compiled_hooks.compat" in graph["compiled_hooks.fsdp.fsdp2"]  # from .. import compat
    source = "def f():\n    from passes import rank_guard\n    import compiled_hooks.zero.layout\n"
    assert _imports("compiled_hooks.marks", source, False, set(graph)) == {
        "passes",
        "compiled_hooks.zero.layout",
    }
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_definitions(tree: ast.AST) -> set[str]:
    """The private names a module defines: module-level and class-level functions, classes and
    assignments, ``self._x`` attributes and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return {n for n in names if _is_private(n)}


_BY_STRING = ("getattr", "hasattr", "setattr", "delattr")


def _by_string(node: ast.AST) -> str | None:
    """The attribute ``getattr(x, "name")`` (``hasattr``, ``setattr``, ``delattr``) names."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _BY_STRING
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _stored_attributes(tree: ast.AST, on_self: bool = True) -> set[str]:
    """The attributes a module stores (``x.name = ...``, ``setattr(x, "name", ...)``); with
    ``on_self=False``, only on objects other than ``self`` / ``cls``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if on_self or not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            names.add(_by_string(node) or "")
    return names


def _private_stores(tree: ast.AST) -> set[str]:
    """The private attributes a module stores on objects other than ``self`` / ``cls``
    (``module._x = ...``, ``setattr(module, "_x", ...)``)."""
    return {n for n in _stored_attributes(tree, on_self=False) if _is_private(n)}


def _private_uses(tree: ast.AST) -> set[tuple[int, str]]:
    """``x._name`` for any ``x`` but ``self`` / ``cls`` (read or stored), ``getattr(x,
    "_name")`` and its kin, and ``from m import _name``."""
    uses: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                uses.add((node.lineno, node.attr))
        elif _is_private(_by_string(node) or ""):
            uses.add((node.lineno, cast(str, _by_string(node))))
        elif isinstance(node, ast.ImportFrom) and (
            node.level
            or "compiled_hooks" in (node.module or "")
            or (node.module or "").startswith("passes")
        ):
            uses.update((node.lineno, a.name) for a in node.names if _is_private(a.name))
    return uses


# Private names of one library module that another reads, each with its reason. The scan goes by
# name, so a torch private that shares a name with one of the library's is listed here too.
PRIVATE_READS_ALLOWED: dict[tuple[str, str], str] = {
    ("compiled_hooks.compat", "_world"): "torch's c10d._world, read in the torch-version shims",
    ("compiled_hooks.fsdp.blocks", "_parameters"): "nn.Module._parameters: a module's own "
    "parameters without recursing, as nn.Module's own methods read them",
    ("compiled_hooks.compat.fsdp2", "_get_fsdp_state"): "torch's FSDPModule._get_fsdp_state, "
    "read on FSDP2 modules; fsdp.root's DataParallelStage overrides it to refuse",
    ("compiled_hooks.compat.fsdp2", "_fsdp_param_groups"): "torch's FSDPState."
    "_fsdp_param_groups, probed on torch's class; compat.pipeline's stage state holds one of "
    "that name for torch's pipelining to read",
}


def _library_trees() -> dict[str, ast.AST]:
    return {m: ast.parse(p.read_text()) for m, p in _modules().items()}


def private_reads(trees: dict[str, ast.AST] | None = None) -> dict[tuple[str, str], list[int]]:
    """``(module, name)`` -> lines where ``module`` reads or stores a private ``name`` that
    another library module owns: defines it (a function, class, assignment, ``self._x``,
    ``__slots__``), or, where no module defines it, stores it on other objects."""
    trees = _library_trees() if trees is None else trees
    defined = {m: _private_definitions(t) for m, t in trees.items()}
    stored = {m: _private_stores(t) for m, t in trees.items()}
    found: dict[tuple[str, str], list[int]] = {}
    for m, tree in trees.items():
        for line, name in sorted(_private_uses(tree)):
            owners = {o for o, names in defined.items() if name in names}
            owners = owners or {o for o, names in stored.items() if name in names}
            if owners - {m} and m not in owners:
                found.setdefault((m, name), []).append(line)
    return found


def test_no_library_module_reads_another_modules_private_names():
    found = private_reads()
    assert {k: v for k, v in found.items() if k not in PRIVATE_READS_ALLOWED} == {}
    assert sorted(k for k in PRIVATE_READS_ALLOWED if k not in found) == []


def test_the_private_scan_sees_attributes_and_imports():
    a = ast.parse("class S:\n    __slots__ = ['_k']\n    def _m(self):\n        self._x = 1\n")
    assert _private_definitions(a) == {"_k", "_m", "_x"}
    b = ast.parse("from .s import _m\nstate._x\nself._y\nf()._k\nhasattr(m, '_j')\n")
    assert {name for _, name in _private_uses(b)} == {"_m", "_x", "_k", "_j"}


def _reads(**sources: str) -> set[tuple[str, str]]:
    return set(private_reads({m: ast.parse(s) for m, s in sources.items()}))


def test_each_rule_of_the_private_scan_can_fail():
    owner = "class A:\n    def f(self):\n        self._x = 1\n"
    # a read by string of another module's private name
    assert _reads(a=owner, b="getattr(obj, '_x', None)\n") == {("b", "_x")}
    assert _reads(a=owner, b="setattr(obj, '_x', 2)\n") == {("b", "_x")}
    # a store on another object of a name another module defines
    assert _reads(a=owner, b="obj._x = 2\n") == {("b", "_x")}
    # a name only stored on other objects belongs to the module that stores it
    assert _reads(a="module._y = 1\nmodule._y\n", b="print(module._y)\n") == {("b", "_y")}
    assert _reads(a="module._y = 1\nmodule._y\n", b="hasattr(module, '_y')\n") == {("b", "_y")}
    # and nothing is found where each module reads its own
    assert _reads(a=owner + "getattr(obj, '_x')\n", b="module._y = 1\nmodule._y\n") == set()


def attribute_reads_by_string(
    trees: dict[str, ast.AST] | None = None,
) -> dict[tuple[str, str], list[int]]:
    """``(module, name)`` -> lines where ``module`` names, by string (``getattr(x, "name")``
    and its kin), an attribute (no dunder) that another library module gives objects (by a
    store or a ``setattr``, on ``self`` or on another object) and ``module`` does not."""
    trees = _library_trees() if trees is None else trees
    given = {m: _stored_attributes(tree) for m, tree in trees.items()}
    found: dict[tuple[str, str], list[int]] = {}
    for m, tree in trees.items():
        for node in ast.walk(tree):
            name = _by_string(node)
            if name is None or (name.startswith("__") and name.endswith("__")):
                continue
            if name not in given[m] and any(name in g for o, g in given.items() if o != m):
                found.setdefault((m, name), []).append(cast(ast.Call, node).lineno)
    return found


# Attributes read by string that another library module also gives, each with its reason.
ATTRIBUTE_STRINGS_ALLOWED = {
    ("compiled_hooks.compat.fsdp2", "_fsdp_param_groups"): PRIVATE_READS_ALLOWED[
        ("compiled_hooks.compat.fsdp2", "_fsdp_param_groups")
    ],
}


def test_no_library_module_reads_another_modules_attributes_by_string():
    found = attribute_reads_by_string()
    assert {k: v for k, v in found.items() if k not in ATTRIBUTE_STRINGS_ALLOWED} == {}
    assert sorted(k for k in ATTRIBUTE_STRINGS_ALLOWED if k not in found) == []


def test_the_attribute_string_scan_can_fail():
    def reads(**sources: str) -> set[tuple[str, str]]:
        return set(attribute_reads_by_string({m: ast.parse(s) for m, s in sources.items()}))

    assert reads(a="hook.reduce_async = f\n", b="getattr(h, 'reduce_async', None)\n") == {
        ("b", "reduce_async")
    }
    assert reads(a="setattr(h, 'tag', 1)\n", b="hasattr(h, 'tag')\n") == {("b", "tag")}
    assert reads(a="setattr(h, 'tag', 1)\ngetattr(h, 'tag')\n", b="x = 1\n") == set()
    assert reads(a="f.__name__ = 'g'\n", b="getattr(f, '__name__')\n") == set()


INT8_PACKAGE = "compiled_hooks.int8"
# What defines the int8 format: its functions, its constants, and the numbers they name
# (QMAX, its half-step bound, the default block size).
INT8_FORMAT_NAMES = {
    "quantize",
    "dequantize",
    "pack",
    "unpack",
    "to_blocks",
    "from_blocks",
    "packed_blocks",
    "dequantize_packed",
}
INT8_FORMAT_CONSTANTS = {"QMAX", "BLOCK_SIZE", "SCALE_BYTES"}
INT8_FORMAT_NUMBERS = {127, 254}


def int8_format_definitions() -> dict[str, list[str]]:
    """Per library module outside :data:`INT8_PACKAGE`: the int8 format it defines itself."""
    found: dict[str, list[str]] = {}
    for m, path in _modules().items():
        if m == INT8_PACKAGE or m.startswith(INT8_PACKAGE + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # a custom op of that name is the traced handle; its eager body calls the codec
            if (
                isinstance(node, ast.FunctionDef)
                and node.name in INT8_FORMAT_NAMES
                and not node.decorator_list
            ):
                found.setdefault(m, []).append(f"def {node.name}")
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for t in node.targets:
                    if isinstance(t, ast.Name) and any(
                        t.id.endswith(c) for c in INT8_FORMAT_CONSTANTS
                    ):
                        found.setdefault(m, []).append(f"{t.id} = {node.value.value!r}")
            elif (
                isinstance(node, ast.Constant)
                and type(node.value) is int
                and node.value in INT8_FORMAT_NUMBERS
            ):
                found.setdefault(m, []).append(f"the number {node.value} (line {node.lineno})")
    return found


def test_the_int8_format_is_defined_in_the_int8_package_only():
    assert int8_format_definitions() == {}
    modules = _modules()
    codec = ast.parse(modules[f"{INT8_PACKAGE}.codec"].read_text())
    defined = {n.name for n in ast.walk(codec) if isinstance(n, ast.FunctionDef)} | {
        t.id
        for n in ast.walk(codec)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert INT8_FORMAT_NAMES | INT8_FORMAT_CONSTANTS <= defined  # the scan looks for real names


def benchmark_imports_out_of_bounds(sources: dict[str, str]) -> list[str]:
    """What benchmark sources import that they must not: the tests, the examples, a private
    module of ``passes`` (``passes._x``) or a private name (``from m import _x``)."""
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                modules, private = [a.name for a in node.names], []
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
                private = [a.name for a in node.names if _is_private(a.name)]
            else:
                continue
            for m in modules:
                parts = m.split(".")
                if parts[0] in ("tests", "examples") or (
                    parts[0] == "passes" and any(p.startswith("_") for p in parts[1:])
                ):
                    found.append(f"{name}: {m}")
            found += [f"{name}: {n}" for n in private]
    return found


def test_no_benchmark_imports_the_tests_the_examples_or_a_private_name():
    sources = {
        str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "benchmarks").rglob("*.py"))
    }
    assert len(sources) > 20
    assert benchmark_imports_out_of_bounds(sources) == []
    mutants = {
        "a.py": "from passes._groups import chunk_bounds\n",
        "b.py": "import examples.train_ddp\n",
        "c.py": "from tests.processes import run_script\n",
        "d.py": "from benchmarks.common.launch import _in_group\n",
    }
    assert len(benchmark_imports_out_of_bounds(mutants)) == 4


def sys_path_edits(source: str) -> list[int]:
    """Lines that edit the import path: ``sys.path.insert`` / ``append`` / ``extend``, or
    pytest's ``syspath_prepend``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (
            (node.attr in ("insert", "append", "extend") and ast.unparse(node.value) == "sys.path")
            or node.attr == "syspath_prepend"
        ):
            lines.append(node.lineno)
    return lines


def test_nothing_edits_the_import_path():
    """The benchmarks run as modules (``python -m benchmarks.<name>``), the examples import the
    installed packages and their own folder's modules, and the tests import both from the
    repository root: no file puts a folder on ``sys.path``."""
    found = {
        str(p.relative_to(ROOT)): sys_path_edits(p.read_text())
        for folder in ("benchmarks", "examples", "tests", "tools", *PACKAGES)
        for p in sorted((ROOT / folder).rglob("*.py"))
    }
    assert {path: lines for path, lines in found.items() if lines} == {}
    assert sys_path_edits("import sys\nsys.path.insert(0, 'x')\n") == [2]
    assert sys_path_edits("def t(monkeypatch):\n    monkeypatch.syspath_prepend('x')\n") == [2]


MAX_LINES, MAX_DOCSTRING_LINES = 400, 45


def test_library_modules_and_their_docstrings_stay_short():
    """No library source file over 400 lines, no module docstring over 45: a module that grows
    past them is doing more than one job, and a docstring states the contract, not the
    history (that goes to docs/ and the CHANGELOG)."""
    long = {}
    for name, path in _modules().items():
        source = path.read_text()
        doc = ast.get_docstring(ast.parse(source), clean=False) or ""
        lines, doc_lines = len(source.splitlines()), len(doc.splitlines())
        if lines > MAX_LINES or doc_lines > MAX_DOCSTRING_LINES:
            long[name] = (lines, doc_lines)
    assert not long, (
        f"(source lines, docstring lines) over ({MAX_LINES}, {MAX_DOCSTRING_LINES}): {long}"
    )
