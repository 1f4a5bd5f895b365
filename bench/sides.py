"""Timing jobs side by side on the same processes: what the benches that compare sides share.

Each timed step starts after a barrier and counts as the slowest rank's time; the sides take
their steps in turns, the order reversed every other step, so that a side is never always the
one after a warm cache or a busy neighbour.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def timed_step(job: Any, batch: Any) -> tuple[float, float]:
    """Seconds of one ``job.step(batch)`` on the slowest rank, and the step's loss."""
    dist.barrier()
    start = time.perf_counter()
    loss = job.step(batch)
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), float(loss)


def in_turns(
    jobs: Mapping[str, Any],
    batches: Sequence[Any],
    warmup: int,
    local: Callable[[Any, Any], Any] = lambda job, batch: batch,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Every side's step on every batch, taken in turns: each side's timed seconds (after
    ``warmup`` batches) and every loss. ``local`` gives a job its rank's part of a batch."""
    names = list(jobs)
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for i, batch in enumerate(batches):
        for name in names if i % 2 == 0 else reversed(names):
            seconds, loss = timed_step(jobs[name], local(jobs[name], batch))
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(seconds)
    return times, losses
