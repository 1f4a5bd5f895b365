"""Run one node's workers under torch elastic's agent and report how they ended.

`run_job(config)` is `plait run` without the command line:

1. build a `LaunchConfig` for `torch.distributed.launcher.api` (rendezvous backend `plait`,
   which is c10d plus node ranks, see `plait.launch.rendezvous`) -> `build_launch_config()`
2. start `local_worker_num` workers through the exec shim (`_worker_exec.py`), each logging to
   `worker_<rank>.log` -> `worker_command()`, `plait.launch.logs.RankLogsSpecs`
3. let the agent supervise: when a worker exits non-zero or is killed, the agent stops the
   others (SIGTERM, then SIGKILL after `shutdown_timeout`) and restarts the group up to
   `max_restarts` times
4. turn torch's `ChildFailedError` into a `JobResult` naming the failing rank, its exit code or
   signal, and the last lines of its log -> `run_job()`, `format_failure()`; on several nodes,
   exchange the nodes' failures so every node names the job's first one
   (`plait.launch.node_reports`) -> `_across_nodes()`

`preview_worker_envs(config)` shows, without starting anything, the environment each local
worker will get (`plait run --dry-run`).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from plait.errors import LaunchError
from plait.launch.config import RunConfig
from plait.launch.environment import DEFAULT_MASTER_PORT
from plait.launch.hang import ENV_BUFFER, ENV_TIMEOUT, HANG_EXIT_CODE, RECORDED, summarize
from plait.launch.logs import LOG_LINE_PREFIX, RankLogsSpecs, last_lines, worker_log_name
from plait.launch.node_reports import NodeReport, format_across_nodes, gather, peer_address, publish
from plait.launch.rendezvous import BACKEND_NAME, StoreKeeper, register_backend

__all__ = [
    "JobResult",
    "WorkerFailure",
    "WorkerPreview",
    "build_launch_config",
    "format_failure",
    "preview_worker_envs",
    "run_job",
    "worker_command",
]

logger = logging.getLogger(__name__)

_SHIM = str(Path(__file__).with_name("_worker_exec.py"))
TAIL_LINES = 20
ELASTIC_LAST_CALL = 5
"""Seconds an elastic rendezvous waits for more nodes once it has `--nnodes` MIN."""
"""Lines of a failed worker's log quoted in the failure report."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerFailure:
    """One worker that did not exit cleanly."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on its node."""
    pid: int
    """Process id."""
    exitcode: int
    """Exit status; negative for a signal (-9 is SIGKILL)."""
    log_file: str | None
    """Its log file, when known."""
    log_tail: tuple[str, ...] = ()
    """Last lines of its log."""
    server: bool = False
    """A parameter server (``--server-num``), not a training worker."""

    @property
    def role(self) -> str:
        """"worker" or "parameter server", as reports say it."""
        return "parameter server" if self.server else "worker"

    @property
    def how(self) -> str:
        """Say how it ended: "exit code 3" or "signal SIGKILL (9)"."""
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = "unknown signal"
            return f"signal {name} ({-self.exitcode})"
        if self.exitcode == HANG_EXIT_CODE:
            return (
                f"exit code {self.exitcode} (hung: its report is in its log and hang_rank<r>.txt)"
            )
        return f"exit code {self.exitcode}"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobResult:
    """How this node's part of the job ended."""

    exit_code: int
    """What `plait run` exits with: 0, the root failure's exit code, or 128 + its signal."""
    log_dir: str
    """Where the logs are."""
    failures: tuple[WorkerFailure, ...] = field(default=())
    """The root-cause failure first, then workers the launcher stopped because of it."""
    across_nodes: tuple[str, ...] = ()
    """Report lines from the other nodes: the job's first failure when it was elsewhere, the
    nodes that sent nothing (several nodes only)."""


def worker_command(config: RunConfig) -> tuple[str, tuple[str, ...]]:
    """Entrypoint and arguments the agent starts for every local worker."""
    options = ["--merge-stderr", "--env-default", "PYTHONUNBUFFERED=1"]
    options += ["--env", f"PLAIT_LOG_DIR={config.log_dir or ''}"]
    if config.rank_table:
        options += ["--env", f"PLAIT_RANK_TABLE={os.path.abspath(config.rank_table)}"]
    if config.server_num:
        options += ["--env", f"PLAIT_SERVER_NUM={config.server_num}"]
        options += ["--env", f"PLAIT_LOCAL_SERVER_NUM={config.local_server_num}"]
    if config.checkpoint_dir:
        options += ["--env", f"PLAIT_CHECKPOINT_DIR={os.path.abspath(config.checkpoint_dir)}"]
    ifname = _interface_to(config.master_addr, config.master_port)
    if ifname is not None:  # gloo binds the interface it reaches node 0 through (a default)
        options += ["--env-default", f"GLOO_SOCKET_IFNAME={ifname}"]
    if config.hang_timeout is not None:
        options += ["--env", f"{ENV_TIMEOUT}={config.hang_timeout:g}"]
        options += ["--env", f"{ENV_BUFFER}={RECORDED}"]
    if config.bind_core:
        options.append("--bind-core")
    else:
        # Like torchrun: without a default, every worker's OpenMP pool would use every core.
        threads = max(1, (os.cpu_count() or 1) // config.local_worker_num)
        options += ["--env-default", f"OMP_NUM_THREADS={threads}"]
    return config.python, (_SHIM, *options, "--", config.python, *config.program)


def effective_node_rank(config: RunConfig) -> int | None:
    """The node rank, which is 0 for a one-node job even when not given."""
    return 0 if config.num_nodes == 1 and not config.elastic else config.node_rank


def build_launch_config(
    config: RunConfig, logs_specs: RankLogsSpecs, keeper: StoreKeeper | None = None
) -> LaunchConfig:
    """The torch elastic `LaunchConfig` for `config` (c10d rendezvous through `plait`);
    `keeper` receives the rendezvous store."""
    register_backend()
    timeout = math.ceil(config.cluster_timeout)
    rdzv_configs: dict[str, object] = {
        "join_timeout": timeout,
        "timeout": timeout,
        "read_timeout": timeout,
        "plait_shape": config.shape_text,
    }
    if config.elastic:
        # once MIN nodes are in, wait this long for the others before starting (torch: 30 s)
        rdzv_configs["last_call_timeout"] = ELASTIC_LAST_CALL
    if keeper is not None:
        rdzv_configs["plait_store_keeper"] = keeper
    node_rank = effective_node_rank(config)
    if node_rank is not None:
        rdzv_configs["plait_node_rank"] = node_rank
        rdzv_configs["is_host"] = node_rank == 0
    return LaunchConfig(
        min_nodes=config.min_nodes or config.num_nodes,
        max_nodes=config.num_nodes,
        nproc_per_node=config.local_worker_num,
        logs_specs=logs_specs,
        run_id=config.run_id,
        rdzv_endpoint=config.rendezvous_endpoint,
        rdzv_backend=BACKEND_NAME,
        rdzv_configs=rdzv_configs,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=_local_addr(config.master_addr, config.master_port),
        log_line_prefix_template=LOG_LINE_PREFIX,
        shutdown_timeout=config.shutdown_timeout,
    )


def _local_addr(master_addr: str, master_port: int = DEFAULT_MASTER_PORT) -> str | None:
    """The address this node advertises to the others (torch's default is its FQDN, which may
    not resolve, or resolve to another interface, in a sandbox or a network namespace).

    On loopback every node is this machine: the same address. Elsewhere the address of the
    interface this node reaches node 0 through (the kernel's route to it: nothing is sent),
    which the other nodes can reach too; None (torch's FQDN) where there is no route yet."""
    try:
        if ipaddress.ip_address(master_addr).is_loopback:
            return master_addr
    except ValueError:
        if master_addr == "localhost":
            return "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, master_port))  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _interface_to(master_addr: str, master_port: int) -> str | None:
    """The network interface this node reaches a remote node 0 through, for gloo: left to
    itself gloo binds the interface its host name resolves to, which on a host with several
    (or in a network namespace) may be one the other nodes cannot reach. None on loopback
    (one machine), where the route is unknown, or off Linux."""
    local = _local_addr(master_addr, master_port)
    if local is None or ipaddress.ip_address(local).is_loopback or ":" in local:
        return None
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(
                        s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15])
                    )  # SIOCGIFADDR: the interface's IPv4 address
                except OSError:
                    continue  # no IPv4 address on it
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except (ImportError, OSError):
        return None
    return None


def run_job(config: RunConfig) -> JobResult:
    """Start this node's workers, supervise them, and report how they ended.

    Raises:
        LaunchError: the rendezvous failed (timeout, unreachable host, clashing node ranks).
    """
    if config.log_dir is None:
        raise LaunchError("run_job needs RunConfig.log_dir; plait run makes a temporary one.")
    logs = RankLogsSpecs(config.log_dir, config.echoed_ranks)
    entrypoint, args = worker_command(config)
    logger.info(
        "starting %d of %d workers (node %s of %d), rendezvous %s, logs in %s",
        config.local_worker_num, config.worker_num, _node_text(config), config.num_nodes,
        config.rendezvous_endpoint, config.log_dir,
    )  # fmt: skip
    keeper = StoreKeeper()
    if config.elastic:
        # torch shares the rendezvous store with the workers, their keys prefixed by the
        # restart count; a group re-formed for a joining node keeps its count (and a node that
        # joined late has its own), so the new group reads the old one's addresses and never
        # connects. Unshared, rank 0 opens a fresh store for every formation (torchrun's
        # behaviour before 2.4). Read by torch's rendezvous in this (the launcher's) process.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        elastic_launch(build_launch_config(config, logs, keeper), entrypoint)(*args)
    except ChildFailedError as e:
        failures = tuple(
            _failure(rank, f, logs, server=_serves(config, rank)) for rank, f in e.failures.items()
        )
        stamp = min(float(f.timestamp) for f in e.failures.values())
        return JobResult(
            exit_code=_exit_code(failures[0].exitcode), log_dir=config.log_dir,
            failures=failures, across_nodes=_across_nodes(config, keeper, failures[0], stamp),
        )  # fmt: skip
    except SignalException as e:
        logger.warning("received %s; the workers were stopped", e.sigval.name)
        return JobResult(exit_code=128 + int(e.sigval), log_dir=config.log_dir)
    return JobResult(exit_code=0, log_dir=config.log_dir)


def _across_nodes(
    config: RunConfig, keeper: StoreKeeper, root: WorkerFailure, timestamp: float
) -> tuple[str, ...]:
    """Exchange this node's failure with the other nodes'; the lines that name the job's."""
    if config.num_nodes == 1 or config.node_rank is None or keeper.store is None:
        return ()
    mine = NodeReport(
        node_rank=config.node_rank, rank=root.rank, how=root.how, timestamp=timestamp,
        log_file=root.log_file, tail=root.log_tail, lost_peer=peer_address(root.log_tail),
    )  # fmt: skip
    try:
        publish(keeper.store, config.run_id, mine)
        others = gather(keeper.store, config.run_id, config.node_rank, config.num_nodes)
    except (RuntimeError, OSError) as e:  # node 0, which holds the store, is gone
        return (
            f"plait run: could not read the other nodes' reports from node 0's store ({e});"
            " node 0 is gone (killed, or its network lost): look there first.",
        )
    return tuple(format_across_nodes(mine, others))


def _node_text(config: RunConfig) -> str:
    rank = effective_node_rank(config)
    return "auto" if rank is None else str(rank)


def _serves(config: RunConfig, rank: int) -> bool:
    """Whether global rank ``rank`` is a parameter server (each node's last local ranks)."""
    local = config.local_worker_num
    return bool(config.local_server_num) and rank % local >= local - config.local_server_num


def _failure(
    rank: int, failure: ProcessFailure, logs: RankLogsSpecs, *, server: bool = False
) -> WorkerFailure:
    path = logs.paths.get(rank)
    return WorkerFailure(
        rank=rank, local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode,
        log_file=path, log_tail=tuple(last_lines(path, TAIL_LINES)) if path else (),
        server=server,
    )  # fmt: skip


def _exit_code(exitcode: int) -> int:
    return exitcode if exitcode > 0 else 128 + (-exitcode or 1)


def format_failure(result: JobResult) -> str:
    """A report of a failed job for people: the failing rank, how, and its last log lines."""
    if not result.failures:
        return f"plait run: job ended with exit code {result.exit_code}; logs in {result.log_dir}"
    root, *others = result.failures
    lines = [
        f"plait run: {root.role} rank {root.rank} (local rank {root.local_rank}, pid {root.pid})"
        f" failed with {root.how}.",
    ]
    if others:
        stopped = ", ".join(f"{f.rank} ({f.how})" for f in others)
        lines.append(f"plait run: stopped the other workers on this node: ranks {stopped}.")
    reports = sorted(Path(result.log_dir).glob("hang_rank*.txt")) if result.log_dir else []
    if reports:  # a hang: where each rank was says more than the last lines of one log
        lines.append(f"plait run: the job hung; each rank's report in brief ({result.log_dir}):")
        lines += [f"    {line}" for line in summarize(p.read_text() for p in reports)]
    elif root.log_file:
        lines.append(f"plait run: last {len(root.log_tail)} lines of {root.log_file}:")
        lines += [f"    {line}" for line in root.log_tail]
    lines += result.across_nodes
    lines.append(f"plait run: exit code {result.exit_code}; all logs in {result.log_dir}")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerPreview:
    """What `--dry-run` shows for one local worker."""

    local_rank: int
    """Rank on this node."""
    env: dict[str, str]
    """Variables the launcher sets for the worker (on top of the launcher's own environment)."""
    log_file: str
    """Where its output will go."""
    command: tuple[str, ...]
    """The program the worker runs."""


def preview_worker_envs(config: RunConfig) -> list[WorkerPreview]:
    """What each local worker will get, for `--dry-run` (nothing is started).

    Values only known at rendezvous (the store port, and the ranks when the node rank is
    automatic) are shown in angle brackets.
    """
    node_rank = effective_node_rank(config)
    _, args = worker_command(config)
    previews = []
    for local_rank in range(config.local_worker_num):
        rank = (
            "<set at rendezvous>"
            if node_rank is None
            else str(node_rank * config.local_worker_num + local_rank)
        )
        env = {
            "RANK": rank, "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(config.worker_num),
            "LOCAL_WORLD_SIZE": str(config.local_worker_num),
            "GROUP_RANK": "<set at rendezvous>" if node_rank is None else str(node_rank),
            "GROUP_WORLD_SIZE": str(config.num_nodes),
            "ROLE_RANK": rank, "ROLE_WORLD_SIZE": str(config.worker_num),
            "ROLE_NAME": "default_role",
            "MASTER_ADDR": "<rendezvous host, set at rendezvous>",
            "MASTER_PORT": "<free port, set at rendezvous>",
            "TORCHELASTIC_RUN_ID": config.run_id, "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }  # fmt: skip
        env.update(_shim_env(args))
        name = worker_log_name(int(rank), 0) if rank.isdigit() else "worker_<rank>.log"
        previews.append(WorkerPreview(
            local_rank=local_rank, env=env,
            log_file=os.path.join(config.log_dir or "<temporary log dir>", name),
            command=args[args.index("--") + 1 :],
        ))  # fmt: skip
    return previews


def _shim_env(args: tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for i, arg in enumerate(args[: args.index("--")]):
        if arg in ("--env", "--env-default"):
            key, _, value = args[i + 1].partition("=")
            env[key] = value if arg == "--env" else os.environ.get(key, value)
    return env
