"""What one training step holds on a device, value by value, from a captured graph.

What a training step holds, value by value, from a captured graph: what autograd saves for
each op's backward (docs/memory.md, "How the plan predicts memory"), when each value dies in
forward, what recompute and activation offload keep off the device until backward, the
gradients backward allocates and frees, and the parameters' gradients bucket by bucket.
:class:`StepTrace` holds what does not depend on the mesh (one per graph and recompute
regions); :meth:`StepTrace.walk` sizes it with one mesh's layouts and walks one step per
pipeline stage; :func:`step_peak` adds the model states and finds the peak.

What autograd saves per op is :mod:`plait.cost.saved`; the model states per ZeRO level and the
closed forms are :mod:`plait.cost.memory`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from plait.cost.errors import CostError
from plait.cost.memory import (
    Accumulation,
    MemoryBreakdown,
    Recompute,
    StateBytes,
    model_state_memory,
)
from plait.cost.saved import (
    FLOATING_DTYPES,
    RANDOM_OPS,
    aliases_input,
    kept_by_selective,
    op_base,
    saved_by,
)

# Types only (no cost <-> graph import cycle).
if TYPE_CHECKING:
    from plait.graph import OpGraph

__all__ = [
    "GradBucket",
    "PeakMemory",
    "StageActivations",
    "StepTrace",
    "graph_activation_bytes",
    "stage_states",
    "step_peak",
]


_Point = tuple[int, int, int, int, int, int]
"""A moment of backward: (activation bytes alive, parameter gradients produced so far, of
them those in buckets reduce-scattered already, a bucket's gradients being reduced at this
moment, of them those optimizer parallel splits, ZeRO-3's gathered parameter bytes alive)."""


@dataclass(frozen=True, slots=True)
class GradBucket:
    """One data-parallel gradient bucket (:func:`plait.fusion.plan_buckets`): its members'
    value names, and which of them optimizer parallel splits (levels 1 to 3)."""

    members: tuple[str, ...]
    split: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class StageActivations:
    """One pipeline stage's step on one device, as :meth:`StepTrace.walk` finds it.

    Activation terms are bytes for the whole graph's batch on the device (divide by the
    micro-batches for one micro-batch's); parameter terms are whole-step bytes.
    """

    inputs: int
    """Batch tensors and buffers the stage reads: alive through the step."""
    kept: int
    """Bytes kept on the device for backward when forward ends (recompute and activation
    offload leave theirs out)."""
    forward_peak: int
    """Most activation bytes alive at once during forward."""
    forward_gathered: int
    """ZeRO-3: most parameter bytes gathered at once during forward (a bucket in use and the
    one gathered ahead of it)."""
    points: tuple[_Point, ...]
    """Moments of backward that can be the peak (the first: the start of backward)."""
    gradients: int
    """Bytes of every parameter gradient the stage produces (whole)."""
    bucket: int
    """Parameter bytes of the largest bucket's split members (what one all-gather of
    optimizer parallel carries, before it is split)."""
    largest_whole: int
    """Elements of the largest parameter piece optimizer parallel leaves whole."""
    largest_split: int
    """Elements of the largest parameter piece it splits (before the split)."""


class StepTrace:
    """What one training step holds, value by value, from a captured graph (mesh-free).

    ``regions`` are the recompute regions, ``(module path, "full" | "selective")`` as
    :func:`plait.planning.estimate.recompute_regions` gives them; an op lies in the longest
    region path its module path is in (as the runtime's :func:`plait.runtime.program.remat.regions`).
    """

    def __init__(self, graph: OpGraph, regions: Sequence[tuple[str, str]] = ()) -> None:
        self.graph = graph
        self.index = {op.name: i for i, op in enumerate(graph.ops)}
        self.inputs = {g.name: g for g in graph.inputs}
        self._roots()
        self._regions(regions)
        self._saves()
        self.kept_roots = self._kept_roots()
        self._recompute: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # parameters backward reads at each op: those it saves, and every parameter of an op
        # recomputed in backward (its clone reads them); ZeRO-3 gathers those again
        self.param_reads: list[tuple[str, ...]] = []
        self.kept_op = [all(a in self.kept_roots for a in own) for own in self.allocs]
        self.producer_of = {r: i for i, own in enumerate(self.allocs) for r in own}
        # every op output (a view's included) -> (its op, output index)
        self.out_slot = {
            (op.name if k == 0 else f"{op.name}:{k}"): (i, k)
            for i, op in enumerate(graph.ops)
            for k in range(len(op.outputs))
        }
        # each op's reads: (input index, root, 0 activation | 1 batch or buffer | 2 parameter)
        self.reads = [
            tuple(
                (
                    j,
                    r,
                    0 if r not in self.inputs else 2 if self.inputs[r].kind == "parameter" else 1,
                )
                for j, r in ((j, self.root[ref]) for j, ref in enumerate(op.inputs))
            )
            for op in graph.ops
        ]
        trainable = {g.name for g in graph.inputs if g.trainable}
        self.param_inputs = [
            tuple(dict.fromkeys(self.root[r] for r in op.inputs if self.root[r] in trainable))
            for op in graph.ops
        ]
        # backward: ops with a gradient to make, the activations' and parameters' it makes
        self.differentiable = [any(r in self.grad for r in op.inputs) for op in graph.ops]
        self.grad_inputs = [
            tuple(
                dict.fromkeys(
                    self.root[r]
                    for r in op.inputs
                    if r in self.grad and self.root[r] not in self.inputs
                )
            )
            for op in graph.ops
        ]
        self.param_grads = [
            tuple(
                dict.fromkeys(
                    self.root[r] for r in op.inputs if r in self.grad and self.root[r] in trainable
                )
            )
            for op in graph.ops
        ]
        for i, op in enumerate(graph.ops):
            read = set(self._saved_params[i])
            if self.mode[i] is not None and not all(a in self.kept_roots for a in self.allocs[i]):
                read.update(r for r in op.inputs if r in self.inputs and self.inputs[r].trainable)
            self.param_reads.append(tuple(sorted(read)))

    def _roots(self) -> None:
        """Each value's root (the op output owning its memory; graph inputs are their own),
        the outputs each op allocates, and the values a gradient flows into."""
        root: dict[str, str] = {g.name: g.name for g in self.graph.inputs}
        grad: set[str] = {g.name for g in self.graph.inputs if g.trainable}
        self.allocs: list[tuple[str, ...]] = []
        for op in self.graph.ops:
            alias = aliases_input(op.target) and bool(op.inputs)
            needs = any(r in grad for r in op.inputs)
            outs = []
            for k, meta in enumerate(op.outputs):
                ref = op.name if k == 0 else f"{op.name}:{k}"
                root[ref] = root[op.inputs[0]] if alias else ref
                if not alias:
                    outs.append(ref)
                if needs and meta.dtype in FLOATING_DTYPES:
                    grad.add(ref)
            self.allocs.append(tuple(outs))
        self.root = root
        self.grad = frozenset(grad)

    def _regions(self, regions: Sequence[tuple[str, str]]) -> None:
        """Each op's recompute region (the longest region path holding its module) and mode."""
        paths = sorted({p for p, _ in regions}, key=len, reverse=True)
        mode_of = dict(regions)
        self.region: list[str | None] = []
        for op in self.graph.ops:
            inside = (
                p
                for p in paths
                if p == "" or op.module_path == p or op.module_path.startswith(p + ".")
            )
            self.region.append(next(inside, None))
        self.mode = [None if r is None else mode_of[r] for r in self.region]

    def _saves(self) -> None:
        """What each op's backward reads: ``(root, index, output?, ratio)`` per saved tensor
        that is an activation (parameters, buffers and the batch are held anyway; the trained
        parameters read are noted apart, for ZeRO-3)."""
        root, inputs = self.root, self.inputs
        self.saved: list[tuple[tuple[str, int, bool, Fraction | None], ...]] = []
        self._saved_params: list[set[str]] = []
        for op in self.graph.ops:
            entries = []
            params: set[str] = set()
            for s in saved_by(op, [r in self.grad for r in op.inputs]):
                if s.output:
                    ref = op.name if s.index == 0 else f"{op.name}:{s.index}"
                else:
                    ref = op.inputs[s.index]
                r = root[ref]
                if s.ratio is None and r in inputs:
                    if inputs[r].trainable:
                        params.add(r)
                    continue
                entries.append((r, s.index, s.output, s.ratio))
            self.saved.append(tuple(entries))
            self._saved_params.append(params)

    # ------------------------------------------------------------------ recompute policy

    def _kept_roots(self) -> frozenset[str]:
        """Op-output roots that stay from forward to backward when something saves them: all
        of them outside recompute regions; inside, a region's outputs (read outside it or
        returned), random results, and under ``"selective"`` matmul-like results."""
        ops, graph = self.graph.ops, self.graph
        out_of_region: set[str] = set(self.root[r] for r in graph.outputs if r in self.root)
        for i, op in enumerate(ops):
            for ref in op.inputs:
                r = self.root[ref]
                if r in self.inputs:
                    continue
                p = self.index[r.split(":")[0]]
                if self.region[p] is not None and self.region[p] != self.region[i]:
                    out_of_region.add(r)
        kept = set()
        for i, op in enumerate(ops):
            mode = self.mode[i]
            base = op_base(op.target)
            for r in self.allocs[i]:
                if (
                    mode is None
                    or r in out_of_region
                    or base in RANDOM_OPS
                    or aliases_input(op.target)
                    or (mode == "selective" and kept_by_selective(base))
                ):
                    kept.add(r)
        return frozenset(kept)

    def recomputed(self) -> tuple[bool, ...]:
        """Per op, whether backward runs its forward again: it lies in a recompute region and
        not all it makes is kept (under "selective", matmul-like ops and random ones are)."""
        return tuple(
            mode is not None and not kept
            for mode, kept in zip(self.mode, self.kept_op, strict=True)
        )

    def producer(self, root: str) -> int:
        """Graph index of the op whose output ``root`` is."""
        return self.index[root.split(":")[0]]

    def recompute_of(self, r: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What recomputing root ``r`` in backward takes: the recomputed roots cloned with it
        (its ancestors up to kept values and graph inputs) and the kept roots those clones
        read (which stay alive from forward for it)."""
        found = self._recompute.get(r)
        if found is not None:
            return found
        clones: dict[str, None] = {}
        sources: dict[str, None] = {}
        stack = [r]
        while stack:
            cur = stack.pop()
            for ref in self.graph.ops[self.producer(cur)].inputs:
                a = self.root[ref]
                if a in self.inputs or a in clones or a == r:
                    continue
                if a in self.kept_roots:
                    sources[a] = None
                    continue
                clones[a] = None
                stack.append(a)
        found = self._recompute[r] = (tuple(clones), tuple(sources))
        return found

    # ------------------------------------------------------------------ one mesh's step

    def walk(
        self,
        *,
        value_bytes: Callable[[str], int],
        read_bytes: Callable[[int, int], int],
        stage_of: Sequence[int],
        stages: int,
        param_numel: Mapping[str, int],
        buckets: Sequence[Sequence[GradBucket]],
        state_bytes: StateBytes,
        offload_min: int | None = None,
        moved: Callable[[int, int], bool] | None = None,
    ) -> tuple[StageActivations, ...]:
        """Walk one step on one device of each pipeline stage.

        Args:
            value_bytes: bytes of an op output's local piece as its producer lays it out.
            read_bytes: bytes of input ``j`` of op ``i`` (graph order) as that op reads it.
            stage_of: each op's pipeline stage, in graph order.
            param_numel: elements of each trained parameter's local piece (by value name).
            buckets: per stage, its data-parallel gradient buckets in launch order.
            offload_min: with activation offload, values kept for backward of at least this
                many bytes wait on the host between their last forward and first backward
                reader.
            moved: whether input ``j`` of op ``i`` reaches it through a collective.
        """
        held = self.hold(
            value_bytes=value_bytes,
            read_bytes=read_bytes,
            stage_of=stage_of,
            stages=stages,
            offload_min=offload_min,
            moved=moved,
        )
        return tuple(
            h.with_gradients(param_numel, buckets[s] if s < len(buckets) else (), state_bytes)
            for s, h in enumerate(held)
        )

    def hold(
        self,
        *,
        value_bytes: Callable[[str], int],
        read_bytes: Callable[[int, int], int],
        stage_of: Sequence[int],
        stages: int,
        offload_min: int | None = None,
        moved: Callable[[int, int], bool] | None = None,
    ) -> tuple[StageBuffers, ...]:
        """The first half of :meth:`walk`: the activations' buffers, which no gradient bucket
        changes (a caller weighing several ZeRO levels walks them once). ``moved(i, j)``:
        whether input ``j`` of op ``i`` reaches it through a collective (its producer's
        layout is redistributed with communication); None: never."""
        per_stage: list[list[int]] = [[] for _ in range(stages)]
        for i, s in enumerate(stage_of):
            per_stage[s].append(i)
        sizes = _Sizes(value_bytes, read_bytes, moved)
        return tuple(
            _StageWalk(self, s, mine, sizes, stage_of, offload_min).run()
            for s, mine in enumerate(per_stage)
        )


_Event = tuple[int, int, int, tuple[str, ...]]
"""One op's backward: (its graph index, activation bytes alive while it runs, after it, the
trained parameters whose gradient it makes)."""


@dataclass(frozen=True, slots=True)
class StageBuffers:
    """What :meth:`StepTrace.hold` finds for one stage: the activation terms of
    :class:`StageActivations` and, op by op, backward's activation bytes and the parameter
    gradients it makes; :meth:`with_gradients` adds the gradients bucket by bucket."""

    inputs: int
    kept: int
    forward_peak: int
    events: tuple[_Event, ...]
    forward_reads: Mapping[str, tuple[int, int]]
    """Each trained parameter's first and last forward reader on the stage (graph index)."""
    backward_reads: Mapping[str, tuple[int, int]]
    """The same for the ops whose backward reads it (ZeRO-3 gathers it again for them)."""

    def with_gradients(
        self, param_numel: Mapping[str, int], buckets: Sequence[GradBucket], sb: StateBytes
    ) -> StageActivations:
        """Backward's moments with the parameters' gradients: produced by each op, whole
        until their bucket is reduced (after its last one is made), and ZeRO-3's gathered
        buckets (:class:`_Buckets`)."""
        b = _Buckets(param_numel, buckets, sb)
        forward = b.gathered(self.forward_reads, forward=True)
        backward = b.gathered(self.backward_reads, forward=False)
        points: list[_Point] = []
        produced: set[str] = set()
        g = d = 0
        gb = sb.gradient
        for i, a, after, params in self.events:
            total = split = 0
            for name in params:
                if name in produced:
                    continue
                produced.add(name)
                g += param_numel.get(name, 0) * gb
                done = b.produced(name)
                if done is not None:
                    total, split = total + done[0], split + done[1]
            z = b.at(backward, i)
            points.append((a, g, d, 0, 0, z))
            if total:
                points.append((after, g, d, total, split, z - b.ends.get(i, 0)))
                d += split
        whole = largest_split = 0
        for name in produced:
            numel = param_numel.get(name, 0)
            if b.split.get(name, False):
                largest_split = max(largest_split, numel)
            else:
                whole = max(whole, numel)
        return StageActivations(
            inputs=self.inputs,
            kept=self.kept,
            forward_peak=self.forward_peak,
            forward_gathered=max((v for _, v in forward), default=0),
            points=_frontier(points),
            gradients=g,
            bucket=b.largest,
            largest_whole=whole,
            largest_split=largest_split,
        )


@dataclass(frozen=True, slots=True)
class _Sizes:
    """How one mesh lays values out: :meth:`StepTrace.hold`'s callbacks."""

    value_bytes: Callable[[str], int]
    read_bytes: Callable[[int, int], int]
    moved: Callable[[int, int], bool] | None


class _StageWalk:
    """One pipeline stage's step on one device, buffer by buffer.

    Buffers (keys): an op output that owns memory (its root name); a value another stage
    produced, received here (``"root@stage"``); a saved input read in another layout than its
    producer's, a redistribution's result (``"root@bytes"``); a saved buffer of an op's own,
    such as a norm's statistics (``"op#k"``).
    """

    def __init__(
        self,
        trace: StepTrace,
        stage: int,
        mine: list[int],
        sizes: _Sizes,
        stage_of: Sequence[int],
        offload_min: int | None,
    ) -> None:
        self.t, self.stage, self.stage_of, self.mine = trace, stage, stage_of, mine
        self.single = len(mine) == len(trace.graph.ops)  # one stage: every value is local
        self.value_bytes, self.read_bytes = sizes.value_bytes, sizes.read_bytes
        moved = sizes.moved
        self.moved = moved if moved is not None else (lambda i, j: False)
        self.size: dict[str, int] = {}
        self.resident: dict[str, int] = {}  # batch tensors and buffers read here
        self.last_use: dict[str, int] = {}  # forward: buffer -> its last reader here
        self.first_read: dict[str, int] = {}  # received: backward sends its gradient back there
        self.creates: dict[int, list[str]] = {}
        self.saves: dict[int, list[str]] = {}
        self.made_by: dict[str, str] = {}  # an op's own buffer -> the root its recompute needs
        self.kept: set[str] = set()
        self._recomputes: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # does a recomputed op read a collective's result (recompute keeps those)?
        self.redistributed = moved is not None and any(
            moved(i, j) for i in mine if trace.mode[i] for j, _, kind in trace.reads[i] if not kind
        )
        for i in mine:
            self._reads(i)
            for r in trace.allocs[i]:
                self._root_bytes(r)
                self.creates.setdefault(i, []).append(r)
                self.last_use.setdefault(r, i)
            for k, entry in enumerate(trace.saved[i]):
                self.saves.setdefault(i, []).extend(self._saved(i, k, *entry))
        graph = trace.graph
        self.returned = {trace.root[r] for r in graph.outputs if trace.root.get(r) in self.size}
        for r in self.returned:
            self.last_use[r] = len(graph.ops)
        self.freed_at: dict[str, int] = {}  # backward frees a saved buffer after its first saver
        for i in mine:
            for key in self.saves.get(i, ()):
                self.freed_at.setdefault(key, i)
        self.on_device = {k for k in self.kept if k in self.freed_at} | self.returned
        self.offloaded: set[str] = set()
        if offload_min is not None:
            # a value received from another stage stays: torch's stage holds its inputs
            self.offloaded = {
                k
                for k in self.on_device
                if k in self.freed_at and self.size[k] >= offload_min and not self._received(k)
            }
            self.on_device -= self.offloaded

    def _received(self, key: str) -> bool:
        """Is ``key`` a value another stage produced, received here (``"root@stage"``)?"""
        root, at, stage = key.rpartition("@")[0], "@" in key, key.rpartition("@")[2]
        producer = self.t.producer_of.get(root) if at else None
        return (
            producer is not None
            and stage == str(self.stage)
            and self.stage_of[producer] != self.stage
        )

    def _root_bytes(self, r: str) -> int:
        found = self.size.get(r)
        if found is None:
            found = self.size[r] = self.value_bytes(r)
        return found

    def _key(self, r: str) -> str:
        if self.single:
            return r
        return r if self.stage_of[self.t.producer_of[r]] == self.stage else f"{r}@{self.stage}"

    def _reads(self, i: int) -> None:
        last_use = self.last_use
        for j, r, kind in self.t.reads[i]:
            if kind:
                if kind == 1 and r not in self.resident:
                    self.resident[r] = self.read_bytes(i, j)
                continue
            key = self._key(r)
            if key != r and key not in self.size:
                self.size[key] = self._root_bytes(r)
                self.creates.setdefault(i, []).append(key)
                self.first_read[key] = i
                self.kept.add(key)  # kept if saved
            last_use[key] = i

    def _saved(
        self, i: int, k: int, r: str, index: int, output: bool, ratio: Fraction | None
    ) -> list[str]:
        """The buffers op ``i`` keeps for its ``k``-th saved tensor (and, when that is
        recomputed in backward, the kept values its recompute reads)."""
        t, op = self.t, self.t.graph.ops[i]
        if ratio is not None:
            whole = self._root_bytes(r) if output else self.read_bytes(i, index)
            key = f"{op.name}#{k}"
            self.size[key] = int(whole * ratio)
            self.creates.setdefault(i, []).append(key)
            own = t.allocs[i]
            base = r if output or not own else own[0]
            if t.kept_op[i] or op_base(op.target) in RANDOM_OPS:
                self.kept.add(key)
                return [key]
            self.made_by[key] = base
            return [key, *self._sources(base, with_base=True)]
        key = self._key(r)
        if not output:
            nbytes = self.read_bytes(i, index)
            if nbytes != self.size[key] or self.moved(i, index):  # a redistribution's result
                key = f"{r}@{nbytes}"
                if key not in self.size:
                    self.size[key] = nbytes
                    self.creates.setdefault(i, []).append(key)
                self.kept.add(key)  # a collective's result: kept, never recomputed
                return [key]
        if key != r or r in t.kept_roots:
            self.kept.add(key)
            return [key]
        return [key, *self._sources(r, with_base=False)]

    def _recompute_of(self, r: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """:meth:`StepTrace.recompute_of` on this mesh: a value an op reads in another layout
        than its producer's is a collective's result, which recompute keeps (the runtime
        never issues a collective again), so a clone's ancestors stop there too."""
        t = self.t
        if not self.redistributed:
            return t.recompute_of(r)
        found = self._recomputes.get(r)
        if found is not None:
            return found
        clones: dict[str, None] = {}
        sources: dict[str, None] = {}
        stack = [r]
        while stack:
            p = t.producer_of[stack.pop()]
            for j, a, kind in t.reads[p]:
                if kind or a in clones or a == r:
                    continue
                nbytes = self.read_bytes(p, j)
                if nbytes != self._root_bytes(a) or self.moved(p, j):
                    key = f"{a}@{nbytes}"
                    if key not in self.size:
                        self.size[key] = nbytes
                        self.creates.setdefault(p, []).append(key)
                    sources[key] = None
                elif a in t.kept_roots:
                    sources[a] = None
                else:
                    clones[a] = None
                    stack.append(a)
        found = self._recomputes[r] = (tuple(clones), tuple(sources))
        return found

    def _sources(self, r: str, *, with_base: bool) -> list[str]:
        """Kept values (of this stage) a recompute of ``r`` reads: they stay from forward."""
        t = self.t
        sources = self._recompute_of(r)[1]
        if with_base and r in t.kept_roots:
            sources = (r, *sources)
        out = []
        for s in sources:
            if s in self.size or self.stage_of[t.producer_of[s]] == self.stage:
                self._root_bytes(s)
                self.kept.add(s)
                out.append(s)
        return out

    def run(self) -> StageBuffers:
        forward_peak = self._forward()
        kept = sum(self.size[k] for k in self.on_device)
        events = self._backward(kept)
        t = self.t
        forward: dict[str, tuple[int, int]] = {}
        backward: dict[str, tuple[int, int]] = {}
        for i in self.mine:
            for r in t.param_inputs[i]:
                lo, _ = forward.get(r, (i, i))
                forward[r] = lo, i
            for r in t.param_reads[i]:
                lo, _ = backward.get(r, (i, i))
                backward[r] = lo, i
        return StageBuffers(
            inputs=sum(self.resident.values()),
            kept=kept,
            forward_peak=forward_peak,
            events=tuple(events),
            forward_reads=forward,
            backward_reads=backward,
        )

    def _forward(self) -> int:
        """Most bytes alive during forward: each op's outputs are made while its inputs
        live; a buffer dies after its last reader unless kept for backward."""
        dying: dict[int, list[str]] = {}
        for key, i in self.last_use.items():
            dying.setdefault(i, []).append(key)
        alive = peak = 0
        size, on_device = self.size, self.on_device
        for i in self.mine:
            for key in self.creates.get(i, ()):
                alive += size[key]
                if key not in self.last_use:  # an op's own buffer: lives for its op
                    dying.setdefault(i, []).append(key)
            peak = max(peak, alive)
            for key in dying.get(i, ()):
                if key not in on_device:
                    alive -= size[key]
        return peak

    def _backward(self, kept: int) -> list[_Event]:
        """Backward op by op, last first: the saved buffers it needs (brought back or
        recomputed), the gradients of its inputs, then what dies after it."""
        t = self.t
        self.alive = set(self.on_device)
        self.saved_alive = kept
        self.grads: dict[str, int] = {}
        self.grad_bytes = 0
        events: list[_Event] = []
        for i in reversed(self.mine):
            transient = 0
            saves = self.saves.get(i, ())
            for key in saves:
                if key not in self.alive:
                    transient = max(transient, self._bring_back(key, i))
            during = self._gradients(i) + transient if t.differentiable[i] else 0
            for key in saves:
                if self.freed_at[key] == i and key in self.alive:
                    self.alive.discard(key)
                    self.saved_alive -= self.size[key]
            if t.differentiable[i]:
                events.append((i, during, self.saved_alive + self.grad_bytes, t.param_grads[i]))
        return events

    def _gradients(self, i: int) -> int:
        """Op ``i``'s backward: its inputs' gradients are made while its outputs' live (the
        bytes alive then, returned), then its outputs' die (and a received value's, sent
        back from its first reader here)."""
        grads = self.grads
        for r in self.t.grad_inputs[i]:
            key = self._key(r)
            if key not in grads:
                grads[key] = self.size[key]
                self.grad_bytes += grads[key]
        during = self.saved_alive + self.grad_bytes
        for r in self.t.allocs[i]:
            self.grad_bytes -= grads.pop(r, 0)
        for key in self.creates.get(i, ()):
            if self.first_read.get(key) == i:
                self.grad_bytes -= grads.pop(key, 0)
        return during

    def _bring_back(self, key: str, i: int) -> int:
        """Make saved buffer ``key`` alive for op ``i``'s backward: copied back from the host,
        or recomputed with the recomputed values it needs, in forward order (those a pending
        backward also saves stay; each other one lives until the next is made). Returns the
        bytes the recompute holds above what stays (its transient)."""
        self.alive.add(key)
        self.saved_alive += self.size[key]
        if key in self.offloaded:
            return 0
        t = self.t
        base = self.made_by.get(key, key)
        clones = self._recompute_of(base)[0] if base not in t.kept_roots else ()
        chain = [a for a in (*clones, *((base,) if base != key else ())) if a not in self.alive]
        chain.sort(key=t.producer_of.__getitem__)
        stays = previous = peak = 0
        for a in chain:
            nbytes = self.size.get(a, 0)
            peak = max(peak, stays + previous + nbytes)
            if 0 <= self.freed_at.get(a, -1) <= i:
                self.alive.add(a)
                self.saved_alive += nbytes
                stays += nbytes
                previous = 0
            else:
                previous = nbytes
        peak = max(peak, stays + previous + self.size[key])  # ``key`` is made last
        return max(0, peak - stays - self.size[key])


class _Buckets:
    """The data-parallel gradient buckets of one stage during backward: which parameters'
    gradients complete each, and ZeRO-3's gathered parameter bytes over a pass."""

    def __init__(
        self, param_numel: Mapping[str, int], buckets: Sequence[GradBucket], sb: StateBytes
    ) -> None:
        self.numel, self.sb, self.buckets = param_numel, sb, buckets
        self.member_of: dict[str, int] = {}
        self.split: dict[str, bool] = {}
        self.left: list[int] = []
        self.split_bytes: list[int] = []  # parameter bytes of each bucket's split members
        for b, bucket in enumerate(buckets):
            self.left.append(len(bucket.members))
            nbytes = 0
            for name, is_split in zip(bucket.members, bucket.split, strict=True):
                self.member_of[name] = b
                self.split[name] = is_split
                nbytes += param_numel.get(name, 0) * sb.parameter if is_split else 0
            self.split_bytes.append(nbytes)
        self.largest = max(self.split_bytes, default=0)
        self.ends: dict[int, int] = {}  # backward: op -> gathered bytes it reads last

    def produced(self, name: str) -> tuple[int, int] | None:
        """Parameter ``name``'s gradient is made: the bytes (all, split) of the bucket this
        completes, or None."""
        b = self.member_of.get(name)
        if b is None:
            return None
        self.left[b] -= 1
        if self.left[b]:
            return None
        total = split = 0
        bucket = self.buckets[b]
        for member, is_split in zip(bucket.members, bucket.split, strict=True):
            part = self.numel.get(member, 0) * self.sb.gradient
            total += part
            split += part if is_split else 0
        return total, split

    def gathered(
        self, reads: Mapping[str, tuple[int, int]], *, forward: bool
    ) -> list[tuple[int, int]]:
        """ZeRO-3's gathered parameter bytes over one pass, as (graph index from which on,
        bytes) in graph order: a bucket is gathered when the pass starts the bucket before
        it (one bucket ahead) and freed after its own last reader in the pass. ``reads``:
        each split parameter's first and last reader in the pass."""
        spans = []
        for b, bucket in enumerate(self.buckets):
            found = [reads[name] for name in bucket.members if name in reads]
            if found and self.split_bytes[b]:
                lo, hi = min(r[0] for r in found), max(r[1] for r in found)
                spans.append((lo, hi, self.split_bytes[b]))
        # in pass order: forward by first reader, backward by last reader from the end
        spans.sort(key=lambda s: s[0] if forward else -s[1])
        delta: dict[int, int] = {}
        previous: int | None = None
        for lo, hi, nbytes in spans:
            first = lo if forward else hi  # where the pass starts reading the bucket
            start = first if previous is None else previous
            previous = first
            a, b = (start, hi) if forward else (lo, start)
            delta[a] = delta.get(a, 0) + nbytes
            delta[b + 1] = delta.get(b + 1, 0) - nbytes
            if not forward:
                self.ends[lo] = self.ends.get(lo, 0) + nbytes
        steps, running = [], 0
        for i, change in sorted(delta.items()):
            running += change
            steps.append((i, running))
        return steps

    @staticmethod
    def at(steps: Sequence[tuple[int, int]], i: int) -> int:
        """The value of a :meth:`gathered` step function at graph index ``i``."""
        n = bisect.bisect_right(steps, (i, math.inf)) - 1
        return steps[n][1] if n >= 0 else 0


def _frontier(points: Sequence[_Point]) -> tuple[_Point, ...]:
    """The moments that can be the peak, whatever the micro-batch count and ZeRO level.

    A moment's bytes grow with its activations, gradients produced, bucket being reduced and
    gathered parameters, and shrink with the gradients reduce-scattered already (``d``, the
    same between two reductions). Between two reductions gradients only accumulate, so a
    moment with no more activations and no more gathered parameters than a later one of
    the same stretch is never the peak. The first (the start of backward, where ZeRO-3
    gathers its first bucket) and every reduction are kept.
    """
    out: list[_Point] = []
    best_a = best_z = stretch = -1
    for n in range(len(points) - 1, -1, -1):
        p = points[n]
        if p[2] != stretch:
            best_a = best_z = -1
            stretch = p[2]
        if p[0] > best_a or p[5] > best_z or p[3] or n == 0:
            out.append(p)
        best_a, best_z = max(best_a, p[0]), max(best_z, p[5])
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class PeakMemory:
    """Bytes of one device at the peak of its step: the model states it holds after the step
    (as :func:`plait.runtime.engine.measure.measure_step_memory` counts them), the rest alive at the
    peak (``activations``: kept values, working sets, gradients still being produced, the
    batch, gathered parameters, communication buffers), the peak and when it comes."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak: int
    when: str


def stage_states(
    *,
    sharded_numel: int,
    whole_numel: int,
    frozen_numel: int,
    shard_group: int,
    optimizer_shard: int | None,
    precision: str,
    optimizer_on_device: bool = True,
) -> MemoryBreakdown:
    """Parameters, gradients and optimizer states one device holds after a step.

    ``sharded_numel``: trained elements optimizer parallel splits (at levels 1 to 3);
    ``whole_numel``: trained elements it leaves whole; ``frozen_numel``: no gradient, no
    state. Levels 1 and 2 also keep a copy of this rank's shard, which the optimizer updates
    and all-gathers back (counted with the optimizer, as the measurement does).
    """
    trained = model_state_memory(
        sharded_numel, shard_group=shard_group, optimizer_shard=optimizer_shard,
        precision=precision,
    )  # fmt: skip
    whole = model_state_memory(whole_numel, precision=precision)
    frozen = model_state_memory(frozen_numel, precision=precision)
    shadow = math.ceil(sharded_numel / shard_group) * 4 if optimizer_shard in (1, 2) else 0
    optimizer = trained.optimizer + whole.optimizer + shadow
    return MemoryBreakdown(
        parameters=trained.parameters + whole.parameters + frozen.parameters,
        gradients=trained.gradients + whole.gradients,
        optimizer=optimizer if optimizer_on_device else 0,
        activations=0,
    )


def step_peak(
    act: StageActivations,
    states: MemoryBreakdown,
    *,
    optimizer_shard: int | None,
    shard_group: int,
    in_flight: Fraction | int,
    micro_batches: int,
    accumulation: Accumulation = "none",
    optimizer_on_device: bool = True,
) -> PeakMemory:
    """The peak of one device's step: the model states plus the most the step holds at once.

    The moments weighed (docs/memory.md, "How the plan predicts memory"):

    * forward of the last micro-batch in flight: the others' kept values, this one's forward
      working set, ZeRO-3's gathered buckets;
    * each moment of its backward (:attr:`StageActivations.points`): what is kept or
      recomputed and still needed, the gradients backward holds, the parameters' gradients
      produced so far (whole until their bucket is reduce-scattered at ZeRO-2/3), a bucket's
      flat copy when it is reduced; at the start, ZeRO-3's gather of the first bucket;
    * with several micro-batches per step, the gradients of the earlier ones (held whole)
      throughout, and the reductions after the last: ``accumulation="in_place"`` (a
      pipeline's micro-batches, which autograd adds into ``.grad``), ``"summed"`` (gradient
      accumulation through the per-rank program: each micro-step's gradients are new
      tensors, added in place into the earlier ones' sums after it, two sets alive at the
      sum; only the sums are left for the reductions and the update);
    * the optimizer step: every gradient, and the update's temporaries (ZeRO-1/2: the
      all-gather writing the updated shards back).

    ``in_flight``: micro-batches whose activations the device holds at its peak
    (:func:`in_flight_micro_batches`).
    """
    m, dp = micro_batches, shard_group
    level = optimizer_shard or 0
    base = states.parameters + states.optimizer
    # Integer arithmetic: every term in units of 1 / (m * den) bytes, den the denominator of
    # in_flight (a one-micro-batch term a / m is a * den of them).
    held = Fraction(in_flight)
    den = held.denominator
    unit = m * den
    others = max(held.numerator - den, 0) * act.kept  # the other micro-batches in flight
    zero3 = level == 3
    # ZeRO-3 gathers from a flat copy of this rank's shards (1/dp of a bucket)
    gather_in = math.ceil(act.bucket / dp) if zero3 else 0
    accumulating = accumulation != "none"
    earlier = act.gradients if accumulating else 0
    forward = act.inputs + (act.forward_gathered + gather_in if zero3 else 0)
    moments: list[tuple[str, int, int]] = [
        ("forward", others + act.forward_peak * den + forward * unit, earlier)
    ]
    largest_t = largest_ts = 0
    for n, (a, g, d, t, ts, z) in enumerate(act.points):
        largest_t, largest_ts = max(largest_t, t), max(largest_ts, ts)
        if accumulating:  # reduced after the last micro-batch
            grads = g if accumulation == "summed" else 0
        elif level >= 2:
            grads = g - d + math.ceil(d / dp) + t + math.ceil(ts / dp)
        else:
            grads = g + t
        fixed = act.inputs + grads + (z + (gather_in if n == 0 else 0) if zero3 else 0)
        moments.append(("backward", others + a * den + fixed * unit, earlier))
    if accumulation == "summed":  # the earlier sums, and this micro-step's added into them
        moments.append(("gradient sum", (act.inputs + act.gradients) * unit, earlier))
    if accumulating:
        # after the last micro-batch the Job reduces each bucket: a flat copy, and the
        # all-reduce's result (a reduce-scatter's is a shard)
        reduce = largest_t + (math.ceil(largest_ts / dp) if level >= 2 else largest_t)
        moments.append(("reduction", (act.inputs + reduce) * unit, act.gradients))
    update = 0
    if optimizer_on_device:
        piece = act.largest_whole, math.ceil(act.largest_split / dp) if level else act.largest_split
        temporaries = 2 * 4 * max(piece)  # single-tensor AdamW: two fp32 tensors of a piece
        if level in (1, 2):
            temporaries = max(temporaries, 2 * act.bucket + math.ceil(act.bucket / dp))
        update += temporaries
    moments.append(("optimizer step", (act.inputs + update) * unit, states.gradients))
    when, peak, as_states = "", -1, 0
    for name, extra, grads_held in moments:
        total = base + grads_held + -(-extra // unit)
        if total > peak:
            when, peak, as_states = name, total, grads_held
    return PeakMemory(
        parameters=states.parameters,
        gradients=states.gradients,
        optimizer=states.optimizer,
        activations=peak - base - as_states,
        peak=peak,
        when=when,
    )


def graph_activation_bytes(
    graph: OpGraph,
    *,
    recompute: Recompute = "none",
    local_bytes: Callable[[str], int] | None = None,
) -> int:
    """Bytes kept for backward when forward ends, one device, from a captured graph.

    What autograd saves for each op (:func:`saved_by`: a linear layer its input, softmax its
    output, views nothing), less what ``recompute`` recomputes in every repeated layer
    (``"full"``: all but the layer's outputs; ``"selective"``: all but matmul-like results
    and the layer's outputs), plus the values the step returns. ``local_bytes(ref)`` gives a
    value's bytes on one device (its layout's local piece); the default is the full tensor.
    The whole step's timeline is :class:`StepTrace`'s.
    """
    if recompute not in ("none", "full", "selective"):
        raise CostError(
            f"recompute={recompute!r} is not allowed; use 'none', 'full' or 'selective'"
        )
    size = local_bytes or (lambda ref: graph.meta(ref).nbytes)
    regions: list[tuple[str, str]] = []
    if recompute != "none":
        regions = [
            (layer, recompute) for layer in dict.fromkeys(op.layer for op in graph.ops if op.layer)
        ]
    trace = StepTrace(graph, regions)
    (stage,) = trace.walk(
        value_bytes=size,
        read_bytes=lambda i, j: size(graph.ops[i].inputs[j]),
        stage_of=[0] * len(graph.ops),
        stages=1,
        param_numel={},
        buckets=[()],
        state_bytes=StateBytes(4, 4, 8),
    )
    return stage.kept
