"""A gradient that can only reach parameters stays a pending sum into the fused buckets.

TinyGPT's learned position table is read by one embedding whose output is added to the
batch-split token activations: its gradient comes back summed over dp from every rank. The
plan keeps that sum pending through the embedding's backward into ``pos.weight``'s gradient,
which the data-parallel bucket reduces with the others (``PlannedOp.pending_grad``), instead
of an all-reduce of its own. Before this rule the searchers priced that all-reduce, and
``auto`` on a dp-only mesh split the table over dp (an all-gather and a reduce-scatter a step
that DDP does not have). Now ``auto`` and ``semi_auto`` on a dp mesh make the pure
data-parallel plan: the bucket, the target count and the loss, nothing else.
"""

from __future__ import annotations

import pytest
import torch

from plait.config import ParallelConfig
from plait.graph import capture_program
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.planning import plan_graph
from plait.search.problem import gradient_values, pending_values
from plait.testing.equivalence import assert_same_run, reference_run
from tests.sim.test_plan_exec import by_kind, gpt_batches, planned_collectives, run_plan, sgd

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)


@pytest.mark.parametrize("mode", ["auto", "semi_auto"])
def test_dp_mesh_plans_keep_the_position_gradient_pending_and_train_like_one_device(mode):
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batches = gpt_batches(GPT, 3)
    cfg = ParallelConfig(mode=mode, mesh={"dp": 4})
    captured = capture_program(model, batches[0], gpt_loss)
    plan = plan_graph(captured.graph, cfg, model=model)

    # every parameter whole; the position table's gradient summed over dp in the bucket
    params = {p.name: p for p in plan.parameters}
    assert all(not any(p.layout.dims) for p in plan.parameters)
    assert params["pos.weight"].grad_reduce_axes == ("dp",)
    pos = next(op for op in plan.ops if op.name == params["pos.weight"].op)
    assert pos.pending_grad == ("dp",)
    assert [op.name for op in plan.ops if op.pending_grad] == [pos.name]
    # the collectives of pure data parallelism: one bucket, the target count, the loss
    reasons = sorted(c.reason.split(" ")[0] for c in plan.collectives)
    assert [c.kind for c in plan.collectives] == ["all_reduce"] * 3, reasons
    [bucket] = [c for c in plan.collectives if c.reason.startswith("gradients of")]
    assert "pos.weight" in bucket.reason
    assert bucket.nbytes == sum(p.numel() * 4 for p in model.parameters())

    expected = reference_run(model, gpt_loss, sgd, batches)
    run, executed, debug, executor = run_plan(model, captured, plan, cfg, gpt_loss, sgd, batches, 4)
    # fp32 sums in another order (the table's gradient reduced after its backward, not before)
    assert_same_run(expected, run, rtol=1e-5, atol=1e-6)
    assert executor.mismatches == [], [m.describe() for m in executor.mismatches]
    assert executed == planned_collectives(plan)
    assert debug == by_kind(executed)


def test_a_table_read_twice_is_reduced_on_its_edge():
    """Tied weights (the token table is also the head) do not qualify: the sum is reduced
    where the plan always reduced it."""

    torch.manual_seed(0)
    model = TinyGPT(GPT)
    model.head.weight = model.tok.weight
    captured = capture_program(model, gpt_batches(GPT, 1)[0], gpt_loss)
    graph = captured.graph
    pending = pending_values(graph, gradient_values(graph))
    readers = {
        op.name: [g.target for ref in op.inputs if (g := graph.graph_input(ref)) is not None]
        for op in graph.ops
    }
    assert [readers[name] for name in pending] == [["pos.weight"]]
