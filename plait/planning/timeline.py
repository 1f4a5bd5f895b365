"""Pipeline schedules as timelines: the order each schedule runs, its times, a picture.

A pipeline step runs every micro-batch's forward and backward through the stages in an order
the schedule fixes. This module writes that order down per rank (:func:`schedule_order`: the
orders ``torch.distributed.pipelining``'s schedules run), times it on per-rank durations
(:func:`simulate`: each pass starts when its rank is free and its input has arrived) and
draws the result (:meth:`Timeline.to_png`, with matplotlib: :mod:`plait.planning.plots`) or
writes it as a Chrome trace (:meth:`Timeline.to_chrome_trace`, for chrome://tracing and
Perfetto). A measured step is
the same :class:`Timeline`: the runtime's ``StageTimer`` (:mod:`plait.runtime.pipeline.stage_timer`)
times the passes of a real run's stages and :func:`timeline_from_records` puts the ranks'
records together.

The bubble's closed form the planner predicts with (:func:`bubble_seconds`) lives here too,
next to the schedules it describes (docs/planner.md, "Pipeline timeline", cites it); the
micro-batches a schedule keeps in flight are the memory model's
(:func:`plait.cost.memory.in_flight_micro_batches`).

No process group; matplotlib (the extra ``plait[plot]``) only when a picture is drawn.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from plait.config import SPLIT_BACKWARD
from plait.errors import PlanError

if TYPE_CHECKING:  # plan_timeline reads a plan's contents; the Plan calls it
    from plait.planning.entries import PlanContents

__all__ = [
    "BACKWARD_FLOPS_FACTOR",
    "KINDS",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "Action",
    "StageTimes",
    "Timeline",
    "TimelineEvent",
    "bubble_seconds",
    "copies_timeline",
    "plan_timeline",
    "schedule_order",
    "simulate",
    "stage_rank",
    "timeline_from_records",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v")
"""plait's schedule names (``ParallelConfig.schedule``)."""
COMPUTE_KINDS = ("forward", "backward", "weight")
KINDS = (*COMPUTE_KINDS, "communication")
"""What a timeline event is: a forward pass, a backward pass (the whole backward, or only the
input gradient where the schedule runs the weight gradient apart), a weight-gradient pass, or
communication (an activation or gradient sent between ranks, the step's gradient reduction)."""
BACKWARD_FLOPS_FACTOR = 2
"""Backward costs about twice the forward: an input-gradient and a weight-gradient pass of
about one forward each (the planner's split of a stage's compute)."""
PP_AXIS = "pp"


# --------------------------------------------------------------------------- closed forms


def bubble_seconds(
    schedule: str,
    stages: int,
    forward_s: float,
    backward_s: float,
    weight_s: float = 0.0,
    virtual_stages: int = 1,
) -> float:
    """Predicted idle time of one step on a pipeline rank (docs/planner.md cites each form).

    ``forward_s`` and ``backward_s`` are one micro-batch's passes through one rank's share of
    the model (communication included), ``weight_s`` the weight-gradient part of the backward;
    ``F``, ``B = backward_s - weight_s`` (input gradient) and ``W`` below. ``p`` ranks:

    - ``gpipe``, ``1f1b``: ``(p - 1)(F + B + W)``, a fraction ``(p - 1) / (m + p - 1)`` of
      the step (Huang et al. 2019; Narayanan et al. 2021);
    - ``interleaved_1f1b`` with ``v`` chunks a rank: that divided by ``v`` (Narayanan et al.
      2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM");
    - ``zero_bubble``: ZB-H1's ``(p - 1)(F + B - W)`` (Qi et al. 2023, "Zero Bubble Pipeline
      Parallelism": the weight passes fill the ramps), divided by ``v`` when interleaved, and
      never less than a forward or an input-gradient pass per ramp step;
    - ``zero_bubble_v``: ``(p - 1) max(F, B, F + B - 2W) / 2``: ZB-V's two half-size chunks,
      whose ramps take a weight pass more; with ``F = B = W`` the ranks only start one
      forward apart (the paper's "zero" counts a steady state where steps overlap).
    """
    p, v = stages, virtual_stages
    f, b, w = forward_s, backward_s - weight_s, weight_s
    if p <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * (f + b + w)
    if schedule == "interleaved_1f1b":
        return (p - 1) * (f + b + w) / v
    if schedule == "zero_bubble":
        return (p - 1) * max(f, b, f + b - w) / v
    if schedule == "zero_bubble_v":
        return (p - 1) * max(f, b, f + b - 2 * w) / 2
    raise _bad_schedule(schedule)


def _bad_schedule(schedule: object) -> PlanError:
    return PlanError(
        f"schedule={schedule!r} is not a pipeline schedule; use one of "
        + ", ".join(map(repr, SCHEDULES))
    )


# --------------------------------------------------------------------------- schedule orders


@dataclass(frozen=True, slots=True)
class Action:
    """One pass of a schedule: ``kind`` ("forward", "backward" or "weight") of micro-batch
    ``micro_batch`` through model chunk ``stage`` (0 .. stages x virtual stages - 1)."""

    kind: str
    stage: int
    micro_batch: int

    @property
    def short(self) -> str:
        """``F3``, ``B3``, ``W3``: the pass and its micro-batch, as pipeline diagrams write it."""
        return f"{self.kind[0].upper()}{self.micro_batch}"


def stage_rank(schedule: str, stage: int, stages: int) -> int:
    """The pipeline rank that runs model chunk ``stage``: looped (``stage % stages``), or the
    V of ``zero_bubble_v`` (rank r runs chunks r and 2 stages - 1 - r)."""
    if schedule == "zero_bubble_v":
        return stage if stage < stages else 2 * stages - 1 - stage
    return stage % stages


def schedule_order(
    schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """The passes each pipeline rank runs, in order (one tuple per rank).

    ``gpipe``: every forward, then every backward. ``1f1b``: rank r runs ``p - r`` forwards,
    then alternates backward and forward, then the remaining backwards. ``interleaved_1f1b``
    and ``zero_bubble``: the same over ``v`` chunks a rank, forwards by chunk in rounds of
    micro-batches (Megatron's depth-first order; zero bubble warms up half as far and runs each
    weight gradient as a pass of its own, deferred by the rank's index). ``zero_bubble_v``:
    two chunks a rank in a V, each backward split into input and weight passes (ZB-V).
    """
    _check_pipeline(schedule, stages, micro_batches, virtual_stages)
    builders: dict[str, Callable[[int, int, int, int], list[Action]]] = {
        "gpipe": _gpipe_order,
        "1f1b": _one_f_one_b_order,
        "interleaved_1f1b": functools.partial(_interleaved_order, zero_bubble=False),
        "zero_bubble": functools.partial(_interleaved_order, zero_bubble=True),
        "zero_bubble_v": _v_order,
    }
    build = builders[schedule]
    return tuple(tuple(build(r, stages, micro_batches, virtual_stages)) for r in range(stages))


def _check_pipeline(schedule: str, stages: int, micro_batches: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise _bad_schedule(schedule)
    for name, value in (
        ("stages", stages),
        ("micro_batches", micro_batches),
        ("virtual_stages", virtual_stages),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"pipeline timeline: {name}={value!r}; give an integer >= 1")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise PlanError(
            f"pipeline timeline: schedule {schedule!r} runs one chunk a rank, not "
            f"virtual_stages={virtual_stages}; use 'interleaved_1f1b' for several"
        )
    if schedule == "zero_bubble_v" and virtual_stages != 2:
        raise PlanError(
            f"pipeline timeline: schedule 'zero_bubble_v' runs exactly 2 chunks a rank, not "
            f"virtual_stages={virtual_stages}"
        )


def _gpipe_order(rank: int, stages: int, m: int, v: int) -> list[Action]:
    return [Action("forward", rank, i) for i in range(m)] + [
        Action("backward", rank, i) for i in range(m)
    ]


def _one_f_one_b_order(rank: int, stages: int, m: int, v: int) -> list[Action]:
    # The warm-up fills the pipeline up to this rank: p - rank forwards before the first
    # backward returns (the last rank runs forward then backward at once).
    warm = min(m, stages - rank)
    out = [Action("forward", rank, i) for i in range(warm)]
    for i in range(m):
        out.append(Action("backward", rank, i))
        if warm + i < m:
            out.append(Action("forward", rank, warm + i))
    return out


def _rounds(stages: int, m: int) -> int:
    """Micro-batches per round of the interleaved schedules (torch: rounds of about ``p``)."""
    rounds = max(1, m // stages)
    if m % rounds:
        raise PlanError(
            f"pipeline timeline: interleaved schedules run micro-batches in {rounds} rounds, "
            f"and micro_batches={m} does not divide into them; use a multiple of {rounds}"
        )
    return m // rounds


def _interleaved_order(
    rank: int, stages: int, m: int, v: int, *, zero_bubble: bool
) -> list[Action]:
    p, per_round, total = stages, _rounds(stages, m), m * v
    # Forwards go chunk by chunk in rounds; the warm-up runs the other chunks' first round
    # ahead, plus two passes (one for zero bubble) for each rank after this one.
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), total)
    next_forward, next_backward = [0] * v, [0] * v

    def forward(k: int) -> Action:
        chunk = (k // per_round) % v
        next_forward[chunk] += 1
        return Action("forward", chunk * p + rank, next_forward[chunk] - 1)

    def backward(k: int) -> Action:
        chunk = v - 1 - (k // per_round) % v  # backwards return through the chunks in reverse
        next_backward[chunk] += 1
        return Action("backward", chunk * p + rank, next_backward[chunk] - 1)

    out = [forward(k) for k in range(warm)]
    weights: deque[Action] = deque()
    for k in range(total):
        if warm + k < total:
            out.append(forward(warm + k))
        done = backward(k)
        out.append(done)
        if zero_bubble:
            # Weight passes wait `rank` backwards, then trail one behind each: the last ranks'
            # deferred weight passes fill the tail where 1F1B idles (ZB-H1).
            weights.append(Action("weight", done.stage, done.micro_batch))
            if k >= rank:
                out.append(weights.popleft())
    return out + list(weights)


def _v_order(rank: int, stages: int, m: int, v: int) -> list[Action]:
    """ZB-V (Qi et al. 2023, section 6; torch's ScheduleZBVZeroBubble): chunk 0 goes down the
    ranks, chunk 1 comes back up, so the last rank turns a micro-batch around at once."""
    p = stages
    n = max(2 * p - 1, m)  # planned as if the pipeline were full, extra passes dropped below
    order = _VOrder((rank, 2 * p - 1 - rank))
    f = order.counts["forward"]
    for _ in range(2 * (p - rank) - 1):
        order.run("forward", 0)
    for _ in range(rank):
        order.run("forward", 1)
        order.run("forward", 0)
    for _ in range(p - rank):
        order.run_all(1)
    while f[1] < f[0] or f[0] < n:  # steady: each chunk's forward, input and weight passes
        if f[0] < n:
            order.run("forward", 0)
        order.run("backward", 0)
        order.run("weight", 0)
        order.run_all(1)
    order.cool_down(rank, p)
    return [a for a in order.out if a.micro_batch < m]


class _VOrder:
    """The passes of one rank's two V chunks, counted per kind and chunk as they are added."""

    def __init__(self, chunk_stage: tuple[int, int]) -> None:
        self.chunk_stage = chunk_stage
        self.counts = {kind: [0, 0] for kind in COMPUTE_KINDS}
        self.out: list[Action] = []

    def run(self, kind: str, chunk: int) -> None:
        self.out.append(Action(kind, self.chunk_stage[chunk], self.counts[kind][chunk]))
        self.counts[kind][chunk] += 1

    def run_all(self, chunk: int) -> None:
        for kind in COMPUTE_KINDS:
            self.run(kind, chunk)

    def cool_down(self, rank: int, p: int) -> None:
        """The input gradients left, then the weight passes they deferred."""
        b, w = self.counts["backward"], self.counts["weight"]
        for _ in range(rank):
            self.run("backward", 0)
            self.run("backward", 1)
        for _ in range(p - rank):
            self.run("backward", 0)
            self.run("weight", 0)
        for chunk in (1, 0):
            while w[chunk] < b[chunk]:
                self.run("weight", chunk)


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True, slots=True)
class StageTimes:
    """What one pipeline rank's passes take for one micro-batch, over its whole share of the
    model (with ``v`` chunks a rank, each chunk's pass takes ``1/v`` of it).

    ``backward_s`` is the whole backward; ``weight_s`` its weight-gradient part, which the
    zero-bubble schedules run as a pass of its own. ``send_s`` is one activation sent to the
    next rank (its gradient coming back is taken to take as long); ``sync_s`` runs once a step
    after the rank's last pass (the gradient reduction over data parallel).
    """

    forward_s: float
    backward_s: float
    weight_s: float = 0.0
    send_s: float = 0.0
    sync_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "weight_s", "send_s", "sync_s"):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                raise PlanError(f"StageTimes.{name}={value!r}; give seconds >= 0")
        if self.weight_s > self.backward_s:
            raise PlanError(
                f"StageTimes.weight_s={self.weight_s} exceeds backward_s={self.backward_s}; "
                "the weight gradient is part of the backward"
            )


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One timed piece of a step on pipeline rank ``rank`` (``kind`` from :data:`KINDS`)."""

    rank: int
    kind: str
    start_s: float
    end_s: float
    stage: int = -1
    micro_batch: int = -1
    name: str = ""

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind in COMPUTE_KINDS and self.micro_batch >= 0:
            return f"{self.kind[0].upper()}{self.micro_batch}"
        return self.kind


def simulate(
    schedule: str,
    stages: int,
    micro_batches: int,
    times: StageTimes | Sequence[StageTimes],
    virtual_stages: int = 1,
    *,
    labels: Sequence[str] | None = None,
    title: str = "",
) -> Timeline:
    """The timeline of one step: each rank runs :func:`schedule_order`'s passes in order, each
    pass starting when its rank is free and its input is there (the previous chunk's pass
    done, plus ``send_s`` when that chunk is on another rank). Sends do not hold up the sender.

    ``times`` is one :class:`StageTimes` for every rank, or one per rank.
    """
    orders = schedule_order(schedule, stages, micro_batches, virtual_stages)
    per_rank = _per_rank(times, stages)
    chunks = stages * virtual_stages
    rank_of = [stage_rank(schedule, s, stages) for s in range(chunks)]
    split = schedule in SPLIT_BACKWARD

    def seconds(a: Action) -> float:
        t = per_rank[rank_of[a.stage]]
        if a.kind == "forward":
            return t.forward_s / virtual_stages
        if a.kind == "weight":
            return t.weight_s / virtual_stages
        return (t.backward_s - (t.weight_s if split else 0.0)) / virtual_stages

    ends: dict[tuple[str, int, int], float] = {}
    events: list[TimelineEvent] = []
    clock, at = [0.0] * stages, [0] * stages
    while any(at[r] < len(orders[r]) for r in range(stages)):
        moved = False
        for r in range(stages):
            while at[r] < len(orders[r]):
                action = orders[r][at[r]]
                ready = _ready(action, ends, rank_of, per_rank, chunks)
                if ready is None:
                    break
                start = max(clock[r], ready)
                clock[r] = start + seconds(action)
                ends[(action.kind, action.stage, action.micro_batch)] = clock[r]
                events.append(
                    TimelineEvent(r, action.kind, start, clock[r], action.stage, action.micro_batch)
                )
                events += _sends(action, r, clock[r], rank_of, per_rank[r], chunks)
                at[r] += 1
                moved = True
        if not moved:  # an order that waits on itself: a bug in an order above, not the user's
            stuck = {r: orders[r][at[r]].short for r in range(stages) if at[r] < len(orders[r])}
            raise PlanError(f"pipeline timeline: {schedule} waits forever at {stuck}")
    for r, t in enumerate(per_rank):
        if t.sync_s > 0:
            events.append(
                TimelineEvent(
                    r, "communication", clock[r], clock[r] + t.sync_s, name="gradient sync"
                )
            )
    rows = tuple(labels) if labels is not None else tuple(f"pp {r}" for r in range(stages))
    return Timeline(tuple(events), rows, title)


def _per_rank(times: StageTimes | Sequence[StageTimes], stages: int) -> list[StageTimes]:
    if isinstance(times, StageTimes):
        return [times] * stages
    given = list(times)
    if len(given) != stages or not all(isinstance(t, StageTimes) for t in given):
        raise PlanError(
            f"pipeline timeline: give one StageTimes, or one per rank ({stages}); got "
            f"{len(given)} values"
        )
    return given


def _ready(
    a: Action,
    ends: Mapping[tuple[str, int, int], float],
    rank_of: Sequence[int],
    per_rank: Sequence[StageTimes],
    chunks: int,
) -> float | None:
    """When ``a``'s inputs are there, or None while a pass it needs has not run."""
    if a.kind == "forward":
        needs = [("forward", a.stage - 1)] if a.stage > 0 else []
    elif a.kind == "backward":
        later = [("backward", a.stage + 1)] if a.stage < chunks - 1 else []
        needs = [("forward", a.stage), *later]
    else:
        needs = [("backward", a.stage)]
    ready = 0.0
    for kind, stage in needs:
        end = ends.get((kind, stage, a.micro_batch))
        if end is None:
            return None
        if rank_of[stage] != rank_of[a.stage]:
            end += per_rank[rank_of[stage]].send_s
        ready = max(ready, end)
    return ready


def _sends(
    a: Action, rank: int, end: float, rank_of: Sequence[int], times: StageTimes, chunks: int
) -> list[TimelineEvent]:
    """The transfer a finished pass starts: its activation forward, its gradient back."""
    if times.send_s <= 0 or a.kind == "weight":
        return []
    to = a.stage + 1 if a.kind == "forward" else a.stage - 1
    if not 0 <= to < chunks or rank_of[to] == rank:
        return []
    what = "activation" if a.kind == "forward" else "gradient"
    return [
        TimelineEvent(
            rank, "communication", end, end + times.send_s, a.stage, a.micro_batch,
            f"send {what} {a.micro_batch}",
        )
    ]  # fmt: skip


# --------------------------------------------------------------------------- the timeline


@dataclass(frozen=True)
class Timeline:
    """A pipeline step as timed events, one row per pipeline rank (``labels``).

    Predicted (:func:`simulate`, :func:`plan_timeline`) or measured
    (:func:`timeline_from_records`). A rank's bubble is the time before the last pass of the
    step ends that it runs no pass: waiting for a neighbour's activation or gradient.
    """

    events: tuple[TimelineEvent, ...]
    labels: tuple[str, ...]
    title: str = ""
    measured: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        object.__setattr__(self, "labels", tuple(self.labels))
        for e in self.events:
            if e.kind not in KINDS:
                raise PlanError(f"timeline event kind {e.kind!r}; use one of {KINDS}")
            if not 0 <= e.rank < len(self.labels):
                raise PlanError(
                    f"timeline event on rank {e.rank}, but the timeline has {len(self.labels)} "
                    "rows; give a label per rank"
                )

    @property
    def ranks(self) -> int:
        return len(self.labels)

    def compute(self, rank: int) -> list[TimelineEvent]:
        """The passes ``rank`` ran, in time order."""
        return sorted(
            (e for e in self.events if e.rank == rank and e.kind in COMPUTE_KINDS),
            key=lambda e: (e.start_s, e.end_s),
        )

    def order(self, rank: int) -> list[str]:
        """``["F0", "F1", "B0", ...]``: the passes of ``rank`` in the order they ran."""
        return [e.label for e in self.compute(rank)]

    @property
    def span_s(self) -> float:
        """From the step's start to its last event's end (gradient reduction included)."""
        return max((e.end_s for e in self.events), default=0.0)

    @property
    def pipeline_s(self) -> float:
        """From the step's start to the end of its last pass."""
        return max((e.end_s for e in self.events if e.kind in COMPUTE_KINDS), default=0.0)

    def busy_s(self, rank: int) -> float:
        return sum(e.seconds for e in self.compute(rank))

    def idle(self, rank: int) -> list[tuple[float, float]]:
        """The gaps of ``rank`` before the pipeline's last pass ends: its bubble."""
        gaps, at = [], 0.0
        for e in self.compute(rank):
            if e.start_s > at:
                gaps.append((at, e.start_s))
            at = max(at, e.end_s)
        if self.pipeline_s > at:
            gaps.append((at, self.pipeline_s))
        return gaps

    @property
    def bubble_s(self) -> float:
        """The step's bubble: the pipeline's time less the busiest rank's passes."""
        return self.pipeline_s - max((self.busy_s(r) for r in range(self.ranks)), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.pipeline_s if self.pipeline_s > 0 else 0.0

    def peak_in_flight(self, rank: int) -> Fraction:
        """The most micro-batches whose activations ``rank`` held at once: a chunk's activation
        is kept from its forward's end to its last backward pass's end, in units of the rank's
        whole share (a chunk of ``v`` counts ``1/v``)."""
        passes = self.compute(rank)
        chunks = len({e.stage for e in passes}) or 1
        last: dict[tuple[int, int], TimelineEvent] = {}
        for e in passes:
            if e.kind != "forward":
                last[(e.stage, e.micro_batch)] = e  # the later of backward and weight wins
        changes = [(e.end_s, 1) for e in passes if e.kind == "forward"]
        changes += [(e.end_s, -1) for e in last.values()]
        held = peak = 0
        for _, change in sorted(changes, key=lambda c: (c[0], c[1])):
            held += change
            peak = max(peak, held)
        return Fraction(peak, chunks)

    # ------------------------------------------------------------------- files

    def chrome_trace(self) -> dict[str, Any]:
        """The Trace Event Format (chrome://tracing, Perfetto): one process per pipeline rank,
        thread 0 its passes, thread 1 its communication; complete ("X") events in us."""
        events: list[dict[str, Any]] = []
        for r, label in enumerate(self.labels):
            events += [
                {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": label}},
                {"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
                 "args": {"sort_index": r}},
                {"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "passes"}},
                {"name": "thread_name", "ph": "M", "pid": r, "tid": 1,
                 "args": {"name": "communication"}},
            ]  # fmt: skip
        for e in sorted(self.events, key=lambda e: (e.start_s, e.rank, e.kind)):
            events.append(
                {
                    "name": e.label,
                    "cat": e.kind,
                    "ph": "X",
                    "ts": round(e.start_s * 1e6, 3),
                    "dur": round(e.seconds * 1e6, 3),
                    "pid": e.rank,
                    "tid": 1 if e.kind == "communication" else 0,
                    "args": {"stage": e.stage, "micro_batch": e.micro_batch},
                }
            )
        other = {
            "title": self.title,
            "measured": self.measured,
            "bubble_s": self.bubble_s,
            "bubble_fraction": self.bubble_fraction,
        }
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`chrome_trace` as JSON to ``path`` (open it in Perfetto or chrome://tracing)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(), f, indent=1)
            f.write("\n")

    def png(self, width: int = 1200) -> bytes:
        """The picture (:func:`plait.planning.plots.timeline_figure`: one row per rank, time
        across, a colour per kind of pass, the bubble hatched) as PNG bytes, ``width`` pixels
        wide. Needs matplotlib (``pip install 'plait[plot]'``)."""
        from plait.planning import plots

        return plots.png_bytes(plots.timeline_figure(self, width=width))

    def to_png(self, path: str | os.PathLike[str], width: int = 1200) -> tuple[int, int]:
        """Write the picture to ``path``; returns its (width, height) in pixels."""
        from plait.planning import plots

        figure = plots.timeline_figure(self, width=width)
        plots.write_png(figure, path)
        w, h = figure.get_size_inches() * plots.DPI
        return round(w), round(h)


# --------------------------------------------------------------------------- from a plan


def plan_timeline(plan: PlanContents) -> Timeline:
    """The predicted schedule of ``plan``'s pipeline, simulated on its per-stage times; for a
    plan without stages that runs copies (``interleave_num > 1``), the copies' turns
    (:func:`copies_timeline`).

    A stage's compute per micro-batch is split by :data:`BACKWARD_FLOPS_FACTOR` (forward a
    third, the input and weight gradients a third each); its collectives inside the stage are
    spread over the passes of their phase, the activations it sends to the next stage are the
    sends, its gradient reductions and optimizer collectives the sync after its last pass.
    """
    p, m, v = plan.pipeline_stages, plan.micro_batches, plan.virtual_stages
    if p < 2 and plan.interleave_num > 1:
        return copies_timeline(plan)
    if p < 2:
        raise PlanError(
            f"plan for {plan.model or 'the model'} has 1 pipeline stage: there is no pipeline "
            "schedule to draw; plan with --pipeline-stages N (N > 1) or a mesh with a 'pp' "
            "axis (or --interleave-num 2: the copies' turns)"
        )
    times = _plan_stage_times(plan)
    title = (
        f"predicted {plan.schedule}: {p} stages"
        + (f" x {v} chunks" if v > 1 else "")
        + f", {m} micro-batches"
        + (f" ({plan.model})" if plan.model else "")
    )
    return simulate(plan.schedule, p, m, times, v, title=title)


def copies_timeline(plan: PlanContents, copies: int | None = None) -> Timeline:
    """One micro-step of a plan without pipeline stages, its copies (``interleave_num``)
    taking turns on the device as the program's pass orders them
    (:mod:`plait.runtime.program.interleave`): each copy runs its ops' compute until an op
    issues a collective, then the next copy computes while that collective is in flight; a
    copy waits for its collective before its next turn, and one collective runs at a time.
    Forward turns first, then backward (each op's compute split by
    :data:`BACKWARD_FLOPS_FACTOR`, ``PlannedOp.compute_s``), the ops' collectives at the ops
    the plan lists them under. One row, the device: its idle time (the timeline's bubble) is
    the collectives it waits for, which copies shorten. ``copies``: draw that many instead of
    the plan's (1: the same pieces one after another, nothing covered). The gradient
    reductions and the loss's, once a step, are not drawn."""
    k = plan.interleave_num if copies is None else copies
    if plan.pipeline_stages > 1 or k < 1:
        raise PlanError(
            f"copies_timeline: the plan has {plan.pipeline_stages} pipeline stages and {k} "
            "copies; it draws a plan without stages (plan.timeline() draws pipelines)"
        )
    if not any(op.compute_s for op in plan.ops):
        raise PlanError(
            f"plan for {plan.model or 'the model'} records no per-op compute (a file written "
            "before PlannedOp.compute_s): plan again to draw its copies"
        )
    turns = {phase: _turns(plan, phase) for phase in ("forward", "backward")}
    events: list[TimelineEvent] = []
    device = link = 0.0
    for phase in ("forward", "backward"):
        ready = [device] * k
        for index in range(len(turns[phase])):  # turn i of every copy, copy by copy
            for copy in range(k):
                compute, comm = turns[phase][index]
                start = max(device, ready[copy])
                device = start + compute
                events.append(TimelineEvent(0, phase, start, device, 0, copy))
                ready[copy] = device
                if comm > 0:
                    begin = max(device, link)
                    link = ready[copy] = begin + comm
                    events.append(
                        TimelineEvent(0, "communication", begin, link, 0, copy, f"copy {copy}")
                    )
        device = max([device, *ready])
    title = (
        f"predicted micro-step, {k} {'copy' if k == 1 else 'copies interleaved'}"
        + (f" ({plan.model})" if plan.model else "")
        + "; idle: waiting on the ops' collectives"
    )
    return Timeline(tuple(events), ("device",), title)


def _turns(plan: PlanContents, phase: str) -> list[tuple[float, float]]:
    """A copy's turns in ``phase``: (compute seconds, then the seconds of the collectives it
    issues) per run of ops ending at an op with collectives of that phase."""
    parameters = {p.name for p in plan.parameters}
    pieces = max(1, plan.grad_accumulation * plan.interleave_num)
    comm: dict[str, float] = {}
    for c in plan.collectives:
        if c.phase == phase and c.op not in parameters and PP_AXIS not in c.axes:
            comm[c.op] = comm.get(c.op, 0.0) + c.seconds * c.count / pieces
    share = 1 / (1 + BACKWARD_FLOPS_FACTOR)
    ops = list(plan.ops) if phase == "forward" else list(reversed(plan.ops))
    turns: list[tuple[float, float]] = []
    compute = 0.0
    for op in ops:
        compute += op.compute_s * (share if phase == "forward" else 1 - share)
        if comm.get(op.name, 0.0) > 0:
            turns.append((compute, comm[op.name]))
            compute = 0.0
    if compute > 0:
        turns.append((compute, 0.0))
    return turns


def _plan_stage_times(plan: PlanContents) -> list[StageTimes]:
    p, m = plan.pipeline_stages, plan.micro_batches
    # Files written before per-stage compute was recorded: every stage as the busiest.
    compute = list(plan.stage_compute_s) or [plan.predicted.compute_s] * p
    stage_of = {name: s for s, names in enumerate(plan.stages) for name in names}
    for param in plan.parameters:
        if param.op in stage_of:
            stage_of.setdefault(param.name, stage_of[param.op])
    parameters = {param.name for param in plan.parameters}
    forward, backward, send, sync = ([0.0] * p for _ in range(4))
    for c in plan.collectives:
        s = min(stage_of.get(c.op, 0), p - 1)
        if c.kind == "send_recv" and PP_AXIS in c.axes:
            if c.phase == "forward" and s > 0:
                send[s - 1] += c.seconds  # the activation entering stage s, per micro-batch
            continue
        if c.phase == "optimizer" or c.op in parameters:
            sync[s] += c.total_seconds
        elif c.phase == "forward":
            forward[s] += c.total_seconds
        else:
            backward[s] += c.total_seconds
    share = 1 / (1 + BACKWARD_FLOPS_FACTOR)
    return [
        StageTimes(
            forward_s=(compute[s] * share + forward[s]) / m,
            backward_s=(compute[s] * (1 - share) + backward[s]) / m,
            weight_s=compute[s] * share / m,
            send_s=send[s],
            sync_s=sync[s],
        )
        for s in range(p)
    ]


# --------------------------------------------------------------------------- a measured step

Record = tuple[int, str, int, int, float, float]
"""One timed pass of a real run: (pipeline rank, kind, stage index, micro-batch, start s, end s),
times from the rank's ``StageTimer.begin_step`` (:mod:`plait.runtime.pipeline.stage_timer`)."""


def timeline_from_records(
    records: Iterable[Sequence[Any]],
    *,
    labels: Sequence[str] | None = None,
    title: str = "",
) -> Timeline:
    """A measured :class:`Timeline` from every rank's ``StageTimer.records`` (flattened).

    Each rank's times are from its own step start; the previous step ended in an all-reduce
    over every rank, so the starts agree to that collective's skew. Rows are pipeline ranks
    0 .. the largest rank seen (or ``len(labels)``).
    """
    events = []
    for record in records:
        rank, kind, stage, micro_batch, start, end = record
        events.append(
            TimelineEvent(int(rank), str(kind), float(start), float(end), int(stage),
                          int(micro_batch))
        )  # fmt: skip
    rows = max((e.rank for e in events), default=0) + 1
    names = tuple(labels) if labels is not None else tuple(f"pp {r}" for r in range(rows))
    return Timeline(tuple(events), names, title, measured=True)
