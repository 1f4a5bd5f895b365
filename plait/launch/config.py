"""`RunConfig`: everything `plait run` needs, validated at construction.

The CLI (`plait run`) only builds one of these from flags; Python callers may build one
directly and hand it to `plait.launch.run_job`. Its fields mirror MindSpore's `msrun` flags
(`--worker_num`, `--local_worker_num`, ...), spelled in kebab case on the command line.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from plait.errors import LaunchError
from plait.launch.environment import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT

__all__ = ["DEFAULT_CLUSTER_TIMEOUT", "RunConfig"]

DEFAULT_CLUSTER_TIMEOUT = 600.0
"""Seconds to wait for every node to join the rendezvous (msrun's `--cluster_time_out`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """One node's share of a job: which program, how many workers, where to meet.

    Example:
        >>> cfg = RunConfig(program=("train.py",), worker_num=8, local_worker_num=4, node_rank=1)
        >>> cfg.num_nodes, cfg.first_rank
        (2, 4)
    """

    program: tuple[str, ...]
    """Script and its arguments (`train.py --lr 0.1`), or `-m module args` to run a module."""
    worker_num: int = 1
    """Workers in the whole job (every node), parameter servers included."""
    server_num: int = 0
    """Of `worker_num`, the processes that are parameter servers, exported as
    ``PLAIT_SERVER_NUM``."""
    local_worker_num: int = 1
    """Workers on this node; the same on every node."""
    local_server_num: int = 0
    """Of `local_worker_num`, the parameter servers on each node (its last local ranks),
    exported as ``PLAIT_LOCAL_SERVER_NUM``; ``server_num`` is this times the nodes."""
    master_addr: str = DEFAULT_MASTER_ADDR
    """Host of the rendezvous (node 0's address)."""
    master_port: int = DEFAULT_MASTER_PORT
    """Port of the rendezvous on `master_addr`."""
    node_rank: int | None = None
    """This node's index; None lets the rendezvous assign one (arrival order)."""
    min_nodes: int | None = None
    """Elastic jobs (`--nnodes MIN:MAX`): the fewest nodes the job trains on; `worker_num` is
    then the most (MAX nodes' workers). None: exactly `num_nodes` nodes."""
    log_dir: str | None = None
    """Directory for `worker_<rank>.log` and `launcher.log`; None makes a temporary one."""
    tail_ranks: tuple[int, ...] = (0,)
    """Global ranks whose output is echoed to the console (all of them with `join`)."""
    join: bool = False
    """Echo every worker's output to the console, as `msrun --join` does."""
    cluster_timeout: float = DEFAULT_CLUSTER_TIMEOUT
    """Seconds for every node to join the rendezvous before the launch fails."""
    max_restarts: int = 0
    """Times the whole worker group is restarted after a failure before giving up."""
    checkpoint_dir: str | None = None
    """Directory of the job's checkpoints, given to every worker as ``PLAIT_CHECKPOINT_DIR``
    (where ``plait.checkpoint.Checkpoints()`` saves and resumes after a restart)."""
    bind_core: bool = False
    """Pin each worker to its own slice of this node's CPUs (Linux only)."""
    rank_table: str | None = None
    """Path of the rank table the node layout came from; passed to workers."""
    hang_timeout: float | None = None
    """Seconds a worker may go without progress before it reports where it is and exits
    (``PLAIT_HANG_TIMEOUT`` for every worker: :mod:`plait.launch.hang`); None: no watchdog."""
    run_id: str = "plait"
    """Rendezvous id; every node of one job must use the same."""
    python: str = field(default_factory=lambda: sys.executable)
    """Interpreter that runs the workers."""
    monitor_interval: float = 0.1
    """Seconds between checks of the workers' health."""
    shutdown_timeout: int = 5
    """Seconds the other workers get to exit after SIGTERM before SIGKILL."""

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_network()
        self._check_program()
        for rank in self.tail_ranks:
            if not 0 <= rank < self.worker_num:
                raise LaunchError(
                    f"--tail-worker-log rank {rank} is outside 0..{self.worker_num - 1}. Pass"
                    " ranks of this job, 'all', or 'none'."
                )
        if self.cluster_timeout <= 0:
            raise LaunchError(
                f"--cluster-timeout {self.cluster_timeout!r} must be > 0 seconds (default"
                f" {DEFAULT_CLUSTER_TIMEOUT:g})."
            )
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts {self.max_restarts} must be >= 0.")
        if self.hang_timeout is not None and not self.hang_timeout > 0:
            raise LaunchError(
                f"--hang-timeout {self.hang_timeout!r} must be > 0 seconds: the time a worker "
                "may wait in a collective for its peers before the job stops as hung (leave it "
                "out for no watchdog)."
            )
        if self.bind_core and not hasattr(os, "sched_setaffinity"):
            raise LaunchError(
                f"--bind-core needs Linux CPU affinity (os.sched_setaffinity); {sys.platform!r}"
                " has none. Drop --bind-core."
            )

    def _check_counts(self) -> None:
        if not 0 <= self.server_num < self.worker_num:
            raise LaunchError(
                f"--server-num {self.server_num} with {self.worker_num} processes: give"
                " 0..processes-1 servers (at least one worker trains)."
            )
        if self.server_num and (
            not 0 < self.local_server_num < self.local_worker_num
            or self.local_server_num * max(self.worker_num // self.local_worker_num, 1)
            != self.server_num
        ):
            raise LaunchError(
                f"--server-num {self.server_num} over {self.worker_num // self.local_worker_num}"
                f" node(s) of {self.local_worker_num} processes puts {self.local_server_num}"
                " on each: give a server count the nodes divide, leaving a worker on each node."
            )
        if self.worker_num < 1 or self.local_worker_num < 1:
            raise LaunchError(
                f"--worker-num {self.worker_num} and --local-worker-num {self.local_worker_num}"
                " must both be >= 1."
            )
        if self.worker_num % self.local_worker_num:
            raise LaunchError(
                f"--worker-num {self.worker_num} is not a multiple of --local-worker-num"
                f" {self.local_worker_num}: plait run starts the same number of workers on every"
                " node. Make the total a multiple of the per-node count."
            )
        if self.min_nodes is not None:
            self._check_elastic()
        if self.node_rank is not None and not 0 <= self.node_rank < self.num_nodes:
            raise LaunchError(
                f"--node-rank {self.node_rank} is outside 0..{self.num_nodes - 1} (a job of"
                f" {self.worker_num} workers, {self.local_worker_num} per node, has"
                f" {self.num_nodes} nodes)."
            )

    def _check_elastic(self) -> None:
        assert self.min_nodes is not None
        if not 1 <= self.min_nodes <= self.num_nodes:
            raise LaunchError(
                f"--nnodes {self.min_nodes}:{self.num_nodes}: the fewest nodes must be in"
                f" 1..{self.num_nodes} (the most). Pass MIN:MAX with 1 <= MIN <= MAX."
            )
        if self.elastic and self.node_rank is not None:
            raise LaunchError(
                f"--node-rank {self.node_rank} with --nnodes {self.nnodes_text}: an elastic job"
                " numbers its nodes at every rendezvous (a node that leaves frees its rank)."
                " Drop --node-rank; the node at --master-addr hosts the rendezvous."
            )
        if self.elastic and self.rank_table is not None:
            raise LaunchError(
                f"--rank-table with --nnodes {self.nnodes_text}: a rank table fixes every node"
                " and rank, an elastic job changes them. Drop one of the two."
            )

    @property
    def elastic(self) -> bool:
        """The job may train on fewer nodes than `num_nodes` (`--nnodes MIN:MAX`, MIN < MAX)."""
        return self.min_nodes is not None and self.min_nodes < self.num_nodes

    @property
    def nnodes_text(self) -> str:
        """`--nnodes` as given: `"2"` or `"1:2"`."""
        if self.elastic:
            return f"{self.min_nodes}:{self.num_nodes}"
        return str(self.num_nodes)

    @property
    def shape_text(self) -> str:
        """The flags every node of one job must agree on, as the rendezvous compares them."""
        if self.elastic:
            return f"--nnodes {self.nnodes_text} --local-worker-num {self.local_worker_num}"
        return (
            f"--worker-num {self.worker_num} --local-worker-num {self.local_worker_num}"
            f" ({self.num_nodes} nodes)"
        )

    def _check_network(self) -> None:
        if not 1 <= self.master_port <= 65535:
            raise LaunchError(f"--master-port {self.master_port} must be in 1..65535.")
        if not self.master_addr:
            raise LaunchError("--master-addr is empty; give node 0's host name or IP address.")

    def _check_program(self) -> None:
        if not self.program or not self.program[0]:
            raise LaunchError(
                "No program: give a script (`plait run train.py`), `-m module`, or --diagnose"
                " (plait's cluster check)."
            )
        if self.program[0] == "-m" and len(self.program) < 2:
            raise LaunchError("`-m` needs a module name: `plait run -m package.module`.")

    def check_program_exists(self) -> None:
        """Raise `LaunchError` if the script is not a file here (not run for `--emit`)."""
        if self.program[0] != "-m" and not os.path.isfile(self.program[0]):
            raise LaunchError(
                f"Script {self.program[0]!r} does not exist (looked from {os.getcwd()!r})."
                " Pass the path of a Python file, or `-m module`."
            )

    @property
    def num_nodes(self) -> int:
        """Nodes in the job."""
        return self.worker_num // self.local_worker_num

    @property
    def launcher_log_name(self) -> str:
        """`launcher.log`, or `launcher_node<r>.log` on several nodes: one `--log-dir` on a
        shared file system then holds every node's logs side by side."""
        if self.num_nodes == 1 or self.node_rank is None:
            return "launcher.log"
        return f"launcher_node{self.node_rank}.log"

    @property
    def first_rank(self) -> int | None:
        """Global rank of this node's local rank 0, when the node rank is known."""
        return None if self.node_rank is None else self.node_rank * self.local_worker_num

    @property
    def echoed_ranks(self) -> frozenset[int]:
        """Global ranks whose output reaches the console."""
        return frozenset(range(self.worker_num)) if self.join else frozenset(self.tail_ranks)

    @property
    def rendezvous_endpoint(self) -> str:
        """`host:port` of the rendezvous."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"
