"""`init()`: one idempotent call that joins this process to the job's default process group.

`init()` reads the launcher's environment (see `plait.launch.environment`), picks a backend
(NCCL when CUDA is available, gloo otherwise), sets the collective timeout and calls
`torch.distributed.init_process_group` once. Without any launcher it makes a one-process
world, so the same script runs alone, under `plait run`, torchrun, mpirun or srun.

How the store is reached:

| launcher | init method |
|---|---|
| `plait run`, torchrun | `env://` (the elastic agent's store, `MASTER_ADDR`/`MASTER_PORT`) |
| MPI, Slurm, rank table | `tcp://MASTER_ADDR:MASTER_PORT`; rank 0 hosts the store |
| none | a `FileStore` in a fresh temporary file |

The one constraint users trip on: under MPI or Slurm on several nodes, `MASTER_ADDR` must be
rank 0's host, reachable from every rank (it defaults to 127.0.0.1 for MPI).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from plait.errors import LaunchError
from plait.launch.environment import LauncherKind, ProcessEnv, detect_environment
from plait.launch.hang import (
    ENV_BUFFER,
    RECORDED,
    HangWatchdog,
    record_collectives,
    timeout_from,
)

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "World", "init"]

logger = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""How long a collective may wait for its peers before it fails, naming the operation."""

Backend = Literal["nccl", "gloo"]


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    """This process's place in the job, after `init()`.

    Example:
        >>> World(rank=1, world_size=4, local_rank=1, local_world_size=2, node_rank=0,
        ...       num_nodes=2, backend="gloo", device="cpu", launcher="torchrun").is_main
        False
    """

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this node."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node, 0..num_nodes-1."""
    num_nodes: int
    """Number of nodes."""
    backend: str
    """Process-group backend: "nccl" or "gloo" (or what the caller initialised)."""
    device: str
    """Device this process computes on: "cuda:<i>" or "cpu"."""
    launcher: str
    """Which launcher's environment was read ("torchrun", "openmpi", "single", ...)."""
    role: Literal["worker", "server"] = "worker"
    """"server" only inside plait (a parameter server's ranks never return from ``init``)."""
    server_num: int = 0
    """Parameter servers beside the workers (``plait run --server-num``, ``PLAIT_SERVER_NUM``);
    ``world_size`` counts the workers only: they form the default process group."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs and writes files."""
        return self.rank == 0


# The default process group is process-wide state in torch itself; caching the World that
# describes it is what makes init() idempotent (a second init() returns it). Nothing else in
# plait keeps global state; what the runtime sees of the world (real or simulated ranks) is
# plait.comm.world.current_world().
_world: World | None = None


_watchdog: HangWatchdog | None = None
"""The hang watchdog init() started (``hang_timeout``), stopped with the group at exit."""


def init(
    *,
    backend: Backend | None = None,
    timeout: timedelta | float = DEFAULT_COLLECTIVE_TIMEOUT,
    hang_timeout: timedelta | float | None = None,
) -> World:
    """Join the job's default process group and return this process's `World`.

    Idempotent: a second call returns the same `World` without re-initialising. If the caller
    already initialised `torch.distributed`, that group is described, not replaced.

    Args:
        backend: "nccl" or "gloo"; default NCCL when CUDA is available, gloo otherwise.
        timeout: collective timeout (a `timedelta`, or seconds).
        hang_timeout: seconds a collective may wait for the other ranks before every rank
            reports where it is (the one waited for too) and exits (:mod:`plait.launch.hang`);
            default ``PLAIT_HANG_TIMEOUT`` (set by ``plait run --hang-timeout``), else no
            watchdog.

    Returns:
        The `World`: rank, world size, local rank and size, node, backend, device.

    Raises:
        LaunchError: the launcher environment is malformed, or NCCL was asked for without
            enough GPUs.
    """
    global _world
    import torch.distributed as dist

    if _world is not None and dist.is_initialized():
        return _world
    hang = timeout_from(hang_timeout)
    penv = detect_environment()
    if dist.is_initialized():
        _world = _describe_existing(penv)
        _watch(_world, hang)
        return _world
    chosen = resolve_backend(backend, penv)
    roles = server_roles(penv)
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if roles is not None and roles.serves(penv):
        _serve(penv, roles, wait)  # a parameter server: never returns
    device = _select_device(chosen, penv)
    if hang is not None:
        record_collectives()  # before the groups exist: each records from its creation
    if roles is not None:
        _init_worker_groups(chosen, penv, wait, roles)
        penv = roles.worker_env(penv)  # the world the script sees: the workers alone
    else:
        _init_process_group(chosen, penv, wait)
    servers = 0 if roles is None else roles.servers
    # The group init() made is destroyed at exit, before the interpreter tears down: left to
    # process teardown, a gloo group's threads can outlive it and abort the process
    # ("terminate called without an active exception", exit code 134) after a clean run.
    atexit.register(_leave)
    _world = _make_world(penv, chosen, device, servers)
    _watch(_world, hang)
    logger.info("joined %s", _world)
    return _world


SERVER_NUM_VARS = ("PLAIT_SERVER_NUM", "MS_SERVER_NUM")
"""Where a launcher says how many of the job's ranks are parameter servers (the last ones)."""


def server_count(penv: ProcessEnv) -> int:
    """Parameter servers among the job's ranks (0: none), from ``PLAIT_SERVER_NUM``."""
    for var in SERVER_NUM_VARS:
        text = os.environ.get(var)
        if text is None or text == "":
            continue
        try:
            count = int(text)
        except ValueError:
            count = -1
        if not 0 <= count < penv.world_size:
            raise LaunchError(
                f"{var}={text!r} on rank {penv.rank}: give the number of parameter servers, "
                f"0..{penv.world_size - 1} (the job has {penv.world_size} processes and at "
                "least one must be a worker)"
            )
        return count
    return 0


LOCAL_SERVER_NUM_VAR = "PLAIT_LOCAL_SERVER_NUM"
"""Parameter servers on each node (its last local ranks), where a job spans several nodes;
unset: the job's last ``PLAIT_SERVER_NUM`` ranks."""


@dataclass(frozen=True, slots=True)
class ServerRoles:
    """Which ranks of a parameter-server job serve: the last ``local`` ranks of every node of
    ``per_node`` processes (``local`` 0: the job's last ``servers`` ranks). Workers and servers
    are numbered apart: workers ``0..W-1`` and servers ``W..W+S-1``, each in rank order (the
    group of workers and servers, and the workers' default group, use these numbers)."""

    servers: int
    local: int = 0
    per_node: int = 1

    def serves(self, penv: ProcessEnv) -> bool:
        if not self.local:
            return penv.rank >= penv.world_size - self.servers
        return penv.rank % self.per_node >= self.per_node - self.local

    def ps_rank(self, penv: ProcessEnv) -> int:
        """This rank's number in the group of workers and servers."""
        if not self.local:
            return penv.rank
        node, local = divmod(penv.rank, self.per_node)
        workers_a_node = self.per_node - self.local
        if local < workers_a_node:
            return node * workers_a_node + local
        return penv.world_size - self.servers + node * self.local + local - workers_a_node

    def worker_env(self, penv: ProcessEnv) -> ProcessEnv:
        """A worker's place among the workers alone (rank, world size, node's share)."""
        return dataclasses.replace(
            penv, rank=self.ps_rank(penv), world_size=penv.world_size - self.servers,
            local_world_size=penv.local_world_size - self.local,
        )  # fmt: skip


def server_roles(penv: ProcessEnv) -> ServerRoles | None:
    """The job's :class:`ServerRoles` from ``PLAIT_SERVER_NUM`` and
    ``PLAIT_LOCAL_SERVER_NUM`` (None: no parameter server)."""
    servers = server_count(penv)
    if not servers:
        return None
    text = os.environ.get(LOCAL_SERVER_NUM_VAR) or ""
    if not text:
        return ServerRoles(servers)
    per_node = penv.local_world_size
    nodes = penv.world_size // max(per_node, 1)
    local = int(text) if text.isdigit() else -1
    if not 0 < local < per_node or penv.world_size % per_node or local * nodes != servers:
        raise LaunchError(
            f"{LOCAL_SERVER_NUM_VAR}={text!r} with PLAIT_SERVER_NUM={servers} on rank "
            f"{penv.rank} ({penv.world_size} processes, {per_node} a node): give the servers "
            f"on each node, 1..{per_node - 1}, with PLAIT_SERVER_NUM that times the nodes; or "
            f"leave {LOCAL_SERVER_NUM_VAR} unset for the job's last ranks to serve"
        )
    return ServerRoles(servers, local, per_node)


def _ps_store(penv: ProcessEnv, timeout: timedelta) -> Any:
    """The job's store, for a parameter-server job's two groups."""
    import torch.distributed as dist

    store = _attempt_store(penv, timeout) if penv.launcher is LauncherKind.TORCHRUN else None
    if store is not None:
        return store
    rendezvous = dist.rendezvous(_init_method(penv), penv.rank, penv.world_size, timeout=timeout)
    store, _, _ = next(rendezvous)
    return store


def _init_method(penv: ProcessEnv) -> str:
    """Where the ranks meet: torch's elastic agent (``env://``) or rank 0's store (``tcp://``)."""
    if penv.launcher is LauncherKind.TORCHRUN:
        return "env://"
    return f"tcp://{_bracket(penv.master_addr)}:{penv.master_port}"


def _init_worker_groups(
    backend: Backend, penv: ProcessEnv, timeout: timedelta, roles: ServerRoles
) -> None:
    """A worker of a parameter-server job: the default group of the workers alone, then the
    group of workers and servers (:mod:`plait.comm.ps`)."""
    import torch.distributed as dist

    from plait.comm import ps

    store = _ps_store(penv, timeout)
    workers = penv.world_size - roles.servers
    dist.init_process_group(
        backend, store=dist.PrefixStore("plait.workers/", store), rank=roles.ps_rank(penv),
        world_size=workers, timeout=timeout,
    )  # fmt: skip
    ps.join(store, roles.ps_rank(penv), workers, roles.servers, timeout)


def _serve(penv: ProcessEnv, roles: ServerRoles, timeout: timedelta) -> None:
    """A parameter server's life: join the workers' group, answer them until they leave,
    exit (the script's code after ``plait.init()`` never runs on a server)."""
    from plait.comm import ps
    from plait.ps.server import serve

    store = _ps_store(penv, timeout)
    workers = penv.world_size - roles.servers
    group = ps.join(store, roles.ps_rank(penv), workers, roles.servers, timeout)
    serve(group)
    raise SystemExit(0)


def _watch(world: World, hang: float | None) -> None:
    """Start the hang watchdog (once), writing its report where ``plait run`` keeps logs."""
    global _watchdog
    if hang is None or _watchdog is not None:
        return
    if ENV_BUFFER not in os.environ:
        logger.warning(
            "hang_timeout: torch.distributed was initialised before plait.init() without "
            "%s set, so its groups record no collectives and the watchdog sees none; set "
            "%s=%d before init_process_group",
            ENV_BUFFER,
            ENV_BUFFER,
            RECORDED,
        )
    report_dir = os.environ.get("PLAIT_LOG_DIR") or None
    _watchdog = HangWatchdog(world.rank, hang, report_dir=report_dir).start()


_LEAVE_BARRIER = timedelta(seconds=10)
"""How long a gloo rank waits at exit for the others before destroying its groups anyway."""


def _leave() -> None:
    """Destroy the default group if it is still there.

    On gloo the ranks first meet at a bounded barrier (``monitored_barrier``, at most
    ``_LEAVE_BARRIER``): a rank that destroys its groups while a peer's last operations are
    still in flight can leave gloo's worker threads holding work that dies with the
    interpreter, and the process aborts after a clean run ("terminate called without an
    active exception", exit code 134; seen once in a loaded test run). A peer that never
    comes (it failed) costs at most the bound; nothing waits unboundedly.
    """
    global _world, _watchdog
    import torch.distributed as dist

    _world = None
    if _watchdog is not None:  # leaving is not a hang
        _watchdog.stop()
        _watchdog = None
    if not dist.is_initialized():
        return
    if getattr(sys, "last_value", None) is None:
        from plait.comm import ps

        ps.leave()  # a parameter-server job's worker says goodbye to the servers
    else:
        # The script died of an exception (the interpreter sets sys.last_value before atexit
        # runs): its peers may be blocked in a collective waiting for this rank, so meeting
        # them at a barrier would wait on them while they wait on us (a dead node's peers
        # hung this way). Leave at once: the closed sockets tell the peers.
        return
    try:
        if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            dist.monitored_barrier(timeout=_LEAVE_BARRIER, wait_all_ranks=True)
    except Exception as e:  # a peer failed or left: destroy anyway
        logger.debug("barrier at exit: %s", e)
    try:
        dist.destroy_process_group()
    except Exception as e:  # exiting anyway: say so, do not mask the exit status
        logger.warning("destroying the process group at exit failed: %s", e)


def resolve_backend(backend: str | None, penv: ProcessEnv) -> Backend:
    """Pick the backend: the caller's, else NCCL with CUDA, else gloo."""
    import torch

    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise LaunchError(
            f"init(backend={backend!r}) is not supported; use 'nccl' (GPUs) or 'gloo' (CPUs),"
            " or None to choose by CUDA availability."
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise LaunchError(
            f"init(backend='nccl') on rank {penv.rank}, but CUDA is not available here."
            " Use backend='gloo' or None."
        )
    return backend  # type: ignore[return-value]


def _select_device(backend: Backend, penv: ProcessEnv) -> str:
    if backend != "nccl":
        return "cpu"
    import torch

    count = torch.cuda.device_count()
    if penv.device_index >= count:
        raise LaunchError(
            f"Rank {penv.rank} (local rank {penv.local_rank}) wants GPU {penv.device_index} but"
            f" this node has {count}. Start at most {count} workers per node"
            " (--local-worker-num), or use backend='gloo'."
        )
    torch.cuda.set_device(penv.device_index)
    return f"cuda:{penv.device_index}"


def _attempt_store(penv: ProcessEnv, timeout: timedelta) -> Any:
    """The elastic agent's store, with keys scoped to this restart attempt (None when the
    workers do not use the agent's store).

    torch's agent keeps one TCP store for every restart of the worker group, and
    ``init_process_group("env://")`` uses it unprefixed: after a restart, a rank can read the
    address a peer published in the previous attempt and fail to connect to it. Scoping the
    keys by ``TORCHELASTIC_RESTART_COUNT`` gives every attempt a clean namespace.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        penv.master_addr, penv.master_port, penv.world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"plait.attempt{attempt}/", store)


def _init_process_group(backend: Backend, penv: ProcessEnv, timeout: timedelta) -> None:
    import torch.distributed as dist

    if penv.launcher is LauncherKind.SINGLE:
        # A FileStore needs no port, so a lone process can never collide with another job.
        fd, path = tempfile.mkstemp(prefix="plait-store-")
        os.close(fd)
        store = dist.FileStore(path, 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    init_method = _init_method(penv)
    if penv.launcher is LauncherKind.TORCHRUN:
        store = _attempt_store(penv, timeout)
        if store is not None:
            logger.debug("rank %d: init_process_group(%s, agent store)", penv.rank, backend)
            dist.init_process_group(
                backend, store=store, rank=penv.rank, world_size=penv.world_size,
                timeout=timeout,
            )  # fmt: skip
            return
    logger.debug("rank %d: init_process_group(%s, %s)", penv.rank, backend, init_method)
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=penv.rank, world_size=penv.world_size,
            timeout=timeout,
        )  # fmt: skip
    except (RuntimeError, TimeoutError, ValueError) as e:
        raise LaunchError(
            f"Rank {penv.rank} of {penv.world_size} ({penv.launcher} environment) could not join"
            f" the process group at {init_method}: {e}. Check MASTER_ADDR/MASTER_PORT: rank 0's"
            " host and a free port, reachable from every rank."
        ) from e


def _make_world(penv: ProcessEnv, backend: str, device: str, servers: int = 0) -> World:
    num_nodes = max(-(-penv.world_size // max(penv.local_world_size, 1)), penv.node_rank + 1)
    return World(
        rank=penv.rank, world_size=penv.world_size, local_rank=penv.local_rank,
        local_world_size=penv.local_world_size, node_rank=penv.node_rank, num_nodes=num_nodes,
        backend=backend, device=device, launcher=str(penv.launcher), server_num=servers,
    )  # fmt: skip


def _describe_existing(penv: ProcessEnv) -> World:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    local = penv if (penv.rank, penv.world_size) == (rank, world_size) else None
    return World(
        rank=rank, world_size=world_size,
        local_rank=local.local_rank if local else 0,
        local_world_size=local.local_world_size if local else 1,
        node_rank=local.node_rank if local else rank,
        num_nodes=max(world_size // (local.local_world_size if local else 1), 1),
        backend=backend, device=f"cuda:{local.device_index if local else 0}"
        if backend == "nccl" else "cpu",
        launcher=str(penv.launcher) if local else "external",
    )  # fmt: skip


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
