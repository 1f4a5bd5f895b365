"""``plait.ops.matmul`` and sharded Embedding against plain PyTorch on the same inputs.

Reference: ``torch.matmul`` / ``nn.Embedding`` on full tensors; gradients from ``.backward()``.
"""

import pytest
import torch
from torch import nn

import plait
from plait import ParallelConfig
from plait.testing.comm import CollectiveLog
from tests.sim.conftest import adamw


class MatmulNet(nn.Module):
    def __init__(self, strategy, out_strategy=None):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 12))
        self.strategy, self.out_strategy = strategy, out_strategy

    def forward(self, x):
        return plait.ops.matmul(x, self.w, strategy=self.strategy, out_strategy=self.out_strategy)


def _loss(model, batch):
    return model(batch[0]).square().mean()


@pytest.mark.parametrize(
    ("strategy", "out_strategy", "expected"),
    [
        (((2, 1), (1, 2)), None, {}),
        (((2, 2), (2, 1)), None, {("all_reduce", "tp"): 1}),
        (((2, 2), (2, 1)), (4, 1), {("reduce_scatter", "tp"): 1}),
    ],
    ids=["column", "row_all_reduce", "row_reduce_scatter"],
)
def test_ops_matmul_matches_torch(strategy, out_strategy, expected):
    torch.manual_seed(1)
    x = torch.randn(8, 8)
    net = MatmulNet(strategy, out_strategy)
    ref_w = net.w.detach().clone().requires_grad_()
    (x @ ref_w).square().mean().backward()
    with plait.testing.simulate(4):
        job = plait.parallelize(
            net,
            ParallelConfig(mode="hybrid", mesh={"dp": 2, "tp": 2}),
            optimizer=adamw,
            loss_fn=_loss,
        )
        xd = job.shard_batch((x,))[0]
        with CollectiveLog(job.device_mesh) as log:
            y = net(xd)
        assert log.counts() == expected
        torch.testing.assert_close(
            plait.comm.dtensor.full_value(y), x @ ref_w.detach(), rtol=1e-5, atol=1e-6
        )
        job.optimizer.zero_grad()
        job._loss((x,)).backward()
        job.grad_sync.finish()  # waits for the fused gradient all-reduce backward started
        torch.testing.assert_close(
            plait.comm.dtensor.full_value(net.w.grad), ref_w.grad, rtol=1e-5, atol=1e-6
        )


def test_ops_matmul_is_torch_matmul_outside_a_job():
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    assert torch.equal(plait.ops.matmul(x, w, strategy=((1, 1), (1, 1))), x @ w)


def test_ops_matmul_inconsistent_strategy_is_refused():
    net = MatmulNet(((2, 2), (1, 2)))
    with plait.testing.simulate(4):
        job = plait.parallelize(
            net,
            ParallelConfig(mode="hybrid", mesh={"dp": 2, "tp": 2}),
            optimizer=adamw,
            loss_fn=_loss,
        )
        with pytest.raises(plait.ShardingError, match="split 2 and 1; make the two splits equal"):
            job.step((torch.randn(8, 8),))


@pytest.mark.parametrize("strategy", [(2, 1), (1, 2)], ids=["vocab_parallel", "hidden_parallel"])
def test_sharded_embedding_matches_torch(strategy):
    """A semi_auto Embedding split by vocabulary or by hidden dim: one SGD step (lr 1) moves
    the weight by exactly minus the single-device gradient."""
    torch.manual_seed(0)
    emb = nn.Embedding(16, 8)
    ref = nn.Embedding(16, 8)
    ref.load_state_dict(emb.state_dict())
    ids = torch.randint(0, 16, (4, 6))
    ref(ids).square().mean().backward()
    before = emb.weight.detach().clone()
    plait.shard(emb, parameter_strategy={"weight": strategy})

    def loss(model, batch):
        return model(batch[0]).square().mean()

    with plait.testing.simulate(4):
        job = plait.parallelize(
            emb,
            ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
            optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
            loss_fn=loss,
        )
        job.step((ids,))
        after = job.full_state_dict()["weight"]
    torch.testing.assert_close(before - after, ref.weight.grad, rtol=1e-5, atol=1e-7)
