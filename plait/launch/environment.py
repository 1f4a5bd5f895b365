"""Environment adapters: who am I in the job, read from the variables a launcher sets.

Each adapter is a pure function from an environment mapping to a `ProcessEnv` (or None when
its launcher did not start this process). `detect_environment` tries them in this order and
takes the first that applies:

| launcher | recognised by | rank, size, local rank, local size (node) |
|---|---|---|
| `plait run`, torchrun | `RANK`, `WORLD_SIZE` | same, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` |
| rank table | `RANK_ID` + `RANK_TABLE_FILE` | `RANK_ID`; the rest from the table |
|   (MindSpore style) | or `PLAIT_RANK_TABLE` | |
| OpenMPI `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}` |
| MVAPICH2 | `MV2_COMM_WORLD_RANK` | `MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}` |
| MPICH, Intel MPI | `PMI_RANK`, `PMI_SIZE` | same, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` |
| Slurm `srun` | `SLURM_PROCID`, | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_LOCALID`, |
|   | `SLURM_STEP_NUM_TASKS` | `SLURM_STEP_TASKS_PER_NODE` (`SLURM_NODEID`) |
| nothing | - | a one-process world |

Where a launcher gives no node index, it is `rank // local_world_size` (processes placed by
node, the default of every launcher above). MPI and Slurm say nothing about where the
`torch.distributed` store lives: `MASTER_ADDR` and `MASTER_PORT` are read when set; otherwise
the address is 127.0.0.1 (MPI; the first host of `SLURM_STEP_NODELIST` under Slurm; the first
server under a rank table) and the port is `DEFAULT_MASTER_PORT` (29500). For a multi-node MPI
job, pass `-x MASTER_ADDR=<rank 0's host>` to mpirun.

Slurm needs `SLURM_STEP_NUM_TASKS`, which only `srun` sets: inside an `sbatch` script without
`srun`, `SLURM_PROCID=0` and `SLURM_NTASKS=N` describe the allocation, not this process, and
reading them would make one process wait forever for N-1 others.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from plait.errors import LaunchError
from plait.launch.rank_table import load_rank_table

__all__ = [
    "DEFAULT_MASTER_PORT",
    "LauncherKind",
    "ProcessEnv",
    "detect_environment",
    "from_mpich",
    "from_mvapich",
    "from_openmpi",
    "from_rank_table",
    "from_slurm",
    "from_torchrun",
]

DEFAULT_MASTER_PORT = 29500
"""Store port used when the launcher sets none (MPI, Slurm, rank table), as torchrun's."""

DEFAULT_MASTER_ADDR = "127.0.0.1"

RANK_TABLE_VARS = ("PLAIT_RANK_TABLE", "RANK_TABLE_FILE")


class LauncherKind(StrEnum):
    """Which launcher's environment described this process."""

    TORCHRUN = "torchrun"
    RANK_TABLE = "rank_table"
    OPENMPI = "openmpi"
    MVAPICH = "mvapich"
    MPICH = "mpich"
    SLURM = "slurm"
    SINGLE = "single"


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessEnv:
    """This process's place in the job, as its launcher described it."""

    launcher: LauncherKind
    """Adapter that produced this description."""
    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this node."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node."""
    master_addr: str
    """Host of the `torch.distributed` store (rank 0's host)."""
    master_port: int
    """Port of the store."""
    device_index: int
    """Accelerator index for this process (the local rank unless a rank table says otherwise)."""
    uses_torchelastic_store: bool = False
    """True under torchrun/`plait run`: the agent hosts the store; init through `env://`."""

    def __post_init__(self) -> None:
        where = f"the {self.launcher} environment"
        if self.world_size < 1:
            raise LaunchError(f"World size {self.world_size} from {where} must be >= 1.")
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(
                f"Rank {self.rank} from {where} is outside 0..{self.world_size - 1}. The launcher"
                " variables disagree; check that the job was started by one launcher."
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError(
                f"Local rank {self.local_rank} from {where} is outside"
                f" 0..{self.local_world_size - 1}."
            )
        if not 1 <= self.master_port <= 65535:
            raise LaunchError(f"MASTER_PORT {self.master_port} must be in 1..65535.")


Env = Mapping[str, str]


def detect_environment(env: Env | None = None) -> ProcessEnv:
    """Describe this process from `env` (default: `os.environ`), trying each adapter in turn.

    Raises:
        LaunchError: a launcher's variables are present but malformed or inconsistent.
    """
    env = os.environ if env is None else env
    for adapter in ADAPTERS:
        found = adapter(env)
        if found is not None:
            return found
    return ProcessEnv(
        launcher=LauncherKind.SINGLE, rank=0, world_size=1, local_rank=0, local_world_size=1,
        node_rank=0, master_addr=DEFAULT_MASTER_ADDR, master_port=DEFAULT_MASTER_PORT,
        device_index=0,
    )  # fmt: skip


def from_torchrun(env: Env) -> ProcessEnv | None:
    """Adapter for `plait run`, torchrun and Kubeflow's PyTorchJob (one process per pod)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", 1 if "LOCAL_RANK" not in env else world_size)
    node_rank = _int(env, "GROUP_RANK", rank // max(local_world_size, 1))
    return ProcessEnv(
        launcher=LauncherKind.TORCHRUN, rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=local_world_size, node_rank=node_rank,
        master_addr=env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        device_index=_table_device(env, rank, local_rank),
        uses_torchelastic_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )  # fmt: skip


def from_rank_table(env: Env) -> ProcessEnv | None:
    """Adapter for MindSpore-style rank-table launches (`RANK_ID` + a table file)."""
    path = _rank_table_path(env)
    if path is None or "RANK_ID" not in env:
        return None
    table = load_rank_table(path, check_hosts=False)
    rank = _int(env, "RANK_ID")
    node_rank, local_rank, device_id = table.locate(rank)
    return ProcessEnv(
        launcher=LauncherKind.RANK_TABLE, rank=rank, world_size=table.world_size,
        local_rank=local_rank, local_world_size=table.local_world_size, node_rank=node_rank,
        master_addr=env.get("MASTER_ADDR", table.servers[0].server_id),
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        device_index=_int(env, "DEVICE_ID", device_id),
    )  # fmt: skip


def _mpi_adapter(kind: LauncherKind, prefix: str) -> Callable[[Env], ProcessEnv | None]:
    def adapter(env: Env) -> ProcessEnv | None:
        if f"{prefix}_RANK" not in env:
            return None
        rank, world_size = _int(env, f"{prefix}_RANK"), _int(env, f"{prefix}_SIZE")
        local_rank = _int(env, f"{prefix}_LOCAL_RANK", 0)
        local_world_size = _int(env, f"{prefix}_LOCAL_SIZE", 1)
        return _derived(kind, env, rank, world_size, local_rank, local_world_size)

    adapter.__name__ = f"from_{kind}"
    adapter.__doc__ = f"Adapter for {kind} (`{prefix}_*` variables)."
    return adapter


from_openmpi = _mpi_adapter(LauncherKind.OPENMPI, "OMPI_COMM_WORLD")
from_mvapich = _mpi_adapter(LauncherKind.MVAPICH, "MV2_COMM_WORLD")


def from_mpich(env: Env) -> ProcessEnv | None:
    """Adapter for MPICH's and Intel MPI's Hydra launcher (PMI variables)."""
    if "PMI_RANK" not in env or "PMI_SIZE" not in env:
        return None
    rank, world_size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    local_rank = _int(env, "MPI_LOCALRANKID", 0)
    local_world_size = _int(env, "MPI_LOCALNRANKS", 1)
    return _derived(LauncherKind.MPICH, env, rank, world_size, local_rank, local_world_size)


def from_slurm(env: Env) -> ProcessEnv | None:
    """Adapter for tasks started by `srun` (see the module docstring for why `srun` only)."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    rank, world_size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
    node_rank = _int(env, "SLURM_NODEID", 0)
    per_node = parse_tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
    )
    local_world_size = per_node[node_rank] if node_rank < len(per_node) else 1
    nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
    return ProcessEnv(
        launcher=LauncherKind.SLURM, rank=rank, world_size=world_size,
        local_rank=_int(env, "SLURM_LOCALID", 0), local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist) or DEFAULT_MASTER_ADDR,
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        device_index=_int(env, "SLURM_LOCALID", 0),
    )  # fmt: skip


def _derived(
    kind: LauncherKind, env: Env, rank: int, world_size: int, local_rank: int, local_size: int
) -> ProcessEnv:
    return ProcessEnv(
        launcher=kind, rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=local_size, node_rank=rank // max(local_size, 1),
        master_addr=env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        device_index=local_rank,
    )  # fmt: skip


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's tasks-per-node syntax: `"2(x3),1"` -> `[2, 2, 2, 1]`."""
    counts: list[int] = []
    for part in filter(None, value.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise LaunchError(
                f"SLURM_STEP_TASKS_PER_NODE part {part!r} of {value!r} is not 'N' or 'N(xM)'."
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first_slurm_host(nodelist: str) -> str | None:
    """First host of a Slurm host list: `"gpu[03-05,9],cpu1"` -> `"gpu03"`."""
    match = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return None
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _rank_table_path(env: Env) -> str | None:
    for var in RANK_TABLE_VARS:
        if env.get(var):
            return env[var]
    return None


def _table_device(env: Env, rank: int, local_rank: int) -> int:
    path = _rank_table_path(env)
    if path is None:
        return local_rank
    return load_rank_table(path, check_hosts=False).locate(rank)[2]


def _int(env: Env, key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise LaunchError(f"Environment variable {key} is not set; the launcher must set it.")
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise LaunchError(
            f"Environment variable {key}={raw!r} is not an integer. Unset it or fix the launcher"
            " that sets it."
        ) from e


ADAPTERS: tuple[Callable[[Env], ProcessEnv | None], ...] = (
    from_torchrun,
    from_rank_table,
    from_openmpi,
    from_mvapich,
    from_mpich,
    from_slurm,
)
"""Adapters in the order `detect_environment` tries them."""
