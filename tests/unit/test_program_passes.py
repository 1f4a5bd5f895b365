"""Passes over a per-rank program's FX graph that change its cost, not its values.

``drop_aliases`` removes the no-op views tracing through DTensor leaves (hundreds per step in
a transformer's program, each a Python call); ``issue_early`` starts collectives computed from
the batch alone before the forward; ``write_buckets_in_place`` has the ops computing a
gradient bucket write into its flat buffer and sums that buffer in place; the loss's reduction
starts where backward starts. They are checked on small traced graphs: what goes, what must
stay (a reshape that copies into an ancestor's geometry), and equal results.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from plait.runtime.program.compile import _all_reduce_output, drop_aliases, issue_early
from plait.runtime.program.grad_sync import write_buckets_in_place

_A = torch.ops.aten
_F = torch.ops._c10d_functional


def _targets(graph_module: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in graph_module.graph.nodes if n.op == "call_function"]


def test_drop_aliases_keeps_values_and_copies_and_drops_views_that_change_nothing():
    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        same = w.t().t()  # w itself
        kept = x.detach()  # an alias: the program runs without autograd
        copied = x.t().reshape(2, 3)  # a copy with x's shape and strides: other values
        chain = x.view(6).view(3, 2)  # one view of x
        twice = x.view(3, 2) * 2 + x.view(3, 2)  # the same view taken twice
        return same @ kept.t(), copied, chain, twice

    x, w = torch.arange(6.0).view(2, 3), torch.randn(3, 3)
    graph_module = make_fx(step, tracing_mode="fake")(x, w)
    before = len(graph_module.graph.nodes)
    dropped = drop_aliases(graph_module)

    assert dropped == before - len(graph_module.graph.nodes) > 0
    targets = _targets(graph_module)
    assert _A.detach.default not in targets
    assert targets.count(_A.t.default) == 1  # kept.t(): w.t().t() went
    assert _A.reshape.default in targets or _A.clone.default in targets  # the copy stays
    # the chain x.view(6).view(3, 2) and the repeated x.view(3, 2) are one view of x
    views = [n for n in graph_module.graph.nodes if n.target is _A.view.default]
    assert all(v.args[0].op == "placeholder" for v in views), [v.format_node() for v in views]
    for got, want in zip(graph_module(x, w), step(x, w), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_issue_early_moves_batch_collectives_to_the_top_and_leaves_the_rest():
    graph = torch.fx.Graph()
    scale = graph.placeholder("scale")
    weight = graph.placeholder("weight")
    targets = graph.placeholder("targets")
    hidden = graph.call_function(_A.mm.default, (weight, weight))
    gathered = graph.call_function(_F.all_gather_into_tensor.default, (hidden, 2, "0"))
    gathered_done = graph.call_function(_F.wait_tensor.default, (gathered,))
    count = graph.call_function(_A.sum.default, (targets,))
    summed = graph.call_function(_F.all_reduce.default, (count, "sum", "0"))
    done = graph.call_function(_F.wait_tensor.default, (summed,))
    loss = graph.call_function(operator.mul, (gathered_done, done))
    graph.output(graph.call_function(operator.mul, (loss, scale)))
    graph_module = torch.fx.GraphModule(torch.nn.Module(), graph)

    # inputs after the grad scale: weight is a parameter (0), targets the batch (1)
    assert issue_early(graph_module, {1}) == 1
    order = [n.name for n in graph_module.graph.nodes if n.op == "call_function"]
    assert order.index("all_reduce_default") < order.index("mm_default"), order  # before forward
    assert order.index("sum_default") < order.index("all_reduce_default")
    assert order.index("wait_tensor_default_1") == order.index("mul") - 1  # waited where needed
    # the gather reads a parameter's product: it stays after the mm that makes its input
    assert order.index("mm_default") < order.index("all_gather_into_tensor_default")


def _local_collectives(graph_module: torch.fx.GraphModule) -> None:
    """The graph's sum all-reduces and waits as identities: one rank's sum is its own value,
    so the rewritten program's numbers can be compared with the original's in one process."""
    for node in graph_module.graph.nodes:
        if node.target in (_F.all_reduce_.default, _F.all_reduce.default):
            node.target, node.args = torch.clone, (node.args[0],)
        elif node.target is _F.wait_tensor.default:
            node.target = torch.Tensor.contiguous
    graph_module.recompile()


def test_write_buckets_in_place_computes_gradients_into_one_summed_buffer():
    def step(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weight = x.t() @ g  # a matrix product: written by mm.out
        bias = g.sum(0, keepdim=True).view(-1)  # a sum and a view: sum.IntList_out
        peak = torch.max(g, 0).values  # an element of a tuple: no out=, copied in
        read = g @ g.t()  # also read by the loss: copied in
        return (read.sum(), weight, bias, peak, read)

    x, g = torch.randn(4, 3), torch.randn(4, 5)
    graph_module = make_fx(step, tracing_mode="fake")(x, g)
    assert write_buckets_in_place(graph_module, [[1, 2, 3, 4]], "0") == []

    targets = _targets(graph_module)
    assert _A.mm.out in targets and _A.sum.IntList_out in targets
    assert targets.count(_A.copy_.default) == 2  # the max's values and the product read twice
    assert targets.count(_F.all_reduce_.default) == 1 and _A.cat.default not in targets
    [buffer] = [n for n in graph_module.graph.nodes if n.target is _A.new_empty.default]
    assert buffer.args[1] == [3 * 5 + 5 + 5 + 4 * 4]
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    for value in output.args[0][1:]:  # views of the summed buffer, after its wait
        assert value.target is _A.as_strided.default
        assert value.args[0].target is _F.wait_tensor.default
    _local_collectives(graph_module)
    for got, want in zip(graph_module(x, g), step(x, g), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_write_buckets_leaves_mixed_dtypes_and_can_sum_a_copy():
    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(), x @ x.t(), (x * 2).to(torch.float64), x.sum(0)

    x = torch.randn(3, 3)
    graph_module = make_fx(step, tracing_mode="fake")(x)
    left = write_buckets_in_place(graph_module, [[1, 2], [3]], "0", in_place=False)
    assert left == [[1, 2]]  # float32 beside float64: packed by the caller
    targets = _targets(graph_module)
    assert _F.all_reduce.default in targets and _F.all_reduce_.default not in targets
    _local_collectives(graph_module)
    for got, want in zip(graph_module(x), step(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_loss_reduction_starts_where_backward_starts_and_is_tagged_so():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    loss = graph.call_function(_A.sum.default, (x,))
    seed = graph.call_function(_A.ones_like.default, (loss,))
    seed.meta["custom"] = {"plait_phase": "backward"}
    grad = graph.call_function(_A.mul.Tensor, (seed, x))
    graph.output((loss, grad))
    graph_module = torch.fx.GraphModule(torch.nn.Module(), graph)

    _all_reduce_output(graph_module, 0, "avg", "0")
    nodes = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    started = next(n for n in nodes if n.target is _F.all_reduce.default)
    assert started.args == (loss, "avg", "0") and started.next is seed
    assert started.meta["custom"] == {"plait_phase": "backward"}  # backward's first node now
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    assert output.args[0][0].target is _F.wait_tensor.default and output.prev is output.args[0][0]
