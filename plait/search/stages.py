"""The pipeline stage partitioner: contiguous stages, the busiest as light as it can be.

Ops keep graph order; stage ``s`` gets the ops between two cut points. When the graph has
repeated layers, cuts fall only at layer boundaries (a stage holds whole layers, as in
Megatron and MindSpore's ``pipeline_stage`` per cell); otherwise any op boundary may be cut.
The runs of ops between allowed cuts are the blocks; the stages are contiguous runs of blocks.

The partition minimises the busiest stage's compute (the pipeline runs at its pace: a step
is about ``micro_batches + stages - 1`` of its turns), not the distance of each cut from
``s / stages`` of the total, which overloads the first or last stage when the embedding or
the head is heavy. With per-op memory figures (:class:`StageMemory`) a stage's memory is its
model states plus its activations times the micro-batches its schedule keeps in flight
(1F1B: ``stages - s``, the first stage the most); a partition within the memory limit is
preferred over a faster one that is not (when none is within it, the fastest is taken), and
among the fastest the one with the lowest peak memory. What ties remain go to the partition
whose stages, from the last back, each come nearest an even share of what is left (the
earlier start when two are as near: the later stage, where 1F1B keeps fewer micro-batches in
flight, takes more).

How: the best bottleneck is found by bisection on it, each probe a reachability pass over the
blocks (stage by stage, which block ends a feasible prefix: ``O(stages x blocks)`` with
numpy), then the lowest peak memory the same way at that bottleneck. Two bottlenecks within
a relative ``1e-9`` are one (float sums of op times are not exact beyond that).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from plait.config import ParallelConfig
from plait.cost.memory import Schedule, StateBytes, in_flight_micro_batches
from plait.cost.step_memory import StepTrace
from plait.errors import ConfigError
from plait.graph import OpGraph
from plait.layout import TensorLayout
from plait.rules.registry import OpStrategy

__all__ = [
    "StageMemory",
    "allowed_cuts",
    "assign_stages",
    "balanced_cuts",
    "op_memory",
    "stage_memory_figures",
]

_TIE = 1e-9  # relative: bottlenecks (and peaks) closer than this are equal
_Floats = npt.NDArray[np.float64]
_Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Memory figures for the partitioner, per op in graph order (or per block for
    :func:`balanced_cuts`).

    ``state_bytes``: model states of the parameters the op reads first (they live in its
    stage); ``activation_bytes``: bytes it keeps for backward over the whole step's batch;
    ``in_flight``: per stage, the fraction of the step's batch whose activations the stage
    holds at its peak (its schedule's micro-batches in flight over ``micro_batches``);
    ``limit``: bytes a device has, or None (then memory only breaks ties).
    """

    state_bytes: Sequence[float]
    activation_bytes: Sequence[float]
    in_flight: Sequence[float]
    limit: float | None = None


def op_memory(
    trace: StepTrace,
    chosen: Sequence[OpStrategy],
    pieces: Callable[[TensorLayout], int],
    precision: str,
    activation_scale: float,
) -> tuple[list[float], list[float]]:
    """Per op (graph order): the model-state bytes of the parameters it reads first, and the
    activation bytes kept for its backward (whole step's batch, this device's pieces).

    A partitioner's figure, not the peak (:mod:`plait.cost.memory` walks that once the stages
    are known): no ZeRO, no recompute, no transient buffers, so that it is the same for every
    setting the outer planner weighs on one mesh. A saved output is counted at its producer,
    once; a saved buffer of its own (a norm's statistics) at the op that saves it.
    ``activation_scale``: bytes of a float32 activation under autocast, per float32 byte."""
    graph = trace.graph
    per_element = StateBytes.for_precision(precision)
    trained = per_element.parameter + per_element.gradient + per_element.optimizer
    states = [0.0] * len(graph.ops)
    kept = [0.0] * len(graph.ops)
    placed: set[str] = set()
    counted: set[str] = set()

    def local(i: int, k: int) -> float:
        meta = graph.ops[i].outputs[k]
        nbytes = meta.nbytes // pieces(chosen[i].outputs[k])
        return nbytes * activation_scale if meta.dtype == "float32" else float(nbytes)

    for i, op in enumerate(graph.ops):
        for j, ref in enumerate(op.inputs):
            g = trace.inputs.get(ref)
            if g is None or g.kind != "parameter" or ref in placed:
                continue
            placed.add(ref)
            numel = g.meta.numel // pieces(chosen[i].inputs[j])
            states[i] += numel * (trained if g.requires_grad else per_element.parameter)
        for root, _, _, ratio in trace.saved[i]:
            if root in trace.inputs:
                kept[i] += float(ratio or 0) * trace.inputs[root].meta.nbytes
                continue
            p, k = trace.out_slot[root]
            if ratio is not None:
                kept[i] += float(ratio) * local(p, k)
            elif root not in counted:
                counted.add(root)
                kept[p] += local(p, k)
    return states, kept


def stage_memory_figures(
    figures: tuple[Sequence[float], Sequence[float]], cfg: ParallelConfig, limit: float | None
) -> StageMemory:
    """:class:`StageMemory` of :func:`op_memory`'s figures under ``cfg``'s schedule: each
    stage holds the micro-batches in flight at its peak (``plait.planning.timeline``'s count:
    GPipe all of them, 1F1B ``stages - s``), as a fraction of the step's batch."""
    states, kept = figures
    schedule, m = cfg.schedule, cfg.micro_batches
    chunks = (cfg.virtual_stages or 1) if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    held = cast(Schedule, "interleaved_1f1b" if schedule == "zero_bubble" else schedule)
    stages = cfg.pipeline_stages
    in_flight = [
        float(in_flight_micro_batches(s, stages, m, held, chunks)) / m for s in range(stages)
    ]
    return StageMemory(states, kept, in_flight, limit)


def allowed_cuts(graph: OpGraph) -> list[int]:
    """Op indices a stage may start at (index 0 excluded)."""
    if not graph.layers:
        return list(range(1, len(graph.ops)))
    cuts = []
    previous = graph.ops[0].layer
    for n, op in enumerate(graph.ops[1:], start=1):
        if op.layer != previous and op.layer is not None:
            cuts.append(n)  # the first op of a layer member
        previous = op.layer
    return cuts


def assign_stages(
    graph: OpGraph,
    op_seconds: Mapping[str, float],
    stages: int,
    memory: StageMemory | None = None,
) -> list[int]:
    """Stage index of every op, in graph order (module doc: the min-max partition)."""
    cuts = allowed_cuts(graph)
    if len(cuts) < stages - 1:
        raise ConfigError(
            f"pipeline_stages={stages} but the graph offers only {len(cuts) + 1} places to cut "
            f"({(len(graph.layers) and 'at repeated-layer boundaries') or 'between ops'}); "
            f"use at most {len(cuts) + 1} stages"
        )
    bounds = [0, *cuts, len(graph.ops)]
    times = _block_sums([op_seconds[op.name] for op in graph.ops], bounds)
    blocks_memory = None
    if memory is not None:
        blocks_memory = StageMemory(
            _block_sums(memory.state_bytes, bounds),
            _block_sums(memory.activation_bytes, bounds),
            memory.in_flight,
            memory.limit,
        )
    starts = [bounds[b] for b in balanced_cuts(times, stages, blocks_memory)]
    stage_of = []
    s = 0
    for n in range(len(graph.ops)):
        while s < len(starts) and n >= starts[s]:
            s += 1
        stage_of.append(s)
    return stage_of


def _block_sums(values: Sequence[float], bounds: Sequence[int]) -> list[float]:
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))
    at = np.asarray(bounds)
    return list(map(float, prefix[at[1:]] - prefix[at[:-1]]))


def balanced_cuts(
    times: Sequence[float], stages: int, memory: StageMemory | None = None
) -> list[int]:
    """Block indices where stages ``1 .. stages-1`` start: the contiguous partition of the
    blocks (``times``: each block's compute, >= 0) into ``stages`` non-empty stages whose
    busiest stage is the lightest (module doc for memory and ties)."""
    k = len(times)
    if not 1 <= stages <= k:
        raise ValueError(f"cannot cut {k} blocks into {stages} non-empty stages")
    if stages == 1:
        return []
    probe = _Probe(times, stages, memory)
    found = probe.reach(np.inf, probe.limit) if memory is not None else None
    if found is None:  # no partition fits the memory limit (or none is given): speed alone
        probe.limit = np.inf
        found = probe.reach(np.inf, np.inf)
    assert found is not None  # k >= stages: some partition exists
    cuts = probe.recover(found, np.inf, probe.limit)
    best = probe.bottleneck(cuts)
    low = max(max(times), probe.prefix[-1] / stages)
    while best > low * (1 + _TIE):
        mid = (low + best) / 2
        rows = probe.reach(mid, probe.limit)
        if rows is None:
            low = mid
            continue
        cuts = probe.recover(rows, mid, probe.limit)
        best = probe.bottleneck(cuts)
    if memory is None:
        return cuts
    # the lowest peak memory among partitions as fast as the best
    at = best * (1 + _TIE)
    peak, floor = probe.peak(cuts), 0.0
    while peak > floor * (1 + _TIE) + 1:
        mid = (floor + peak) / 2
        rows = probe.reach(at, mid)
        if rows is None:
            floor = mid
            continue
        cuts = probe.recover(rows, at, mid)
        peak = probe.peak(cuts)
    return cuts


class _Probe:
    """Prefix sums of the blocks and the reachability pass behind :func:`balanced_cuts`.

    Position ``x`` (0..k) is the boundary after ``x`` blocks; stage ``s`` spans ``(y, x]``.
    A stage's time and memory only grow as it takes more blocks, so for each end ``x`` the
    starts it may have are ``y >= lowest(x)``: one ``searchsorted`` per stage and probe.
    """

    def __init__(self, times: Sequence[float], stages: int, memory: StageMemory | None) -> None:
        self.stages = stages
        self.k = len(times)
        self.prefix: _Floats = np.concatenate(([0.0], np.cumsum(np.asarray(times, np.float64))))
        self.limit: float = np.inf
        self.memory: list[_Floats] = []  # per stage: prefix of states + in-flight activations
        if memory is not None:
            states = np.concatenate(([0.0], np.cumsum(np.asarray(memory.state_bytes, np.float64))))
            acts = np.concatenate(
                ([0.0], np.cumsum(np.asarray(memory.activation_bytes, np.float64)))
            )
            if len(memory.in_flight) != stages:
                raise ValueError(f"in_flight has {len(memory.in_flight)} entries, not {stages}")
            self.memory = [states + float(f) * acts for f in memory.in_flight]
            self.limit = np.inf if memory.limit is None else float(memory.limit)
        self.ends = np.arange(self.k + 1)

    def _lowest(self, s: int, time: float, limit: float) -> npt.NDArray[np.intp]:
        """Per end ``x``: the first start ``y`` whose stage ``s`` fits ``time`` and ``limit``."""
        lowest = np.searchsorted(self.prefix, self.prefix - time, side="left")
        if self.memory and limit != np.inf:
            q = self.memory[s]
            lowest = np.maximum(lowest, np.searchsorted(q, q - limit, side="left"))
        return lowest

    def reach(self, time: float, limit: float) -> list[_Bools] | None:
        """Per stage, the ends a feasible prefix of that many stages can have; None when the
        last stage cannot end at ``k``."""
        rows: list[_Bools] = []
        previous = np.zeros(self.k + 1, dtype=bool)
        previous[0] = True
        for s in range(self.stages):
            count = np.cumsum(previous)  # previous ends at or before each position
            lowest = self._lowest(s, time, limit)
            last = self.ends - 1
            below = np.where(lowest > 0, count[np.maximum(lowest - 1, 0)], 0)
            current = (last >= lowest) & (count[np.maximum(last, 0)] - below > 0)
            current[0] = False
            current[self.k - (self.stages - 1 - s) + 1 :] = False  # room for the rest
            rows.append(current)
            previous = current
        return rows if previous[self.k] else None

    def recover(self, rows: list[_Bools], time: float, limit: float) -> list[int]:
        """A partition through ``rows``: from the last stage back, each stage's start the
        feasible one nearest its even share of what is left (ties: the earlier start, a
        longer later stage), so stages the bottleneck does not bind stay even too."""
        cuts: list[int] = []
        x = self.k
        for s in range(self.stages - 1, 0, -1):
            lowest = int(self._lowest(s, time, limit)[x])
            starts = lowest + np.flatnonzero(rows[s - 1][lowest:x])
            share = self.prefix[x] * s / (s + 1)
            y = int(starts[int(np.argmin(np.abs(self.prefix[starts] - share)))])
            cuts.append(y)
            x = y
        return cuts[::-1]

    def _spans(self, cuts: Sequence[int]) -> list[tuple[int, int]]:
        at = [0, *cuts, self.k]
        return list(itertools.pairwise(at))

    def bottleneck(self, cuts: Sequence[int]) -> float:
        return max(float(self.prefix[b] - self.prefix[a]) for a, b in self._spans(cuts))

    def peak(self, cuts: Sequence[int]) -> float:
        return max(
            float(self.memory[s][b] - self.memory[s][a])
            for s, (a, b) in enumerate(self._spans(cuts))
        )
