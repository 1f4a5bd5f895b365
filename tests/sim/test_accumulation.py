"""Gradient accumulation: k micro-steps give the update of one step on the whole batch.

Reference: single-device training on the whole (k-times larger) batch per step.
"""

import pytest
import torch

import plait
from plait import ParallelConfig, ShardingError
from plait.models import annotate_megatron, gpt_loss, mlp_loss
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import assert_same_run, reference_run, simulated_run
from tests.sim.conftest import adamw


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("optimizer", [adamw, sgd], ids=["adamw", "sgd"])
def test_accumulation_k4_data_parallel_matches_whole_batch(optimizer, mlp_and_batches):
    model, batches = mlp_and_batches
    expected = reference_run(model, mlp_loss, optimizer, batches)
    config = ParallelConfig(mode="data_parallel", grad_accumulation=4)
    # 8 samples per step: 4 micro-batches of 2, each split over 2 data-parallel ranks
    assert_same_run(expected, simulated_run(model, config, mlp_loss, optimizer, batches, 2))


@pytest.mark.nightly  # accumulation beside tp stays default: test_auto_parallelize (auto, dp=2 x tp=2)
def test_accumulation_k2_megatron_gpt_matches_whole_batch(gpt_and_batches):
    model, batches = gpt_and_batches
    expected = reference_run(model, gpt_loss, adamw, batches[:4])
    annotate_megatron(model, 2)
    config = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, grad_accumulation=2)
    assert_same_run(expected, simulated_run(model, config, gpt_loss, adamw, batches[:4], 4))


def test_accumulation_reduces_gradients_once(mlp_and_batches):
    """k = 4 micro-steps, one fused gradient all-reduce (after the last) plus the loss value.

    Counted with CollectiveLog alone: CommDebugMode's module tracker (torch 2.13) fails on a
    second forward after a backward inside one mode.
    """
    model, batches = mlp_and_batches
    with plait.testing.simulate(2):
        job = plait.parallelize(
            model, ParallelConfig(grad_accumulation=4), optimizer=adamw, loss_fn=mlp_loss
        )
        with CollectiveLog(job.device_mesh) as log:
            job.step(batches[0])
    assert len(job.grad_sync.buckets) == 1  # the whole model fits one default bucket
    assert log.counts() == {("all_reduce", "dp"): 1 + 1}


def test_accumulation_batch_not_divisible_is_refused(mlp_and_batches):
    model, _ = mlp_and_batches
    with plait.testing.simulate(2):
        job = plait.parallelize(
            model, ParallelConfig(grad_accumulation=3), optimizer=adamw, loss_fn=mlp_loss
        )
        with pytest.raises(
            ShardingError, match=r"dim 0 does not divide into grad_accumulation=3 micro-batches"
        ):
            job.step((torch.randn(8, 16), torch.randn(8, 8)))
