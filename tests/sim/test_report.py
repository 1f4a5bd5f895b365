"""job.report(): the plan's prediction beside this rank's measured step time and memory."""

from __future__ import annotations

import pytest
import torch

import plait
from plait import NotBuiltError, ParallelConfig
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.runtime.engine.measure import measure_step_memory

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, GPT.vocab, (8, GPT.seq), generator=torch.Generator().manual_seed(0))
    return ids, torch.roll(ids, -1, dims=1)


def test_report_puts_the_plan_beside_the_measured_steps_and_memory() -> None:
    torch.manual_seed(0)
    batch = _batch()
    with plait.testing.simulate(4):
        job = plait.parallelize(
            TinyGPT(GPT), ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2}), optimizer=sgd,
            loss_fn=gpt_loss,
        )  # fmt: skip
        with pytest.raises(NotBuiltError, match="before the first step"):
            job.report()
        for _ in range(3):
            job.step(batch)
        plan = job.loss_fn.plan
        before = job.report()
        memory = measure_step_memory(job, batch)
        report = job.report(memory, warmup=2)
    assert before.steps_measured == 2 and before.measured_step_s > 0  # the first left out
    assert before.predicted_step_s == plan.predicted.step_time_s
    assert before.memory_source == "not measured" and before.memory_ratio is None
    assert report.steps_measured == 2  # 4 steps, 2 left out
    assert report.measured_peak_bytes == memory.peak
    assert report.predicted_memory_bytes == plan.predicted.memory_bytes
    assert report.memory_ratio == pytest.approx(memory.peak / plan.predicted.memory_bytes)
    assert report.step_ratio == pytest.approx(report.measured_step_s / report.predicted_step_s)
    table = str(report)
    assert "| step time |" in table and "(median of 2)" in table
    assert f"| {report.memory_ratio:.2f} |" in table and "| parameters |" in table


def test_a_job_without_a_plan_reports_what_it_measured_only() -> None:
    batch = _batch()  # made outside the simulated world: one tensor, not one per rank
    with plait.testing.simulate(2):
        job = plait.parallelize(TinyGPT(GPT), ParallelConfig(), optimizer=sgd, loss_fn=gpt_loss)
        job.step(batch)
        job.step(batch)
        report = job.report()
    assert report.predicted_step_s is None and report.step_ratio is None
    assert report.steps_measured == 1 and "| step time | - |" in str(report)
