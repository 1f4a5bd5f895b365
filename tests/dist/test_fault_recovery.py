"""Fault recovery end to end: `plait run --max-restarts 2 --checkpoint-dir DIR` survives a
worker killed with SIGKILL in the middle of a step and another killed in the middle of a save,
and the final weights are bitwise those of an uninterrupted run.

The script saves every 2 steps (keeping 2) through ``plait.checkpoint.Checkpoints()``, whose
directory comes from ``--checkpoint-dir``:

* attempt 0 saves steps 2 and 4; rank 1 is killed inside its 6th step's forward;
* attempt 1 resumes at step 4; rank 1 is killed inside the save of step 6, after writing its
  shard and small state, before its checksums reach rank 0 (the save is left as
  ``step-00000006.partial``, never committed);
* attempt 2 resumes at step 4 again (the interrupted save is not a checkpoint), trains to
  step 8, then trains a fresh job for 8 steps without interruption in the same process and
  compares the two bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.test_launch_e2e import free_port, plait_run, results, run, script

pytestmark = pytest.mark.dist

TRAIN = """
import os, signal, sys
import torch
import plait
import plait.comm.checkpoint_io as checkpoint_io
from plait import ParallelConfig
from plait.checkpoint import Checkpoints
from plait.data import ShardedLoader
from plait.models import GPTConfig, TinyGPT, gpt_loss

world = plait.init()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
STEPS = 8
gen = torch.Generator().manual_seed(1)
ids = torch.randint(0, CFG.vocab, (64, CFG.seq), generator=gen)
dataset = list(zip(ids, torch.roll(ids, -1, dims=1)))
taken = [0]


def loss_fn(model, batch):
    if attempt == 0 and world.rank == 1 and taken[0] == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: inside the forward
    return gpt_loss(model, batch)


def build():
    torch.manual_seed(0)
    job = plait.parallelize(
        TinyGPT(CFG), ParallelConfig(mode="data_parallel", mesh={"dp": 2}),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), loss_fn=loss_fn,
    )
    return job, ShardedLoader.for_job(dataset, job, global_batch_size=8, seed=3)


def train(job, loader, ckpt=None):
    batches = iter(loader)
    while job.steps_taken < STEPS:
        taken[0] = job.steps_taken
        job.step(next(batches))
        if ckpt is not None:
            ckpt.maybe_save(job, loader=loader)
    return job.full_state_dict()


if attempt == 1 and world.rank == 1:
    write = checkpoint_io._Writer.write_data

    def write_then_die(self, plan, planner):
        written = write(self, plan, planner)
        if "step-00000006" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)  # mid-save: shard written, not committed
        return written

    checkpoint_io._Writer.write_data = write_then_die

ckpt = Checkpoints(every=2, keep=2)
job, loader = build()
start = ckpt.resume(job, loader=loader)
print(f"rank {world.rank} attempt {attempt} resumed at step {start}", flush=True)
resumed = train(job, loader, ckpt)
whole = train(*build())
same = all(torch.equal(resumed[k], whole[k]) for k in whole)
print(f"RESULT rank={world.rank} attempt={attempt} start={start} bitwise={same}", flush=True)
"""


def test_kill_mid_step_and_mid_save_then_resume_bitwise(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    prog = script(tmp_path, "train.py", TRAIN)
    proc = run(
        plait_run("--worker-num", "2", "--max-restarts", "2", "--master-port", str(free_port()),
                  "--checkpoint-dir", str(ckpt), "--tail-worker-log", "all", prog),
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results(proc.stdout) == [f"rank={r} attempt=2 start=4 bitwise=True" for r in range(2)], (
        proc.stdout[-3000:]
    )
    assert "attempt 1 resumed at step 4" in proc.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000006", "step-00000008"]
