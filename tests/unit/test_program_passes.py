"""Passes over a per-rank program's FX graph that change its cost, not its values.

``drop_aliases`` removes the no-op views tracing through DTensor leaves (hundreds per step in
a transformer's program, each a Python call); ``issue_early`` starts collectives computed from
the batch alone before the forward. Both are checked on small traced graphs: what goes, what
must stay (a reshape that copies into an ancestor's geometry), and equal results.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from plait.runtime.program import drop_aliases, issue_early

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
