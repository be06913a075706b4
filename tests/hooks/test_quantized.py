"""int8_compress_hook on 2 gloo ranks: the int8 collectives' values, error feedback that sends
what rounding drops, residuals through state_dict, non-finite steps, and the hook in DDP (both
reducers), data_parallel and FSDP2."""

import contextlib
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import compiled_hooks as ch
from compiled_hooks.int8.codec import QMAX
from tests.hooks.test_int8_collectives import int8_all_reduce, int8_reduce_scatter
from tests.ranks import run_ranks

BLOCK = 16


def _grad(rank, shape=(6, 8), dtype=torch.float32):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _collectives_worker(rank, world_size, dtype):
    group, x = dist.group.WORLD, _grad(rank, dtype=dtype)
    out = {}
    for feedback in (False, True):
        state = ch.QuantizedState(group, block_size=BLOCK, error_feedback=feedback)
        full, shard = x.clone(), x.new_empty(3, 8)
        ch.int8_compress_hook(state, full, param="w")
        ch.int8_compress_hook(state, x.clone(), shard, param="v")
        out[feedback] = (full, shard)
    out["reference"] = (
        int8_all_reduce(x, world_size, group, BLOCK, post=world_size).to(dtype),
        (int8_reduce_scatter(x, world_size, group, BLOCK) / world_size).view(3, 8).to(dtype),
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_step_is_the_int8_collectives_average_in_the_gradients_dtype(dtype):
    """Both forms, with and without error feedback (no residual yet): the int8 collectives'
    average bit for bit, in ``grad``'s dtype; the all-reduce form the same on both ranks."""
    ranks = run_ranks(_collectives_worker, 2, dtype)
    for out in ranks:
        for feedback in (False, True):
            for got, want in zip(out[feedback], out["reference"]):
                assert got.dtype == dtype and torch.equal(got, want), feedback
    assert torch.equal(ranks[0][True][0], ranks[1][True][0])


def _drop_worker(rank, world_size, feedback, steps, reduce_scatter):
    """One outlier per block of 16 and values far below half a quantization step, every step
    the same: without error feedback they round to 0 every time."""
    grad = torch.full((4, BLOCK), 1e-3 * (rank + 1))
    grad[:, 0] = 1.0
    state = ch.QuantizedState(dist.group.WORLD, block_size=BLOCK, error_feedback=feedback)
    total = torch.zeros(2, BLOCK) if reduce_scatter else torch.zeros(4, BLOCK)
    for _ in range(steps):
        g = grad.clone()
        if reduce_scatter:
            out = g.new_empty(2, BLOCK)
            ch.int8_compress_hook(state, g, out, param="w")
            total += out
        else:
            ch.int8_compress_hook(state, g, param="w")
            total += g
    return total


@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_error_feedback_sends_what_rounding_drops(reduce_scatter):
    """Over 40 steps the averages sum to 40 times the exact average within a few quantization
    steps (the residuals still held), with error feedback; without, the small values are lost
    every step (a sum of 0 where 40 * 1.5e-3 = 0.06 was due)."""
    steps, step_size = 40, 1.0 / QMAX
    exact = torch.full((4, BLOCK), 1.5e-3)
    exact[:, 0] = 1.0
    for feedback in (True, False):
        totals = run_ranks(_drop_worker, 2, feedback, steps, reduce_scatter)
        for rank, total in enumerate(totals):
            due = steps * (exact[2 * rank : 2 * rank + 2] if reduce_scatter else exact)
            err = (total - due).abs().max().item()
            if feedback:
                assert err <= 2 * step_size, (rank, err)
            else:
                assert torch.all(total[:, 1:] == 0) and err > 0.05, (rank, err)


def _resume_worker(rank, world_size, keyed_by_name):
    group = dist.group.WORLD
    params = [torch.nn.Parameter(torch.zeros(5, 7)), torch.nn.Parameter(torch.zeros(9))]
    keys = ["a", "b"] if keyed_by_name else params

    def step(state, i):
        out = []
        for j, (key, p) in enumerate(zip(keys, params)):
            g = _grad(rank + 7 * i + 3 * j, p.shape)
            ch.int8_compress_hook(state, g, param=key)
            out.append(g)
        return out

    state = ch.QuantizedState(group, block_size=4)
    for i in range(2):
        step(state, i)
    saved = state.state_dict()
    continued = step(state, 2)
    resumed_state = ch.QuantizedState(group, block_size=4)
    resumed_state.load_state_dict(saved)
    fresh = step(ch.QuantizedState(group, block_size=4), 2)
    return continued, step(resumed_state, 2), fresh, sorted(saved["errors"])


@pytest.mark.parametrize("keyed_by_name", [True, False], ids=["names", "parameters"])
def test_residuals_survive_state_dict(keyed_by_name):
    """Two steps, ``state_dict``, a new state loads it: its third step equals the third step of
    the state that went on, bit for bit; a state without the residuals does not."""
    for continued, resumed, fresh, saved in run_ranks(_resume_worker, 2, keyed_by_name):
        assert saved == (["a", "b"] if keyed_by_name else ["#0", "#1"])
        for c, r, f in zip(continued, resumed, fresh):
            assert torch.equal(c, r)
            assert not torch.equal(c, f)


def test_checkpoints_hold_values_and_load_in_place(fake_pg):
    """The state holds a residual in the hook's layout (the rows bound for each rank, in
    blocks) and a checkpoint holds its values, in the gradient's shape. Loading writes into the
    residuals that exist; one of another size is refused, before anything changes; one the
    state has not met yet is kept, and saved again, also after a gradient of another size
    refused it."""
    from compiled_hooks.int8.state import WORKER

    state = ch.QuantizedState(dist.group.WORLD, block_size=4)  # 8 ranks
    kept = state.residual("w", WORKER, torch.Size([6, 8]), torch.device("cpu"), "test")
    assert kept.shape == (8, 2, 4)  # 48 values: 6 a rank, in blocks of 4
    kept.view(8, -1)[:, :6].copy_(torch.arange(48.0).view(8, 6))
    saved = state.state_dict()
    assert torch.equal(saved["errors"]["w"][0], torch.arange(48.0).view(6, 8))
    kept.zero_()
    state.load_state_dict(saved | {"errors": {**saved["errors"], "v": {WORKER: torch.ones(3)}}})
    assert state._errors[("w", WORKER)] is kept
    assert torch.equal(state.state_dict()["errors"]["w"][0], saved["errors"]["w"][0])
    assert torch.equal(state.state_dict()["errors"]["v"][0], torch.ones(3))  # not met yet
    wrong = {**saved, "errors": {"w": {WORKER: torch.zeros(5)}}}
    with pytest.raises(ValueError, match="holds 5 values in the checkpoint, 48 in this state"):
        state.load_state_dict(wrong)
    assert torch.equal(state.state_dict()["errors"]["w"][0], saved["errors"]["w"][0])
    with pytest.raises(ValueError, match="residual for 'v' holds 3 values, its gradient 4"):
        state.residual("v", WORKER, torch.Size([4]), torch.device("cpu"), "test")
    assert torch.equal(state.state_dict()["errors"]["v"][0], torch.ones(3))  # still kept


def test_residuals_created_while_traced_are_no_pad_of_a_constant(fake_pg):
    """Traced on a state that has not met the parameter, the hook creates its residuals in the
    graph: zeros made in the blocks' layout, so every pad in the graph pads a graph input.
    Inductor 2.11's C++ backend cannot compile a pad of a constant (a masked load of one), and
    a gradient that does not fill whole blocks is padded."""
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm.forward

    state = ch.QuantizedState(dist.group.WORLD, block_size=16)  # 8 ranks: rows of 6, padded

    def step(grad):
        ch.int8_compress_hook(state, grad, param="w")
        return grad

    from passes.core.traversal import ancestors

    torch.compile(step, backend=capture, fullgraph=True)(torch.randn(6, 8))
    (gm,) = graphs
    pads = [n for n in gm.graph.nodes if getattr(n.target, "__name__", None) == "pad"]
    assert pads, gm.code
    for pad in pads:
        assert any(n.op == "placeholder" for n in ancestors([pad])), gm.code
    assert len(state._errors) == 2


def _nonfinite_worker(rank, world_size):
    state = ch.QuantizedState(dist.group.WORLD, block_size=BLOCK)
    steps = []
    for i in range(3):
        g = _grad(rank + 10 * i, (2, BLOCK))
        if i == 1 and rank == 0:
            g[0, 3] = float("inf")
        ch.int8_compress_hook(state, g, param="w")
        steps.append(g)
    return steps, {k: v.clone() for k, v in state._errors.items()}


def test_a_non_finite_step_stays_non_finite_and_leaves_finite_residuals():
    """An inf on one rank: that step's block averages to non-finite values on every rank (the
    grad scaler sees it), the other block stays finite, and the residuals stay finite, so the
    next step is finite again."""
    for steps, errors in run_ranks(_nonfinite_worker, 2):
        assert torch.isfinite(steps[0]).all() and torch.isfinite(steps[2]).all()
        assert not torch.isfinite(steps[1][0]).any() and torch.isfinite(steps[1][1]).all()
        assert all(torch.isfinite(e).all() for e in errors.values())


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _ddp_worker(rank, world_size, mode, feedback):
    """3 steps of eager DDP with the hook; in the C++ reducer also each bucket's buffer before
    and after, then (without error feedback) the hook run on those buffers again, to
    completion."""
    if mode == "python_reducer":
        torch._dynamo.config.optimize_ddp = "python_reducer"
    net = _net()
    ddp = DDP(net, bucket_cap_mb=0.001)
    state = ch.QuantizedState(dist.group.WORLD, block_size=BLOCK, error_feedback=feedback)
    hook = ch.ddp_comm_hook(ch.int8_compress_hook)
    buckets = []

    def watched(state, bucket):
        before = bucket.buffer().clone()

        def record(fut):
            buckets.append((before, fut.value().clone()))
            return fut.value()

        return hook(state, bucket).then(record)

    ddp.register_comm_hook(state, watched if mode == "cpp" else hook)
    grads = []
    for step in range(3):
        net.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    same = []
    if not feedback:
        for before, after in buckets:
            ch.int8_compress_hook(state, before)
            same.append(torch.equal(before, after))
    residuals = {k: tuple(shape) for k, shape in state._shapes.items()}
    return grads, residuals, same


def _exact_mean_grads(step):
    grads = []
    for rank in range(2):
        net = _net()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        grads.append([p.grad for p in net.parameters()])
    return [(a + b) / 2 for a, b in zip(*grads)]


@pytest.mark.parametrize("feedback", [True, False], ids=["feedback", "no_feedback"])
@pytest.mark.parametrize("mode", ["cpp", "python_reducer"])
def test_ddp(mode, feedback):
    """Eager DDP through the C++ reducer (the async form) and the python reducer (per
    parameter): the same on both ranks, within two quantizations of the exact average in the
    first step; with error feedback, a worker residual shaped like each parameter (the C++
    reducer reorders its bucket after the first step). Without, the C++ reducer's buckets hold
    what the hook gives their buffers run to completion, bit for bit."""
    (grads0, residuals, same), (grads1, _, _) = run_ranks(_ddp_worker, 2, mode, feedback)
    exact = _exact_mean_grads(0)
    if feedback:
        workers = [shape for (_, part), shape in residuals.items() if part == 0]
        assert sorted(workers) == sorted(tuple(e.shape) for e in exact)
    elif mode == "cpp":
        assert len(same) >= 3 and all(same), same
    for step in range(3):
        for a, b in zip(grads0[step], grads1[step]):
            assert torch.equal(a, b), step
    for g, e in zip(grads0[0], exact):
        assert (g - e).abs().max() <= 2 * e.abs().max() / QMAX


def _fsdp2_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compiled_hooks.fsdp import register_comm_hook

    mesh = init_device_mesh("cpu", (world_size,))

    def build():
        net = _net()
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(net, mesh=mesh)

    ref, model = build(), build()
    state = ch.QuantizedState(dist.group.WORLD, block_size=BLOCK)
    register_comm_hook(model, state, ch.int8_compress_hook)
    try:
        register_comm_hook(build(), state, ch.int8_compress_hook, compile=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    x, y = _batch(rank, 0)
    for m in (ref, model):
        torch.nn.functional.mse_loss(m(x), y).backward()
    diffs = []
    for a, b in zip(model.parameters(), ref.parameters()):
        a, b = a.grad.full_tensor(), b.grad.full_tensor()
        diffs.append(((a - b).abs().max() / b.abs().max()).item())
    return diffs, sorted({key for key, _ in state._errors}), refused


def test_fsdp2_register_comm_hook():
    """FSDP2 (fully_shard per layer and the root) with the hook: gradients within two
    quantizations of FSDP2's own, residuals kept per FSDP module; ``compile=True`` refused (one
    graph per module)."""
    for diffs, keys, refused in run_ranks(_fsdp2_worker, 2):
        assert max(diffs) <= 2 / QMAX, diffs
        assert keys == ["module1", "module2"], keys  # the two layers; the root holds none
        assert refused is not None and "leave compile unset" in refused


def _compiled_worker(rank, world_size, steps):
    torch._dynamo.config.optimize_ddp = "python_reducer"
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        net = _net()
        state = ch.QuantizedState(dist.group.WORLD, block_size=BLOCK)
        ddp, model = ch.compile_ddp(net, state, ch.int8_compress_hook)
        history = []

        def run(step, net=net, run=model if compiled else ddp, compiled=compiled):
            net.zero_grad()
            x, y = _batch(rank, step)
            with ch.compiled_autograd() if compiled else contextlib.nullcontext():
                torch.nn.functional.mse_loss(run(x), y).backward()
            return [p.grad.clone() for p in net.parameters()]

        for step in range(steps):
            history.append(run(step))
            if step == steps - 2:
                saved = state.state_dict()
        counters = torch._dynamo.utils.counters
        graphs = counters["stats"]["unique_graphs"]
        # resumed in place: the last step again from the residuals saved before it
        state.load_state_dict(saved)
        resumed = run(steps - 1)
        out[compiled] = (
            history,
            dict(counters["graph_break"]),
            counters["compiled_autograd"]["captures"],
            len(state._errors),
            graphs,
            all(torch.equal(a, b) for a, b in zip(resumed, history[-1])),
            counters["stats"]["unique_graphs"] - graphs,
        )
    return out


@pytest.mark.slow
def test_compiled_ddp_with_error_feedback_matches_eager_and_resumes_bitwise():
    """compile_ddp with the hook: the backward compiled whole (compiled autograd, fullgraph; no
    graph break), residuals kept per parameter, and over 3 steps the eager python reducer's
    gradients up to fp32 rounding, the same on both ranks. The first step creates the
    residuals; the second compiles the backward once more, with them as inputs, and the third
    reuses it: three graphs, the forward's among them. ``load_state_dict`` of the residuals
    saved before the last step, then that step again: the same gradients, bit for bit, from the
    same graphs (the load writes into the graphs' inputs)."""
    ranks = run_ranks(_compiled_worker, 2, 3, timeout=600)
    for out in ranks:
        history, breaks, captures, residuals, graphs, resumed, recompiled = out[True]
        assert breaks == {} and captures == 1 and graphs == 3, (breaks, captures, graphs)
        assert resumed and recompiled == 0, (resumed, recompiled)
        assert out[False][5]  # eager resumes bitwise too
        assert residuals == out[False][3] == 2 * len(history[0])
        for got, want in zip(history, out[False][0]):
            for g, w in zip(got, want):
                # one fp32 rounding can move a value across a quantization boundary
                torch.testing.assert_close(g, w, rtol=0, atol=2 * w.abs().max().item() / QMAX)
    for a, b in zip(ranks[0][True][0][-1], ranks[1][True][0][-1]):
        assert torch.equal(a, b)


def _training_worker(rank, world_size, steps):
    """The main example's training (AdamW) with the bf16 hook, eager (the reference), and with
    the int8 hook, compiled DDP with the passes: per run the losses averaged over the ranks,
    and the final parameters."""

    import passes
    from benchmarks.common.models import TinyTransformer, batch, loss_fn

    out = {}
    for name, state, hook in [
        ("bf16", ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook),
        ("int8", ch.QuantizedState(dist.group.WORLD), ch.int8_compress_hook),
    ]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = TinyTransformer()
        ddp, compiled = ch.compile_ddp(net, state, hook)
        model = compiled if name == "int8" else ddp  # the python reducer runs the hook eagerly
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        losses = []
        for step in range(steps):
            opt.zero_grad(set_to_none=False)
            with contextlib.ExitStack() as stack:
                if name == "int8":
                    stack.enter_context(passes.install())
                    stack.enter_context(ch.compiled_autograd())
                loss = loss_fn(model, *batch(rank, step))
                loss.backward()
            opt.step()
            losses.append(loss.detach())
        losses = torch.stack(losses)
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        residuals = len(state._errors) if name == "int8" else None
        out[name] = (losses.tolist(), [p.detach().clone() for p in net.parameters()], residuals)
    return out


@pytest.mark.slow
def test_training_ends_within_two_percent_of_bf16():
    """100 steps of the main example's transformer (its loss a quarter of step 50's by then):
    with int8 gradients and error feedback the final loss is within 2% of the bf16 hook's, and
    the parameters are the same on both ranks, bit for bit."""
    ranks = run_ranks(_training_worker, 2, 100, timeout=900)
    bf16, int8 = ranks[0]["bf16"][0], ranks[0]["int8"][0]
    assert ranks[0]["int8"][2] == 2 * len(ranks[0]["int8"][1])  # int8 ran, feedback kept
    assert abs(int8[-1] - bf16[-1]) <= 0.02 * bf16[-1], (int8[-1], bf16[-1])
    for name in ("bf16", "int8"):
        for a, b in zip(ranks[0][name][1], ranks[1][name][1]):
            assert torch.equal(a, b), name


def _data_parallel_training_worker(rank, world_size, steps):
    """The main example's transformer under data_parallel: the bf16 hook, eager (the
    reference), and int8 gradients (error feedback) with int8 weight gathers, compiled with the
    passes; per run the losses averaged over the ranks and the final full parameters."""

    from torch.distributed.device_mesh import init_device_mesh

    import passes
    from benchmarks.common.models import TinyTransformer, batch, loss_fn
    from compiled_hooks.fsdp import data_parallel, register_comm_hook

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, state, hook, gather_dtype in [
        ("bf16", ch.LowPrecisionState(mesh.get_group()), ch.bf16_compress_hook, None),
        ("int8", ch.QuantizedState(mesh.get_group()), ch.int8_compress_hook, torch.int8),
    ]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = data_parallel(TinyTransformer(), mesh, gather_dtype=gather_dtype)
        register_comm_hook(model, state, hook)
        run = torch.compile(model, fullgraph=True) if name == "int8" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            with passes.install() if name == "int8" else contextlib.nullcontext():
                loss = loss_fn(run, *batch(rank, step))
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        losses = torch.stack(losses)
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        params = [p.full_tensor() for p in model.parameters()]
        out[name] = (losses.tolist(), params, len(getattr(state, "_errors", ())))
    return out


@pytest.mark.slow
def test_data_parallel_training_with_int8_gathers_ends_within_three_percent_of_bf16():
    """100 steps of the main example's transformer under data_parallel: with int8 gradients,
    error feedback and int8 weight gathers the final loss is within 3% of the bf16 hook's; the
    full parameters are the same on both ranks, bit for bit."""
    ranks = run_ranks(_data_parallel_training_worker, 2, 100, timeout=900)
    bf16, int8 = ranks[0]["bf16"][0], ranks[0]["int8"][0]
    assert ranks[0]["int8"][2] == len(ranks[0]["int8"][1])  # int8 ran: a worker residual each
    assert abs(int8[-1] - bf16[-1]) <= 0.03 * bf16[-1], (int8[-1], bf16[-1])
    for name in ("bf16", "int8"):
        for a, b in zip(ranks[0][name][1], ranks[1][name][1]):
            assert torch.equal(a, b), name


@pytest.mark.slow  # an Inductor compile
def test_compiled_hook_kernels_index_linearly_and_load_no_int8(fake_pg):
    """Every kernel of the compiled hook (error feedback on) indexes its inputs linearly: no
    integer division or modulo per element, which a loop over the gradient's shape needs to
    find each element's block (and which keeps Inductor's C++ loop from vectorizing); the
    residuals are kept in the block layout, and the gathered values reach the gradient as a
    view of the block layout. On CPU no kernel loads int8 (Inductor's loop loads it through a
    temporary buffer per vector): the ``dequantize_packed`` op reads both received rows (each
    above ``ATEN_DEQUANTIZE_MIN_BYTES``)."""
    from torch._inductor.utils import run_and_get_code

    from tests import output_code

    state = ch.QuantizedState(dist.group.WORLD)

    def step(grad):
        ch.int8_compress_hook(state, grad, param="w")
        return grad

    torch._dynamo.reset()
    step = torch.compile(step, fullgraph=True)
    step(torch.randn(1024, 512))  # creates the residuals: the next call takes them as inputs
    _, (code,) = run_and_get_code(step, torch.randn(1024, 512))
    assert code.count("compiled_hooks.dequantize_packed.default(") == 2
    # the residuals are updated by the kernels that quantize, with no copy after them: the
    # gradient and the two residuals are the inputs written, and only the gradient by a copy
    defined = output_code.kernels(code)
    writers = output_code.cpp_input_writers(code)
    assert len(writers) == 3, writers
    quantizing = [
        arg for arg, ks in writers.items() if all(output_code.quantizes(defined[k]) for k in ks)
    ]
    assert len(quantizing) == 2, writers
    assert "aten.copy_" not in code
    # nor is a residual computed into a buffer of its own and copied: every fp32 buffer is
    # smaller than the smaller residual (the shard's, half the gradient)
    residual = 1024 * 512 // 2
    assert all(math.prod(s) < residual for s in output_code.allocations(code, "float32")), code
    for name, source in output_code.kernels(code).items():
        assert "div_floor_integer" not in source, name
        assert not re.search(r"\)\s*%\s*static_cast", source), name
        assert "int8_t" not in output_code.input_types(source), name


@pytest.mark.slow  # an Inductor compile
def test_compiled_int8_step_issues_every_all_to_all_before_the_first_wait(fake_pg):
    """With the passes, the generated code of two gradients' hooks, the second computed after
    the first is hooked (as in a backward), issues both all-to-alls before it waits for the
    first: ``sink_quantized_receives`` moved the first one's receive side below the second
    gradient's compute and quantize, so that compute runs while the first rows are on the
    wire; likewise it issues both all-gathers before it waits for the first. The four
    residuals are written by the kernels that quantize, with no copy after."""
    from torch._inductor.utils import run_and_get_code

    import passes
    from tests import output_code

    state = ch.QuantizedState(dist.group.WORLD)

    def step(g1, x, w):
        ch.int8_compress_hook(state, g1, param="g1")
        g2 = torch.mm(x, w)
        ch.int8_compress_hook(state, g2, param="g2")
        return g1, g2

    args = torch.randn(1024, 512), torch.randn(256, 1024), torch.randn(1024, 512)
    # a bucket each: the all-to-alls' rows take 532 and 133 KB, the shards' 67 and 17 KB
    pipeline = passes.default_pipeline(quantized_bucket_cap_mb=0.05)
    torch._dynamo.reset()
    with passes.install(pipeline):
        step = torch.compile(step, fullgraph=True)
        step(*args)  # creates the residuals: the next call takes them as inputs
        _, (code,) = run_and_get_code(step, *args)
    defined, writers = output_code.kernels(code), output_code.cpp_input_writers(code)
    quantizing = [
        arg for arg, ks in writers.items() if all(output_code.quantizes(defined[k]) for k in ks)
    ]
    assert len(writers) == 5 and len(quantizing) == 4, writers  # g1 and the residuals
    assert "aten.copy_" not in code
    issues = [
        m.start() for m in re.finditer(r"_c10d_functional\.all_to_all_single\.default\(", code)
    ]
    waits = [m.start() for m in re.finditer(r"_c10d_functional\.wait_tensor\.default\(", code)]
    mm = code.index("extern_kernels.mm(")
    assert len(issues) == 2, code
    assert issues[0] < mm < issues[1] < min(waits), code
    # and both all-gathers before the first one's wait: the second bucket's receive side runs
    # while the first all-gather is on the wire
    gathered = re.findall(r"(buf\d+) = torch\.ops\._c10d_functional\.all_gather_into", code)
    gathers = [code.index(f"{b} = torch.ops._c10d_functional.all_gather") for b in gathered]
    gather_waits = [code.index(f"wait_tensor.default({b})") for b in gathered]
    assert len(gathers) == 2 and max(gathers) < min(gather_waits), code
