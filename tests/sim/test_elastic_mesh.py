"""A mesh whose data-parallel axis is -1 takes the rest of the world at ``parallelize``: one
config serves every world size of an elastic job (docs/launch.md, "Elastic jobs")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plait
from plait.models import MLP
from plait.testing import simulate


@pytest.mark.parametrize("world", [2, 4])
def test_dp_minus_one_is_sized_by_the_world_and_trains_like_one_device(world: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
    torch.manual_seed(0)
    reference = MLP((8, 16, 4))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for _ in range(2):
        loss = F.mse_loss(reference(x), y)
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        expected.append(loss.item())
    with simulate(world):
        torch.manual_seed(0)
        job = plait.parallelize(
            MLP((8, 16, 4)),
            plait.ParallelConfig(mode="semi_auto", mesh={"dp": -1, "tp": 2}),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
        )
        assert job.config.mesh_dict == {"dp": world // 2, "tp": 2}
        losses = [float(job.step((x, y))) for _ in range(2)]
        state = job.full_state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
