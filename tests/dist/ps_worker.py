"""A parameter-server job's script (run by tests/dist/test_parameter_server.py under
`plait run --server-num`): trains tests/dist/ps_model.py's recommender and, on worker 0,
saves its losses (by step), dense weights and both tables as the servers hold them.

``sys.argv[2]`` is JSON: ParallelConfig fields, plus what the test asks of the run:
``steps``; ``kill_server_at`` (worker 0 SIGKILLs the first server before that step, in the
first attempt only); ``save_at`` and ``save`` (a checkpoint after that step); ``load`` (a
checkpoint to start from); ``every`` (plait.checkpoint.Checkpoints in --checkpoint-dir);
``export`` (the tables to a safetensors file at the end); ``prefetch`` (the next batch's rows
asked before each step).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

import plait
from plait import ParallelConfig
from plait.checkpoint import Checkpoints
from plait.testing.comm import CollectiveLog
from tests.dist.ps_model import Recommender, batches, loss_fn

out, settings = sys.argv[1], json.loads(sys.argv[2])
asked = {
    k: settings.pop(k, None)
    for k in ("steps", "kill_server_at", "save_at", "save", "load", "every", "export", "prefetch")
}


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
checkpoints = Checkpoints(every=asked["every"]) if asked["every"] else None
start = job.load(asked["load"]) if asked["load"] else 0
if checkpoints is not None:
    start = checkpoints.resume(job)
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
losses = {}
collectives: list[tuple[str, str, int]] = []
every_batch = batches(asked["steps"]) if asked["steps"] else batches()


def mine(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.chunk(world.world_size)[world.rank] for k, v in batch.items()}


for step, batch in enumerate(every_batch):
    if step < start:
        continue
    if step == asked["kill_server_at"] and world.rank == 0 and first_attempt:
        kill_first_server(world)
    if asked["prefetch"] and step + 1 < len(every_batch):
        following = mine(every_batch[step + 1])
        job.parameter_server.prefetch({"users": following["users"], "items": following["items"]})
    if step == 2:  # a step after the first (a plan job's program is traced by then)
        with CollectiveLog(job.device_mesh) as log:
            losses[step] = job.step(mine(batch))
        collectives = [(c.kind, c.axis, c.bytes) for c in log.events]
    else:
        losses[step] = job.step(mine(batch))
    if step + 1 == asked["save_at"]:
        job.save(asked["save"])
    if checkpoints is not None:
        checkpoints.maybe_save(job)
client = job.parameter_server
evaluated = job.evaluate(mine(every_batch[0]))  # eval mode, no gradient: nothing pushed
if asked["export"]:
    client.export(asked["export"])
# a plan job's parameters are DTensors (ZeRO-3 shards them): made whole on every rank
mlp = {
    k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    for k, v in job.model.mlp.state_dict().items()
}
if world.rank == 0:
    torch.save(
        {
            "losses": losses,
            "mlp": mlp,
            "users": client.table("users"),
            "items": client.table("items"),
            "traffic": {**vars(client.traffic), "hit_rate": client.traffic.hit_rate},
            "report": str(job.report()),
            "evaluated": evaluated,
            "collectives": collectives,
        },
        out,
    )
print(f"worker {world.rank}: losses {losses}", flush=True)
