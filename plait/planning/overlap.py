"""Communication hidden behind compute: the overlap the runtime gets, priced per stage.

What overlaps, and how the runtime gets it:

- **Data-parallel gradient reductions** (a bucket's all-reduce; ZeRO's reduce-scatter and
  HSDP's all-reduce across shard groups). A bucket starts as soon as backward has made its
  last gradient (``grad_sync``'s post-accumulate-grad hooks, FSDP2's reduce-scatter per
  module) and the buckets run one after another on the communication stream while backward
  goes on. With gradient accumulation or pipeline micro-batches only the last micro-step
  reduces, so only its backward can hide them. Simulated bucket by bucket: a bucket is ready
  when backward has passed the earliest op (in forward order) reading one of its parameters;
  what runs past the end of backward is exposed.
- **ZeRO-3's gathers** before forward and before backward (FSDP2 prefetches them). Issued in
  the order they are needed, back to back; compute waits where a bucket's gather is not done
  when its first reader runs. Simulated within one micro-step.

- **Pipeline transfers** (torch's schedules send asynchronously and receive a micro-batch's
  activation or gradient while the stage computes another one). In the steady state every
  micro-batch's transfer but one hides behind the passes between: of ``m`` transfers each
  way, ``m - 1`` hide. The one that does not is on the path every micro-batch waits for, and
  the fill and drain are the schedule's bubble, which counts each pass with its transfers
  (:func:`plait.planning.timeline.bubble_seconds`).

Not overlapped: tensor-parallel collectives (their result is the next op's input), the loss
reduction and gathers after the optimizer step (ZeRO-1 and 2).

How much of what could hide does is the hardware's ``comm_overlap`` (eta): the exposed
seconds are ``(1 - eta) * total + eta * simulated``. Datasheet GPUs overlap fully (NCCL's
kernels run on their own stream); ``plait calibrate`` measures it on ``local``, where the
cores that compute also run gloo's threads.

Called by the one predictor (:mod:`plait.planning.estimate`), whose prediction is both the
outer planner's and the assembled plan's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from plait.graph import OpGraph
from plait.planning.timeline import BACKWARD_FLOPS_FACTOR

__all__ = ["GATHER_BACKWARD", "GATHER_FORWARD", "P2P", "REDUCE", "Overlappable", "StageClock"]

REDUCE = "reduce"
"""A data-parallel gradient reduction: starts once backward has made its bucket."""
GATHER_FORWARD = "gather_forward"
"""ZeRO-3's gather of a bucket before forward: needed when its first reader runs."""
GATHER_BACKWARD = "gather_backward"
"""ZeRO-3's gather of a bucket again before backward: needed when backward reaches it."""
P2P = "p2p"
"""A pipeline transfer between stages, once per micro-batch: all but one hide."""
ROLES = (REDUCE, GATHER_FORWARD, GATHER_BACKWARD, P2P)


@dataclass(frozen=True, slots=True)
class Overlappable:
    """One collective that may run beside compute: its role, the parameters (graph values) of
    its bucket, and its seconds per step."""

    role: str
    members: tuple[str, ...]
    seconds: float


class StageClock:
    """When, inside one micro-step of each pipeline stage, forward reaches an op and backward
    has passed it: the op's forward and backward seconds (its recomputed forward counted in
    backward), split off its per-step time as :meth:`~plait.planning.estimate.MeshEstimate.predict` does."""

    def __init__(
        self,
        graph: OpGraph,
        stage_of: Mapping[str, int],
        op_time: Mapping[str, float],
        recomputed: Sequence[bool],
        stages: int,
        micro_batches: int,
    ) -> None:
        share = 1 / (1 + BACKWARD_FLOPS_FACTOR)
        forward = [0.0] * stages
        self._before: list[float] = []  # forward seconds of the op's stage before it
        own_backward: list[float] = []
        for op, again in zip(graph.ops, recomputed, strict=True):
            s = stage_of[op.name]
            t = op_time[op.name]
            self._before.append(forward[s])
            forward[s] += t * share
            own_backward.append(t - t * share + (t * share if again else 0.0))
        backward = [0.0] * stages
        self._after = [0.0] * len(graph.ops)  # backward seconds until the op's is done
        for i in range(len(graph.ops) - 1, -1, -1):
            s = stage_of[graph.ops[i].name]
            backward[s] += own_backward[i]
            self._after[i] = backward[s]
        self._own = own_backward
        self.backward_s = backward
        """Each stage's backward seconds in one micro-step (the window reductions hide in)."""
        self.micro_batches = micro_batches
        readers: dict[str, list[int]] = {}
        for i, op in enumerate(graph.ops):
            for ref in op.inputs:
                readers.setdefault(ref, []).append(i)
        self._readers = readers

    def with_micro_batches(self, micro_batches: int) -> StageClock:
        """The same clock for another micro-batch count (what the count changes is only how
        much of a micro-step each of them runs), sharing the per-op times."""
        other = copy.copy(self)
        other.micro_batches = micro_batches
        return other

    def _ready(self, members: Iterable[str]) -> float:
        """Backward seconds until every member's gradient is made: backward has passed the
        earliest reader of each."""
        return max((self._after[r[0]] for m in members if (r := self._readers.get(m))), default=0.0)

    def _needed_forward(self, members: Iterable[str]) -> float:
        return min(
            (self._before[r[0]] for m in members if (r := self._readers.get(m))), default=0.0
        )

    def _needed_backward(self, members: Iterable[str]) -> float:
        """Backward seconds before it reaches the last reader of a member."""
        return min(
            (self._after[r[-1]] - self._own[r[-1]] for m in members if (r := self._readers.get(m))),
            default=0.0,
        )

    def hidden(self, stage: int, items: Sequence[Overlappable], overlap: float) -> float:
        """Seconds of ``items`` (one stage's, in plan order) that run beside compute.

        The graph is one micro-step's (gradient accumulation); a pipeline's micro-batches
        each run ``1 / micro_batches`` of it.
        """
        if not items or overlap == 0.0:
            return 0.0
        n = self.micro_batches
        window = self.backward_s[stage]
        reduced = sorted((self._ready(i.members), i.seconds) for i in items if i.role == REDUCE)
        hidden = 0.0
        if reduced:
            end = 0.0
            for ready, seconds in reduced:
                end = max(end, ready / n) + seconds
            total = sum(seconds for _, seconds in reduced)
            hidden += max(0.0, total - max(0.0, end - window / n))  # >= 0 despite rounding
        for role, needed in (
            (GATHER_FORWARD, self._needed_forward),
            (GATHER_BACKWARD, self._needed_backward),
        ):
            gathers = sorted((needed(i.members), i.seconds) for i in items if i.role == role)
            done = wait = 0.0
            for need, seconds in gathers:
                done += seconds
                wait = max(wait, done - need / n)
            hidden += max(0.0, sum(seconds for _, seconds in gathers) - wait)
        sent = sorted(i.seconds for i in items if i.role == P2P)  # one order for every caller
        hidden += sum(seconds - seconds / n for seconds in sent)
        return overlap * hidden
