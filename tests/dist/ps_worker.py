"""A parameter-server job's script (run by tests/dist/test_parameter_server.py under
`plait run --server-num`): trains tests/dist/ps_model.py's recommender and, on worker 0,
saves its losses, dense weights and both tables as the servers hold them."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

import plait
from plait import ParallelConfig
from tests.dist.ps_model import Recommender, batches, loss_fn

out, settings = sys.argv[1], json.loads(sys.argv[2])
steps = settings.pop("steps", None)
kill_server_at = settings.pop("kill_server_at", None)


def kill_first_server(world: plait.World) -> None:
    """SIGKILL the first server (the process whose RANK follows the workers', in this job's
    log directory): a server lost mid-training."""
    rank = f"RANK={world.world_size}".encode()
    logs = f"PLAIT_LOG_DIR={os.environ['PLAIT_LOG_DIR']}".encode()
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if rank in env and logs in env:
            os.kill(int(proc.name), signal.SIGKILL)


world = plait.init()  # a server never returns from here
torch.manual_seed(0)
model = Recommender()
plait.on_server(model.users, init_in_server=True, seed=3)
config = ParallelConfig(mode="parameter_server", server_modules=("items",), **settings)
job = plait.parallelize(
    model, config, optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss_fn=loss_fn
)
losses = []
for step, batch in enumerate(batches(steps) if steps else batches()):
    if step == kill_server_at and world.rank == 0:
        kill_first_server(world)
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
