"""Unit tests of the runner's pieces: launch config, failure reports, rendezvous ordering,
and `init()` for a one-process world. No worker processes are started."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from plait.comm.world import CurrentWorld, current_world
from plait.launch import LaunchError, RunConfig, World, init
from plait.launch.logs import RankLogsSpecs
from plait.launch.rendezvous import NodeRankedHandler
from plait.launch.runner import (
    JobResult,
    WorkerFailure,
    build_launch_config,
    format_failure,
    worker_command,
)


def config(**kw) -> RunConfig:
    return RunConfig(program=("train.py", "--lr", "1"), **kw)


def test_launch_config_node_zero_hosts_rendezvous(tmp_path: Path) -> None:
    logs = RankLogsSpecs(tmp_path, frozenset({0}))
    lc = build_launch_config(config(worker_num=4, local_worker_num=2, node_rank=0,
                                    cluster_timeout=30, max_restarts=2), logs)  # fmt: skip
    assert (lc.min_nodes, lc.max_nodes, lc.nproc_per_node, lc.max_restarts) == (2, 2, 2, 2)
    assert lc.rdzv_backend == "plait" and lc.rdzv_endpoint == "127.0.0.1:29500"
    assert lc.rdzv_configs["is_host"] is True and lc.rdzv_configs["plait_node_rank"] == 0
    assert lc.rdzv_configs["join_timeout"] == 30 and lc.local_addr == "127.0.0.1"
    auto = build_launch_config(config(worker_num=4, local_worker_num=2), logs)
    assert "plait_node_rank" not in auto.rdzv_configs


def test_launch_worker_command_uses_exec_shim() -> None:
    entry, args = worker_command(config(bind_core=True, log_dir="/logs"))
    assert args[0].endswith("_worker_exec.py")
    options, program = args[: args.index("--")], args[args.index("--") + 1 :]
    assert "--merge-stderr" in options and "--bind-core" in options
    assert program == (entry, "train.py", "--lr", "1")


def test_launch_logs_named_by_rank(tmp_path: Path) -> None:
    logs = RankLogsSpecs(tmp_path, frozenset({2}))

    def start(count: str) -> dict[int, dict[str, str]]:
        return {0: {"RANK": "2", "TORCHELASTIC_RESTART_COUNT": count},
                1: {"RANK": "3", "TORCHELASTIC_RESTART_COUNT": count}}  # fmt: skip

    envs = start("0")
    dest = logs.reify(envs)
    assert dest.stdouts == {0: str(tmp_path / "worker_2.log"),
                            1: str(tmp_path / "worker_3.log")}  # fmt: skip
    assert dest.tee_stdouts == {0: str(tmp_path / "worker_2.log")}
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "worker_3.error.json")
    assert logs.reify(start("1")).stdouts[1] == str(tmp_path / "worker_3.restart1.log")
    # an elastic group re-formed for a joining node keeps torch's restart count: the logs
    # count this node's starts, so the previous formation's are kept
    assert logs.reify(start("1")).stdouts[1] == str(tmp_path / "worker_3.restart2.log")


def test_launch_failure_report_names_rank_signal_and_log() -> None:
    root = WorkerFailure(rank=5, local_rank=1, pid=42, exitcode=-9, log_file="/l/worker_5.log",
                         log_tail=("step 7", "Killed"))  # fmt: skip
    other = WorkerFailure(rank=4, local_rank=0, pid=41, exitcode=-15, log_file=None)
    text = format_failure(JobResult(exit_code=137, log_dir="/l", failures=(root, other)))
    assert "worker rank 5 (local rank 1, pid 42) failed with signal SIGKILL (9)" in text
    assert "ranks 4 (signal SIGTERM (15))" in text
    assert "last 2 lines of /l/worker_5.log:\n    step 7\n    Killed" in text
    assert "exit code 137" in text


class FakeInner(RendezvousHandler):
    """Stands in for c10d's handler: returns a fixed group rank, or times out."""

    def __init__(self, store: dist.Store, rank: int, *, timeout: bool = False) -> None:
        self.store, self.rank, self.timeout = store, rank, timeout

    def get_backend(self) -> str:
        return "c10d"

    def next_rendezvous(self) -> RendezvousInfo:
        if self.timeout:
            raise RendezvousTimeoutError
        return RendezvousInfo(self.store, self.rank, 2, None)  # type: ignore[arg-type]

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None: ...

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "job"

    def shutdown(self) -> bool:
        return True


def params(node_rank: int | None) -> RendezvousParameters:
    extra = {} if node_rank is None else {"plait_node_rank": node_rank}
    return RendezvousParameters("plait", "127.0.0.1:1", "job", 2, 2, join_timeout=5, **extra)


def test_launch_rendezvous_reorders_by_node_rank() -> None:
    store = dist.HashStore()
    store.set("plait.node_rank.0", "1")  # the other node (c10d rank 0) said --node-rank 1
    handler = NodeRankedHandler(FakeInner(store, rank=1), store, params(0))
    assert handler.next_rendezvous().rank == 0
    assert handler.get_backend() == "plait"


def test_launch_rendezvous_duplicate_node_ranks_fail() -> None:
    store = dist.HashStore()
    store.set("plait.node_rank.0", "0")
    handler = NodeRankedHandler(FakeInner(store, rank=1), store, params(0))
    with pytest.raises(LaunchError, match=r"--node-rank values \[0, 0\]; they must be 0..1"):
        handler.next_rendezvous()


def test_launch_rendezvous_timeout_counts_arrivals() -> None:
    store = dist.HashStore()
    handler = NodeRankedHandler(FakeInner(store, 0, timeout=True), store, params(1))
    with pytest.raises(LaunchError, match=r"1 of 2 nodes arrived. Node ranks never seen: \[0\]"):
        handler.next_rendezvous()


def test_launch_init_single_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                "RANK_ID"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    try:
        world = init(timeout=timedelta(seconds=30))
        assert world == World(rank=0, world_size=1, local_rank=0, local_world_size=1,
                              node_rank=0, num_nodes=1, backend="gloo", device="cpu",
                              launcher="single")  # fmt: skip
        assert init() is world
        assert current_world() == CurrentWorld(0, 1, simulated=False, device_type="cpu")
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert current_world() is None


def test_launch_init_rejects_unknown_backend() -> None:
    with pytest.raises(LaunchError, match="init\\(backend='mpi'\\) is not supported"):
        init(backend="mpi")  # type: ignore[arg-type]
