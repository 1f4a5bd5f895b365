"""The outer planner of mode="auto": mesh shape, ZeRO level, recompute, micro-batches.

Known answers reasoned from the cost model; each test's docstring says why.
"""

from __future__ import annotations

import pytest
import torch

import plait
from plait.config import ParallelConfig
from plait.models import MLP, GPTConfig, TinyGPT, gpt_loss, mlp_loss


def _gpt(layers: int = 4, width: int = 64, batch: int = 16):
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=128, seq=32, width=width, heads=4, layers=layers))
        ids = torch.zeros(batch, 32, dtype=torch.long)
    return model, (ids, ids)


def test_generous_memory_needs_no_zero_or_recompute() -> None:
    """With memory to spare, ZeRO only adds collectives and recompute only adds compute: the
    winner uses neither, and every option it weighed is recorded with the reason."""
    model, batch = _gpt()
    plan = plait.plan(
        model,
        ParallelConfig(mode="auto", devices=8, hardware="a100-80g"),
        example_batch=batch,
        loss_fn=gpt_loss,
    )
    assert plan.optimizer_shard is None and plan.recompute == "none"
    assert len(plan.options) > 3
    assert plan.options[0].feasible
    assert plan.options[0].step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert all(o.step_time_s >= plan.options[0].step_time_s for o in plan.options if o.feasible)
    text = plan.explain("mesh")
    assert "auto chose" in text and "next best" in text


def test_tight_memory_escalates_until_the_plan_fits() -> None:
    """Cut the memory limit below what the fastest option needs: the planner must pick a
    configuration whose predicted memory fits (sharding states, recomputing or pipelining),
    and it is slower than the unconstrained winner (or it would have won before)."""
    model, batch = _gpt()
    free = plait.plan(
        model,
        ParallelConfig(mode="auto", devices=8, hardware="a100-80g"),
        example_batch=batch,
        loss_fn=gpt_loss,
    )
    # 0.75: the memory model counts ZeRO-3's gathered buckets and the reduction's flat copies,
    # so less than 0.75 of the free plan's peak is out of reach of ZeRO and recompute here
    limit = int(free.predicted.memory_bytes * 0.75)
    tight = plait.plan(
        model,
        ParallelConfig(mode="auto", devices=8, hardware="a100-80g", memory_limit=limit),
        example_batch=batch,
        loss_fn=gpt_loss,
    )
    assert tight.predicted.memory_bytes <= limit
    assert tight.predicted.step_time_s >= free.predicted.step_time_s
    assert any(not o.feasible for o in tight.options)


def test_what_the_user_fixes_stays_fixed() -> None:
    """A given mesh, stage count, ZeRO level or recompute policy is not searched over."""
    model, batch = _gpt()
    cfg = ParallelConfig(
        mode="auto", mesh={"dp": 4, "tp": 2}, optimizer_shard=2, hardware="a100-80g"
    )
    plan = plait.plan(model, cfg, example_batch=batch, loss_fn=gpt_loss)
    assert plan.mesh.as_dict() == {"dp": 4, "tp": 2}
    assert plan.optimizer_shard == 2
    assert {tuple(o.mesh.items()) for o in plan.options} == {(("dp", 4), ("tp", 2))}
    staged = plait.plan(
        model,
        ParallelConfig(mode="auto", devices=8, pipeline_stages=2, hardware="a100-80g"),
        example_batch=batch,
        loss_fn=gpt_loss,
    )
    assert staged.pipeline_stages == 2 and staged.mesh.as_dict()["pp"] == 2
    assert all(o.mesh.get("pp") == 2 for o in staged.options)


def test_big_batch_small_model_stays_data_parallel() -> None:
    """An MLP of width 64 with a batch of 262,144 rows: every layer moves ~64 MiB of
    activations but its weights are 16 KiB. Splitting the batch 8 ways cuts the memory-bound
    compute 8 times for one tiny all-reduce per weight; splitting weights (tp) would move
    activations instead, and replicating would waste 7/8 of the devices. So: pure dp."""
    with torch.device("meta"):
        model = MLP((64, 64, 64, 64))
        x = torch.zeros(262_144, 64)
        y = torch.zeros(262_144, 64)
    plan = plait.plan(
        model,
        ParallelConfig(mode="auto", devices=8, hardware="a100-80g"),
        example_batch=(x, y),
        loss_fn=mlp_loss,
    )
    assert plan.mesh.as_dict() == {"dp": 8}
    assert plan.pipeline_stages == 1


def test_nothing_fits_names_the_ways_out_the_user_fixed() -> None:
    """When no option fits, the note says so and names what would help that the search could
    not change (a fixed ZeRO level, offload), beside more devices or memory."""
    model, batch = _gpt(layers=2)
    cfg = ParallelConfig(mode="auto", devices=4, memory_limit=1000, optimizer_shard=1)
    plan = plait.plan(model, cfg, example_batch=batch, loss_fn=gpt_loss)
    note = plan.notes[-1]
    assert note.startswith("no option fits 1000 B per device")
    assert "optimizer_shard=3" in note and "offload='optimizer'" in note and "add devices" in note


def test_micro_batches_only_between_pipeline_stages() -> None:
    """Micro-batches run only in a pipeline (parallelize refuses them without stages): on a
    fixed mesh without 'pp' plait.plan refuses them up front, naming grad_accumulation; on a
    free mesh the options without stages weigh one micro-batch, those with stages the user's
    count."""
    model, batch = _gpt(layers=4, batch=16)
    fixed = ParallelConfig(
        mode="auto", mesh={"dp": 2, "tp": 2}, micro_batches=4, hardware="a100-80g"
    )
    with pytest.raises(plait.ConfigError, match=r"grad_accumulation=4 and micro_batches=1"):
        plait.plan(model, fixed, example_batch=batch, loss_fn=gpt_loss)
    free = ParallelConfig(mode="auto", devices=4, micro_batches=4, hardware="a100-80g")
    plan = plait.plan(model, free, example_batch=batch, loss_fn=gpt_loss)
    assert plan.options and all(o.mesh.get("pp", 1) == 1 for o in plan.options)
    assert all(o.micro_batches == 1 for o in plan.options)  # was 4: a plan parallelize refused
    staged = ParallelConfig(
        mode="auto", devices=4, pipeline_stages=2, micro_batches=4, hardware="a100-80g"
    )
    plan = plait.plan(model, staged, example_batch=batch, loss_fn=gpt_loss)
    assert plan.options and all(o.mesh["pp"] == 2 for o in plan.options)
    assert all(o.micro_batches == 4 for o in plan.options)
