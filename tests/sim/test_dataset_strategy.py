"""Dataset sharding in training: equal to single-device training on the same global batches.

Reference: single-device training (``reference_run``) on the global batches a
``plait.data.ShardedSampler`` produces.
"""

import torch
from torch.utils.data import TensorDataset

import plait
from plait import ParallelConfig
from plait.data import ShardedLoader, slice_batch
from plait.mesh import MeshSpec
from plait.models import MLP, mlp_loss
from plait.testing.equivalence import assert_same_run, reference_run, simulated_run
from tests.sim.conftest import adamw


def _dataset():
    torch.manual_seed(3)
    return TensorDataset(torch.randn(64, 16), torch.randn(64, 8))


def test_data_parallel_loader_matches_single_device():
    torch.manual_seed(0)
    model = MLP((16, 32, 8))
    loader = ShardedLoader(_dataset(), global_batch_size=16, seed=5)  # the global batches
    batches = [tuple(b) for b in loader]
    expected = reference_run(model, mlp_loss, adamw, batches)
    assert_same_run(expected, simulated_run(model, ParallelConfig(), mlp_loss, adamw, batches, 4))


def test_per_input_strategy_splits_features_and_matches_single_device():
    """x split (dp, tp) on (batch, features) feeds a row-parallel first layer directly."""
    torch.manual_seed(0)
    model = MLP((16, 32, 8))
    batches = [tuple(b) for b in ShardedLoader(_dataset(), global_batch_size=16, seed=5)]
    expected = reference_run(model, mlp_loss, adamw, batches)
    plait.shard(model.layers[0], parameter_strategy={"weight": (1, 2)})
    config = ParallelConfig(
        mode="semi_auto", mesh={"dp": 2, "tp": 2}, dataset_strategy=((2, 2), (2, 1))
    )
    assert_same_run(expected, simulated_run(model, config, mlp_loss, adamw, batches, 4))


def test_per_input_strategy_needs_no_input_redistribution():
    """The loaded slices already have the layouts the first layer needs: the program's first
    collective is the row-parallel all-reduce over tp (nothing moves the inputs before it)."""
    torch.manual_seed(0)
    model = MLP((16, 32, 8))
    plait.shard(model.layers[0], parameter_strategy={"weight": (1, 2)})
    config = ParallelConfig(
        mode="semi_auto", mesh={"dp": 2, "tp": 2}, dataset_strategy=((2, 2), (2, 1))
    )
    x, y = _dataset().tensors
    with plait.testing.simulate(4):
        job = plait.parallelize(model, config, optimizer=adamw, loss_fn=mlp_loss)
        xd, _ = job.shard_batch((x[:16], y[:16]))
        assert [str(p) for p in xd.placements] == ["S(0)", "S(1)"]
        first = job.program.collectives()[0]
    assert (first.kind, first.axis) == ("all_reduce", "tp")


def test_slice_batch_gives_each_rank_only_its_piece():
    x = torch.arange(8 * 4).reshape(8, 4)
    mesh = MeshSpec.from_dict({"dp": 2, "tp": 2})
    (piece,) = slice_batch((x,), ((2, 2),), mesh, rank=3)  # dp 1, tp 1
    assert torch.equal(piece, x[4:, 2:])
