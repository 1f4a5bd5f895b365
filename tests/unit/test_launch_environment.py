"""Unit tests of the environment adapters, from environment dictionaries (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.launch import LaunchError
from plait.launch.environment import (
    DEFAULT_MASTER_PORT,
    LauncherKind,
    detect_environment,
    first_slurm_host,
    from_mpich,
    from_mvapich,
    from_openmpi,
    from_rank_table,
    from_slurm,
    from_torchrun,
    parse_tasks_per_node,
)


def place(p) -> tuple:
    return (p.launcher, p.rank, p.world_size, p.local_rank, p.local_world_size, p.node_rank)


def test_environment_torchrun() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    p = from_torchrun(env)
    assert p is not None
    assert place(p) == (LauncherKind.TORCHRUN, 5, 8, 1, 4, 1)
    assert (p.master_addr, p.master_port, p.device_index) == ("10.0.0.1", 1234, 1)
    assert p.uses_torchelastic_store


def test_environment_torchrun_one_process_per_pod() -> None:
    p = from_torchrun({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "m"})
    assert p is not None
    assert place(p) == (LauncherKind.TORCHRUN, 3, 4, 0, 1, 3)
    assert p.master_port == DEFAULT_MASTER_PORT


def test_environment_openmpi() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    p = from_openmpi(env)
    assert p is not None
    assert place(p) == (LauncherKind.OPENMPI, 3, 4, 1, 2, 1)
    assert (p.master_addr, p.master_port) == ("127.0.0.1", DEFAULT_MASTER_PORT)


def test_environment_openmpi_master_from_env() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "MASTER_ADDR": "host0", "MASTER_PORT": "4000"}  # fmt: skip
    p = from_openmpi(env)
    assert p is not None
    assert (p.master_addr, p.master_port, p.local_world_size) == ("host0", 4000, 1)


def test_environment_mvapich() -> None:
    env = {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4",
           "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    p = from_mvapich(env)
    assert p is not None
    assert place(p) == (LauncherKind.MVAPICH, 2, 4, 0, 2, 1)


def test_environment_mpich_pmi() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    p = from_mpich(env)
    assert p is not None
    assert place(p) == (LauncherKind.MPICH, 1, 2, 1, 2, 0)


def test_environment_slurm_srun() -> None:
    env = {"SLURM_PROCID": "6", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "2",
           "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURM_STEP_NODELIST": "gpu[07-08]"}  # fmt: skip
    p = from_slurm(env)
    assert p is not None
    assert place(p) == (LauncherKind.SLURM, 6, 8, 2, 4, 1)
    assert (p.master_addr, p.master_port, p.device_index) == ("gpu07", DEFAULT_MASTER_PORT, 2)


def test_environment_slurm_batch_script_without_srun_is_not_a_job() -> None:
    # Inside sbatch (no srun) these describe the allocation; one process must not wait for 8.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[1-2]"}
    assert from_slurm(env) is None
    assert detect_environment(env).launcher is LauncherKind.SINGLE


def test_environment_slurm_helpers() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    assert first_slurm_host("gpu[03-05,9],cpu1") == "gpu03"
    assert first_slurm_host("node17") == "node17"
    with pytest.raises(LaunchError, match="is not 'N' or 'N\\(xM\\)'"):
        parse_tasks_per_node("2x3")


def test_environment_rank_table(tmp_path: Path) -> None:
    table = {"server_list": [
        {"server_id": "10.0.0.1", "device": [{"device_id": "4", "rank_id": "0"},
                                             {"device_id": "5", "rank_id": "1"}]},
        {"server_id": "10.0.0.2", "device": [{"device_id": "4", "rank_id": "2"},
                                             {"device_id": "5", "rank_id": "3"}]},
    ]}  # fmt: skip
    path = tmp_path / "rank_table.json"
    path.write_text(json.dumps(table))
    p = from_rank_table({"RANK_TABLE_FILE": str(path), "RANK_ID": "3"})
    assert p is not None
    assert place(p) == (LauncherKind.RANK_TABLE, 3, 4, 1, 2, 1)
    assert (p.master_addr, p.device_index) == ("10.0.0.1", 5)
    # Under plait run --rank-table, torchrun variables win but the device comes from the table.
    q = from_torchrun({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "2", "PLAIT_RANK_TABLE": str(path)})  # fmt: skip
    assert q is not None
    assert q.device_index == 4


def test_environment_detect_order_and_single() -> None:
    both = {"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2"}  # fmt: skip
    assert detect_environment(both).launcher is LauncherKind.TORCHRUN
    alone = detect_environment({})
    assert place(alone) == (LauncherKind.SINGLE, 0, 1, 0, 1, 0)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "Rank 2 from the torchrun environment is outside 0..1"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not set"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "must be in 1..65535"),
    ],
)
def test_environment_malformed_values_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        detect_environment(env)
