"""Training metrics where people look: TensorBoard event files and a JSON-lines log.

``ParallelConfig(log_dir=DIR)`` makes every job (stand-alone, plain data parallel, plan and
program jobs, pipelines) write one record per ``job.step`` into ``DIR``, from the process of
global rank 0 only (the step's loss is the global loss, the same on every rank; one writer
keeps one file). ``log_formats`` picks what is written:

* ``"tensorboard"``: event files (``torch.utils.tensorboard.SummaryWriter``; the
  ``tensorboard`` package, ``pip install 'plait[metrics]'``), read by ``tensorboard --logdir
  DIR``;
* ``"jsonl"``: ``DIR/metrics.jsonl``, one JSON object a line.

A record, key (TensorBoard tag): value:

* ``step`` (the event's step): optimizer steps taken, from 1;
* ``loss`` (``loss/train``): the global loss ``step`` returned;
* ``lr`` (``lr``): the learning rate of the optimizer's first parameter group;
* ``step_time_s`` (``step_time/measured_s``): wall time of the ``step`` call;
* ``predicted_step_time_s`` (``step_time/predicted_s``): the plan's (null: the job runs no
  plan);
* ``predicted_on`` (a text, ``step_time/predicted_on``, written when it changes): the
  hardware profile the prediction was made on, as every report prints it (on the
  uncalibrated ``local`` defaults it says so and how to calibrate); null without a plan;
* ``samples_per_s`` (``throughput/samples_per_s``): rows of the global batch / step time;
* ``tokens_per_s`` (``throughput/tokens_per_s``): null unless the batch holds token ids;
* ``peak_memory_bytes`` (``memory/peak_bytes``) and ``memory_source`` (no tag): below;
* ``wall_time`` (the event's time): seconds since the epoch.

Samples: dim 0 of the token ids (below) or else of the batch's first tensor, times the
data-parallel processes whose slices make the global batch when each process passes its own
slice (``dataset_strategy="data_parallel"`` on real processes); as it is when the batch
given is the global one (``"full_batch"``, simulated worlds, stand-alone). Tokens: when the batch holds an integer
tensor of two dims (its first: token ids, ``(batch, seq)``), samples times ``seq``.

Memory: on CUDA the allocator's peak since the process started
(``torch.cuda.max_memory_allocated``, not reset, so ``job.report()`` reads the same); on the
CPU the process's peak resident set size (``getrusage``'s ``ru_maxrss``).

Both files are flushed after every record, so a killed job loses at most the step it was
taking; ``job.close()`` closes them (so does the end of the process). A job that starts at
step 0 starts ``metrics.jsonl`` afresh; a job resumed from a checkpoint appends to it, first
dropping the records of steps after the checkpoint (they were trained again).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import resource
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from plait._compat import tree_leaves
from plait.config import ParallelConfig
from plait.errors import ConfigError, NotBuiltError
from plait.runtime.engine.measure import plan_of

__all__ = [
    "JSONL_NAME",
    "PREDICTED_ON_TAG",
    "TAGS",
    "MetricsLog",
    "StepMetrics",
    "batch_counts",
    "check_log_dir",
    "learning_rate",
    "metrics_log",
    "peak_memory",
    "step_metrics",
]

JSONL_NAME = "metrics.jsonl"

TAGS: Mapping[str, str] = MappingProxyType(
    {
        "loss": "loss/train",
        "lr": "lr",
        "step_time_s": "step_time/measured_s",
        "predicted_step_time_s": "step_time/predicted_s",
        "samples_per_s": "throughput/samples_per_s",
        "tokens_per_s": "throughput/tokens_per_s",
        "peak_memory_bytes": "memory/peak_bytes",
    }
)
"""A record's numeric keys -> their TensorBoard scalar tags (the sections ``loss``,
``step_time``, ``throughput`` and ``memory`` group them in TensorBoard's view)."""

PREDICTED_ON_TAG = "step_time/predicted_on"
"""The TensorBoard text tag of ``predicted_on`` (stored by torch's ``add_text`` as
``step_time/predicted_on/text_summary``)."""


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What one training step measured (see the module docstring for each field)."""

    step: int
    loss: float
    step_time_s: float
    samples: int | None
    tokens: int | None
    peak_memory_bytes: int | None
    memory_source: str
    lr: float | None
    predicted_step_time_s: float | None
    predicted_on: str | None = None

    def record(self, wall_time: float) -> dict[str, Any]:
        """The JSON-lines record (the module docstring's keys, in its order): rates per
        second in place of counts."""
        seconds = self.step_time_s
        return {
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "step_time_s": seconds,
            "predicted_step_time_s": self.predicted_step_time_s,
            "predicted_on": self.predicted_on,
            "samples_per_s": _rate(self.samples, seconds),
            "tokens_per_s": _rate(self.tokens, seconds),
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_source": self.memory_source,
            "wall_time": wall_time,
        }


def _rate(count: int | None, seconds: float) -> float | None:
    return None if count is None or seconds <= 0 else count / seconds


def check_log_dir(config: ParallelConfig) -> None:
    """Refuse, before any process waits on another, metrics that cannot be written: event
    files without the ``tensorboard`` package, or a ``log_dir`` that is a file."""
    if config.log_dir is None:
        return
    where = os.fspath(config.log_dir)
    if "tensorboard" in config.log_formats and not _tensorboard_installed():
        raise NotBuiltError(
            f"ParallelConfig(log_dir={where!r}) writes TensorBoard event files, which need the "
            "tensorboard package, not installed here: pip install 'plait[metrics]' (or "
            "tensorboard), or write the JSON-lines log alone with log_formats=('jsonl',)"
        )
    if Path(where).exists() and not Path(where).is_dir():
        raise ConfigError(
            f"ParallelConfig.log_dir={where!r} is a file; give a directory (created if missing)"
        )


def _tensorboard_installed() -> bool:
    """Whether ``torch.utils.tensorboard`` can import (found without importing it: ``import
    plait`` never loads tensorboard)."""
    return importlib.util.find_spec("tensorboard") is not None


def metrics_log(config: ParallelConfig, rank: int) -> MetricsLog | None:
    """The writer of this process's step records: None without ``log_dir``, or on any
    process other than global rank 0."""
    if config.log_dir is None or rank != 0:
        return None
    return MetricsLog(Path(os.fspath(config.log_dir)), config.log_formats)


class MetricsLog:
    """Rank 0's metrics files, opened at the first record (a job built and dropped unstepped
    leaves nothing behind), flushed after each, closed by :meth:`close`."""

    def __init__(self, log_dir: Path, formats: tuple[str, ...]) -> None:
        self.log_dir = log_dir
        self.formats = formats
        self._jsonl: Any = None
        self._events: Any = None
        self._opened = False
        self._predicted_on: str | None = None
        """The hardware label last written as text to the event files."""
        self.closed = False

    def write(self, metrics: StepMetrics) -> None:
        """One step's record, in every format, flushed."""
        if self.closed:
            return  # job.close() was called and the job stepped on: nothing more is written
        if not self._opened:
            self._open(first_step=metrics.step)
        now = time.time()
        record = metrics.record(now)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._events is not None:
            for key, tag in TAGS.items():
                value = record[key]
                if value is not None:
                    self._events.add_scalar(tag, value, metrics.step, walltime=now)
            label = metrics.predicted_on
            if label is not None and label != self._predicted_on:
                self._events.add_text(PREDICTED_ON_TAG, label, metrics.step, walltime=now)
                self._predicted_on = label
            self._events.flush()

    def _open(self, first_step: int) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.formats:
            path = self.log_dir / JSONL_NAME
            if first_step > 1 and path.exists():
                _drop_records_from(path, first_step)
                self._jsonl = path.open("a", encoding="utf-8")
            else:
                self._jsonl = path.open("w", encoding="utf-8")
        if "tensorboard" in self.formats:
            # imported here: `import plait` never loads tensorboard (an optional extra)
            from torch.utils.tensorboard import SummaryWriter

            self._events = SummaryWriter(log_dir=os.fspath(self.log_dir))
        self._opened = True

    def close(self) -> None:
        """Close the files (again: nothing)."""
        self.closed = True
        jsonl, events, self._jsonl, self._events = self._jsonl, self._events, None, None
        if jsonl is not None:
            jsonl.close()
        if events is not None:
            events.close()


def _drop_records_from(path: Path, step: int) -> None:
    """Keep the records of steps before ``step`` (a resumed job trains the later ones again);
    a line that is not a whole record (a job killed mid-write) goes too."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            done = record.get("step") if isinstance(record, dict) else None
            if isinstance(done, int) and done < step:
                kept.append(line + "\n")
    path.write_text("".join(kept), encoding="utf-8")


def step_metrics(job: Any, batch: Any, loss: float, seconds: float) -> StepMetrics:
    """The record of the step ``job`` just took on ``batch`` (``job.steps_taken`` counts it)."""
    samples, tokens = batch_counts(batch, job._batch_processes(batch))
    peak, source = peak_memory(job.device_type)
    plan = plan_of(job)
    return StepMetrics(
        step=int(job.steps_taken),
        loss=float(loss),
        step_time_s=float(seconds),
        samples=samples,
        tokens=tokens,
        peak_memory_bytes=peak,
        memory_source=source,
        lr=learning_rate(job.optimizer),
        predicted_step_time_s=None if plan is None else float(plan.predicted.step_time_s),
        predicted_on=None if plan is None else str(plan.hardware_label),
    )


def batch_counts(batch: Any, processes: int) -> tuple[int | None, int | None]:
    """(samples, tokens) of the global batch a step trained on, from this process's
    ``batch`` and the number of processes whose batches make the global one (the module
    docstring's rule); None where the batch holds no tensor with a batch dim (or no ids)."""
    tensors = [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor) and x.ndim >= 1]
    if not tensors:
        return None, None
    ids = next((x for x in tensors if x.ndim == 2 and not x.is_floating_point()
                and not x.is_complex() and x.dtype != torch.bool), None)  # fmt: skip
    first = ids if ids is not None else tensors[0]
    samples = int(first.shape[0]) * processes
    return samples, None if ids is None else samples * int(ids.shape[1])


def peak_memory(device_type: str) -> tuple[int | None, str]:
    """(peak bytes, where it comes from) on this process (the module docstring's rule)."""
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda max allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux counts kilobytes, macOS bytes
    return int(peak if sys.platform == "darwin" else peak * 1024), "process peak rss"


def learning_rate(optimizer: Any) -> float | None:
    """The learning rate of the optimizer's first parameter group (None without one)."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    lr = groups[0].get("lr")
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        return float(lr.item())
    return float(lr) if isinstance(lr, int | float) and not isinstance(lr, bool) else None
