"""What ``ParallelConfig(log_dir=...)`` adds to a step on rank 0: one record written and
flushed, per format (#35 item 4).

Times :meth:`plait.runtime.engine.metrics.MetricsLog.write` alone on 1,000 records into a temporary
directory: the JSON line by itself, then a TensorBoard event file beside it (seven scalars and
a flush of the event writer's queue each step). The other ranks write nothing.

    python bench/metrics_write.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from plait.runtime.engine.metrics import MetricsLog, StepMetrics

RECORDS = 1000


def _record(step: int) -> StepMetrics:
    return StepMetrics(
        step=step,
        loss=1.0,
        step_time_s=0.01,
        samples=8,
        tokens=128,
        peak_memory_bytes=10**8,
        memory_source="process peak rss",
        lr=0.1,
        predicted_step_time_s=0.001,
        predicted_on="local",
    )


def time_writes(formats: tuple[str, ...]) -> list[float]:
    """Seconds of each of ``RECORDS`` writes in ``formats``."""
    with tempfile.TemporaryDirectory() as where:
        log = MetricsLog(Path(where), formats)
        seconds = []
        for step in range(1, RECORDS + 1):
            record = _record(step)
            started = time.perf_counter()
            log.write(record)
            seconds.append(time.perf_counter() - started)
        log.close()
    return seconds


def main() -> None:
    print("| formats | median per step | p90 |")
    print("|---|---:|---:|")
    for formats in (("jsonl",), ("tensorboard", "jsonl")):
        seconds = time_writes(formats)
        p90 = statistics.quantiles(seconds, n=10)[-1]
        print(f"| {' + '.join(formats)} | {statistics.median(seconds) * 1e6:.0f} us "
              f"| {p90 * 1e6:.0f} us |")  # fmt: skip


if __name__ == "__main__":
    main()
