"""Communication fusion: gradients reduced in buckets, one collective per bucket, started
during backward; training still equals single-device training.

Reference: single-device training (``reference_run``) on the same batches.
"""

import pytest
import torch

import plait
from plait import CommFusion, ParallelConfig
from plait.models import annotate_megatron, gpt_loss, mlp_loss
from plait.runtime.program.grad_sync import plan_buckets
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import assert_same_run, reference_run, simulated_run
from tests.sim.conftest import adamw

NUM_MLP_PARAMS = 6  # MLP((16, 32, 16, 8)): three Linears, weight and bias each
FUSIONS = {
    "one_bucket_per_parameter": (CommFusion(bucket_mb=1e-9), NUM_MLP_PARAMS),
    "several_buckets_by_size": (CommFusion(bucket_mb=0.004), 2),  # 4 kB: 2784 B, then fc0.weight
    "several_buckets_by_index": (CommFusion(mode="index", boundaries=(2, 4)), 3),
    "one_bucket_for_all": (CommFusion(bucket_mb=1000), 1),
}


def test_plan_buckets_by_size_in_reverse_order():
    assert plan_buckets([4, 4, 4, 4], CommFusion(bucket_mb=8e-6)) == [[3, 2], [1, 0]]
    assert plan_buckets([100, 1, 1], CommFusion(bucket_mb=1e-5)) == [[2, 1], [0]]
    assert plan_buckets([4, 4], CommFusion(bucket_mb=1e-9)) == [[1], [0]]


def test_plan_buckets_by_index():
    assert plan_buckets([1] * 6, CommFusion(mode="index", boundaries=(2, 5))) == [
        [5],
        [2, 3, 4],
        [0, 1],
    ]
    assert plan_buckets([1] * 3, CommFusion(mode="index", boundaries=(2, 9))) == [[2], [0, 1]]


@pytest.mark.parametrize("case", sorted(FUSIONS))
def test_fusion_matches_single_device(case, mlp_and_batches):
    model, batches = mlp_and_batches
    fusion, _ = FUSIONS[case]
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    expected = reference_run(model, mlp_loss, sgd, batches)
    got = simulated_run(model, ParallelConfig(comm_fusion=fusion), mlp_loss, sgd, batches, 4)
    assert_same_run(expected, got)


@pytest.mark.parametrize("case", sorted(FUSIONS))
def test_fusion_one_collective_per_bucket_started_in_backward(case, mlp_and_batches):
    model, batches = mlp_and_batches
    fusion, num_buckets = FUSIONS[case]
    with plait.testing.simulate(4):
        job = plait.parallelize(
            model, ParallelConfig(comm_fusion=fusion), optimizer=adamw, loss_fn=mlp_loss
        )
        with CollectiveLog(job.device_mesh) as log:
            job.step(batches[0])
    assert job.engine == "plain"  # pure data parallel: the plain-tensor path real runs take
    assert len(job.grad_sync.buckets) == num_buckets
    assert log.counts() == {("all_reduce", "dp"): num_buckets + 1}  # + the loss value
    assert job.grad_sync.launched_in_backward == num_buckets


@pytest.mark.parametrize("case", ["several_buckets_by_size", "several_buckets_by_index"])
def test_fusion_on_dtensor_path_one_collective_per_bucket(case, mlp_and_batches):
    """semi_auto runs the compiled program; its dp gradients use the same buckets, each
    all-reduced inside the program as soon as its last gradient is computed."""
    model, batches = mlp_and_batches
    fusion, num_buckets = FUSIONS[case]
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    expected = reference_run(model, mlp_loss, sgd, batches[:3])
    config = ParallelConfig(mode="semi_auto", comm_fusion=fusion)
    with plait.testing.simulate(4):
        job = plait.parallelize(
            model, config, optimizer=sgd, loss_fn=mlp_loss, example_batch=batches[0]
        )
        with CollectiveLog(job.device_mesh) as log:
            losses = [job.step(batches[0])]
        losses += [job.step(b) for b in batches[1:3]]
        state = job.full_state_dict()
    assert job.engine == "program"
    assert log.counts() == {("all_reduce", "dp"): num_buckets + 1}
    assert job.grad_sync.launched_in_backward == num_buckets
    assert job.program.fused_buckets == num_buckets
    assert_same_run(expected, plait.testing.equivalence.Run(losses, state))


def test_fusion_in_megatron_plan_reduces_dp_axis_only(gpt_and_batches):
    model, batches = gpt_and_batches
    expected = reference_run(model, gpt_loss, adamw, batches[:3])
    annotate_megatron(model, 2)
    config = ParallelConfig(
        mode="semi_auto", mesh={"dp": 2, "tp": 2}, comm_fusion=CommFusion(bucket_mb=0.004)
    )
    assert_same_run(expected, simulated_run(model, config, gpt_loss, adamw, batches[:3], 4))
