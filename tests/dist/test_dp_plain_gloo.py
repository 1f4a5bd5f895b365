"""Real processes: pure data parallelism on plain tensors equals one device and equals DDP.

Two gloo processes run, in one spawn, three trainings of the same MLP on the same global
batches: plait with ``full_batch`` inputs, three index buckets and ``grad_accumulation=2``;
plait with local slices on a model that was already parallelized once (the first job's hooks
must not start collectives any more); ``torch.nn.parallel.DistributedDataParallel``; and plait
with the first layer on the host (``plait.on_host``), plus a sum over the gloo group an NCCL
world would sum host gradients over. Reference: plain PyTorch in the test
process on the global batches.
"""

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import plait
from plait import CommFusion, ParallelConfig
from plait.comm.dp import gloo_axis_mesh, start_sum, wait_sum
from plait.models import MLP, mlp_loss
from plait.testing import run_workers
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import Run, assert_same_run, reference_run

WORLD = 2
STEPS = 4


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP((16, 32, 16, 8))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    return [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(STEPS)
    ]


def _train() -> dict[str, Any]:
    rank = dist.get_rank()
    batches = _batches()
    local = [tuple(t.chunk(WORLD)[rank] for t in b) for b in batches]
    out: dict[str, Any] = {}

    cfg = ParallelConfig(
        dataset_strategy="full_batch",
        comm_fusion=CommFusion(mode="index", boundaries=(2, 4)),
        grad_accumulation=2,
    )
    job = plait.parallelize(_model(), cfg, optimizer=_sgd, loss_fn=mlp_loss)
    with CollectiveLog(job.device_mesh) as log:
        losses = [job.step(batches[0])]
    losses += [job.step(b) for b in batches[1:]]
    out["full_batch"] = Run(losses, job.full_state_dict())
    out["full_batch_counts"] = log.counts()
    out["grad_types"] = {type(p.grad) for p in job.model.parameters()}

    model = _model()
    plait.parallelize(model, ParallelConfig(), optimizer=_sgd, loss_fn=mlp_loss)  # dropped
    job = plait.parallelize(model, ParallelConfig(), optimizer=_sgd, loss_fn=mlp_loss)
    with CollectiveLog(job.device_mesh) as log:
        losses = [job.step(local[0])]
    out["twice"] = Run(losses + [job.step(b) for b in local[1:]], job.full_state_dict())
    out["twice_counts"] = log.counts()

    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = _sgd(ddp.parameters())
    ddp_losses = []
    for b in local:
        opt.zero_grad()
        loss = mlp_loss(ddp, b)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        ddp_losses.append(value.item() / WORLD)
    out["ddp_losses"] = ddp_losses

    model = _model()
    plait.on_host(model.layers[0])  # on CPU processes the host is the device: numerics
    job = plait.parallelize(model, ParallelConfig(), optimizer=_sgd, loss_fn=mlp_loss)
    out["host"] = Run([job.step(b) for b in local], job.full_state_dict())
    # the gloo group an NCCL world sums host gradients over, made and used on real processes
    mesh = gloo_axis_mesh(job.device_mesh, "dp")
    out["gloo_sum"] = wait_sum(start_sum(torch.full((3,), float(rank + 1)), mesh)).tolist()
    return out


@pytest.mark.dist
def test_plain_data_parallel_on_two_gloo_processes():
    expected = reference_run(_model(), mlp_loss, _sgd, _batches())
    for result in run_workers(_train, WORLD):
        assert_same_run(expected, result["full_batch"])
        assert_same_run(expected, result["twice"])
        assert result["full_batch_counts"] == {("all_reduce", "dp"): 3 + 1}  # buckets + loss
        assert result["grad_types"] == {torch.Tensor}
        assert result["twice_counts"] == {("all_reduce", "dp"): 1 + 1}  # the first job is silent
        torch.testing.assert_close(
            torch.tensor(result["twice"].losses), torch.tensor(result["ddp_losses"])
        )
        assert_same_run(expected, result["host"])
        assert result["gloo_sum"] == [3.0, 3.0, 3.0]  # 1 + 2 over the two ranks
