"""Multi-node for real (issue 34 item 2, first part): two "nodes" on this machine, each in a
network namespace of the test's own with its own address (10.77.0.1 and 10.77.0.2 on a veth
pair: no traffic anywhere else), each running ``plait run --node-rank i --master-addr
10.77.0.1``. They form one world of 4 ranks (the launcher advertises and gloo binds the
interface each node reaches node 0 through, not the host name's), and data-parallel training
across them equals one device. Skipped with the reason where namespaces cannot be made (not
root, no ``ip``)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.dist.test_launch_e2e import ALLREDUCE, PY, REPO, clean_env, free_port, results, script

pytestmark = pytest.mark.dist

NODE0 = "10.77.0.1"

TRAIN = """
import torch
import torch.nn.functional as F

import plait
from plait.models import MLP

world = plait.init()
torch.manual_seed(0)
job = plait.parallelize(
    MLP((8, 16, 4)),
    plait.ParallelConfig(mode="data_parallel", mesh={"dp": 4}),
    optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
)
gen = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(3)]
losses = [job.step(tuple(t.chunk(4)[world.rank] for t in b)) for b in batches]
state = {k: v.tolist() for k, v in job.full_state_dict().items()}
print(f"RESULT rank={world.rank} node={world.node_rank} {losses!r} {state!r}", flush=True)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespaces() -> Iterator[list[str]]:
    """Two network namespaces joined by a veth pair: node 0 at 10.77.0.1, node 1 at .2."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's ip (not available here)")
    tag = uuid.uuid4().hex[:6]
    names = [f"plait{i}-{tag}" for i in range(2)]
    links = [f"pv{i}-{tag}" for i in range(2)]
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i, (name, link) in enumerate(zip(names, links, strict=True)):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"10.77.0.{i + 1}/24", "dev", link)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", link, "up")
    except subprocess.CalledProcessError as e:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"network namespaces cannot be made here: {e.stderr.strip()}")
    yield names
    for name in names:  # the veth pair goes with them
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _two_nodes(
    names: list[str], prog: str, tmp_path: Path, port: int
) -> list[subprocess.CompletedProcess[str]]:
    common = ["--worker-num", "4", "--local-worker-num", "2", "--master-addr", NODE0,
              "--master-port", str(port), "--cluster-timeout", "60", "--tail-worker-log", "all"]  # fmt: skip
    procs = []
    for i, name in reversed(list(enumerate(names))):  # node 1 first: it waits for node 0
        cmd = ["ip", "netns", "exec", name, PY, "-m", "plait", "run", *common, "--node-rank",
               str(i), "--log-dir", str(tmp_path / f"node{i}"), prog]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd,
                env=clean_env(),
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done[::-1]


def test_two_nodes_in_their_own_namespaces_form_one_world(
    namespaces: list[str], tmp_path: Path
) -> None:
    prog = script(tmp_path, "allreduce.py", ALLREDUCE)
    node0, node1 = _two_nodes(namespaces, prog, tmp_path, free_port())
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    assert results(node0.stdout) == [
        f"rank={r} size=4 local={r} node=0 launcher=torchrun sum=10" for r in (0, 1)
    ]
    assert results(node1.stdout) == [
        f"rank={r} size=4 local={r - 2} node=1 launcher=torchrun sum=10" for r in (2, 3)
    ]


def test_data_parallel_across_two_nodes_trains_like_one_device(
    namespaces: list[str], tmp_path: Path
) -> None:
    prog = script(tmp_path, "train.py", TRAIN)
    nodes = _two_nodes(namespaces, prog, tmp_path, free_port())
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    lines = [line for node in nodes for line in results(node.stdout)]
    assert [line.split()[:2] for line in lines] == [
        ["rank=0", "node=0"], ["rank=1", "node=0"], ["rank=2", "node=1"], ["rank=3", "node=1"],
    ]  # fmt: skip
    assert_trains_like_one_device(lines)


def assert_trains_like_one_device(lines: list[str]) -> None:
    """Every rank's `RESULT` line of TRAIN holds one device's losses and final parameters."""
    from plait.models import MLP

    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    expected = []
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        expected.append(loss.item())
    assert len(lines) == 4, lines
    for line in lines:
        _, _, rest = line.split(" ", 2)
        losses_text, _, state_text = rest.partition("] ")
        losses = ast.literal_eval(losses_text + "]")
        state = ast.literal_eval(state_text)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6
        )
        for name, value in model.state_dict().items():
            torch.testing.assert_close(torch.tensor(state[name]), value, rtol=1e-5, atol=1e-6)
