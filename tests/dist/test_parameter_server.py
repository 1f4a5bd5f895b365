"""Parameter-server jobs on real processes (`plait run --worker-num 2 --server-num 2`).

The recommender of tests/dist/ps_model.py keeps its two tables on the servers: ``users``
(``nn.Embedding`` with a padding row, made on the servers from a seed) and ``items``
(``nn.EmbeddingBag``, sent by worker 0); its MLP trains data parallel over the workers.
Synchronous training equals one device training the whole batch with
``nn.Embedding(sparse=True)`` tables and the same torch sparse optimizer; asynchronous
training converges on the same task; a server killed mid-training stops the job with the
server named.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait import SparseOptimizer
from plait.ps import initial_table, sparse_optimizer
from tests.dist.ps_model import DIM, ROWS, Recommender, batches, loss_fn

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "dist" / "ps_worker.py"


def _run(
    tmp_path: Path, settings: dict, *, workers: int = 2, servers: int = 2, name: str = "run",
    flags: tuple[str, ...] = (),
):  # fmt: skip
    out = tmp_path / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable, "-m", "plait", "run", "--worker-num", str(workers), "--server-num",
        str(servers), "--log-dir", str(tmp_path / f"{name}-logs"), *flags, str(SCRIPT),
        str(out), json.dumps(settings),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    return proc, out


def _one_device(optimizer: SparseOptimizer, steps: int | None = None):
    """The same model on one device: sparse tables, torch's sparse optimizer, whole batches."""
    torch.manual_seed(0)
    model = Recommender(sparse=True)
    with torch.no_grad():  # the users table as the servers made it
        model.users.weight.copy_(initial_table(ROWS, DIM, seed=3, padding_idx=0))
    dense = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    tables = sparse_optimizer(optimizer, [model.users.weight, model.items.weight])
    losses = []
    for batch in batches(steps) if steps else batches():
        dense.zero_grad()
        tables.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        dense.step()
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            tables.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize(
    ("split", "optimizer", "extra"),
    [
        ("range", SparseOptimizer(kind="adagrad", lr=0.1, eps=1e-10), {}),
        # the worker's cache, filled ahead by prefetch and shared by a step's two
        # micro-batches: still one device's training
        (
            "hash",
            SparseOptimizer(kind="adam", lr=0.05),
            {"vocab_cache_size": 40, "prefetch": True, "grad_accumulation": 2},
        ),
        # the dense part as the plan's per-rank program with ZeRO: the lookups are ops of it
        pytest.param(  # ZeRO-1 (about 15 s): nightly; ZeRO-3 below runs in make test
            "range", SparseOptimizer(kind="adagrad", lr=0.1, eps=1e-10), {"optimizer_shard": 1},
            marks=pytest.mark.nightly,
        ),
        ("hash", SparseOptimizer(kind="adam", lr=0.05), {"optimizer_shard": 3,
                                                         "grad_accumulation": 2}),
    ],
    ids=["range-adagrad", "hash-adam-cache-prefetch-accumulation", "zero1", "zero3-accumulation"],
)
def test_sync_parameter_server_trains_like_one_device(tmp_path, split, optimizer, extra):
    settings = {"ps_split": split, "server_optimizer": {
        "kind": optimizer.kind, "lr": optimizer.lr, "eps": optimizer.eps}, **extra}  # fmt: skip
    proc, out = _run(tmp_path, settings)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out)
    losses, model = _one_device(optimizer)
    # fp32; the only difference is the order rows' gradients are summed in (per worker, then
    # over workers): rounding, a few ulps after six steps
    assert list(got["losses"]) == list(range(6))
    torch.testing.assert_close(list(got["losses"].values()), losses, rtol=1e-5, atol=1e-6)
    for name, value in model.mlp.state_dict().items():
        torch.testing.assert_close(got["mlp"][name], value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["users"], model.users.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["items"], model.items.weight.detach(), rtol=1e-5, atol=1e-6)
    assert got["users"][0].abs().sum() == 0  # the padding row: never trained
    with torch.no_grad():  # job.evaluate pulls the trained rows: one device's eval loss
        expected = loss_fn(model.eval(), batches()[0]).item()
    assert got["evaluated"] == pytest.approx(expected, rel=1e-5)
    traffic = got["traffic"]
    assert traffic["steps"] == 6 and traffic["bytes_pushed"] > 0
    # the workers' collectives of a step are the dense part's: no table's rows or gradients
    # cross the workers' mesh (a table is 3,072 bytes, the MLP's gradients 1,156)
    kinds = {kind for kind, _, _ in got["collectives"]}
    assert got["collectives"] and kinds <= {"all_reduce", "all_gather", "reduce_scatter"}, kinds
    assert max(n for _, _, n in got["collectives"]) < ROWS * DIM * 4, got["collectives"]
    if not extra.get("optimizer_shard"):  # plain data parallel: gradient buckets and the loss
        assert kinds == {"all_reduce"}, got["collectives"]
    assert "parameter servers, a step on this worker:" in got["report"]
    assert "ms waiting for rows" in got["report"] and traffic["pull_s"] > 0 < traffic["push_s"]
    if extra.get("vocab_cache_size"):  # the second micro-batch and the prefetched rows: cached
        assert traffic["hit_rate"] > 0.5, traffic
        assert "cache hit rate" in got["report"]
    else:
        assert traffic["cache_hits"] == 0 and traffic["rows_read"] > 0


@pytest.mark.nightly  # about 15 s: in `make nightly` (.ci/run), not `make test`
def test_async_parameter_server_converges_on_the_same_task(tmp_path):
    optimizer = SparseOptimizer(kind="adagrad", lr=0.1, eps=1e-10)
    settings = {"ps_mode": "async", "max_staleness": 2, "steps": 40, "server_optimizer": {
        "kind": "adagrad", "lr": 0.1, "eps": 1e-10}}  # fmt: skip
    proc, out = _run(tmp_path, settings)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = list(torch.load(out)["losses"].values())
    sync, _ = _one_device(optimizer, steps=40)
    first, last, one = sum(got[:5]) / 5, sum(got[-5:]) / 5, sum(sync[-5:]) / 5
    # one device goes from 1.05 to 0.67 over these 40 steps (the mean of 5); async, whose
    # pushes land in any order and whose pulls may miss two steps' updates, follows it
    assert last < 0.75 * first, got
    assert abs(last - one) < 0.25 * one, (got, sync)


def test_a_killed_server_stops_the_job_naming_it(tmp_path):
    proc, _ = _run(tmp_path, {"kill_server_at": 3, "steps": 50})
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "parameter server rank 2" in text and "SIGKILL" in text, text[-3000:]


# nightly: the servers' checkpoint is in make test through the killed-server restart
@pytest.mark.nightly
def test_a_checkpoint_loads_under_another_server_count_and_split(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, out = _run(tmp_path, {"save_at": 3, "save": str(ckpt)}, name="a")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (ckpt / "parts" / "parameter_server" / "items" / "server1-of-2.pt").is_file()
    exported = tmp_path / "tables.safetensors"
    settings = {"ps_split": "hash", "load": str(ckpt), "export": str(exported)}
    proc, again = _run(tmp_path, settings, servers=3, name="b")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = torch.load(out), torch.load(again)
    assert list(b["losses"]) == [3, 4, 5]
    # the same numbers in the same order: servers hold other rows, each row's update is its own
    for step in (3, 4, 5):
        assert b["losses"][step] == pytest.approx(a["losses"][step], rel=1e-6)
    for table in ("users", "items"):
        torch.testing.assert_close(b[table], a[table], rtol=1e-6, atol=1e-7)
    from safetensors.torch import load_file

    whole = load_file(str(exported))
    assert torch.equal(whole["users.weight"], b["users"])
    assert torch.equal(whole["items.weight"], b["items"])


def test_a_killed_server_restarts_the_job_from_the_last_checkpoint(tmp_path):
    flags = ("--max-restarts", "1", "--checkpoint-dir", str(tmp_path / "ckpts"))
    proc, out = _run(tmp_path, {"every": 2, "kill_server_at": 3}, flags=flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out)
    assert list(got["losses"]) == [2, 3, 4, 5]  # resumed after step 2's checkpoint
    losses, model = _one_device(SparseOptimizer())
    torch.testing.assert_close(list(got["losses"].values()), losses[2:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["users"], model.users.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["items"], model.items.weight.detach(), rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_other_launchers_give_the_last_ranks_to_the_servers(tmp_path, launcher):
    """PLAIT_SERVER_NUM under torchrun and mpirun: the same job, the same one-device result."""
    out = tmp_path / "run.pt"
    optimizer = SparseOptimizer(kind="adagrad", lr=0.1, eps=1e-10)
    settings = json.dumps({"server_optimizer": {"kind": "adagrad", "lr": 0.1, "eps": 1e-10}})
    env = {**os.environ, "PYTHONPATH": str(REPO), "PLAIT_SERVER_NUM": "2"}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", str(SCRIPT), str(out), settings]  # fmt: skip
    else:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.skip("mpirun is not installed (CI installs Debian's openmpi-bin via .ci/run)")
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4",
               "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={_free_port()}",
               "-x", "PYTHONPATH", "-x", "PLAIT_SERVER_NUM",
               sys.executable, str(SCRIPT), str(out), settings]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out)
    losses, model = _one_device(optimizer)
    torch.testing.assert_close(list(got["losses"].values()), losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["items"], model.items.weight.detach(), rtol=1e-5, atol=1e-6)


def test_servers_on_two_nodes_train_like_one_device(tmp_path):
    """`plait run --nnodes 2 --server-num 2`: two launchers on loopback, each node one worker
    and its share of the servers (one); the job trains as one device does."""
    out = tmp_path / "run.pt"
    optimizer = SparseOptimizer(kind="adagrad", lr=0.1, eps=1e-10)
    settings = json.dumps({"server_optimizer": {"kind": "adagrad", "lr": 0.1, "eps": 1e-10}})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    common = [sys.executable, "-m", "plait", "run", "--nnodes", "2", "--local-worker-num", "1",
              "--server-num", "2", "--master-port", str(_free_port()), "--cluster-timeout",
              "60"]  # fmt: skip
    node1 = subprocess.Popen(
        [*common, "--node-rank", "1", "--log-dir", str(tmp_path / "n1"), str(SCRIPT),
         str(tmp_path / "node1.pt"), settings],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    node0 = subprocess.run(
        [*common, "--node-rank", "0", "--log-dir", str(tmp_path / "n0"), str(SCRIPT), str(out),
         settings],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out1, err1 = node1.communicate(timeout=60)
    assert node0.returncode == 0, node0.stdout[-3000:] + node0.stderr[-3000:]
    assert node1.returncode == 0, out1[-3000:] + err1[-3000:]
    # node 1's worker is worker 1 (global rank 2); its server is the second server
    assert "worker 1: losses" in (tmp_path / "n1" / "worker_2.log").read_text()
    got = torch.load(out)
    losses, model = _one_device(optimizer)
    torch.testing.assert_close(list(got["losses"].values()), losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["users"], model.users.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["items"], model.items.weight.detach(), rtol=1e-5, atol=1e-6)
