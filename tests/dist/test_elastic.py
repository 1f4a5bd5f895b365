"""Elastic scale in and out (issue 34 item 1): `plait run --nnodes 1:2` on two "nodes" of this
machine (two launchers on loopback, 2 workers each). Mid-run node B is killed outright; node A's
group re-forms alone at world 2 and resumes from the last checkpoint, resharded; later B starts
again, A's launcher sees it waiting, and the group re-forms at world 4 and resumes once more.
The script keeps the global batch (8 samples: gradient accumulation takes the micro-batches a
smaller world cannot hold side by side) and the data loader's position (in the checkpoint), and
lets data parallel absorb the change (``mesh={"dp": -1}``: dp takes the world). Every step's loss, however
many times it was run, and the final weights equal one device's.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from plait.checkpoint import files
from tests.dist.test_launch_e2e import PY, REPO, clean_env, free_port, script

pytestmark = pytest.mark.dist

STEPS = 24
GLOBAL_BATCH = 8
MICRO = 2
"""Samples a rank takes at once: a world of 4 runs 1 micro-batch a step, a world of 2 runs 2."""

TRAIN = f"""
import time
import torch
import torch.nn.functional as F

import plait
from plait.checkpoint import Checkpoints
from plait.data import ShardedLoader
from plait.models import MLP

world = plait.init()
gen = torch.Generator().manual_seed(1)
data = list(zip(torch.randn(96, 8, generator=gen), torch.randn(96, 4, generator=gen)))
torch.manual_seed(0)
job = plait.parallelize(
    MLP((8, 16, 4)),
    plait.ParallelConfig(
        mode="data_parallel", mesh={{"dp": -1}},  # dp takes the world, whatever its size
        grad_accumulation={GLOBAL_BATCH} // ({MICRO} * world.world_size),
    ),
    optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
)
loader = ShardedLoader.for_job(data, job, global_batch_size={GLOBAL_BATCH}, shuffle=False)
ckpt = Checkpoints(every=2, keep=2)
ckpt.resume(job, loader=loader)
def endless():  # epoch after epoch; the loader resumes inside the saved one
    while True:
        yield from loader


batches = endless()
while job.steps_taken < {STEPS}:
    loss = job.step(next(batches))
    if world.rank == 0:
        print(f"LOSS step={{job.steps_taken}} world={{world.world_size}} loss={{loss!r}}", flush=True)
    ckpt.maybe_save(job, loader=loader)
    time.sleep(0.5)
if world.rank == 0:
    state = {{k: v.tolist() for k, v in job.full_state_dict().items()}}
    print(f"FINAL {{state!r}}", flush=True)
"""


def _node(prog: str, port: int, ckpt: Path, logs: Path) -> subprocess.Popen[str]:
    cmd = [PY, "-m", "plait", "run", "--nnodes", "1:2", "--local-worker-num", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "3",
           "--cluster-timeout", "60", "--checkpoint-dir", str(ckpt), "--log-dir", str(logs),
           prog]  # fmt: skip
    return subprocess.Popen(
        cmd, env=clean_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _kill_node(launcher: subprocess.Popen[str]) -> None:
    """SIGKILL a launcher and every process under it (torch starts its workers in sessions of
    their own, so its process group is not enough), as when the node is lost."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [launcher.pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _lines(logs: list[Path], marker: str) -> list[str]:
    found = []
    for directory in logs:
        for path in sorted(directory.glob("worker_*.log")):
            found += [line for line in path.read_text().splitlines() if line.startswith(marker)]
    return found


def _wait_for(what: str, check, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _one_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    from plait.models import MLP

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 8, generator=gen), torch.randn(96, 4, generator=gen)
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH % 96, step * GLOBAL_BATCH % 96 + GLOBAL_BATCH)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.nightly  # about 65 s: in `make nightly` (.ci/run), not `make test`
def test_node_leaves_and_joins_training_goes_on_like_one_device(tmp_path: Path) -> None:
    prog = script(tmp_path, "train.py", TRAIN)
    port, ckpt = free_port(), tmp_path / "ckpt"
    logs_a, logs_b, logs_b2 = tmp_path / "a", tmp_path / "b", tmp_path / "b2"
    node_a = _node(prog, port, ckpt, logs_a)
    _wait_for("node A's launcher", lambda: (logs_a / "launcher.log").exists())
    time.sleep(1)  # A hosts the rendezvous store (it binds the port first)
    node_b = _node(prog, port, ckpt, logs_b)
    procs = [node_a, node_b]
    try:
        _wait_for("a checkpoint at step 6", lambda: max(
            (step for step, _ in files.complete_checkpoints(ckpt)), default=0) >= 6)  # fmt: skip
        _kill_node(node_b)  # node B is lost: launcher and workers
        node_b.communicate(timeout=30)  # reaped, its pipes closed
        _wait_for("node A alone at world 2", lambda: any(
            "world=2" in line for line in _lines([logs_a], "LOSS")))  # fmt: skip
        _wait_for("two steps at world 2", lambda: sum(
            "world=2" in line for line in _lines([logs_a], "LOSS")) >= 2)  # fmt: skip
        node_b2 = _node(prog, port, ckpt, logs_b2)  # node B comes back
        procs.append(node_b2)
        out_a, err_a = node_a.communicate(timeout=240)
        out_b2, err_b2 = node_b2.communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_node(proc)
                proc.communicate(timeout=30)
    assert node_a.returncode == 0, err_a[-3000:]
    assert node_b2.returncode == 0, err_b2[-3000:]

    expected_losses, expected_state = _one_device()
    seen = [
        (int(m["step"]), int(m["world"]), float(m["loss"]))
        for line in _lines([logs_a, logs_b, logs_b2], "LOSS")
        if (m := re.match(r"LOSS step=(?P<step>\d+) world=(?P<world>\d+) loss=(?P<loss>\S+)", line))
    ]
    worlds = [world for _, world, _ in seen]
    assert 2 in worlds and worlds.count(4) > 0, worlds
    assert worlds[-1] == 4, "the last steps ran after node B came back"
    assert {step for step, _, _ in seen} == set(range(1, STEPS + 1))
    for step, world, loss in seen:  # every run of a step, before and after each re-forming
        assert loss == pytest.approx(expected_losses[step - 1], rel=1e-5, abs=1e-6), (step, world)
    finals = _lines([logs_a, logs_b2], "FINAL ")
    assert len(finals) == 1, finals
    state = ast.literal_eval(finals[0].removeprefix("FINAL "))
    for name, value in expected_state.items():
        torch.testing.assert_close(torch.tensor(state[name]), value, rtol=1e-5, atol=1e-6)
