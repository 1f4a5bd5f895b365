"""Activation recompute on simulated ranks: equal to one device, the plan's collectives, less
kept from forward for backward.

TinyGPT with Megatron annotations on dp=2 x tp=2: ``recompute="full"`` recomputes each block's
forward in backward (keeping its inputs, outputs and collectives' results), ``"selective"``
keeps matrix products and recomputes the cheap ops; ``plait.recompute(module)`` marks one
module. Training equals one device (fp32, rtol 1e-4; every parameter has a gradient, no key
bias), and one step's collectives are exactly the plan's list: recompute issues no collective
again. Combined with ZeRO-3 on dp=4 the parameter gathers of backward serve the recomputed
forward too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait.config import ParallelConfig
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


@pytest.fixture(scope="module")
def gpt_and_batches():
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batches = gpt_batches(GPT, 3)
    return model, batches, reference_run(model, gpt_loss, adamw, batches)


def _run(model, batches, cfg):
    """Train under ``cfg`` on 4 simulated ranks; step 2's collectives; the program's kept bytes."""
    captured = capture_program(model, batches[0], gpt_loss)
    plan = plan_graph(captured.graph, cfg, model=model)
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
        run = Run(losses, job.full_state_dict())
        kept = job.program.saved_bytes
    executed = executed_collectives(log)
    assert executed == planned_collectives(plan)
    assert sum(debug_counts(debug).values()) == sum(executed.values())
    return plan, run, kept


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_megatron_matches_one_device_with_the_plans_collectives(gpt_and_batches, mode):
    model, batches, expected = gpt_and_batches
    model = annotate_megatron(copy.deepcopy(model), 2)
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, recompute=mode)
    plan, run, (before, after) = _run(model, batches, cfg)
    assert plan.recompute_regions == (("blocks.0", mode), ("blocks.1", mode))
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)
    # what backward keeps from forward: full keeps a block's inputs, outputs and collective
    # results (about a third here); selective also keeps the matrix products
    assert after < before * (0.35 if mode == "full" else 0.8), (before, after)


def test_recompute_one_module_marked_by_plait_recompute(gpt_and_batches):
    """MindSpore's Cell.recompute(): only the marked block is recomputed."""
    model, batches, expected = gpt_and_batches
    model = copy.deepcopy(model)
    plait.recompute(model.blocks[1])
    cfg = ParallelConfig(mode="data_parallel", mesh={"dp": 4})
    plan, run, (before, after) = _run(model, batches, dataclass_with_marks(model, cfg))
    assert plan.recompute_regions == (("blocks.1", "full"),)
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)
    assert after < before * 0.75, (before, after)


def dataclass_with_marks(model, cfg):
    """The config plan_graph sees: parallelize folds plait.recompute marks in the same way."""
    from plait.runtime.parallelize import _with_model_marks

    return _with_model_marks(model, cfg)


def test_recompute_full_with_zero3_matches_one_device(gpt_and_batches):
    """ZeRO-3 gathers again in backward what the recomputed forward reads (biases too)."""
    model, batches, expected = gpt_and_batches
    cfg = ParallelConfig(
        mode="auto",
        mesh={"dp": 4},
        recompute="full",
        optimizer_shard=3,
        optimizer_shard_threshold=0,
    )
    _, run, _ = _run(copy.deepcopy(model), batches, cfg)
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)


def test_recompute_modules_names_a_mode_or_is_refused():
    with pytest.raises(plait.ConfigError, match="recompute_modules"):
        ParallelConfig(recompute_modules={"blocks.0": "all"})
    with pytest.raises(plait.ConfigError, match="mode must be"):
        plait.recompute(torch.nn.Linear(2, 2), mode="yes")


def test_activation_offload_pass_moves_what_backward_reads_and_trains_the_same(gpt_and_batches):
    """offload="activations": forward values backward reads are copied to the host after
    forward and back before backward (on this CPU machine the host is the device: the copies
    run, nothing is saved; the GPU benchmark measures the memory). The tiny model's values are
    under the 1 MiB default, so the pass is applied again with no minimum."""
    model, batches, expected = gpt_and_batches
    cfg = ParallelConfig(mode="data_parallel", mesh={"dp": 4}, offload="activations")
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batches[0]
        )
        assert job.program.offloaded_bytes == 0  # nothing reaches 1 MiB here
        before = len(job.program.graph_module.graph.nodes)
        moved = job.program.offload_activations(min_bytes=0)
        copies = len(job.program.graph_module.graph.nodes) - before
        run = Run([job.step(b) for b in batches], job.full_state_dict())
        shown = str(job.program)
    assert moved > 0 and copies >= 10 and copies % 2 == 0  # one copy down, one up, per value
    assert "kept on the host for backward" in shown
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)
