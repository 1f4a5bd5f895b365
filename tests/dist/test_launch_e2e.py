"""End-to-end tests of `plait run` and `plait.init()` with real processes on gloo.

Each test starts real launchers and workers on loopback (127.0.0.1, free ports). Workers that
only need to exit or sleep do not import torch, which keeps the file fast on two cores; the
collective tests compare an all-reduce against its closed form, sum(rank + 1).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

ALLREDUCE = """
import torch
import torch.distributed as dist
from plait.launch import init

world = init()
assert init() is world, "init() must be idempotent"
t = torch.tensor([float(world.rank + 1)])
dist.all_reduce(t)
print(f"RESULT rank={world.rank} size={world.world_size} local={world.local_rank}"
      f" node={world.node_rank} launcher={world.launcher} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""

TORCHRUN_STYLE = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"RESULT rank={os.environ['RANK']} local={os.environ['LOCAL_RANK']}"
      f" node={os.environ['GROUP_RANK']} size={dist.get_world_size()} sum={t.item():g}",
      flush=True)
dist.destroy_process_group()
"""

CRASH = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} started", flush=True)
if rank == 1:
    time.sleep(1)
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
    print("Traceback: something went wrong on rank 1", flush=True)
    sys.exit(3)
time.sleep(120)
"""

FAIL_ONCE = """
import os, sys, time
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
marker = sys.argv[1]
if rank == 1 and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(5)
if attempt == 0:
    time.sleep(120)  # the launcher must stop this worker when rank 1 fails
print(f"RESULT rank={rank} attempt={attempt}", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PLAIT_DEBUG")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("OMPI_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def plait_run(*args: str) -> list[str]:
    return [PY, "-m", "plait", "run", "--master-addr", "127.0.0.1", *args]


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def results(text: str) -> list[str]:
    # Split on the marker, not on lines: torchrun interleaves its workers' unprefixed output.
    return sorted(chunk.splitlines()[0].strip() for chunk in text.split("RESULT ")[1:])


def test_launch_four_workers_allreduce(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    prog = script(tmp_path, "allreduce.py", ALLREDUCE)
    port = str(free_port())
    proc = run(plait_run("--worker-num", "4", "--master-port", port, "--log-dir", str(logs),
                         "--join", prog))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert results(proc.stdout) == [
        f"rank={r} size=4 local={r} node=0 launcher=torchrun sum=10" for r in range(4)
    ]
    assert sorted(p.name for p in logs.iterdir()) == [
        "launcher.log", "worker_0.log", "worker_1.log", "worker_2.log", "worker_3.log"
    ]  # fmt: skip
    assert "sum=10" in (logs / "worker_3.log").read_text()


def test_launch_two_nodes_form_one_world(tmp_path: Path) -> None:
    # The workers import torch only (not plait): this test is about the launchers meeting.
    prog = script(tmp_path, "plain.py", TORCHRUN_STYLE)
    port = str(free_port())
    common = ["--worker-num", "4", "--local-worker-num", "2", "--master-port", port,
              "--cluster-timeout", "60", "--tail-worker-log", "all"]  # fmt: skip
    # Node 1 starts first: it must wait for node 0, and still get ranks 2 and 3.
    node1 = subprocess.Popen(
        plait_run(*common, "--node-rank", "1", "--log-dir", str(tmp_path / "n1"), prog),
        env=clean_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    node0 = run(plait_run(*common, "--node-rank", "0", "--log-dir", str(tmp_path / "n0"), prog))
    out1, err1 = node1.communicate(timeout=60)
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, err1
    assert results(node0.stdout) == [
        "rank=0 local=0 node=0 size=4 sum=10",
        "rank=1 local=1 node=0 size=4 sum=10",
    ]
    assert results(out1) == [
        "rank=2 local=0 node=1 size=4 sum=10",
        "rank=3 local=1 node=1 size=4 sum=10",
    ]


def test_launch_crash_stops_job_and_names_rank(tmp_path: Path) -> None:
    prog = script(tmp_path, "crash.py", CRASH)
    crashed_at = tmp_path / "crashed_at"
    proc = run(plait_run("--worker-num", "3", "--master-port", str(free_port()),
                         "--log-dir", str(tmp_path / "logs"), prog, str(crashed_at)),
               timeout=100)  # fmt: skip
    stopped = time.time() - float(crashed_at.read_text())
    assert proc.returncode == 3
    # the others sleep 120 s: the launcher stopped them (its monitor interval and SIGTERM's
    # grace are seconds; the bound is far from both, so a loaded machine does not fail it)
    assert stopped < 40, f"the job stopped {stopped:.1f} s after rank 1 crashed"
    assert "worker rank 1 (local rank 1" in proc.stderr
    assert "failed with exit code 3" in proc.stderr
    assert "Traceback: something went wrong on rank 1" in proc.stderr
    assert "stopped the other workers on this node: ranks 0 (signal SIGTERM" in proc.stderr


def test_launch_max_restarts_recovers(tmp_path: Path) -> None:
    prog = script(tmp_path, "fail_once.py", FAIL_ONCE)
    logs = tmp_path / "logs"
    proc = run(plait_run("--worker-num", "2", "--max-restarts", "1", "--master-port",
                         str(free_port()), "--log-dir", str(logs), "--join", prog,
                         str(tmp_path / "marker")))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert results(proc.stdout) == ["rank=0 attempt=1", "rank=1 attempt=1"]
    assert (logs / "worker_1.restart1.log").exists()


def test_launch_torchrun_style_script_runs_unmodified(tmp_path: Path) -> None:
    prog = script(tmp_path, "plain.py", TORCHRUN_STYLE)
    proc = run(plait_run("--worker-num", "2", "--master-port", str(free_port()),
                         "--log-dir", str(tmp_path / "logs"), "--join", prog))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert results(proc.stdout) == [
        "rank=0 local=0 node=0 size=2 sum=3",
        "rank=1 local=1 node=0 size=2 sum=3",
    ]


def test_launch_plait_script_runs_under_torchrun(tmp_path: Path) -> None:
    prog = script(tmp_path, "allreduce.py", ALLREDUCE)
    proc = run([PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                "--local-addr", "127.0.0.1", prog])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert results(proc.stdout) == [
        "rank=0 size=2 local=0 node=0 launcher=torchrun sum=3",
        "rank=1 size=2 local=1 node=0 launcher=torchrun sum=3",
    ]


def test_launch_mpirun_two_ranks(tmp_path: Path) -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed (CI installs Debian's openmpi-bin via .ci/run)")
    prog = script(tmp_path, "allreduce.py", ALLREDUCE)
    proc = run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}",
                "-x", "PYTHONPATH", PY, prog])  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert results(proc.stdout) == [
        "rank=0 size=2 local=0 node=0 launcher=openmpi sum=3",
        "rank=1 size=2 local=1 node=0 launcher=openmpi sum=3",
    ]


def test_launch_missing_node_times_out_with_count(tmp_path: Path) -> None:
    prog = script(tmp_path, "never.py", "raise SystemExit(9)\n")
    proc = run(plait_run("--worker-num", "4", "--local-worker-num", "2", "--node-rank", "0",
                         "--master-port", str(free_port()), "--cluster-timeout", "2",
                         "--log-dir", str(tmp_path / "logs"), prog), timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "timed out after 2 s: 1 of 2 nodes arrived" in proc.stderr
    assert "Node ranks never seen: [1]" in proc.stderr
    assert not (tmp_path / "logs" / "worker_0.log").exists()


def test_launch_nodes_with_different_worker_num_are_refused(tmp_path: Path) -> None:
    prog = script(tmp_path, "allreduce.py", ALLREDUCE)
    port = str(free_port())
    common = ("--local-worker-num", "1", "--master-port", port, "--cluster-timeout", "60")
    node0 = subprocess.Popen(
        plait_run("--worker-num", "2", *common, "--node-rank", "0", "--log-dir",
                  str(tmp_path / "n0"), prog),
        env=clean_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(2)  # node 0 first: its --worker-num is the job's
    node1 = run(plait_run("--worker-num", "3", *common, "--node-rank", "1", "--log-dir",
                          str(tmp_path / "n1"), prog), timeout=60)  # fmt: skip
    _, err0 = node0.communicate(timeout=60)  # stopped by node 1's refusal, not the timeout
    message = (
        "node 0 passed --worker-num 2 --local-worker-num 1 (2 nodes), but node 1 passed"
        " --worker-num 3 --local-worker-num 1 (3 nodes). Every node must pass the same"
    )
    assert node1.returncode == 2 and message in node1.stderr, node1.stderr
    assert node0.returncode == 2 and message in err0, err0
