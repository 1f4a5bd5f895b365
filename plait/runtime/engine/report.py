"""``job.report()``: what the plan predicted beside what the run measured.

A :class:`RunReport` holds, for this rank:

* **step time**: the plan's predicted seconds per step (``plan.predicted.step_time_s``) and
  the median wall time of the job's steps so far (``Job.step`` times every call; the first
  ``warmup`` steps, which build caches and the optimizer's states, are left out);
* **peak memory**: the plan's predicted bytes per device (``plan.predicted.memory_bytes``) and
  a measured peak: the :class:`~plait.runtime.engine.measure.MemoryMeasurement` passed in (from
  :func:`~plait.runtime.engine.measure.measure_step_memory`, which counts every tensor a step holds,
  on any device), else on CUDA the allocator's peak since the job was made. On CPU without a
  measurement the memory is "not measured".

A plan made on the uncalibrated ``local`` defaults (no ``plait calibrate`` file) says so under
the table, with the command that calibrates.

Jobs that run no plan (plain data parallel, stand-alone, hybrid, pipelines of marks) have no
prediction: ``plait.plan(model, config, example_batch=...)`` makes one to compare with.

A pipeline job's report also holds the last training step's measured timeline (gathered over
the pipeline group, as ``job.timeline()``: every rank calls ``report()`` there) and the
plan's predicted one. :meth:`RunReport.plot` draws the report (matplotlib, ``pip install
'plait[plot]'``): memory by kind, predicted beside measured, and the timelines.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.comm.world import current_world
from plait.errors import PlanError
from plait.planning import plots
from plait.planning.timeline import Timeline
from plait.runtime.engine.measure import MemoryMeasurement, format_bytes, plan_of

__all__ = ["RunReport", "plot_memory", "run_report"]


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
    rank: int = 0
    """The rank that measured (the world's rank; 0 without a process group or simulated)."""
    measured_timeline: Timeline | None = None
    """A pipeline job's last training step as measured (every pipeline rank's passes)."""
    predicted_timeline: Timeline | None = None
    """A pipeline job's plan's predicted schedule (None without a plan)."""
    notes: tuple[str, ...] = ()
    """Lines under the table: a parameter-server job's traffic with its servers."""

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
        if self.notes:
            rows += ["", *self.notes]
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def memory_columns(self) -> list[plots.MemoryColumn]:
        """This rank's memory by kind as the memory picture's columns: the prediction, and
        beside it the measurement where one has kinds (``measure_step_memory``)."""
        rank = f"rank {self.rank}"
        columns = []
        if self.predicted_by_kind:
            columns.append(
                plots.MemoryColumn(
                    rank, "predicted", dict(self.predicted_by_kind), self.predicted_memory_bytes
                )
            )
        if self.measured_by_kind:
            columns.append(
                plots.MemoryColumn(
                    rank, "measured", dict(self.measured_by_kind), self.measured_peak_bytes
                )
            )
        return columns

    def plot(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write the report's pictures into ``directory`` (made if missing) and return their
        paths (needs matplotlib: ``pip install 'plait[plot]'``):

        * ``memory_rank{R}.png``: this rank's memory by kind, predicted beside measured
          (the measurement where ``job.report(measure_step_memory(job, batch))`` gave one);
        * ``timeline.png`` (a pipeline job, written by rank 0): the predicted schedule above
          the last training step as measured.

        Every rank may call it: file names carry the rank, the shared timeline is rank 0's.
        """
        plots.require_matplotlib("RunReport.plot")
        columns = self.memory_columns()
        timelines = [t for t in (self.predicted_timeline, self.measured_timeline) if t]
        if not columns and not timelines:
            raise PlanError(
                "RunReport.plot: nothing to draw: the job has no plan (no predicted memory), "
                "no memory was measured and it is not a pipeline; pass a measurement "
                "(job.report(plait.runtime.engine.measure.measure_step_memory(job, batch))) or plan "
                "the job"
            )
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        if columns:
            figure = plots.memory_figure(
                columns, title=f"memory by kind on rank {self.rank}: predicted beside measured"
            )
            written.append(plots.write_png(figure, out / f"memory_rank{self.rank}.png"))
        if timelines and self.rank == 0:
            figure = plots.timeline_figure(*timelines)
            written.append(plots.write_png(figure, out / "timeline.png"))
        return written


def plot_memory(reports: Sequence[RunReport], path: str | os.PathLike[str]) -> Path:
    """Several ranks' memory in one picture (e.g. every rank's report gathered on rank 0):
    for each rank its prediction beside its measurement, stacked by kind; returns ``path``."""
    plots.require_matplotlib("plot_memory")
    columns = [c for r in sorted(reports, key=lambda r: r.rank) for c in r.memory_columns()]
    if not columns:
        raise PlanError(
            f"plot_memory: the {len(reports)} reports hold no memory by kind (no plan, nothing "
            "measured); pass measurements: job.report(measure_step_memory(job, batch))"
        )
    title = f"memory per rank by kind: predicted beside measured ({len(reports)} ranks)"
    return plots.write_png(plots.memory_figure(columns, title=title), path)


def run_report(
    job: Any,
    step_seconds: list[float],
    memory: MemoryMeasurement | None,
    warmup: int,
    *,
    measured_timeline: Timeline | None = None,
) -> RunReport:
    """The report of ``job`` after the steps timed in ``step_seconds`` (see :meth:`Job.report
    <plait.runtime.engine.job.Job.report>`)."""
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
        rank=_rank(),
        measured_timeline=measured_timeline,
        predicted_timeline=None
        if measured_timeline is None or plan is None or plan.pipeline_stages < 2
        else plan.timeline(),
        notes=_server_traffic(job),
    )


def _server_traffic(job: Any) -> tuple[str, ...]:
    """A parameter-server job's traffic, a step on average (:class:`plait.ps.worker.PsTraffic`)."""
    client = getattr(job, "parameter_server", None)
    if client is None or not client.traffic.steps:
        return ()
    t, steps = client.traffic, client.traffic.steps
    cache = f", cache hit rate {t.hit_rate:.0%}" if client.cache_rows else ""
    return (
        f"parameter servers, a step on this worker: {t.rows_read / steps:,.0f} rows read, "
        f"{t.rows_pulled / steps:,.0f} pulled ({format_bytes(t.bytes_pulled // steps)}), "
        f"{format_bytes(t.bytes_pushed // steps)} pushed{cache}; "
        f"{t.pull_s / steps * 1e3:,.1f} ms waiting for rows, {t.push_s / steps * 1e3:,.1f} ms "
        "pushing",
    )


def _rank() -> int:
    world = current_world()
    return 0 if world is None else world.rank


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
