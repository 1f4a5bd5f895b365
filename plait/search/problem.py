"""The search problem every searcher sees: an OpGraph, candidate strategies per op, and costs.

A searcher picks one :class:`~plait.rules.registry.OpStrategy` per op. What it pays:

- per op, compute time of its share of the work (forward and backward) plus the gradient
  all-reduce of the parameters it reads (MindSpore's mirror operators);
- per edge (a value from its producer to one consumer), the redistribution from the
  producer's output layout to the consumer's input layout, and the backward redistribution of
  the gradient the other way.

Costs are seconds on a hardware profile (:mod:`plait.cost`). Everything here is pure and
cached: a 96-layer GPT asks the same questions thousands of times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import cast

from plait.graph import GraphInput, OpGraph, OpNode, TensorMeta
from plait.layout import TensorLayout
from plait.layout.redistribute import Redistribution, plan_redistribution
from plait.mesh import MeshSpec
from plait.rules.registry import OpStrategy, grad_reduce_axes

__all__ = [
    "CostModel",
    "Edge",
    "SearchProblem",
    "carries_gradient",
    "gradient_layout",
    "gradient_values",
    "kept_gradient",
    "pending_values",
    "settled",
]

AxisSeconds = Callable[[str, str, int], float]
"""``(collective kind, mesh axis, bytes of one device's piece before it) -> seconds``."""
OpCompute = Callable[[OpNode, int], float]
"""``(op, number of pieces its work is cut into) -> seconds of forward + backward``."""


FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "complex64"})


def carries_gradient(meta: TensorMeta) -> bool:
    """Only floating tensors have gradients (ids, masks and indices do not)."""
    return meta.dtype in FLOATING


def settled(layout: TensorLayout) -> TensorLayout:
    """The layout a consumer sees once pending sums are reduced (partial axes dropped).

    Equal layouts settle to one object (prices are cached by layout identity too).
    """
    return layout if not layout.partial else _settled(layout)


@lru_cache(maxsize=1 << 14)
def _settled(layout: TensorLayout) -> TensorLayout:
    return _interned(TensorLayout(layout.mesh, layout.dims))


@lru_cache(maxsize=1 << 16)
def _interned(layout: TensorLayout) -> TensorLayout:
    """The first layout seen equal to ``layout`` (one object per value)."""
    return layout


def gradient_values(graph: OpGraph) -> frozenset[str]:
    """Values a gradient flows back into: floating values computed from a trainable parameter.

    Batch tensors, buffers, constants, frozen parameters (``requires_grad=False``) and
    everything computed from them alone (masks, rotary tables, position ids, a frozen
    embedding's output) get no gradient, so their edges cost nothing in backward.
    """
    found = {g.name for g in graph.inputs if g.trainable}
    for op in graph.ops:
        if any(ref in found for ref in op.inputs):
            for k, meta in enumerate(op.outputs):
                if carries_gradient(meta):
                    found.add(op.name if k == 0 else f"{op.name}:{k}")
    return frozenset(found)


def pending_values(graph: OpGraph, grad_refs: frozenset[str]) -> frozenset[str]:
    """Values whose gradient may stay a pending sum over the data-parallel axis into the
    parameters of the op that makes them, reduced with them in the fused gradient buckets.

    A value qualifies when its gradient can only reach parameters: the op that makes it has
    one output, read by one op, and the op's inputs that take gradients are trainable
    parameters no other op reads (a learned position table: its output added to a batch-split
    activation comes back summed over dp from every rank; an op's backward is linear in the
    output's gradient, so the table's gradient is the same pending sum, and the bucket that
    reduces the other gradients reduces it, with no collective of its own).
    """
    readers: dict[str, int] = {}
    for op in graph.ops:
        for ref in op.inputs:
            readers[ref] = readers.get(ref, 0) + 1
    found: set[str] = set()
    for op in graph.ops:
        if len(op.outputs) != 1 or readers.get(op.name, 0) != 1 or op.name not in grad_refs:
            continue
        learned = [ref for ref in op.inputs if ref in grad_refs]
        if learned and all(
            (g := graph.graph_input(ref)) is not None
            and g.kind == "parameter"
            and g.trainable
            and readers[ref] == 1
            for ref in learned
        ):
            found.add(op.name)
    return frozenset(found)


@dataclass
class _GraphFacts:
    """What every problem on one graph shares (the outer planner builds one per mesh)."""

    graph: OpGraph
    grad_refs: frozenset[str]
    signatures: dict[str, int] | None = None
    pending: frozenset[str] | None = None


_LAST_GRAPH: list[_GraphFacts] = []


def _facts(graph: OpGraph) -> _GraphFacts:
    """The facts of ``graph``, remembered for the last graph asked about."""
    last = _LAST_GRAPH[0] if _LAST_GRAPH else None  # one read: another thread may replace it
    if last is None or last.graph is not graph:
        last = _GraphFacts(graph, gradient_values(graph))
        _LAST_GRAPH[:] = [last]
    return last


def _gradient_values_of(graph: OpGraph) -> frozenset[str]:
    return _facts(graph).grad_refs


def _pending_values_of(graph: OpGraph) -> frozenset[str]:
    facts = _facts(graph)
    if facts.pending is None:
        facts.pending = pending_values(graph, facts.grad_refs)
    return facts.pending


def _signatures_of(graph: OpGraph) -> dict[str, int]:
    """Per op, the number of its pricing signature (:meth:`SearchProblem.signature`)."""
    facts = _facts(graph)
    if facts.signatures is None:
        numbers: dict[tuple[object, ...], int] = {}
        found: dict[str, int] = {}
        for op in graph.ops:
            # a frozen parameter pays no gradient reduction: it prices differently
            params = tuple(
                (i, graph.meta(ref), ref in facts.grad_refs)
                for i, ref in enumerate(op.inputs)
                if (g := graph.graph_input(ref)) is not None and g.kind == "parameter"
            )
            full = (
                op.target,
                op.input_metas,
                op.outputs,
                repr(op.args),
                repr(op.kwargs),
                op.flops,
                op.bytes,
                params,
            )
            found[op.name] = numbers.setdefault(full, len(numbers))
        facts.signatures = found
    return facts.signatures


def kept_gradient(grad: TensorLayout, src: TensorLayout, keep: str | None) -> TensorLayout | None:
    """What is left to reduce on an edge whose gradient (laid out as ``grad``) keeps its
    pending sum over ``keep`` into the producer's parameters (:func:`pending_values`); None
    when it keeps nothing: no such sum, or the producer's output (``src``) involves that axis
    (an output split or pending over it means parameters that are too)."""
    if (
        keep is None
        or keep not in grad.partial
        or keep in src.partial
        or any(keep in axes for axes in src.dims)
    ):
        return None
    rest = tuple(a for a in grad.partial if a != keep)
    return _interned(grad.with_partial(rest, grad.reduce_op)) if rest else settled(grad)


@lru_cache(maxsize=1 << 16)
def gradient_layout(strategy: OpStrategy, input_index: int) -> TensorLayout:
    """Layout of the gradient an op hands back for its input ``input_index``.

    Axes that divide the op's work but not that input leave each device with a partial
    gradient (e.g. a column-parallel linear's input gradient is a partial sum over ``tp``).
    """
    layout = strategy.inputs[input_index]
    return _interned(layout.with_partial(grad_reduce_axes(strategy, input_index)))


_OpPrices = tuple[OpGraph, Sequence[OpStrategy], dict[tuple[int, int], float]]
"""A graph, one of its candidate lists, and (signature, index) -> op seconds."""


@dataclass(frozen=True)
class CostModel:
    """Seconds for collectives on mesh axes and for ops' compute on one hardware profile.

    Prices of redistributions and edges are cached on the model (every search of a problem
    asks for the same pairs many times).
    """

    axis_seconds: AxisSeconds
    op_compute: OpCompute
    _moves: dict[tuple[object, ...], float] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    _edges: dict[tuple[object, ...], float] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    scratch: dict[tuple[object, ...], object] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    """Price tables a searcher keeps on the model (keys start with the searcher's name)."""

    def redistribution(
        self, src: TensorLayout, dst: TensorLayout, meta: TensorMeta
    ) -> Redistribution:
        return plan_redistribution(src, dst, meta.shape, meta.itemsize)

    def move_seconds(self, src: TensorLayout, dst: TensorLayout, meta: TensorMeta) -> float:
        """Seconds of the redistribution ``src -> dst`` of a tensor ``meta`` (0.0 if equal)."""
        key = (src, dst, meta)
        found = self._moves.get(key)
        if found is None:
            found = (
                0.0
                if src == dst
                else self.redistribution(src, dst, meta).seconds(self.axis_seconds)
            )
            self._moves[key] = found
        return found

    def edge_seconds(
        self,
        src: TensorLayout,
        dst: TensorLayout,
        grad: TensorLayout | None,
        meta: TensorMeta,
        keep: str | None = None,
        bucket: float = 0.0,
    ) -> float:
        """Forward ``src -> dst`` plus backward ``grad -> settled(src)`` for one edge.

        ``grad`` is None when no gradient flows back along the edge. ``keep`` names an axis
        whose pending sum the gradient keeps into the producer's parameters (see
        :func:`pending_values`): it is not reduced on the edge, and ``bucket`` (the
        parameters' share of the fused buckets) is paid instead when the gradient has it.
        """
        key = (src, dst, grad, meta, keep, bucket)
        found = self._edges.get(key)
        if found is None:
            fwd = self.move_seconds(src, dst, meta)
            kept = None if grad is None else kept_gradient(grad, src, keep)
            if grad is None:
                found = fwd
            elif kept is not None:
                found = fwd + self.move_seconds(kept, settled(src), meta) + bucket
            else:
                found = fwd + self.move_seconds(grad, settled(src), meta)
            self._edges[key] = found
        return found


@dataclass
class SearchProblem:
    """What a searcher needs, with the costs it asks for cached."""

    graph: OpGraph
    mesh: MeshSpec
    candidates: Mapping[str, Sequence[OpStrategy]]
    input_layouts: Mapping[str, TensorLayout]  # batch inputs: layouts fixed by dataset_strategy
    cost: CostModel
    fused_axis: str | None = None
    """The axis whose gradient reductions the runtime fuses into buckets (the data-parallel
    axis without ZeRO-2/3): a parameter pays only the bytes of its share of a bucket, the
    per-collective latency is paid once per bucket, whatever the strategies."""
    dp_axis: str | None = None
    """The data-parallel axis, over which a gradient that can only reach parameters keeps its
    pending sum into theirs (:meth:`keeps_pending`; bucketed with or without ZeRO)."""
    _op_cost: dict[tuple[object, int], float] = field(default_factory=dict, repr=False)
    _grad_refs: frozenset[str] | None = field(default=None, repr=False)
    _edges: list[Edge] | None = field(default=None, repr=False)

    def needs_grad(self, ref: str) -> bool:
        """Does a gradient flow back into value ``ref`` (it depends on a trainable parameter)?"""
        if self._grad_refs is None:
            self._grad_refs = _gradient_values_of(self.graph)
        return ref in self._grad_refs

    _op_keys: dict[str, int] = field(default_factory=dict, repr=False)

    def op_seconds(self, op: OpNode, index: int) -> float:
        """Compute plus parameter-gradient reduction of one candidate of ``op``.

        Ops with equal signatures (the same op in every repeated layer) share one price.
        """
        key = (self.signature(op), index)
        found = self._op_cost.get(key)
        if found is None:
            found = self._op_cost[key] = self._shared_op_seconds(op, key)
        return found

    def _shared_op_seconds(self, op: OpNode, key: tuple[int, int]) -> float:
        """:meth:`_price_op` of candidate ``key[1]`` of ``op`` (signature ``key[0]``), kept on
        the cost model for every problem of the same graph, mesh, fused axis and candidate
        list (``prepare`` shares the cost model and the lists: a second search of a graph
        on a mesh prices no op again). The entry holds the graph and the list it is keyed
        by (an id is never reused while the entry lives); an entry that is not the asker's
        is replaced, not read."""
        cands = self.candidates[op.name]
        graph = self.graph
        at = ("SearchProblem.op_seconds", id(graph), id(cands), self.mesh, self.fused_axis)
        scratch = self.cost.scratch
        entry = cast("_OpPrices | None", scratch.get(at))
        if entry is None or entry[0] is not graph or entry[1] is not cands:
            entry = (graph, cands, {})
            scratch[at] = entry
        prices = entry[2]
        found = prices.get(key)
        if found is None:
            found = prices[key] = self._price_op(op, cands[key[1]])
        return found

    def signature(self, op: OpNode) -> int:
        """A number shared by the ops that price alike (equal target, shapes, arguments,
        FLOPs and bytes, and parameters read at the same positions, trainable alike)."""
        key = self._op_keys.get(op.name)
        if key is None:
            self._op_keys = _signatures_of(self.graph)
            key = self._op_keys[op.name]
        return key

    def keeps_pending(self, ref: str) -> str | None:
        """The data-parallel axis when value ``ref``'s gradient stays pending into its
        producer's parameters (:func:`pending_values`), else None."""
        axis = self.dp_axis
        if axis is None or axis not in self.mesh.axis_names or self.mesh.axis_size(axis) == 1:
            return None
        return axis if ref in _pending_values_of(self.graph) else None

    _buckets: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    def bucket_seconds(self, op: OpNode, index: int) -> float:
        """What candidate ``index`` of ``op`` adds to the gradient reductions when its output's
        gradient comes back pending over the data-parallel axis: its parameters' reductions
        over it (as :meth:`param_grad_seconds` prices them: in a fused bucket, their bytes
        alone), except those it reduces over that axis itself."""
        key = (self.signature(op), index)
        found = self._buckets.get(key)
        if found is None:
            strategy = self.candidates[op.name][index]
            found = 0.0
            axis = self.dp_axis
            for i, ref in enumerate(op.inputs):
                source = self.graph.graph_input(ref)
                if axis is None or source is None or source.kind != "parameter":
                    continue
                if not source.trainable or axis in grad_reduce_axes(strategy, i):
                    continue
                found = self._add_reduction(found, source, strategy.inputs[i], axis)
            self._buckets[key] = found
        return found

    def _is_param(self, ref: str) -> bool:
        source = self.graph.graph_input(ref)
        return source is not None and source.kind == "parameter"

    def _price_op(self, op: OpNode, strategy: OpStrategy) -> float:
        pieces = math.prod(self.mesh.axis_size(a) for a in strategy.used_axes())
        seconds = self.cost.op_compute(op, pieces)
        for i, ref in enumerate(op.inputs):
            source = self.graph.graph_input(ref)
            if source is None or source.kind != "parameter":
                continue
            seconds += self.param_grad_seconds(source, strategy, i)
        return seconds

    def param_grad_seconds(self, param: GraphInput, strategy: OpStrategy, index: int) -> float:
        """The gradient all-reduces of ``param`` read as input ``index``; 0 when it is frozen."""
        if not param.trainable:
            return 0.0
        layout = strategy.inputs[index]
        seconds = 0.0
        for axis in grad_reduce_axes(strategy, index):
            seconds = self._add_reduction(seconds, param, layout, axis)
        return seconds

    def _add_reduction(
        self, seconds: float, param: GraphInput, layout: TensorLayout, axis: str
    ) -> float:
        """``seconds`` plus the all-reduce of ``param``'s local gradient (laid out as
        ``layout``) over ``axis``."""
        nbytes = param.meta.nbytes // math.prod(layout.splits())
        seconds += self.cost.axis_seconds("all_reduce", axis, nbytes)
        if axis == self.fused_axis:  # in a bucket: the latency is not this parameter's
            seconds -= self.cost.axis_seconds("all_reduce", axis, 0)
        return seconds

    def input_edge_seconds(
        self,
        op: OpNode,
        index: int,
        strategy: OpStrategy,
        source: TensorLayout,
        keep: str | None = None,
        bucket: float = 0.0,
    ) -> float:
        """Cost of feeding value ``op.inputs[index]``, laid out as ``source``, to ``strategy``
        (``keep``, ``bucket``: as :meth:`CostModel.edge_seconds`, from the value's producer)."""
        meta = op.input_metas[index]
        grad = gradient_layout(strategy, index) if self.needs_grad(op.inputs[index]) else None
        return self.cost.edge_seconds(source, strategy.inputs[index], grad, meta, keep, bucket)

    def edges(self) -> list[Edge]:
        """Every edge between two ops (producer output -> consumer input), in graph order."""
        if self._edges is None:
            found: list[Edge] = []
            for op in self.graph.ops:
                for i, ref in enumerate(op.inputs):
                    node, k = self.graph.producer(ref)
                    if isinstance(node, OpNode):
                        found.append(Edge(node.name, k, op.name, i, ref, self.needs_grad(ref)))
            self._edges = found
        return self._edges

    def edge_cost(self, edge: Edge, producer_index: int, consumer_index: int) -> float:
        """Seconds of one edge for a candidate of its producer and one of its consumer."""
        src = self.candidates[edge.producer][producer_index].outputs[edge.output]
        target = self.candidates[edge.consumer][consumer_index]
        grad = gradient_layout(target, edge.input) if edge.needs_grad else None
        meta = self.graph.meta(edge.ref)
        keep = self.keeps_pending(edge.ref)
        bucket = 0.0
        if keep is not None:  # what the producer adds to the buckets when the sum is kept
            bucket = self.bucket_seconds(self.graph.op(edge.producer), producer_index)
        return self.cost.edge_seconds(src, target.inputs[edge.input], grad, meta, keep, bucket)

    def source_cost(self, op: OpNode, index: int) -> float:
        """Seconds of ``op``'s edges from values no op makes: the batch, shared parameters.

        A parameter's layout is the one its first reader (in graph order) wants; a later
        reader that wants another layout pays the redistribution (e.g. tied embeddings).
        """
        strategy = self.candidates[op.name][index]
        seconds = 0.0
        for i, ref in enumerate(op.inputs):
            if ref in self.input_layouts:
                seconds += self.input_edge_seconds(op, i, strategy, self.input_layouts[ref])
        return seconds

    def evaluate(self, choice: Mapping[str, int]) -> float:
        """Total predicted seconds of a full assignment (op name -> candidate index).

        The objective every searcher minimises: own costs of all ops, every op-to-op edge, the
        batch edges, and parameters read by several ops in different layouts.
        """
        total = 0.0
        for op in self.graph.ops:
            total += self.op_seconds(op, choice[op.name]) + self.source_cost(op, choice[op.name])
        for edge in self.edges():
            total += self.edge_cost(edge, choice[edge.producer], choice[edge.consumer])
        total += self.shared_parameter_seconds(choice)
        return total

    def shared_parameter_seconds(self, choice: Mapping[str, int]) -> float:
        """Redistribution of parameters whose readers want different layouts."""
        first: dict[str, TensorLayout] = {}
        seconds = 0.0
        for op in self.graph.ops:
            strategy = self.candidates[op.name][choice[op.name]]
            for i, ref in enumerate(op.inputs):
                if not self._is_param(ref):
                    continue
                if ref not in first:
                    first[ref] = strategy.inputs[i]
                elif first[ref] != strategy.inputs[i]:
                    seconds += self.input_edge_seconds(op, i, strategy, first[ref])
        return seconds


@dataclass(frozen=True, slots=True)
class Edge:
    """A value made by one op and read by another."""

    producer: str
    output: int  # which output of the producer
    consumer: str
    input: int  # which input of the consumer
    ref: str
    needs_grad: bool
