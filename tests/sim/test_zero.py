"""Optimizer parallel (ZeRO 1/2/3) on simulated ranks: equal to one device, exactly the plan's
collectives, the memory it promises, clear refusals.

TinyGPT (two blocks, no key bias: every parameter has a real gradient, so AdamW's steps are
comparable at a tight tolerance) is trained with ``optimizer_shard`` 1, 2 and 3 on dp=4 and on
dp=2 x tp=2, with and without gradient accumulation; losses and final parameters equal
single-device training (fp32, rtol 1e-4). ``optimizer_shard_threshold=0`` splits every
parameter that can be split (the tiny model's pieces are all under the 64 KiB default).
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait.comm.dtensor import local_piece
from plait.config import CommFusion, ParallelConfig
from plait.errors import ConfigError, NotBuiltError
from plait.graph import capture_program
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.planning import plan_graph
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import Run, assert_same_run, reference_run
from tests.sim.test_plan_exec import (
    adamw,
    debug_counts,
    executed_collectives,
    gpt_batches,
    planned_collectives,
)

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2)
RTOL = 1e-4
NIGHTLY = pytest.mark.nightly


@pytest.fixture(scope="module")
def gpt_and_batches():
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batches = gpt_batches(GPT, 3)
    return model, batches, reference_run(model, gpt_loss, adamw, batches)


@pytest.mark.parametrize(
    ("level", "mesh", "k"),
    [
        pytest.param(3, {"dp": 4}, 2, marks=NIGHTLY),
        pytest.param(2, {"dp": 2, "tp": 2}, 2, marks=NIGHTLY),
        pytest.param(1, {"dp": 4}, 1, marks=NIGHTLY),
        pytest.param(1, {"dp": 2, "tp": 2}, 2, marks=NIGHTLY),
        pytest.param(2, {"dp": 4}, 1, marks=NIGHTLY),
        pytest.param(3, {"dp": 2, "tp": 2}, 2, marks=NIGHTLY),
    ],
    ids=[
        "3-dp4-accum2",
        "2-dp2xtp2-accum2",
        "1-dp4",
        "1-dp2xtp2-accum2",
        "2-dp4",
        "3-dp2xtp2-accum2",
    ],
)
def test_optimizer_shard_matches_one_device(gpt_and_batches, level, mesh, k):
    """Auto plans (the searcher's layouts, ZeRO on top); with accumulation one reduction per
    step, after the last micro-batch."""
    model, batches, expected = gpt_and_batches
    cfg = ParallelConfig(
        mode="auto",
        mesh=mesh,
        optimizer_shard=level,
        optimizer_shard_threshold=0,
        grad_accumulation=k,
    )
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batches[0]
        )
        run = Run([job.step(b) for b in batches], job.full_state_dict())
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_optimizer_shard_megatron_runs_the_plans_collectives_and_matches_one_device(
    gpt_and_batches, level
):
    """Megatron tp=2 x dp=2 with a few gradient buckets: one step's collectives (kind, axis,
    bytes) are exactly the plan's list (bucketed reduce-scatters for 2 and 3; all-gathers after
    the update for 1 and 2, before forward and again before backward for 3, but for a bucket
    backward does not read), the optimizer's states are shards, and training equals one device."""
    model, batches, expected = gpt_and_batches
    model = annotate_megatron(copy.deepcopy(model), 2)
    cfg = ParallelConfig(
        mode="semi_auto",
        mesh={"dp": 2, "tp": 2},
        optimizer_shard=level,
        optimizer_shard_threshold=0,
        comm_fusion=CommFusion(bucket_mb=0.004),  # a few buckets, not one
    )
    captured = capture_program(model, batches[0], gpt_loss)
    plan = plan_graph(captured.graph, cfg, model=model)
    kinds = Counter((c.kind, c.phase) for c in plan.collectives if "optimizer_shard" in c.reason)
    buckets = kinds["all_gather", "forward" if level == 3 else "optimizer"]
    assert buckets >= 4
    assert kinds["reduce_scatter", "backward"] == (0 if level == 1 else buckets)
    if level == 3:  # gathered again for backward (not a bucket backward never reads)
        assert 0 < kinds["all_gather", "backward"] <= buckets
    losses = []
    with plait.testing.simulate(4):
        job = plait.parallelize(
            model, cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batches[0]
        )
        for i, batch in enumerate(batches):
            if i != 1:
                losses.append(job.step(batch))
                continue
            with CommDebugMode() as debug, CollectiveLog(job.device_mesh) as log:
                losses.append(job.step(batch))
        _check_model_states(job, level)
        run = Run(losses, job.full_state_dict())
    assert executed_collectives(log) == planned_collectives(plan)
    assert sum(debug_counts(debug).values()) == sum(executed_collectives(log).values())
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)


def _check_model_states(job, level: int) -> None:
    """Each split parameter's optimizer states are 1/dp of its tensor-parallel piece; under
    ZeRO-3 so are the parameter and its gradient, under 1 and 2 the parameter stays whole."""
    zero = job.optimizer._plait_shadows
    split = [spec for _, _, spec in zero.pairs if spec is not None]
    assert len(split) >= 20
    for p, shadow, spec in zero.pairs:
        piece = math.prod(spec.piece_shape if spec is not None else p.to_local().shape)
        expected = piece // 2 if spec is not None else piece
        assert shadow.numel() == expected
        state = job.optimizer.state[shadow]
        assert state["exp_avg"].numel() == expected and state["exp_avg_sq"].numel() == expected
        if spec is not None:
            assert local_piece(p).numel() == (expected if level == 3 else piece)


def test_threshold_keeps_small_parameters_whole_and_says_why(gpt_and_batches):
    model, batches, _ = gpt_and_batches
    cfg = ParallelConfig(mode="auto", mesh={"dp": 4}, optimizer_shard=2)  # 64 KiB default
    captured = capture_program(model, batches[0], gpt_loss)
    plan = plan_graph(captured.graph, cfg, model=model)
    assert all(p.optimizer_shard_dim is None for p in plan.parameters)
    assert any("optimizer_shard_threshold" in p.reason for p in plan.parameters)


def test_optimizer_shard_refuses_a_non_elementwise_optimizer(gpt_and_batches):
    model, batches, _ = gpt_and_batches

    class Lamb(torch.optim.SGD):  # not in the elementwise list: looks across elements
        pass

    with plait.testing.simulate(4), pytest.raises(ConfigError, match=r"optimizer_shard=2.*Lamb"):
        plait.parallelize(
            copy.deepcopy(model),
            ParallelConfig(mode="auto", mesh={"dp": 4}, optimizer_shard=2),
            optimizer=lambda p: Lamb(p, lr=0.1),
            loss_fn=gpt_loss,
            example_batch=batches[0],
        )


def test_optimizer_shard_in_hybrid_mode_is_refused_by_name(gpt_and_batches):
    model, _, _ = gpt_and_batches
    cfg = ParallelConfig(mode="hybrid", mesh={"dp": 4}, optimizer_shard=1)
    with plait.testing.simulate(4), pytest.raises(NotBuiltError, match="optimizer_shard=1"):
        plait.parallelize(copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss)


def test_offload_optimizer_moves_optimizer_states_off_the_device_in_the_plan(gpt_and_batches):
    model, batches, _ = gpt_and_batches
    captured = capture_program(model, batches[0], gpt_loss)
    plans = {
        offload: plan_graph(
            captured.graph,
            ParallelConfig(mode="data_parallel", mesh={"dp": 4}, offload=offload),
            model=model,
        )
        for offload in (None, "optimizer")
    }
    kept, moved = (plans[o].predicted.memory_by_kind for o in (None, "optimizer"))
    assert kept["optimizer"] > 0 and moved["optimizer"] == 0
    assert moved["parameters"] == kept["parameters"]
    assert "offload optimizer (host)" in plans["optimizer"].summary()


def test_offload_of_parameters_is_refused_by_name(gpt_and_batches):
    model, _, _ = gpt_and_batches
    cfg = ParallelConfig(mode="data_parallel", mesh={"dp": 4}, offload="parameters")
    with plait.testing.simulate(4), pytest.raises(NotBuiltError, match="offload='parameters'"):
        plait.parallelize(copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss)


def test_outer_planner_escalates_to_zero_and_recompute_under_a_memory_limit_and_runs(
    gpt_and_batches,
):
    """Mode auto with a memory limit of ZeRO-3 with selective recompute's peak: no option
    without ZeRO and recompute fits, so the outer planner (the fastest option that fits, over
    every level and policy) picks both, and the plan runs like one device,
    with gradient accumulation (one reduce-scatter per step, after the last micro-batch) and
    the optimizer offloaded (on this CPU-only machine the host is the device: the numerics and
    the wiring are what is tested; bench/gpu_memory.py measures the memory on a GPU).

    A batch of 64 sequences: with a few, the step's peak is the gradient reduction after the
    accumulation, which no recompute lowers, so recompute would rightly not be chosen."""
    model = gpt_and_batches[0]
    torch.manual_seed(3)
    batches = gpt_batches(GPT, 2, batch=64)
    expected = reference_run(model, gpt_loss, adamw, batches)
    base = {
        "mode": "auto",
        "mesh": {"dp": 4},
        "optimizer_shard_threshold": 0,
        "grad_accumulation": 2,
        "offload": "optimizer",
    }
    micro = tuple(x[:32] for x in batches[0])  # plans are for one micro-step's batch
    captured = capture_program(model, micro, gpt_loss)
    fixed = ParallelConfig(**base, optimizer_shard=3, recompute="selective")
    limit = plan_graph(captured.graph, fixed, model=model).predicted.memory_bytes
    cfg = ParallelConfig(**base, memory_limit=limit)
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batches[0]
        )
        plan = job.loss_fn.plan
        run = Run([job.step(b) for b in batches], job.full_state_dict())
    assert plan.optimizer_shard is not None and plan.recompute != "none"
    assert plan.offload == "optimizer" and plan.predicted.memory_bytes <= limit
    assert plan.grad_accumulation == 2
    assert plan.recompute_regions == (("blocks.0", plan.recompute), ("blocks.1", plan.recompute))
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)


@NIGHTLY
def test_zero3_and_full_recompute_under_bf16_equal_plain_bf16(gpt_and_batches):
    """Mixed precision composes: ZeRO-3 with full recompute under bf16 autocast trains exactly
    (bitwise here) like the same bf16 plan without them."""
    model, batches, _ = gpt_and_batches
    runs = []
    for extra in ({}, {"optimizer_shard": 3, "optimizer_shard_threshold": 0, "recompute": "full"}):
        cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 4}, precision="bf16", **extra)
        with plait.testing.simulate(4):
            job = plait.parallelize(
                copy.deepcopy(model),
                cfg,
                optimizer=adamw,
                loss_fn=gpt_loss,
                example_batch=batches[0],
            )
            runs.append(Run([job.step(b) for b in batches], job.full_state_dict()))
    assert_same_run(runs[0], runs[1], rtol=0, atol=0)


def test_a_parameter_no_dim_of_which_divides_stays_whole_with_a_warning_naming_it(caplog):
    """A (3,) bias on dp=4: no dim divides, so it stays whole (exact, just not split); the job
    says which parameter and how to get it split, and still trains. A parameter flagged
    ``parallel_optimizer = False`` (MindSpore's flag) stays whole too, without a warning."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model[0].bias.parallel_optimizer = False  # MindSpore's flag: keep this one whole
    x, y = torch.randn(8, 8), torch.randn(8, 3)

    def loss(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean()

    cfg = ParallelConfig(mesh={"dp": 4}, optimizer_shard=2, optimizer_shard_threshold=0)
    with plait.testing.simulate(4), caplog.at_level("WARNING", logger="plait"):
        job = plait.parallelize(
            model, cfg, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss,
            example_batch=(x, y),
        )  # fmt: skip
        job.step((x, y))
    planned = {p.name: p for p in job.loss_fn.plan.parameters}
    dims = {name: p.optimizer_shard_dim for name, p in planned.items()}
    assert dims == {"0.weight": 0, "0.bias": None, "2.weight": 1, "2.bias": None}
    assert "excluded" in planned["0.bias"].reason
    warned = [r.getMessage() for r in caplog.records if "stays whole" in r.getMessage()]
    assert len(warned) == 1 and "2.bias" in warned[0] and "divisible by 4" in warned[0]
