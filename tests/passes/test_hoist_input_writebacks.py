"""hoist_input_writebacks: an input's write-back moves to its value (fake process group):
snapshot, numerics, idempotence, what is left alone; and in Inductor's code, the write goes
into the kernel that computes the value."""

import pytest
import torch

from passes import hoist_input_writebacks
from passes.core.verify import check_rewrite, copy_graph
from passes.testing import graph_str, trace
from tests import output_code
from tests.passcase import PassTestCase

c10d = torch.ops._c10d_functional


def keep_residual(grad, err):
    """The shape of an error-feedback hook: the input's new value is ready before the
    collective, and AOTAutograd writes it back at the end."""
    x = grad + err
    sent = torch.round(x * 4) / 4
    err.copy_(x - sent)
    return c10d.wait_tensor(c10d.all_reduce(sent, "sum", "0")) * 2


def with_writeback(fn, grad, err):
    """The graph of ``fn(grad, err) -> (result, new)`` returning ``result``, with
    ``copy_(err, new)`` at its end: the shape AOTAutograd gives an input updated in place, built
    here so that no release's functionalization (2.15 clones a view of the input read before
    the update) decides what the test reads."""
    gm = trace(fn, grad, err, world_size=2)
    graph = gm.graph
    output = next(iter(graph.find_nodes(op="output")))
    result, new = output.args[0]
    target = list(graph.find_nodes(op="placeholder"))[1]
    with graph.inserting_before(output):
        copy = graph.call_function(torch.ops.aten.copy_.default, (target, new))
    copy.meta["val"] = target.meta["val"]
    output.args = (result,)
    gm.recompile()
    return gm


def copies(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]


class TestHoistInputWritebacks(PassTestCase):
    def test_writeback_follows_its_value(self):
        gm = trace(keep_residual, torch.randn(8), torch.randn(8), world_size=2)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, hoist_input_writebacks)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[8] = input
err_1: f32[8] = input
add: f32[8] = aten.add(grad_1, err_1)
mul: f32[8] = aten.mul(add, 4)
round_1: f32[8] = aten.round(mul)
div: f32[8] = aten.div(round_1, 4)
sub: f32[8] = aten.sub(add, div)
copy_: f32[8] = aten.copy_(err_1, sub)
all_reduce: f32[8] = c10d.all_reduce(div, 'sum', group(size=2))
wait_tensor: f32[8] = c10d.wait_tensor(all_reduce)
mul_1: f32[8] = aten.mul(wait_tensor, 2)
return mul_1""",
        )
        self.assertTrue(check_rewrite("hoist_input_writebacks", before, gm.graph))

    def test_every_writeback_of_several_inputs(self):
        def two(grad, e1, e2):
            a, b = grad + e1, grad * 2 + e2
            e1.copy_(a * 0.5)
            e2.copy_(b * 0.25)
            return c10d.wait_tensor(c10d.all_reduce(a + b, "sum", "0"))

        gm = trace(two, torch.randn(4), torch.randn(4), torch.randn(4), world_size=2)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, hoist_input_writebacks)
        order = list(gm.graph.nodes)
        for copy in copies(gm):
            self.assertIs(order[order.index(copy) - 1], copy.args[1])
        self.assertTrue(check_rewrite("hoist_input_writebacks", before, gm.graph))

    def test_left_alone(self):
        def read_after(grad, err):
            new = (grad + err) * 0.5
            old = err * 3  # the old value, read after the new one is computed
            return c10d.wait_tensor(c10d.all_reduce(new + old, "sum", "0")), new

        def view_read_after(grad, err):
            view = err.view(2, 4)  # made before the new value, read after it
            new = (grad + 1) * 2
            return new.sum() + view.sum(), new

        for fn in (read_after, view_read_after):
            gm = with_writeback(fn, torch.randn(8), torch.randn(8))
            self.assertUntouched(
                gm, hoist_input_writebacks, "skipped: the input is read after its new value"
            )

    def test_adjacent_writeback_and_a_copy_from_an_input_stay(self):
        def adjacent(grad, err, other):
            out = grad + 1
            err.copy_(grad * 3)  # the last value computed: already next to its write-back
            return out

        def from_input(grad, err, other):
            err.copy_(other)  # its value is an input: nowhere earlier to go
            return grad + 1

        for fn in (adjacent, from_input):
            gm = trace(fn, torch.randn(8), torch.randn(8), torch.randn(8), world_size=2)
            text = graph_str(gm)
            self.assertFalse(hoist_input_writebacks(gm.graph))
            self.assertEqual(graph_str(gm), text)


@pytest.mark.slow
def test_inductor_writes_the_input_in_the_kernel_that_computes_it():
    """A compiled step (fake process group) whose state tensor is updated in place: without
    the pass the input is written by a kernel after the collective, from a buffer the first
    kernel filled (which pins that the test can fail); with it, by the kernel that computes
    the value from the gradient."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._inductor.utils import run_and_get_code

    import passes
    from passes.testing import fake_process_group

    fake_process_group(2)

    def step(grad, err):
        x = grad + err
        amax = x.abs().amax().clamp_min(1e-12)
        sent = torch.round(x / amax * 127) * amax / 127
        err.copy_(x - sent)
        # after the collective, a kernel the write-back at the end fuses into
        return funcol.all_reduce(sent, "sum", dist.group.WORLD) * 0.5

    def readers_of_writes(pipeline) -> list[set[str]]:
        """What each kernel that writes ``err`` (``arg1_1``) reads."""
        torch._dynamo.reset()
        err = torch.zeros(256)
        with torch._inductor.config.patch(fx_graph_cache=False), passes.install(pipeline):
            step_ = torch.compile(step, fullgraph=True)
            _, (code,) = run_and_get_code(step_, torch.randn(256), err)
        assert err.abs().sum() > 0  # the state was written
        return output_code.cpp_writers(code, "arg1_1")

    # without the pass: a kernel after the collective copies a buffer into the input
    assert any("arg0_1" not in reads for reads in readers_of_writes(passes.Pipeline([])))
    # with it: the kernel that reads the gradient writes the input
    writers = readers_of_writes(passes.Pipeline([hoist_input_writebacks]))
    assert writers and all("arg0_1" in reads for reads in writers), writers
