"""A batch of a new shape plans again (plait.runtime.engine.replan): per shape, cached, logged.

Training on batches of three shapes (another batch size, another sequence length, and back)
equals one device; each new shape is planned once, with the parameters pinned where the first
plan put them; the collectives a new shape's step issues are its new plan's, exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait import ParallelConfig
from plait.errors import PlanError
from plait.graph import capture
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.models import MLP, GPTConfig, TinyGPT, annotate_megatron, gpt_loss, mlp_loss
from plait.planning import plan_graph
from plait.runtime.engine.replan import check_same_parameters
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import assert_same_run, parallel_steps, reference_run
from tests.sim.test_plan_exec import executed_collectives, planned_collectives

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
REPLANNED = "planning again"


def sgd(params):
    """SGD: a parameter's error is lr times its gradient's error (no Adam normalisation)."""
    return torch.optim.SGD(params, lr=0.1)


def _batch(n: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, GPT.vocab, (n, seq))
    return ids, torch.roll(ids, -1, dims=1)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three shapes: the planned one, a smaller batch (an epoch's last), a shorter sequence;
    the smaller one comes back, which must not plan again."""
    torch.manual_seed(1)
    return [_batch(8, 8), _batch(4, 8), _batch(8, 6), _batch(4, 8)]


@pytest.mark.parametrize(
    "config",
    [
        ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2}, search="dynamic_programming"),
        ParallelConfig(mode="data_parallel", optimizer_shard=3),
    ],
    ids=["auto-dp2xtp2", "zero3-dp4"],
)
def test_new_batch_shapes_plan_again_and_train_like_one_device(config, caplog) -> None:
    """Planned at the first step (no example batch); two new shapes, each planned once."""
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batches = _batches()
    expected = reference_run(model, gpt_loss, sgd, batches)
    with plait.testing.simulate(4), caplog.at_level(logging.INFO, logger="plait.runtime.engine.replan"):
        job = plait.parallelize(copy.deepcopy(model), config, optimizer=sgd, loss_fn=gpt_loss)
        actual = parallel_steps(job, batches)
        assert job.loss_fn.plan.batch == ((4, 8), (4, 8))  # the last step's plan is active
    assert_same_run(expected, actual, rtol=1e-5, atol=1e-6)
    replanned = [r.getMessage() for r in caplog.records if REPLANNED in r.getMessage()]
    assert len(replanned) == 2, replanned
    assert "(4, 8)" in replanned[0] and "(8, 6)" in replanned[1]


def test_new_shape_step_issues_its_plans_collectives() -> None:
    """semi_auto Megatron (dp=2 x tp=2): the step on a new batch size issues exactly the
    collectives of the plan made for it (kind, axis, bytes), counted by CommDebugMode too; the
    parameters keep their first layouts; back on the first shape, its program runs again."""
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    first, second = _batch(8, 8), _batch(4, 8)
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2})
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=gpt_loss, example_batch=first
        )
        layouts = {p.name: p.layout for p in job.loss_fn.plan.parameters}
        program = job.program
        job.step(first)
        job.step(second)  # plans and compiles for (4, 8)
        with CommDebugMode() as debug, CollectiveLog(job.device_mesh) as log:
            job.step(second)
        plan = job.loss_fn.plan
        job.step(first)
        assert job.program is program
    assert plan.batch == ((4, 8), (4, 8))
    assert executed_collectives(log) == planned_collectives(plan)
    assert debug.get_total_counts() == log.total()
    assert {p.name: p.layout for p in plan.parameters} == layouts
    assert any(kind == "all_reduce" and axis == "tp" for kind, axis, _ in planned_collectives(plan))


def test_a_given_plan_runs_its_shapes_only() -> None:
    """A Plan passed to parallelize is run as it is: another batch shape is refused by name,
    before any collective (plait plans again only for jobs its planner made)."""
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    first = _batch(8, 8)
    cfg = ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2})
    plan = plait.plan(model, cfg, example_batch=first, loss_fn=gpt_loss)
    with plait.testing.simulate(4):
        job = plait.parallelize(model, plan, optimizer=sgd, loss_fn=gpt_loss, example_batch=first)
        job.step(first)
        with CommDebugMode() as debug, pytest.raises(plait.ShardingError, match="given plan"):
            job.step(_batch(4, 8))
    assert debug.get_total_counts() == 0


def test_parameters_stay_where_the_first_plan_put_them() -> None:
    """plan_graph(fixed_parameters=...) keeps a parameter's layout even where the searcher
    would choose another (here a tensor-parallel split of a data-parallel MLP's weight)."""
    torch.manual_seed(0)
    model = MLP((16, 32, 8))
    graph = capture(model, (torch.randn(8, 16), torch.randn(8, 8)), mlp_loss)
    cfg = ParallelConfig(mode="auto", search="dynamic_programming")
    mesh = MeshSpec.from_dict({"dp": 2, "tp": 2})
    free = {p.name: p.layout for p in plan_graph(graph, cfg, mesh=mesh).parameters}
    name = "layers.0.weight"
    pinned = TensorLayout(mesh, (("tp",), ()))
    assert free[name] != pinned
    fixed = plan_graph(graph, cfg, mesh=mesh, fixed_parameters={name: pinned})
    assert {p.name: p.layout for p in fixed.parameters}[name] == pinned


def test_a_plan_that_moves_a_parameter_is_refused_by_name() -> None:
    torch.manual_seed(0)
    model = MLP((16, 32, 8))
    graph = capture(model, (torch.randn(8, 16), torch.randn(8, 8)), mlp_loss)
    mesh = MeshSpec.from_dict({"dp": 2, "tp": 2})
    plan = plan_graph(graph, ParallelConfig(mode="auto"), mesh=mesh)
    moved = dataclasses.replace(
        plan,
        parameters=tuple(
            dataclasses.replace(p, grad_reduce_axes=()) if p.name == "layers.0.bias" else p
            for p in plan.parameters
        ),
    )
    check_same_parameters(plan, plan, [(4, 16)])
    with pytest.raises(PlanError, match=r"batch shapes \[\(4, 16\)\].*layers\.0\.bias"):
        check_same_parameters(plan, moved, [(4, 16)])
