"""compiled_hooks.compat: every version-dependent name resolves on the running torch, no other
module of the packages reads the torch internals it owns, and what a release lacks is a
clear error."""

import ast
import pathlib
import re

import pytest
import tomllib
import torch

from compiled_hooks import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("compiled_hooks", "passes")


def test_every_name_resolves_on_this_torch():
    names = compat.resolved()
    print(f"\ntorch {torch.__version__}: " + "; ".join(f"{k} -> {v}" for k, v in names.items()))
    assert names["torch"] == torch.__version__
    for name in ("all_gather_single", "reduce_scatter_single"):
        module, attr = names[name].rsplit(".", 1)
        assert module == "torch.distributed._functional_collectives"
        assert callable(getattr(torch.distributed._functional_collectives, attr)), name
    assert names["fsdp_param_groups"] in (
        "FSDPState._fsdp_param_groups",
        "FSDPState._fsdp_param_group",
    )


def owned_reads(source: str) -> list[str]:
    """Where ``source`` reads a name of ``compat.OWNED`` other than through ``compat``: an
    attribute (``fcol.all_gather_single``, ``state._fsdp_param_groups``) or an import from
    torch (``from torch...._fully_shard import ...``), as "line: what". Strings and comments
    do not count."""
    owned, found = set(compat.OWNED), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in owned:
            if not (isinstance(node.value, ast.Name) and node.value.id == "compat"):
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            for module in modules:
                if module.startswith("torch") and owned & {*module.split("."), *names}:
                    found.append(f"{node.lineno}: import {module}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_only_compat_reads_the_internals_it_owns():
    sources = [
        p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if p.parent != ROOT / "compiled_hooks" / "compat"
    ]
    assert len(sources) > 30
    found = {str(p.relative_to(ROOT)): owned_reads(p.read_text()) for p in sources}
    assert {path: reads for path, reads in found.items() if reads} == {}


def test_the_scan_finds_what_it_looks_for():
    source = (
        "import torch.distributed._functional_collectives as fcol\nfrom "
        "torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo\nx = "
        "fcol.all_gather_single(t, 0, g)\ny = state._fsdp_param_groups\nz = "
        "compat.all_gather_single(t, 0, g)  # through compat: fine\ns = "
        "'fcol.reduce_scatter_single'  # a string: fine\n"
    )
    assert owned_reads(source) == [
        "2: import torch.distributed.fsdp._fully_shard._fsdp_common",
        "3: .all_gather_single",
        "4: ._fsdp_param_groups",
    ]


def test_supported_range_matches_the_requirement():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == [f"torch{compat.SUPPORTED}"]


def test_a_missing_feature_names_itself_and_both_releases(monkeypatch):
    monkeypatch.setattr(compat, "_ALL_GATHER", None)
    message = (
        "the functional all_gather_single needs torch >=2.11,<2.16; this is torch "
        f"{torch.__version__} (compiled-hooks supports torch>=2.11,<2.16)"
    )
    with pytest.raises(compat.UnsupportedTorch, match=re.escape(message)):
        compat.all_gather_single(torch.ones(2), 0, None)


class _Pass(compat.CustomGraphPass):
    def __init__(self, name, seen, uuid="u"):
        self.name, self.seen, self._uuid = name, seen, uuid

    def __call__(self, graph):
        self.seen.append(self.name)

    def uuid(self):
        return self._uuid


@pytest.mark.parametrize("lists", [True, False], ids=["lists", "one_pass"])
def test_several_custom_passes_run_in_order_on_either_form(monkeypatch, lists):
    monkeypatch.setattr(compat, "_LISTS", lists)
    seen = []
    a, b = _Pass("a", seen, "ua"), _Pass("b", seen, "ub")
    setting = compat.post_pass_setting([a, b])
    assert isinstance(setting, list) is lists
    assert compat.post_passes(setting) == [a, b]
    assert compat.post_pass_setting([a]) is a and compat.post_pass_setting([]) is None
    assert compat.post_passes(None) == [] and compat.post_passes(a) == [a]
    for p in compat.post_passes(setting) if lists else [setting]:
        p(torch.fx.Graph())
    assert seen == ["a", "b"]
    if not lists:  # one CustomGraphPass: a cache key from both uuids, none if one pass has none
        assert (
            setting.uuid()
            == compat.post_pass_setting([a, b]).uuid()
            != compat.post_pass_setting([b, a]).uuid()
        )
        assert compat.post_pass_setting([a, print]).uuid() is None


def _gather_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD
    t = torch.arange(6.0).reshape(2, 3) + 10 * rank
    takes_c10d = {
        "host": compat._gathers_off_host_on_gloo(t, group),
        "device": compat._gathers_off_host_on_gloo(t.to("meta"), group),
        "device, a rank list": compat._gathers_off_host_on_gloo(t.to("meta"), [0, 1]),
    }
    functional = [compat.all_gather_single(t, d, group) for d in (0, 1)]
    compat._gathers_off_host_on_gloo = lambda t, group: True  # this rank process only
    c10d = [compat.all_gather_single(t, d, group) for d in (0, 1)]
    # traced on fake tensors (AOTAutograd's form, not compiling on torch 2.11): the functional
    traced = make_fx(lambda x: compat.all_gather_single(x, 0, group), tracing_mode="fake")(t)
    ops = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    return {
        "takes_c10d": takes_c10d,
        "functional": [x * 1 for x in functional],
        "c10d": c10d,
        "traced": [op for op in ops if "gather" in op],
    }


def test_device_gathers_on_gloo_take_c10d_with_the_functional_values():
    """gloo's functional all-gather has no device form (a CUDA tensor faults the process), so
    eager device gathers on gloo take c10d's; here forced on CPU, where both forms run. Traced,
    they stay functional (Inductor cannot lower c10d's)."""
    from tests.ranks import run_ranks

    expected = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(2)]
    for out in run_ranks(_gather_worker, 2):
        assert out["takes_c10d"] == {"host": False, "device": True, "device, a rank list": False}
        assert out["traced"] == ["_c10d_functional.all_gather_into_tensor.default"]
        for d, (functional, c10d) in enumerate(zip(out["functional"], out["c10d"])):
            torch.testing.assert_close(functional, torch.cat(expected, d), rtol=0, atol=0)
            torch.testing.assert_close(c10d, functional, rtol=0, atol=0)


def test_region_schemas_are_computed_once_per_subgraph_and_kind_of_operands(monkeypatch):
    from torch.fx.experimental.proxy_tensor import make_fx

    from compiled_hooks.compat import regions

    hop = type(torch.ops.higher_order.invoke_subgraph)
    original = hop.gen_schema
    computed = []

    def counting(*args):
        computed.append(args)
        return original(*args)

    monkeypatch.setattr(regions, "_GEN_SCHEMA", counting)
    subgraph = make_fx(lambda x, w: (x @ w).relu())(torch.randn(2, 3), torch.randn(3, 4))
    invoke = torch.ops.higher_order.invoke_subgraph

    def schema(*shape):
        return invoke.gen_schema(subgraph, "s", torch.randn(*shape), torch.randn(3, 4))

    with compat.region_schemas_reused(), compat.region_schemas_reused():  # nested: one patch
        first = schema(2, 3)
        assert schema(2, 3) is first and len(computed) == 1  # the same kinds: reused
        assert str(schema(5, 3)) == str(first) and len(computed) == 2  # another shape
    assert hop.gen_schema is counting  # restored on exit (torch's own, as the module holds it)
    assert str(schema(2, 3)) == str(first) and len(computed) == 3  # outside: every call


def test_region_lowering_keeps_its_inputs(monkeypatch):
    """Inside ``region_inputs_kept``, a region's lowering marks no input donated, whatever the
    backward around it donates (here, what a stand-in for torch 2.13's ``__init__`` sets)."""
    from torch._inductor.graph import SubgraphLowering

    def inherits(self, *args, **kwargs):
        self.bw_donated_idxs = [0, 1]  # the outer backward's indices

    monkeypatch.setattr(SubgraphLowering, "__init__", inherits)

    def lowered():
        lowering = object.__new__(SubgraphLowering)
        lowering.__init__()
        return lowering.bw_donated_idxs

    with compat.region_inputs_kept(), compat.region_inputs_kept():  # nested: one patch
        assert lowered() is None
    assert SubgraphLowering.__init__ is inherits  # restored on exit
    assert lowered() == [0, 1]


def _dtensor_keys(rank, world_size):
    """AOTAutograd's cache keys, on this rank of a 2 x 2 ("pp", "dp") mesh, of ``Shard(0)``
    DTensors over "dp": 13 rows (7 and 6 per rank) and 16 rows (8 each), before and after
    ``key_dtensors_by_rank``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    tensors = [distribute_tensor(torch.ones(rows, 4), dp, [Shard(0)]) for rows in (13, 16)]
    before = [compat.dtensor_cache_key(t) for t in tensors]
    compat.key_dtensors_by_rank()
    after = [compat.dtensor_cache_key(t) for t in tensors]
    compat.key_dtensors_by_rank()  # a second call adds nothing (a second wrap would rehash)
    assert [compat.dtensor_cache_key(t) for t in tensors] == after
    return before, after


def test_ranks_key_their_own_dtensors_for_aotautograds_cache():
    """Ranks that share a cache dir must not load each other's graphs of a DTensor input: the
    graph holds the rank's shard shape (uneven: ranks 0 and 1) and its groups' names (the "dp"
    groups of pipeline ranks 0 and 1, ranks 0 and 2). Each rank's key is its own."""
    from tests.ranks import run_ranks

    results = run_ranks(_dtensor_keys, 4)
    if results[0][0][0] is None:
        pytest.skip(f"torch {torch.__version__} keys no DTensor input for AOTAutograd's cache")
    for rows in range(2):
        after = [r[1][rows] for r in results]
        assert len(set(after)) == 4, after  # every rank its own key
    assert all(r[1][0] != r[1][1] for r in results)  # and every shape its own
    again = run_ranks(_dtensor_keys, 4)
    assert [r[1] for r in again] == [r[1] for r in results]  # stable across processes


def test_to_local_keeps_none_gradients_says_what_to_locals_backward_does():
    """The probe reads ``to_local()``'s forward; what matters is its backward: a function of the
    local tensor that gives it no gradient leaves the DTensor's gradient None where the probe
    says so, and zeros where it does not (torch 2.11)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from passes.testing import fake_process_group

    class Unused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.set_materialize_grads(False)
            return a * 2, b.detach()

        @staticmethod
        def backward(ctx, ga, gb):
            return (None if ga is None else ga * 2), None

    fake_process_group(2)
    mesh = init_device_mesh("cpu", (2,))
    x, w = (
        DTensor.from_local(torch.ones(3), mesh, [Replicate()]).requires_grad_() for _ in range(2)
    )
    out, _ = Unused.apply(x.to_local(), w.to_local())
    out.sum().backward()
    assert x.grad is not None
    if compat.to_local_keeps_none_gradients():
        assert w.grad is None
    else:
        assert w.grad is not None and not w.grad.to_local().any()
