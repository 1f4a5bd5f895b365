"""The GPT example (examples/gpt/train.py, the code of `make demo`) runs and its loss falls.

Short real runs under `plait run` on 2 gloo workers (Megatron dp=1 x tp=2, mode auto, and its
saved plan replayed) and one in-process run in stand_alone mode, all with a tiny model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import plait
from plait.cost import load_profile
from plait.demo.train import load_corpus, parse_args, sample_batch, train

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt" / "train.py"
TINY = ["--steps", "8", "--batch", "4", "--seq", "16", "--width", "32", "--layers", "1",
        "--heads", "4", "--lr", "1e-2", "--eval-every", "4", "--sample", "6"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PLAIT_DEBUG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_gpt_example_semi_auto_on_two_workers(tmp_path: Path) -> None:
    """make demo's run (semi_auto, --calibrate) on 2 workers: the workers calibrate this
    machine briefly into the example's own cache and plan on it (#35 item 2)."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "plait", "run", "--worker-num", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--log-dir", str(logs),
           str(EXAMPLE), "--mode", "semi_auto", "--tp", "2", "--calibrate", *TINY]  # fmt: skip
    env = clean_env()
    env["PLAIT_HOME"] = str(tmp_path / "home")  # nothing saved: the workers measure
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cache = tmp_path / "home" / "world2" / "local.json"
    assert "hardware: calibrated this machine in" in proc.stdout
    assert f"on the 2 workers; written to {cache}" in proc.stdout
    assert "  hardware    local, calibrated (measured in " in proc.stdout
    plan_line = _summary_line(proc.stdout, "plan")
    assert "on hardware 'local', measured" in plan_line and "UNCALIBRATED" not in plan_line
    profile = load_profile(cache)
    assert profile.measured["all_reduce"]["world_size"] == 2 and not profile.uncalibrated
    assert "the GPT example's --calibrate" in profile.source
    assert not (tmp_path / "home" / "local.json").exists()  # plait calibrate's file: untouched
    assert "[rank0]: summary" in proc.stdout
    assert "mode        semi_auto, mesh {'dp': 1, 'tp': 2}" in proc.stdout
    assert "step     8  eval loss" in proc.stdout
    assert "  sample      '" in proc.stdout  # text written by job.predict after training
    assert "[rank1]" not in proc.stdout  # the console shows rank 0 only
    rank1 = (logs / "worker_1.log").read_text()
    assert "INFO rank1 plait.demo.gpt: summary" in rank1  # other ranks log into their files


def _run_example(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "plait", "run", "--worker-num", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--log-dir", str(tmp_path / "logs"),
           str(EXAMPLE), *TINY, *args]  # fmt: skip
    env = clean_env()
    env["PLAIT_HOME"] = str(tmp_path / "home")  # no calibrated profile: the built-in defaults
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _summary_line(stdout: str, key: str) -> str:
    return next(line for line in stdout.splitlines() if f"  {key} " in line)


@pytest.mark.nightly  # make test: saved auto plans replay on gloo in tests/dist/test_plan_gloo.py
def test_gpt_example_auto_on_two_workers_and_its_saved_plan(tmp_path: Path) -> None:
    """Mode auto: plait plans the mesh and every op on the example batch and runs the plan,
    saving it; a second run replays the saved file (--plan) with the same losses."""
    path = tmp_path / "gpt.plan.json"
    auto = _run_example(tmp_path, "--mode", "auto", "--search", "recursive_programming",
                        "--save-plan", str(path))  # fmt: skip
    assert "mode        auto, mesh {'dp': " in auto.stdout
    assert "plan        recursive_programming: " in auto.stdout
    assert "predicted" in auto.stdout and "step     8  eval loss" in auto.stdout
    # no calibration in this PLAIT_HOME: the plan line says its prediction is the defaults'
    assert "on hardware 'local' (UNCALIBRATED: " in _summary_line(auto.stdout, "plan")
    saved = plait.Plan.load(path)
    assert saved.search == "recursive_programming" and saved.mesh.size == 2

    replay = _run_example(tmp_path, "--plan", str(path))
    for key in ("mode", "train loss", "eval loss", "sample"):
        assert _summary_line(replay.stdout, key) == _summary_line(auto.stdout, key)


def test_gpt_example_refuses_a_plan_with_another_mode() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--mode", "semi_auto", "--plan", "gpt.plan.json"])
    with pytest.raises(SystemExit):
        parse_args(["--mode", "data_parallel", "--save-plan", "gpt.plan.json"])
    assert parse_args(["--plan", "gpt.plan.json"]).mode == "auto"


def test_gpt_example_stand_alone_in_process(tmp_path: Path) -> None:
    summary = train(parse_args(["--mode", "stand_alone", *TINY, "--log-dir", str(tmp_path)]))
    assert summary.mesh is None and summary.steps == 8
    # --log-dir: a record a step (TensorBoard's files beside them: tests/sim/test_metrics.py)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[0]["loss"] == summary.first_loss
    assert records[0]["tokens_per_s"] * records[0]["step_time_s"] == pytest.approx(4 * 16)
    assert list(tmp_path.glob("events.out.tfevents.*"))
    assert len(summary.sample) == 6  # the characters job.predict's logits chose
    assert summary.loss_fell, (summary.first_loss, summary.last_loss)
    assert [step for step, _ in summary.eval_losses] == [0, 4, 8]
    assert summary.eval_losses[-1][1] < summary.eval_losses[0][1]
    assert "summary" in summary.text() and "tokens/s" in summary.text()


def test_gpt_example_batches_are_deterministic() -> None:
    import torch

    corpus = load_corpus(REPO / "plait" / "demo" / "corpus.txt")
    total = len(corpus.train) + len(corpus.eval)
    assert abs(len(corpus.eval) - total / 10) <= 1  # the last 10% is held out
    draw = [sample_batch(corpus.train, 16, 4, torch.Generator().manual_seed(1)) for _ in range(2)]
    assert torch.equal(draw[0][0], draw[1][0])
    assert torch.equal(draw[0][0][:, 1:], draw[0][1][:, :-1])  # targets: ids shifted by one


@pytest.mark.nightly  # make test keeps the exact-resume checks of tests/unit/test_checkpoint.py
def test_gpt_example_saves_and_resumes_to_the_same_result(tmp_path: Path) -> None:
    """--save-every / --resume: 4 steps, then a resumed run to 8, ends where 8 straight steps
    end (model, optimizer and the batch generator's position restored)."""
    common = ["--mode", "stand_alone", *TINY, "--checkpoint-dir"]
    whole = train(parse_args([*common, str(tmp_path / "a")]))
    first = train(parse_args([*common, str(tmp_path / "b"), "--save-every", "4", "--steps", "4"]))
    assert first.steps == 4 and (tmp_path / "b" / "step-00000004" / "plait.json").is_file()
    resumed = train(parse_args([*common, str(tmp_path / "b"), "--resume", "--save-every", "4"]))
    assert resumed.steps == 4
    assert resumed.eval_losses[-1] == whole.eval_losses[-1]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "step-00000004", "step-00000008"
    ]  # fmt: skip


@pytest.mark.nightly  # make test: pipelines train, evaluate and predict in test_pipeline_gloo.py
def test_gpt_example_pipeline_on_two_workers(tmp_path: Path) -> None:
    """--pp 2: two pipeline stages (mode data_parallel, mesh pp=2 x dp=1), 1F1B over 4
    micro-batches, one block a stage; the loss falls, evaluation runs through the stages and
    the trained pipeline writes text (job.predict)."""
    run = _run_example(tmp_path, "--pp", "2", "--micro-batches", "4", "--layers", "2")
    assert "mode        data_parallel, mesh {'pp': 2, 'dp': 1}" in run.stdout
    assert "step     8  eval loss" in run.stdout
    assert "  sample      '" in run.stdout
