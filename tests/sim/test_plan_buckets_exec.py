"""A plan's gradient reductions are exactly what a plan run executes (simulated ranks).

TinyGPT with Megatron annotations, planned semi_auto on ``{"dp": 2, "tp": 2}`` with the
DEFAULT ``comm_fusion`` (25 MB buckets) and frozen parameters, runs with ``build_plan_job``:
the collectives of step 2 (kind, mesh axis, bytes, count) equal ``plan.collectives`` with no
adjustment (fused dp buckets, no reduction for frozen parameters), and training equals one
device. Pure data parallelism (plain tensors, PlainGradSync) is checked the same way.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import plait
from plait.annotate import shard
from plait.config import CommFusion, ParallelConfig
from plait.graph import capture_program
from plait.models import MLP, GPTConfig, TinyGPT, annotate_megatron, gpt_loss, mlp_loss
from plait.planning import plan_graph
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import assert_same_run, reference_run
from tests.sim.test_plan_exec import (
    adamw,
    by_kind,
    executed_collectives,
    gpt_batches,
    planned_collectives,
    run_plan,
    sgd,
)

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
# pos.weight: its embedding's output then needs no gradient (the backward all-reduce of that
# value goes too); q.weight: split over tp (column parallel)
FROZEN = ("pos.weight", "blocks.0.attn.q.weight")


def _frozen_gpt(sequence_parallel_head: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    if sequence_parallel_head:
        # the final norm's input split over dp (batch) and tp (sequence): the gradients of
        # ln.weight, ln.bias and head.weight are pending over both axes, so GradSync reduces
        # each alone, outside the buckets
        shard(model.ln, in_strategy=((2, 2, 1),))
    for name in FROZEN:
        model.get_parameter(name).requires_grad_(False)
    return model


@pytest.mark.parametrize("sequence_parallel_head", [False, True], ids=["megatron", "sp_head"])
def test_default_fusion_plan_with_frozen_parameters_runs_exactly_its_collectives(
    sequence_parallel_head,
):
    model = _frozen_gpt(sequence_parallel_head)
    batches = gpt_batches(GPT, 2)
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2})
    captured = capture_program(model, batches[0], gpt_loss)
    plan = plan_graph(captured.graph, cfg, model=model)

    buckets = [c for c in plan.collectives if c.reason.startswith("gradients of")]
    over_dp = [c for c in buckets if c.axes == ("dp",)]
    assert len(over_dp) == 1  # the tiny model's dp gradients fit one 25 MB bucket
    assert all(c.op not in FROZEN for c in plan.collectives)
    params = {p.name: p for p in plan.parameters}
    assert all(params[n].grad_reduce_axes == () for n in FROZEN)
    both = {p.name for p in plan.parameters if len(p.grad_reduce_axes) > 1}
    assert both == ({"ln.weight", "ln.bias", "head.weight"} if sequence_parallel_head else set())
    # those pending over dp and tp are summed over tp together first, then join the bucket
    first = [c for c in buckets if c.axes == ("tp",)]
    assert len(first) == (1 if both else 0)
    assert all(f"gradients of {len(both)} parameters" in c.reason for c in first)

    expected = reference_run(model, gpt_loss, adamw, batches)
    run, executed, debug, executor = run_plan(
        model, captured, plan, cfg, gpt_loss, adamw, batches, 4
    )
    assert_same_run(expected, run, rtol=1e-4, atol=1e-5)
    assert executor.mismatches == [], [m.describe() for m in executor.mismatches]
    planned = planned_collectives(plan)
    assert executed == planned, (
        f"executed - planned: {executed - planned}; planned - executed: {planned - executed}"
    )
    assert debug == by_kind(executed)


@pytest.mark.parametrize(
    ("fusion", "n_buckets"),
    [(None, 1), (CommFusion(bucket_mb=0.002), 3), (CommFusion(mode="index", boundaries=(2,)), 2)],
    ids=["default", "small", "index"],
)
def test_pure_data_parallel_runs_the_planned_buckets(fusion, n_buckets):
    """mode data_parallel runs on plain tensors (PlainGradSync); a frozen weight is skipped."""
    torch.manual_seed(0)
    model = MLP((16, 32, 16, 8))
    next(iter(model.parameters())).requires_grad_(False)
    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(2)]
    cfg = ParallelConfig(mode="data_parallel", devices=4, comm_fusion=fusion)
    plan = plait.plan(model, batches[0], cfg, loss_fn=mlp_loss)
    assert sum(c.reason.startswith("gradients of") for c in plan.collectives) == n_buckets
    with plait.testing.simulate(4):
        job = plait.parallelize(copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=mlp_loss)
        assert job.engine == "plain"
        job.step(batches[0])
        with CollectiveLog(job.device_mesh) as log:
            job.step(batches[1])
    executed: Counter[tuple[str, str, int]] = executed_collectives(log)
    assert executed == planned_collectives(plan)
