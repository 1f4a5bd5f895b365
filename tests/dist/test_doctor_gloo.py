"""``plait.launch.doctor`` (issue 34 item 3): a cluster checked before training, on real gloo
processes: every rank reachable, versions compared, each collective and each link from rank 0
timed; a version mismatch refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.launch.doctor import Facts, examine, version_problems
from plait.testing import run_workers
from tests.dist.test_launch_e2e import free_port, plait_run, run

pytestmark = pytest.mark.dist


def _examine() -> object:
    return examine(sizes=(1 << 10, 64 << 10), repeats=2)


def test_every_rank_is_reached_and_every_collective_and_link_is_timed() -> None:
    found = run_workers(_examine, 3)
    first = found[0]
    assert [f.rank for f in first.facts] == [0, 1, 2] and not first.problems
    kinds = {(kind, nbytes) for kind, nbytes, _, _ in first.collectives}
    assert kinds == {
        (k, n)
        for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
        for n in (1 << 10, 64 << 10)
    }
    assert all(seconds > 0 and bandwidth > 0 for _, _, seconds, bandwidth in first.collectives)
    assert [peer for peer, _, _ in first.links] == [1, 2]  # rank 0's links, one per peer
    assert all(seconds > 0 for _, _, seconds in first.links)
    assert not found[1].links  # only rank 0 measures
    assert "| all_reduce | 1,024 |" in first.text()


def test_a_version_mismatch_is_refused_by_name() -> None:
    same = dict(host="n0", python="3.11.7", plait="0.1.0", backend="gloo", device="cpu")
    facts = [
        Facts(rank=0, torch="2.13.0", **same),
        Facts(rank=1, torch="2.13.0", **same),
        Facts(rank=2, torch="2.14.1", **{**same, "host": "n1"}),
    ]
    assert version_problems(facts) == [
        "rank 2 on n1 runs torch 2.14.1 (rank 0: 2.13.0): install the same versions on every "
        "node (a mismatch can hang or corrupt collectives)"
    ]
    assert version_problems(facts[:2]) == []


def test_diagnose_runs_the_doctor_instead_of_a_program() -> None:
    from plait.cli import build_parser
    from plait.launch import LaunchError
    from plait.launch.command import config_from_args

    def parse(*argv: str) -> object:
        return build_parser().parse_args(["run", *argv])

    config = config_from_args(parse("--worker-num", "2", "--diagnose"))
    assert config.program == ("-m", "plait.launch.doctor")
    with pytest.raises(LaunchError, match=r"--diagnose runs plait's cluster check .* 'train\.py'"):
        config_from_args(parse("--diagnose", "train.py"))
    with pytest.raises(LaunchError, match=r"No program: .* or --diagnose"):
        config_from_args(parse("--worker-num", "2"))


def test_plait_run_diagnose_prints_the_tables(tmp_path: Path) -> None:
    proc = run(
        plait_run("--worker-num", "2", "--master-port", str(free_port()), "--log-dir",
                  str(tmp_path), "--diagnose"),
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plait doctor: 2 ranks reachable" in proc.stdout
    assert "| all_reduce | 4,096 |" in proc.stdout and "| 0 -> 1 |" in proc.stdout
