"""Real processes: ``ShardedLoader.for_job`` on a 2-rank gloo world trains like one device.

Reference: plain PyTorch in the test process on the global batches of a single-rank loader with
the same seed. Each worker loads only its data-parallel slice, found from its real device-mesh
coordinate; the slices, concatenated in rank order, are the global batches. (Model-parallel
peers are checked with a fake job in tests/unit/test_data.py; 4 processes cost 30 s here.)
"""

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import plait
from plait.data import ShardedLoader
from plait.testing import run_workers
from plait.testing.equivalence import Run, assert_same_run, reference_run

GLOBAL_BATCH = 8


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _model_and_data() -> tuple[nn.Module, TensorDataset]:
    torch.manual_seed(0)
    return nn.Linear(4, 2), TensorDataset(torch.randn(40, 4), torch.randn(40, 2))


def _train() -> tuple[Run, list[list[float]]]:
    model, data = _model_and_data()
    cfg = plait.ParallelConfig(mode="data_parallel", mesh={"dp": 2})
    job = plait.parallelize(model, cfg, optimizer=_sgd, loss_fn=_mse)
    loader = ShardedLoader.for_job(data, job, global_batch_size=GLOBAL_BATCH, seed=7)
    losses, seen = [], []
    for batch in loader:
        seen.append(batch[0][:, 0].tolist())
        losses.append(job.step(batch))
    return Run(losses, job.full_state_dict()), seen


@pytest.mark.dist
def test_for_job_on_two_gloo_processes_matches_single_device():
    model, data = _model_and_data()
    batches = list(ShardedLoader(data, global_batch_size=GLOBAL_BATCH, seed=7))
    expected = reference_run(model, _mse, _sgd, batches)
    results = run_workers(_train, 2)
    for run, _ in results:
        assert_same_run(expected, run)
    seen = [s for _, s in results]
    for step, (x, _) in enumerate(batches):
        assert seen[0][step] + seen[1][step] == x[:, 0].tolist()
