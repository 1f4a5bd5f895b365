"""A parameter-server job's script (run by tests/dist/test_parameter_server.py under
`plait run --server-num`): trains tests/dist/ps_model.py's recommender and, on worker 0,
saves its losses, dense weights and both tables as the servers hold them."""

from __future__ import annotations

import json
import sys

import torch

import plait
from plait import ParallelConfig
from tests.dist.ps_model import Recommender, batches, loss_fn

out, settings = sys.argv[1], json.loads(sys.argv[2])
world = plait.init()  # a server never returns from here
torch.manual_seed(0)
model = Recommender()
plait.on_server(model.users, init_in_server=True, seed=3)
config = ParallelConfig(mode="parameter_server", server_modules=("items",), **settings)
job = plait.parallelize(
    model, config, optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss_fn=loss_fn
)
losses = []
for batch in batches():
    mine = {k: v.chunk(world.world_size)[world.rank] for k, v in batch.items()}
    losses.append(job.step(mine))
client = job.parameter_server
if world.rank == 0:
    torch.save(
        {
            "losses": losses,
            "mlp": {k: v.clone() for k, v in model.mlp.state_dict().items()},
            "users": client.table("users"),
            "items": client.table("items"),
            "traffic": vars(client.traffic),
        },
        out,
    )
print(f"worker {world.rank}: losses {losses}", flush=True)
