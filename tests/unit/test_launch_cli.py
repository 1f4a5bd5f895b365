"""Unit tests of `plait run`'s flags, `--dry-run`, `--emit`, the exec shim and failure reports.

Nothing here starts a worker: these run in-process in milliseconds.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from plait.cli import Command, build_parser, main, register_command
from plait.launch import LaunchError, RunConfig
from plait.launch._worker_exec import cpu_slice
from plait.launch.command import config_from_args


@pytest.fixture
def train(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def test_launch_cli_script_args_go_to_the_script(train: str) -> None:
    cfg = config_from_args(parse("--worker-num", "8", "--local-worker-num", "4", "--node-rank",
                                 "1", train, "--worker-num", "3", "--lr=0.1"))  # fmt: skip
    assert cfg.program == (train, "--worker-num", "3", "--lr=0.1")
    assert (cfg.worker_num, cfg.local_worker_num, cfg.num_nodes, cfg.first_rank) == (8, 4, 2, 4)


def test_launch_cli_defaults_and_module(train: str) -> None:
    cfg = config_from_args(parse(train))
    assert (cfg.worker_num, cfg.local_worker_num, cfg.master_port, cfg.tail_ranks) == (
        1, 1, 29500, (0,)
    )  # fmt: skip
    assert config_from_args(parse("--local-worker-num", "3", train)).worker_num == 3
    assert config_from_args(parse("-m", "pkg.mod", "x")).program == ("-m", "pkg.mod", "x")
    assert config_from_args(parse("--worker-num", "4", "--tail-worker-log", "all", train)
                            ).echoed_ranks == frozenset(range(4))  # fmt: skip
    assert config_from_args(parse("--tail-worker-log", "none", train)).tail_ranks == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worker-num", "6", "--local-worker-num", "4"], "is not a multiple of"),
        (["--worker-num", "8", "--local-worker-num", "4", "--node-rank", "2"],
         r"--node-rank 2 is outside 0..1"),
        (["--master-port", "0"], "must be in 1..65535"),
        (["--cluster-timeout", "0"], "must be > 0 seconds"),
        (["--max-restarts", "-1"], "must be >= 0"),
        (["--worker-num", "2", "--tail-worker-log", "5"], r"rank 5 is outside 0..1"),
        (["--tail-worker-log", "zero"], "is not a list of ranks"),
        (["--nnodes", "1:2"], "--nnodes 1:2 needs --local-worker-num"),
        (["--nnodes", "2:1", "--local-worker-num", "2"], r"fewest nodes must be in 1..1"),
        (["--nnodes", "0:2", "--local-worker-num", "2"], "is not N or MIN:MAX"),
        (["--nnodes", "a:b", "--local-worker-num", "2"], "is not N or MIN:MAX"),
        (["--nnodes", "1:2", "--local-worker-num", "2", "--worker-num", "8"],
         r"--worker-num 8 does not match --nnodes 1:2 with --local-worker-num 2"),
        (["--nnodes", "1:2", "--local-worker-num", "2", "--node-rank", "0"],
         "an elastic job numbers its nodes at every rendezvous"),
    ],
)  # fmt: skip
def test_launch_cli_bad_flags_are_refused(train: str, argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        config_from_args(parse(*argv, train))


def test_launch_cli_nnodes(train: str) -> None:
    elastic = config_from_args(parse("--nnodes", "1:3", "--local-worker-num", "2", train))
    assert (elastic.min_nodes, elastic.num_nodes, elastic.worker_num) == (1, 3, 6)
    assert elastic.elastic and elastic.nnodes_text == "1:3"
    assert elastic.shape_text == "--nnodes 1:3 --local-worker-num 2"
    fixed = config_from_args(parse("--nnodes", "2", "--local-worker-num", "4", train))
    assert (fixed.worker_num, fixed.num_nodes, fixed.elastic) == (8, 2, False)
    assert fixed.shape_text == "--worker-num 8 --local-worker-num 4 (2 nodes)"


def test_launch_emit_refuses_an_elastic_job(train: str, capsys) -> None:
    assert main(["run", "--emit", "slurm", "--nnodes", "1:2", "--local-worker-num", "2",
                 train]) == 2  # fmt: skip
    assert "the job would not be elastic" in capsys.readouterr().err


def test_launch_cli_missing_script_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_launch_cli_dry_run_prints_each_worker(train: str, tmp_path: Path, capsys) -> None:
    logs = str(tmp_path / "logs")
    code = main(["run", "--worker-num", "4", "--local-worker-num", "2", "--node-rank", "1",
                 "--log-dir", logs, "--dry-run", train, "--epochs", "2"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    blocks = out.split("[worker local_rank=")[1:]
    assert len(blocks) == 2
    assert "RANK=3\n" in blocks[1] and "LOCAL_RANK=1\n" in blocks[1]
    assert "WORLD_SIZE=4\n" in blocks[1] and "LOCAL_WORLD_SIZE=2\n" in blocks[1]
    assert "GROUP_RANK=1\n" in blocks[1] and "MASTER_ADDR=" in blocks[1]
    assert f"# command: {sys.executable} {train} --epochs 2\n" in blocks[1]
    assert "worker_3.log" in blocks[1]
    assert not any((tmp_path / "logs").iterdir())


def test_launch_cli_registry_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register_command(Command("run", "again", lambda p: None, lambda a: 0))


def test_launch_emit_slurm_passes_bash_n(train: str, tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    code = main(["run", "--emit", "slurm", "-o", str(out), "--worker-num", "8", "--max-restarts",
                 "2", "--local-worker-num", "4", train, "--msg", "it's"])  # fmt: skip
    assert code == 0
    text = out.read_text()
    assert "#SBATCH --nodes=2" in text
    assert '--node-rank "$SLURM_NODEID"' in text and '--master-addr "$MASTER_ADDR"' in text
    assert "--max-restarts 2" in text
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    subprocess.run(["bash", "-n", str(out)], check=True)


def test_launch_emit_pytorchjob_manifest(train: str, capsys) -> None:
    assert main(["run", "--emit", "kubernetes", "--image", "reg.example/train:1",
                 "--job-name", "llama", "--worker-num", "12", "--local-worker-num", "4",
                 "--master-port", "23456", "--cluster-timeout", "300", train]) == 0  # fmt: skip
    doc = yaml.safe_load(capsys.readouterr().out)
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) == (
        "kubeflow.org/v1", "PyTorchJob", "llama"
    )  # fmt: skip
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["image"] == "reg.example/train:1"
    cmd = container["command"]
    assert cmd[:2] == ["plait", "run"] and cmd[-1] == train
    flags = dict(zip(cmd[2:-1:2], cmd[3:-1:2], strict=False))
    assert flags["--worker-num"] == "12" and flags["--local-worker-num"] == "4"
    assert flags["--master-addr"] == "$(MASTER_ADDR)" and flags["--node-rank"] == "$(RANK)"
    assert flags["--master-port"] == "23456" and flags["--cluster-timeout"] == "300"


def test_launch_emit_jobset_manifest(train: str, capsys) -> None:
    assert main(["run", "--emit", "kubernetes", "--k8s-api", "jobset", "--image", "img:1",
                 "--job-name", "big", "--worker-num", "8", "--local-worker-num", "2",
                 train]) == 0  # fmt: skip
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "JobSet"
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    cmd = job["template"]["spec"]["containers"][0]["command"]
    assert "big-node-0-0.big" in cmd and "$(NODE_RANK)" in cmd


def test_launch_emit_kubernetes_needs_image(train: str, capsys) -> None:
    assert main(["run", "--emit", "kubernetes", train]) == 2
    assert "needs --image" in capsys.readouterr().err


def test_launch_shim_cpu_slices() -> None:
    cpus = list(range(8))
    assert [cpu_slice(cpus, r, 4) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [cpu_slice(cpus, r, 3) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert [cpu_slice([0, 1], r, 4) for r in range(4)] == [[0], [1], [0], [1]]


def test_launch_runconfig_program_rules() -> None:
    with pytest.raises(LaunchError, match="`-m` needs a module name"):
        RunConfig(program=("-m",))
    with pytest.raises(LaunchError, match="does not exist"):
        RunConfig(program=("surely-missing.py",)).check_program_exists()
