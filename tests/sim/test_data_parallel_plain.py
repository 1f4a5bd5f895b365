"""Pure data parallelism runs on plain tensors (no DTensor) and still equals one device.

Reference: single-device training (``reference_run``) on the same global batches. Under
``simulate`` the plain path holds one private ``LocalTensor`` value per rank, so these tests run
the code real processes run.
"""

import copy

import pytest
import torch
from torch import nn

import plait
from plait import CommFusion, ParallelConfig, ShardingError
from plait._compat import LocalTensor
from plait.comm.dtensor import is_dtensor
from plait.models import MLP, mlp_loss
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import assert_same_run, reference_run, simulated_run
from tests.sim.conftest import adamw


def _job(model, config=None, optimizer=adamw, loss_fn=mlp_loss):
    return plait.parallelize(
        model, config or ParallelConfig(), optimizer=optimizer, loss_fn=loss_fn
    )


def test_data_parallel_parameters_gradients_and_batch_are_plain(mlp_and_batches):
    model, batches = mlp_and_batches
    x, y = batches[0]
    with plait.testing.simulate(4):
        job = _job(model)
        local_x, _ = job.shard_batch((x, y))
        job.step(batches[0])
        params = list(job.model.parameters())
    assert job.engine == "plain" and job.plain.size == 4
    assert not any(is_dtensor(p) for p in params)
    assert all(isinstance(p.grad, LocalTensor) and not is_dtensor(p.grad) for p in params)
    assert isinstance(local_x, LocalTensor)
    for rank in range(4):  # rank r trains on rows 2r, 2r+1 of the global batch of 8
        assert torch.equal(local_x._local_tensors[rank], x[2 * rank : 2 * rank + 2])


@pytest.mark.parametrize(
    ("config", "world"),
    [
        (ParallelConfig(mode="semi_auto"), 4),  # semi_auto keeps DTensor, annotated or not
        (ParallelConfig(mode="data_parallel", mesh={"dp": 2, "tp": 2}), 4),  # tp replicas
        (ParallelConfig(dataset_strategy=((4, 1), (4, 1))), 4),  # per-input strategies
    ],
    ids=["semi_auto", "dp_with_tp_axis", "per_input_strategy"],
)
def test_other_configurations_keep_the_dtensor_path(config, world, mlp_and_batches):
    """They run a plan: DTensor parameters, planned at the first step."""
    model, batches = mlp_and_batches
    with plait.testing.simulate(world):
        job = _job(model, config)
        job.step(batches[0])
    assert job.engine == "program"
    assert all(is_dtensor(p) for p in job.model.parameters())


def test_one_bucket_gradients_are_views_of_one_summed_buffer(mlp_and_batches):
    """No copy back after the all-reduce: every gradient is a piece of the bucket's result."""
    model, batches = mlp_and_batches
    with plait.testing.simulate(2):
        job = _job(model)
        job.step(batches[0])
        grads = [p.grad._local_tensors[1] for p in job.model.parameters()]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    assert len(job.grad_sync.buckets) == 1 and len(storages) == 1
    assert sum(g.numel() for g in grads) == grads[0].untyped_storage().nbytes() // 4


def test_three_ranks_average_exactly_enough(mlp_and_batches):
    """1/dp is folded into the backward; with dp = 3 it is not a power of two."""
    model, batches = mlp_and_batches
    batches = [(torch.randn(9, 16), torch.randn(9, 8)) for _ in range(5)]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    expected = reference_run(model, mlp_loss, sgd, batches)
    got = simulated_run(
        model, ParallelConfig(comm_fusion=CommFusion(bucket_mb=0.002)), mlp_loss, sgd, batches, 3
    )
    assert_same_run(expected, got)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(16, 8)
        self.unused = nn.Linear(16, 8)

    def forward(self, x):
        return self.used(x)


def test_unused_parameters_keep_no_gradient_and_training_matches(mlp_and_batches):
    _, batches = mlp_and_batches
    torch.manual_seed(0)
    model = _WithUnused()
    expected = reference_run(model, mlp_loss, adamw, batches[:3])
    fusion = CommFusion(mode="index", boundaries=(2,))  # used.* in one bucket, unused.* in another
    model_copy = copy.deepcopy(model)
    with plait.testing.simulate(2):
        job = _job(model_copy, ParallelConfig(comm_fusion=fusion))
        with CollectiveLog(job.device_mesh) as log:
            losses = [job.step(b) for b in batches[:3]]
        state = job.full_state_dict()
        unused_grads = [job.model.unused.weight.grad, job.model.unused.bias.grad]
    assert unused_grads == [None, None]
    assert log.counts() == {("all_reduce", "dp"): 3 * (1 + 1)}  # used bucket + loss, per step
    assert_same_run(expected, plait.testing.equivalence.Run(losses, state))


def test_evaluate_is_the_global_loss_and_changes_nothing(mlp_and_batches):
    model, batches = mlp_and_batches
    expected = mlp_loss(model, batches[0]).item()
    with plait.testing.simulate(4):
        job = _job(copy.deepcopy(model))
        before = job.full_state_dict()
        got = job.evaluate(batches[0])
        after = job.full_state_dict()
    assert got == pytest.approx(expected, rel=1e-6)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_full_state_dict_returns_copies(mlp_and_batches):
    model, _ = mlp_and_batches
    with plait.testing.simulate(2):
        job = _job(model)
        state = job.full_state_dict()
        state["layers.0.weight"].zero_()
        again = job.full_state_dict()
    assert again["layers.0.weight"].abs().sum() > 0


def test_fp16_needs_no_extra_collective_to_agree_on_overflow(mlp_and_batches):
    """The summed gradients are the same on every rank, so the inf check is local."""
    model, batches = mlp_and_batches
    with plait.testing.simulate(4):
        job = _job(model, ParallelConfig(precision="fp16"))
        with CollectiveLog(job.device_mesh) as log:
            job.step(batches[0])
    assert log.counts() == {("all_reduce", "dp"): 1 + 1}


def test_loss_fn_returning_a_number_is_refused(mlp_and_batches):
    model, batches = mlp_and_batches
    with plait.testing.simulate(2):
        job = _job(model, loss_fn=lambda m, b: mlp_loss(m, b).detach())
        with pytest.raises(ShardingError, match="does not depend on the model's parameters"):
            job.step(batches[0])


def test_mlp_world_of_one_is_plain_and_matches(mlp_and_batches):
    model, batches = mlp_and_batches
    expected = reference_run(model, mlp_loss, adamw, batches[:3])
    got = simulated_run(model, ParallelConfig(), mlp_loss, adamw, batches[:3], 1)
    assert_same_run(expected, got)


def test_tied_parameters_stay_tied():
    torch.manual_seed(0)
    model = MLP((8, 8, 8))
    model.layers[1].weight = model.layers[0].weight
    with plait.testing.simulate(2):
        job = _job(model)
    assert job.model.layers[1].weight is job.model.layers[0].weight
    assert len(list(job.model.parameters())) == 3
