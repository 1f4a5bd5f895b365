"""``job.report()``: what the plan predicted beside what the run measured.

A :class:`RunReport` holds, for this rank:

* **step time**: the plan's predicted seconds per step (``plan.predicted.step_time_s``) and
  the median wall time of the job's steps so far (``Job.step`` times every call; the first
  ``warmup`` steps, which build caches and the optimizer's states, are left out);
* **peak memory**: the plan's predicted bytes per device (``plan.predicted.memory_bytes``) and
  a measured peak: the :class:`~plait.runtime.measure.MemoryMeasurement` passed in (from
  :func:`~plait.runtime.measure.measure_step_memory`, which counts every tensor a step holds,
  on any device), else on CUDA the allocator's peak since the job was made. On CPU without a
  measurement the memory is "not measured".

A plan made on the uncalibrated ``local`` defaults (no ``plait calibrate`` file) says so under
the table, with the command that calibrates.

Jobs that run no plan (plain data parallel, stand-alone, hybrid, pipelines of marks) have no
prediction: ``plait.plan(model, config, example_batch=...)`` makes one to compare with.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from plait.runtime.measure import MemoryMeasurement, format_bytes, plan_of

__all__ = ["RunReport", "run_report"]


@dataclass(frozen=True, slots=True)
class RunReport:
    """One rank's predicted and measured step time and peak memory (module docstring)."""

    predicted_step_s: float | None
    measured_step_s: float | None
    steps_measured: int
    predicted_memory_bytes: int | None
    measured_peak_bytes: int | None
    memory_source: str
    """Where the measured peak comes from: ``"measure_step_memory"``, ``"cuda allocator"``,
    or ``"not measured"``."""
    predicted_by_kind: tuple[tuple[str, int], ...] = ()
    measured_by_kind: tuple[tuple[str, int], ...] = ()
    hardware: str = ""
    """The plan's hardware profile as reports print it (``Plan.hardware_label``: on the
    uncalibrated ``local`` defaults, a warning and how to calibrate); empty without a plan."""
    hardware_uncalibrated: bool = False
    """The prediction is on the uncalibrated ``local`` defaults (the table says so)."""

    @property
    def step_ratio(self) -> float | None:
        """Measured / predicted step time (None when either is missing)."""
        return _ratio(self.measured_step_s, self.predicted_step_s)

    @property
    def memory_ratio(self) -> float | None:
        """Measured / predicted peak memory (None when either is missing)."""
        return _ratio(self.measured_peak_bytes, self.predicted_memory_bytes)

    def table(self) -> str:
        """A markdown table: predicted, measured, measured / predicted, per row."""
        rows = [
            "| | predicted | measured | measured / predicted |",
            "|---|---:|---:|---:|",
            _row(
                "step time",
                _ms(self.predicted_step_s),
                _ms(self.measured_step_s)
                + (f" (median of {self.steps_measured})" if self.steps_measured else ""),
                self.step_ratio,
            ),
            _row(
                "peak memory",
                _bytes(self.predicted_memory_bytes),
                _bytes(self.measured_peak_bytes) + f" ({self.memory_source})",
                self.memory_ratio,
            ),
        ]
        measured = dict(self.measured_by_kind)
        for kind, predicted in self.predicted_by_kind:
            got = measured.get(kind)
            rows.append(_row(kind, format_bytes(predicted), _bytes(got), _ratio(got, predicted)))
        if self.hardware_uncalibrated:
            rows += ["", f"predicted on hardware {self.hardware}"]
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def run_report(
    job: Any, step_seconds: list[float], memory: MemoryMeasurement | None, warmup: int
) -> RunReport:
    """The report of ``job`` after the steps timed in ``step_seconds`` (see :meth:`Job.report
    <plait.runtime.job.Job.report>`)."""
    plan = plan_of(job)
    predicted = None if plan is None else plan.predicted
    timed = step_seconds[warmup:] if len(step_seconds) > warmup else []
    peak, source, by_kind = _measured_memory(memory)
    return RunReport(
        predicted_step_s=None if predicted is None else float(predicted.step_time_s),
        measured_step_s=statistics.median(timed) if timed else None,
        steps_measured=len(timed),
        predicted_memory_bytes=None if predicted is None else int(predicted.memory_bytes),
        measured_peak_bytes=peak,
        memory_source=source,
        predicted_by_kind=()
        if predicted is None
        else tuple((k, int(v)) for k, v in predicted.memory_by_kind.items()),
        measured_by_kind=by_kind,
        hardware="" if plan is None else plan.hardware_label,
        hardware_uncalibrated=plan is not None and plan.hardware_uncalibrated,
    )


def _measured_memory(
    memory: MemoryMeasurement | None,
) -> tuple[int | None, str, tuple[tuple[str, int], ...]]:
    if memory is not None:
        kinds = tuple((k, int(v)) for k, v in memory.by_kind().items() if k != "peak")
        return memory.peak, "measure_step_memory", kinds
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda allocator", ()
    return None, "not measured", ()


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _row(name: str, predicted: str, measured: str, ratio: float | None) -> str:
    return f"| {name} | {predicted} | {measured} | {'-' if ratio is None else f'{ratio:.2f}'} |"
