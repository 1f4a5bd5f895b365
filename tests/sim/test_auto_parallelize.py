"""plait.parallelize in mode "auto" and with a saved plan file: plan, then run op by op."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait.config import ParallelConfig
from plait.errors import ConfigError, PlanError
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.testing.equivalence import Run, assert_same_run, parallel_steps, reference_run

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, GPT.vocab, (8, GPT.seq))
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _run(model, cfg, batches):
    model = copy.deepcopy(model)
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            model, cfg, optimizer=sgd, loss_fn=gpt_loss, example_batch=batches[0]
        )
        return parallel_steps(job, batches)


@pytest.mark.parametrize(
    "search", ["dynamic_programming", "recursive_programming", "ilp", "sharding_propagation"]
)
def test_auto_mode_plans_and_trains_like_one_device(search: str) -> None:
    """Mode auto on a dp=2 x tp=2 mesh with the linears annotated Megatron style: each searcher
    chooses every other op around them (a third or more end up split), the plan runs op by op,
    and 3 SGD steps equal single-device training (SGD exposes gradient-scale errors that Adam
    hides). Unannotated, this tiny model is best fully replicated on the cost model, which
    would test nothing."""
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batches = _batches(3)
    expected = reference_run(model, gpt_loss, sgd, batches)
    cfg = ParallelConfig(mode="auto", search=search, mesh={"dp": 2, "tp": 2})
    plan = plait.plan(model, batches[0], cfg, loss_fn=gpt_loss)
    assert sum(op.label != "replicate" for op in plan.ops) > len(plan.ops) // 3  # really split
    actual = _run(model, cfg, batches)
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)


def test_saved_plan_file_replays(tmp_path) -> None:
    """A Megatron plan saved to a file runs through ParallelConfig(plan=...)."""
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batches = _batches(2)
    plan = plait.plan(
        model,
        batches[0],
        ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
        loss_fn=gpt_loss,
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    expected = reference_run(model, gpt_loss, sgd, batches)
    actual = _run(
        model, ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, plan=str(path)), batches
    )
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)


def test_plan_object_runs_through_parallelize() -> None:
    """``parallelize(model, plan)``: a Plan value runs as it is (mesh and settings its own)."""
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batches = _batches(2)
    plan = plait.plan(
        model, batches[0], ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2}), loss_fn=gpt_loss
    )
    expected = reference_run(model, gpt_loss, sgd, batches)
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            copy.deepcopy(model), plan, optimizer=sgd, loss_fn=gpt_loss, example_batch=batches[0]
        )
        assert job.loss_fn.plan is plan
        actual = parallel_steps(job, batches)
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)


def test_plan_object_keeps_the_settings_it_was_made_with(tmp_path) -> None:
    """A plan made on axis "data" with one-parameter gradient buckets runs so through
    parallelize(model, plan): the collectives of a step are the plan's; a config replaying
    its file with other settings is refused by name."""
    from plait.config import CommFusion
    from plait.testing.comm import CollectiveLog
    from tests.sim.test_plan_exec import executed_collectives, planned_collectives

    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batches = _batches(2)
    cfg = ParallelConfig(
        mode="auto",
        mesh={"data": 2, "tp": 2},
        dp_axis="data",
        comm_fusion=CommFusion(bucket_mb=1e-9),  # one bucket per parameter
    )
    plan = plait.plan(model, batches[0], cfg, loss_fn=gpt_loss)
    assert (plan.dp_axis, plan.comm_fusion) == ("data", cfg.comm_fusion)
    expected = reference_run(model, gpt_loss, sgd, batches)
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            copy.deepcopy(model), plan, optimizer=sgd, loss_fn=gpt_loss, example_batch=batches[0]
        )
        first = job.step(batches[0])
        with CollectiveLog(job.device_mesh) as log:
            second = job.step(batches[1])
        state = job.full_state_dict()
    assert executed_collectives(log) == planned_collectives(plan)
    assert sum(n for (kind, axis, _), n in planned_collectives(plan).items() if axis == "data") > 5
    assert_same_run(expected, Run([first, second], state), rtol=1e-4, atol=1e-5)

    path = tmp_path / "plan.json"
    plan.save(path)
    other = ParallelConfig(mode="auto", mesh={"data": 2, "tp": 2}, dp_axis="data", plan=path)
    with plait.testing.simulate(world_size=4), pytest.raises(PlanError, match="comm_fusion"):
        plait.parallelize(model, other, optimizer=sgd, loss_fn=gpt_loss, example_batch=batches[0])


def test_plan_object_that_does_not_fit_is_refused_before_any_collective() -> None:
    """A plan for another world size, or for another model, is refused by name up front."""
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batches = _batches(1)
    plan = plait.plan(
        model, batches[0], ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2}), loss_fn=gpt_loss
    )
    other = TinyGPT(dataclasses.replace(GPT, width=32))
    kwargs = {"optimizer": sgd, "loss_fn": gpt_loss, "example_batch": batches[0]}
    two = plait.testing.simulate(world_size=2)
    with two, CommDebugMode() as comm, pytest.raises(PlanError, match=r"4 devices.*2"):
        plait.parallelize(model, plan, **kwargs)
    assert comm.get_total_counts() == 0
    four = plait.testing.simulate(world_size=4)
    with four, CommDebugMode() as comm, pytest.raises(PlanError, match="shape"):
        plait.parallelize(other, plan, **kwargs)
    assert comm.get_total_counts() == 0


def test_parallelize_names_what_it_was_given() -> None:
    with plait.testing.simulate(world_size=2), pytest.raises(ConfigError, match="got dict"):
        plait.parallelize(TinyGPT(GPT), {"mode": "auto"}, optimizer=sgd, loss_fn=gpt_loss)  # type: ignore[arg-type]


def test_auto_mode_plans_at_the_first_step() -> None:
    """Without example_batch the job is planned at its first step, on that batch; until then
    only what the config fixes exists, and asking for more says when it will."""
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    ids = torch.randint(0, GPT.vocab, (4, GPT.seq))
    with plait.testing.simulate(world_size=2):
        job = plait.parallelize(model, ParallelConfig(mode="auto"), optimizer=sgd, loss_fn=gpt_loss)
        assert job.built is None and job.engine == "program"
        with pytest.raises(AttributeError, match="first step"):
            job.optimizer  # noqa: B018
        loss = job.step((ids, torch.roll(ids, -1, dims=1)))
        assert job.built is not None and job.program is job.built.program
    assert math.isfinite(loss)


def test_hugging_face_model_runs_through_parallelize_in_a_simulated_world() -> None:
    """Mode auto on an unmodified Hugging Face GPT-2 built and planned inside ``simulate``
    (the export runs outside the simulated world: HF models do not export under it)."""
    from tests.sim.test_plan_exec import hf_loss, hf_model

    model = hf_model("gpt2")
    batches = _batches(3)
    batches = [(ids[:4], targets[:4]) for ids, targets in batches]
    expected = reference_run(model, hf_loss, sgd, batches)
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            copy.deepcopy(model),
            ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2}),
            optimizer=sgd,
            loss_fn=hf_loss,
            example_batch=batches[0],
        )
        actual = parallel_steps(job, batches)
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)


def test_auto_plan_with_gradient_accumulation_matches_one_device() -> None:
    """grad_accumulation=2: the plan is made for one micro-step's batch; its activation
    collectives repeat per micro-step (count 2), the gradient reductions happen once after
    the last; training equals one device on the whole batch, and what runs is what the plan
    lists."""
    from plait.testing.comm import CollectiveLog
    from tests.sim.test_plan_exec import executed_collectives, planned_collectives

    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batches = _batches(3)
    expected = reference_run(model, gpt_loss, sgd, batches)
    cfg = ParallelConfig(
        mode="auto", search="dynamic_programming", mesh={"dp": 2, "tp": 2}, grad_accumulation=2
    )
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=gpt_loss, example_batch=batches[0]
        )
        plan = job.loss_fn.plan
        losses = [job.step(batches[0])]
        with CollectiveLog(job.device_mesh) as log:
            losses.append(job.step(batches[1]))
        losses.append(job.step(batches[2]))
        actual = Run(losses, job.full_state_dict())
        evaluated = job.evaluate(batches[0])  # the step's batch size: two micro-batches
        # half the batch: micro-batches of 2, a new shape, planned again (plait.runtime.engine.replan)
        half = job.evaluate(tuple(x[:4] for x in batches[0]))
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)
    assert plan.grad_accumulation == 2 and plan.batch == ((4, GPT.seq), (4, GPT.seq))
    # plait.plan takes the step's batch as parallelize does, and plans one micro-batch of it
    assert plait.plan(model, batches[0], cfg, loss_fn=gpt_loss).batch == plan.batch
    trained = copy.deepcopy(model)
    trained.load_state_dict(expected.state)
    with torch.no_grad():
        halves = [gpt_loss(trained, tuple(x[i : i + 4] for x in batches[0])) for i in (0, 4)]
        quarters = [gpt_loss(trained, tuple(x[i : i + 2] for x in batches[0])) for i in (0, 2)]
    assert evaluated == pytest.approx(float(sum(halves)) / 2, rel=1e-5)
    assert half == pytest.approx(float(sum(quarters)) / 2, rel=1e-5)
    assert executed_collectives(log) == planned_collectives(plan)
    twice = {c.kind for c in plan.collectives if c.count == 2}
    params = {p.name for p in plan.parameters}
    once = [c for c in plan.collectives if c.op in params]  # gradient reductions
    assert "all_reduce" in twice and once and all(c.count == 1 for c in once)


def test_saved_plan_refuses_another_gradient_accumulation(tmp_path) -> None:
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batches = _batches(1)
    plan = plait.plan(
        model,
        batches[0],
        ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
        loss_fn=gpt_loss,
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    cfg = ParallelConfig(
        mode="semi_auto", mesh={"dp": 2, "tp": 2}, plan=str(path), grad_accumulation=2
    )
    with plait.testing.simulate(world_size=4):
        with pytest.raises(plait.PlanError, match="grad_accumulation=1 but the config"):
            plait.parallelize(model, cfg, optimizer=sgd, loss_fn=gpt_loss, example_batch=batches[0])
        half = [(x[:4], y[:4]) for x, y in batches]
        cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, plan=str(path))
        with pytest.raises(plait.PlanError, match=r"made for batch shapes \[\(8, 8\)"):
            plait.parallelize(model, cfg, optimizer=sgd, loss_fn=gpt_loss, example_batch=half[0])
