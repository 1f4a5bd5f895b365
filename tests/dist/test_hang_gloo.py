"""Hangs named (issue 34 item 3): a rank that never reaches a collective stops the job within
``hang_timeout`` with a report from every rank, on real gloo processes, under
``plait.init(hang_timeout=...)`` and under ``plait run --hang-timeout``.

Rank 1 sleeps where it should call its second all-reduce; rank 0 waits in it. Without the
watchdog rank 0 would wait out the sleep (60 s) and both would return. With
``plait.init(hang_timeout=2)`` both exit with ``HANG_EXIT_CODE`` before that: rank 1's report
says it never arrived, names the last collective it finished and shows its stack in
``time.sleep``; rank 0's names the all-reduce it waits in, one further in the same group."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from plait.launch.hang import HANG_EXIT_CODE
from plait.testing import run_workers
from tests.dist.test_launch_e2e import free_port, plait_run, run, script

pytestmark = pytest.mark.dist

SLEEP_S = 60.0


def _one_rank_never_arrives(culprit: int) -> str:
    import torch.distributed as dist

    import plait

    plait.init(hang_timeout=2.0)
    t = torch.ones(4)
    dist.all_reduce(t)  # every rank arrives once
    if dist.get_rank() == culprit:
        time.sleep(SLEEP_S)  # never reaches the next collective in time
    dist.all_reduce(t)
    return "finished"


def test_a_rank_that_never_arrives_is_named_and_the_job_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAIT_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")  # the group is made before plait.init
    with pytest.raises(Exception, match=f"exit code {HANG_EXIT_CODE}|{HANG_EXIT_CODE}"):
        run_workers(_one_rank_never_arrives, 2, 1, timeout_s=120)
    waiting = (tmp_path / "hang_rank0.txt").read_text()
    culprit = (tmp_path / "hang_rank1.txt").read_text()
    assert "rank 0 is hung" in waiting and "waiting in gloo:all_reduce #" in waiting
    assert "rank 1 never arrived: rank 0 waits in gloo:all_reduce" in culprit
    assert "no collective pending; the last one it finished: gloo:all_reduce #" in culprit
    assert "time.sleep(SLEEP_S)" in culprit  # its own stack, where it stopped
    waits = int(re.search(r"waiting in gloo:all_reduce #(\d+)", waiting).group(1))
    finished = int(re.search(r"it finished: gloo:all_reduce #(\d+)", culprit).group(1))
    assert waits == finished + 1  # the one collective rank 1 never reached


def _plan_step_never_arrives() -> str:
    import torch.distributed as dist
    import torch.nn.functional as F

    import plait
    from plait.models import MLP

    plait.init(hang_timeout=2.0)
    torch.manual_seed(0)
    # auto splits the hidden layers over tp: the program gathers a hidden activation
    job = plait.parallelize(
        MLP((64, 256, 256, 64)), plait.ParallelConfig(mode="auto", mesh={"tp": 2}),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
    )  # fmt: skip
    batch = (torch.randn(8, 64), torch.randn(8, 64))
    job.step(batch)
    if dist.get_rank() == 1:
        time.sleep(SLEEP_S)
    job.step(batch)  # rank 0 waits inside the per-rank program
    return "finished"


def test_a_hang_inside_the_plans_program_names_the_plans_op_and_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAIT_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    with pytest.raises(Exception, match=f"exit code {HANG_EXIT_CODE}|{HANG_EXIT_CODE}"):
        run_workers(_plan_step_never_arrives, 2, timeout_s=120)
    waiting = (tmp_path / "hang_rank0.txt").read_text()
    assert "waiting in gloo:all_gather #" in waiting
    assert re.search(
        r"in the plan's per-rank program at node 'all_gather_into_tensor\w*' \(all_gather_into_"
        r"tensor.default\), the plan's op 'linear_1' \(module 'layers.1'\): linear_1 needs"
        r" output of gelu as \[None, None\]; it is \[None, tp\]",
        waiting,
    ), waiting


NEVER_ARRIVES = """
import time

import torch
import torch.distributed as dist

import plait

world = plait.init()  # the watchdog from plait run's PLAIT_HANG_TIMEOUT
t = torch.ones(4)
dist.all_reduce(t)
if world.rank == 1:
    time.sleep(60)
dist.all_reduce(t)
print("RESULT finished", flush=True)
"""


def test_plait_run_hang_timeout_stops_the_job_and_says_where(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    prog = script(tmp_path, "never_arrives.py", NEVER_ARRIVES)
    proc = run(
        plait_run("--worker-num", "2", "--master-port", str(free_port()), "--log-dir", str(logs),
                  "--hang-timeout", "2", prog),
        timeout=50,  # the sleep alone is 60 s: only the watchdog ends the job sooner
    )  # fmt: skip
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    assert "RESULT finished" not in proc.stdout
    assert f"exit code {HANG_EXIT_CODE} (hung" in proc.stderr
    assert "the job hung; each rank's report in brief" in proc.stderr
    assert "rank 1 never arrived: rank 0 waits in gloo:all_reduce #" in proc.stderr
    culprit = (logs / "hang_rank1.txt").read_text()
    assert "rank 1 never arrived: rank 0 waits in gloo:all_reduce #" in culprit
    assert "time.sleep(60)" in culprit
    assert "waiting in gloo:all_reduce #" in (logs / "hang_rank0.txt").read_text()


def test_hang_timeout_is_checked() -> None:
    from plait.errors import LaunchError
    from plait.launch.config import RunConfig

    with pytest.raises(LaunchError, match="--hang-timeout 0 must be > 0 seconds"):
        RunConfig(program=("train.py",), hang_timeout=0)


def test_hang_timeout_reads_its_argument_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from datetime import timedelta

    from plait.errors import ConfigError
    from plait.launch.hang import HangWatchdog, timeout_from

    monkeypatch.delenv("PLAIT_HANG_TIMEOUT", raising=False)
    assert timeout_from(None) is None
    assert timeout_from(timedelta(minutes=2)) == 120.0
    monkeypatch.setenv("PLAIT_HANG_TIMEOUT", "300")
    assert timeout_from(None) == 300.0
    monkeypatch.setenv("PLAIT_HANG_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="PLAIT_HANG_TIMEOUT='soon' is not a number"):
        timeout_from(None)
    with pytest.raises(ConfigError, match="hang_timeout='5': give seconds"):
        timeout_from("5")
    with pytest.raises(ConfigError, match=r"hang_timeout=-1\.0: give the seconds"):
        HangWatchdog(0, -1.0)
