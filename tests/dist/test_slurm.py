"""Slurm for real (issue 34 item 4): a one-node Slurm cluster started by the test (munged,
slurmctld and slurmd on localhost, every file in the test's own directory, its own ports), then

- ``srun -n 2 python script.py``: ``plait.init()`` reads srun's environment (ranks, node, the
  rendezvous host from ``SLURM_STEP_NODELIST``) and the ranks form one world;
- the sbatch script ``plait run --emit slurm`` writes, submitted with ``sbatch --wait``: its
  ``plait run`` starts 4 workers that train data-parallel equal to one device;
- the same script around a worker that crashes: the job ends FAILED, its output naming the rank.

Skipped with the reason where Slurm cannot start (not root, Debian's ``slurm-wlm`` and ``munge``
not installed; ``.ci/run`` installs them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.dist.test_launch_e2e import ALLREDUCE, CRASH, PY, REPO, clean_env, free_port, results
from tests.dist.test_launch_e2e import script as write_script
from tests.dist.test_netns_nodes import TRAIN, assert_trains_like_one_device

pytestmark = pytest.mark.dist

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol")
SLURM_CONF = """\
ClusterName=plaittest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@dataclass(frozen=True)
class Slurm:
    """A running one-node cluster: the environment that reaches it and its files."""

    root: Path
    env: dict[str, str]

    def run(self, cmd: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(
            cmd, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((self.root / "log").glob("*"))
        )


def _kill_pidfile(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError):  # already gone, or never started
        os.kill(int(path.read_text().split()[0]), signal.SIGTERM)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing or os.geteuid() != 0:
        pytest.skip(
            f"a test Slurm cluster needs root and {', '.join(missing or DAEMONS)} (Debian's"
            " slurm-wlm and munge; .ci/run installs them)"
        )
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o700)
    root.chmod(0o755)  # munged checks the directories above its socket
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=host, root=root, cpus=os.cpu_count() or 1,
            ctld_port=free_port(), slurmd_port=free_port(),
        )
    )  # fmt: skip
    env = clean_env()
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = os.pathsep.join([str(Path(PY).parent), env.get("PATH", "")])
    cluster = Slurm(root, env)
    munge = root / "munge"
    started = [
        ["munged", "-f", f"--socket={munge}/munge.sock", f"--key-file={key}",
         f"--pid-file={munge}/munged.pid", f"--log-file={root}/log/munged.log",
         f"--seed-file={munge}/seed"],
        ["slurmctld", "-i"],
        ["slurmd"],
    ]  # fmt: skip
    try:
        for cmd in started:
            proc = cluster.run(cmd, cwd=root, timeout=30)
            if proc.returncode != 0:
                pytest.skip(f"Slurm cannot start here: {cmd[0]} failed: {proc.stderr.strip()}")
        deadline = time.monotonic() + 30
        while True:
            state = cluster.run(["sinfo", "-h", "-o", "%T"], cwd=root).stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                pytest.skip(f"Slurm's node never became idle (state {state!r}):\n{cluster.logs()}")
            time.sleep(0.5)
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        for pid in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            _kill_pidfile(root / pid)


def test_srun_environment_is_read_by_plait_init(slurm: Slurm, tmp_path: Path) -> None:
    prog = write_script(tmp_path, "allreduce.py", ALLREDUCE)
    env_port = ["--export", f"ALL,MASTER_PORT={free_port()}"]
    proc = slurm.run(["srun", "-n", "2", "--overcommit", *env_port, PY, prog], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr + slurm.logs()
    assert results(proc.stdout) == [
        f"rank={r} size=2 local={r} node=0 launcher=slurm sum=3" for r in (0, 1)
    ]


def _sbatch(slurm: Slurm, tmp_path: Path, prog: str, *args: str) -> tuple[int, str, str]:
    """Emit the sbatch script for `prog`, submit it, wait; (exit code, job state, output)."""
    emitted = tmp_path / "job.sbatch"
    emit = slurm.run(
        [PY, "-m", "plait", "run", "--emit", "slurm", "-o", str(emitted), "--job-name", "plait-t",
         "--worker-num", "4", "--master-port", str(free_port()), "--cluster-timeout", "60",
         "--tail-worker-log", "all", "--log-dir", str(tmp_path / "logs"), prog, *args],
        cwd=REPO,
    )  # fmt: skip
    assert emit.returncode == 0, emit.stderr
    submit = slurm.run(["sbatch", "--parsable", str(emitted)], cwd=tmp_path)
    job_id = submit.stdout.strip().split(";")[0]
    assert job_id.isdigit(), submit.stdout + submit.stderr
    # polled here: `sbatch --wait` backs off to tens of seconds between its own polls
    deadline = time.monotonic() + 180
    while True:
        state = slurm.run(["scontrol", "show", "job", job_id, "-o"], cwd=tmp_path).stdout
        if not any(f"JobState={s} " in state for s in ("PENDING", "CONFIGURING", "RUNNING",
                                                       "COMPLETING")):  # fmt: skip
            break
        assert time.monotonic() < deadline, f"job {job_id} still running:\n{state}"
        time.sleep(0.5)
    code = int(state.split("ExitCode=")[1].split(":")[0])
    output = (tmp_path / f"plait-t-{job_id}.out").read_text()
    return code, state, output


def test_emitted_sbatch_script_trains_like_one_device(slurm: Slurm, tmp_path: Path) -> None:
    code, state, output = _sbatch(slurm, tmp_path, write_script(tmp_path, "train.py", TRAIN))
    assert code == 0, output + slurm.logs()
    assert "JobState=COMPLETED" in state, state
    lines = results(output)
    assert [line.split()[:2] for line in lines] == [
        [f"rank={r}", "node=0"] for r in range(4)
    ], output
    assert_trains_like_one_device(lines)


def test_emitted_sbatch_script_fails_with_the_rank_named(slurm: Slurm, tmp_path: Path) -> None:
    prog = write_script(tmp_path, "crash.py", CRASH)
    code, state, output = _sbatch(slurm, tmp_path, prog, str(tmp_path / "crashed_at"))
    assert code != 0, output
    assert "JobState=FAILED" in state, state
    assert "worker rank 1 (local rank 1" in output, output
    assert "failed with exit code 3" in output, output


def test_srun_gives_the_last_ranks_to_parameter_servers(slurm: Slurm, tmp_path: Path) -> None:
    """`srun -n 4` with PLAIT_SERVER_NUM=2: ranks 2 and 3 serve, 0 and 1 train, and the job
    trains as one device does (issue 31: a role per rank under Slurm)."""
    from plait import SparseOptimizer
    from tests.dist.test_parameter_server import SCRIPT, _one_device

    out = tmp_path / "run.pt"
    settings = json.dumps({"server_optimizer": {"kind": "adagrad", "lr": 0.1, "eps": 1e-10}})
    exports = f"ALL,MASTER_PORT={free_port()},PLAIT_SERVER_NUM=2,PYTHONPATH={REPO}"
    proc = slurm.run(
        ["srun", "-n", "4", "--overcommit", "--export", exports, PY, str(SCRIPT), str(out),
         settings],
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + slurm.logs()
    assert sorted(line.split(":")[0] for line in proc.stdout.splitlines() if "losses" in line) \
        == ["worker 0", "worker 1"]  # fmt: skip
    got = torch.load(out)
    losses, model = _one_device(SparseOptimizer(kind="adagrad", lr=0.1, eps=1e-10))
    torch.testing.assert_close(list(got["losses"].values()), losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["items"], model.items.weight.detach(), rtol=1e-5, atol=1e-6)
