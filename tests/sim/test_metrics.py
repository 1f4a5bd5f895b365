"""Metrics where people look (#35 item 4): ``ParallelConfig(log_dir=...)`` writes each step's
record as TensorBoard event files (read back here by TensorBoard's own reader) and as
``metrics.jsonl``, equal to what the job returned; a plan job's records carry the plan's
predicted step time beside the measured one; resumed logs drop the steps trained again;
missing tensorboard is refused at parallelize. Real processes (only global rank 0 writes,
pipelines): tests/dist/test_metrics_gloo.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import plait
from plait import ConfigError, NotBuiltError, ParallelConfig
from plait.demo.train import plan_file_config
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.runtime.engine import metrics
from plait.runtime.engine.metrics import (
    JSONL_NAME,
    PREDICTED_ON_TAG,
    TAGS,
    MetricsLog,
    StepMetrics,
    metrics_log,
)
from plait.testing.equivalence import reference_run

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
REPO = Path(__file__).resolve().parents[2]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, GPT.vocab, (8, GPT.seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPT)


def read_events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the one event file in ``log_dir``, by tag, as TensorBoard reads it."""
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def read_jsonl(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / JSONL_NAME).read_text().splitlines()]


def _same_in_both(records: list[dict], scalars: dict[str, list[tuple[int, float]]]) -> None:
    """Each numeric key of the JSON lines is its TensorBoard tag's scalar (float32 there)."""
    for key, tag in TAGS.items():
        wanted = [(r["step"], r[key]) for r in records if r[key] is not None]
        got = scalars.get(tag, [])
        assert [s for s, _ in got] == [s for s, _ in wanted], tag
        for (_, value), (_, expected) in zip(got, wanted, strict=True):
            assert value == pytest.approx(expected, rel=1e-6), tag


def test_plain_data_parallel_writes_its_losses_to_tensorboard_and_json_lines(tmp_path) -> None:
    batches = _batches()
    with plait.testing.simulate(2):
        job = plait.parallelize(
            _model(), ParallelConfig(mesh={"dp": 2}, log_dir=tmp_path / "run"), optimizer=sgd,
            loss_fn=gpt_loss,
        )  # fmt: skip
        assert job.engine == "plain"  # the plain data-parallel engine
        losses = [job.step(b) for b in batches]
        job.close()
    reference = reference_run(_model(), gpt_loss, sgd, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses))
    records = read_jsonl(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["loss"] for r in records] == losses  # the floats step returned, exactly
    scalars = read_events(tmp_path / "run")
    assert scalars["loss/train"] == [(i + 1, pytest.approx(x, rel=1e-6)) for i, x in enumerate(losses)]
    _same_in_both(records, scalars)
    assert "step_time/predicted_s" not in scalars  # no plan: nothing predicted
    for r in records:
        assert r["lr"] == 0.1 and r["predicted_step_time_s"] is r["predicted_on"] is None
        # a simulated world's step takes the global batch: 8 sequences of 8 tokens
        assert r["samples_per_s"] * r["step_time_s"] == pytest.approx(8)
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(64)
        assert r["memory_source"] == "process peak rss" and r["peak_memory_bytes"] > 2**20
    assert job.metrics.closed


def test_a_plan_job_logs_its_predicted_step_time_beside_the_measured(tmp_path) -> None:
    """A saved semi_auto plan run from its file as the demo's ``--plan PATH --log-dir DIR``
    does: the plan's prediction in every record, beside the measured step time; closing the
    job closes its files."""
    batches = _batches(2)
    plan = plait.plan(_model(), ParallelConfig(mode="semi_auto", mesh={"dp": 2}),
                      example_batch=batches[0], loss_fn=gpt_loss)  # fmt: skip
    plan.save(tmp_path / "plan.json")
    config = plan_file_config(tmp_path / "plan.json", plan, tmp_path / "run")
    with plait.testing.simulate(2):
        job = plait.parallelize(_model(), config, optimizer=sgd, loss_fn=gpt_loss,
                                example_batch=batches[0])  # fmt: skip
        losses = [job.step(b) for b in batches]
        job.close()
        job.step(batches[0])  # after close: trains, logs nothing
    records = read_jsonl(tmp_path / "run")
    assert [(r["step"], r["loss"]) for r in records] == [(1, losses[0]), (2, losses[1])]
    assert {r["predicted_step_time_s"] for r in records} == {plan.predicted.step_time_s}
    assert all(r["step_time_s"] > 0 for r in records)
    scalars = read_events(tmp_path / "run")
    _same_in_both(records, scalars)
    assert [s for s, _ in scalars["step_time/predicted_s"]] == [1, 2]
    # the profile the prediction was made on, as reports print it (UNCALIBRATED on `local`)
    assert {r["predicted_on"] for r in records} == {plan.hardware_label}
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    # written once (it never changed), under torch's suffix for text
    (text,) = events.Tensors(PREDICTED_ON_TAG + "/text_summary")
    assert (text.step, text.tensor_proto.string_val[0].decode()) == (1, plan.hardware_label)
    reference = reference_run(_model(), gpt_loss, sgd, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses))


def test_a_stand_alone_job_logs_too(tmp_path) -> None:
    batches = _batches(2)
    job = plait.parallelize(
        _model(), ParallelConfig(mode="stand_alone", log_dir=str(tmp_path)), optimizer=sgd,
        loss_fn=gpt_loss,
    )  # fmt: skip
    losses = [job.step(b) for b in batches]
    job.close()
    records = read_jsonl(tmp_path)
    assert [r["loss"] for r in records] == losses
    assert read_events(tmp_path)["loss/train"] == [
        (1, pytest.approx(losses[0], rel=1e-6)), (2, pytest.approx(losses[1], rel=1e-6))
    ]  # fmt: skip


def test_only_global_rank_zero_writes(tmp_path) -> None:
    config = ParallelConfig(log_dir=tmp_path)
    assert metrics_log(config, rank=1) is None and metrics_log(config, rank=0) is not None
    assert metrics_log(ParallelConfig(), rank=0) is None


def test_a_resumed_log_drops_the_steps_trained_again(tmp_path) -> None:
    """Steps 1-4 logged, the job killed mid-line; resumed from the checkpoint of step 2, its
    step 3 replaces the old 3 and 4."""

    def record(step: int, loss: float) -> StepMetrics:
        return StepMetrics(step=step, loss=loss, step_time_s=0.5, samples=4, tokens=None,
                           peak_memory_bytes=None, memory_source="process peak rss", lr=None,
                           predicted_step_time_s=None)  # fmt: skip

    first = MetricsLog(tmp_path, ("jsonl",))
    for step in range(1, 5):
        first.write(record(step, float(step)))
    first.close()
    with (tmp_path / JSONL_NAME).open("a") as f:
        f.write('{"step": 5, "lo')  # killed while writing
    again = MetricsLog(tmp_path, ("jsonl",))
    again.write(record(3, 30.0))
    again.close()
    records = read_jsonl(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert records[0]["samples_per_s"] == 8.0 and records[0]["tokens_per_s"] is None
    fresh = MetricsLog(tmp_path, ("jsonl",))  # a job from step 0: the file starts afresh
    fresh.write(record(1, 7.0))
    fresh.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path)] == [(1, 7.0)]


def test_tensorboard_missing_is_refused_before_anything_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(metrics, "_tensorboard_installed", lambda: False)
    # no process group: the refusal comes first (before the world is even looked at)
    with pytest.raises(NotBuiltError, match=r"need the tensorboard package.*pip install "
                       r"'plait\[metrics\]'.*log_formats=\('jsonl',\)"):  # fmt: skip
        plait.parallelize(_model(), ParallelConfig(log_dir=tmp_path), optimizer=sgd,
                          loss_fn=gpt_loss)  # fmt: skip
    job = plait.parallelize(
        _model(), ParallelConfig(mode="stand_alone", log_dir=tmp_path, log_formats=("jsonl",)),
        optimizer=sgd, loss_fn=gpt_loss,
    )  # fmt: skip
    job.step(_batches(1)[0])
    job.close()
    assert len(read_jsonl(tmp_path)) == 1
    taken = tmp_path / "file"
    taken.write_text("")
    with pytest.raises(ConfigError, match=r"log_dir='.*file' is a file; give a directory"):
        plait.parallelize(_model(), ParallelConfig(mode="stand_alone", log_dir=taken,
                          log_formats=("jsonl",)), optimizer=sgd, loss_fn=gpt_loss)  # fmt: skip


def test_import_plait_does_not_import_tensorboard() -> None:
    code = (
        "import sys, plait, plait.runtime.parallelize; "
        "print(sorted(m for m in sys.modules if 'tensorboard' in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True, timeout=120)  # fmt: skip
    assert out.stdout.strip() == "[]"
