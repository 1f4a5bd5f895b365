"""``search="sharding_propagation"``: MindSpore's breadth-first strategy propagation.

From the ops whose strategy is configured (user annotations; reference section 7.4) and the
batch inputs (whose layouts the dataset strategy fixes), a breadth-first walk over the graph,
in both directions, gives every newly reached op the candidate that minimises, in this order:

1. the redistribution cost (seconds, forward and backward) on its edges to ops already decided,
   plus, for an output left as a pending sum, the cost of reducing it for each consumer not
   yet decided (otherwise a split that defers its communication looks free);
2. its own cost: compute of its share of the work plus its parameters' gradient reduction;
3. the candidate's index (the catalogue lists candidates in a fixed order), for determinism.

As in MindSpore, an op reached while some op feeding it is undecided waits until all of them
are (when every reachable op waits, the earliest in graph order goes first). Greedy and one
pass, linear in edges times candidates; the result depends on where the user put
strategies, as in MindSpore. Ops the walk never reaches take their first candidate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from plait.graph import OpGraph, OpNode, TensorMeta
from plait.layout import TensorLayout
from plait.search.problem import CostModel, SearchProblem, gradient_layout, settled

__all__ = ["Decision", "sharding_propagation"]

ALTERNATIVES_KEPT = 3


@dataclass(frozen=True, slots=True)
class Decision:
    """The strategy chosen for one op (an index into its candidates) and why."""

    index: int
    reason: str
    cost_s: float = 0.0  # redistribution on decided edges + own cost, as weighed
    alternatives: tuple[tuple[int, float], ...] = ()  # (candidate index, cost) of runners-up


class _Walk:
    """State of one propagation: decided ops and the layouts of decided values.

    Costs are weighed as vectors over an op's candidates, cached by what they depend on
    (the candidate list, which input or output, the layout on the other side, the value's
    shape, whether a gradient flows back): the ops of repeated layers share candidate lists,
    so a 96-layer GPT computes each vector once, not once per layer. Sums run in the order
    the scalar definition adds them (inputs, then outputs' consumers), so every candidate's
    cost is the same float.
    """

    def __init__(self, problem: SearchProblem, allowed: Mapping[str, Sequence[int]]) -> None:
        self.problem = problem
        self.graph = graph = problem.graph
        self.allowed = allowed
        self.decided: dict[str, Decision] = {}
        self.param_layout: dict[str, tuple[TensorLayout, str]] = {}
        self.producers, self.consumers = _structure(graph)
        # cost vectors, each with the objects whose identities key it (kept alive)
        self._vectors: dict[tuple[object, ...], tuple[object, list[float]]] = {}
        self._ranked: dict[tuple[int, ...], list[tuple[float, float, int]]] = {}

    def strategy(self, name: str):  # -> OpStrategy
        return self.problem.candidates[name][self.decided[name].index]

    def source_layout(self, op: OpNode, i: int) -> tuple[TensorLayout, str] | None:
        """Layout of input ``i`` of ``op`` if already known, with the op (or input) that
        fixed it."""
        node, index = self.producers[op.name][i]
        if node is None:
            ref = op.inputs[i]
            source = self.graph.graph_input(ref)
            if source is not None and source.kind == "parameter":
                return self.param_layout.get(ref)
            fixed = self.problem.input_layouts.get(ref)
            return (fixed, ref) if fixed is not None else None
        decided = self.decided.get(node.name)
        if decided is None:
            return None
        return self.problem.candidates[node.name][decided.index].outputs[index], node.name

    def terms(
        self, op: OpNode, indices: Sequence[int]
    ) -> tuple[list[tuple[str | None, list[float]]], list[float]]:
        """(redistribution terms in the order they are added, each named by the op it is
        weighed against or None; own costs), as vectors over ``indices``.

        Vectors are cached by what they depend on; objects enter keys by identity (candidate
        lists, strategies, layouts and metas are shared by the ops of repeated layers and
        live as long as the problem).
        """
        problem, cands, vectors = self.problem, self.problem.candidates[op.name], self._vectors
        at = indices if isinstance(indices, range) else tuple(indices)
        base = id(cands), len(at) if isinstance(at, range) else at
        out: list[tuple[str | None, list[float]]] = []
        for i, ref in enumerate(op.inputs):
            known = self.source_layout(op, i)
            if known is None:
                continue
            layout, meta, grad = known[0], op.input_metas[i], problem.needs_grad(ref)
            keep, bucket = problem.keeps_pending(ref), 0.0
            if keep is not None:  # its producer is decided: what it adds to the buckets
                producer = self.producers[op.name][i][0]
                assert producer is not None
                bucket = problem.bucket_seconds(producer, self.decided[producer.name].index)
            key: tuple[object, ...] = (base, 0, i, id(layout), id(meta), grad, keep, bucket)
            found = vectors.get(key)
            if found is None:
                vector = [
                    problem.input_edge_seconds(op, i, cands[j], layout, keep, bucket) for j in at
                ]
                found = vectors[key] = ((cands, layout, meta), vector)
            out.append((known[1], found[1]))
        cost = problem.cost
        for k, readers in enumerate(self.consumers[op.name]):
            meta = op.outputs[k]
            ref = op.name if k == 0 else f"{op.name}:{k}"
            grad = problem.needs_grad(ref)
            keep = problem.keeps_pending(ref)
            for consumer, i in readers:
                decided = self.decided.get(consumer.name)
                if decided is None:  # a pending sum is priced as if reduced for the consumer
                    key = (base, 1, k, id(meta))
                    found = vectors.get(key)
                    if found is None:
                        vector = [_pending(cost, cands[j].outputs[k], meta) for j in at]
                        found = vectors[key] = ((cands, meta), vector)
                    out.append((None, found[1]))
                    continue
                target = problem.candidates[consumer.name][decided.index]
                key = (base, 2, k, id(target), i, id(meta), grad, keep)
                found = vectors.get(key)
                if found is None:
                    want, back = target.inputs[i], gradient_layout(target, i) if grad else None
                    vector = [
                        cost.edge_seconds(
                            cands[j].outputs[k],
                            want,
                            back,
                            meta,
                            keep,
                            0.0 if keep is None else problem.bucket_seconds(op, j),
                        )
                        for j in at
                    ]
                    found = vectors[key] = ((cands, target, meta), vector)
                out.append((consumer.name, found[1]))
        key = (base, 3, problem.signature(op))
        found = vectors.get(key)
        if found is None:
            found = vectors[key] = (cands, [problem.op_seconds(op, j) for j in at])
        return out, found[1]

    def decide(self, op: OpNode, via: str) -> None:
        indices = self.allowed.get(op.name) or range(len(self.problem.candidates[op.name]))
        terms, own = self.terms(op, indices)
        key = (id(own), *(id(v) for _, v in terms))
        ranked = self._ranked.get(key)
        if ranked is None:
            sums = [0.0] * len(own)
            for _, vector in terms:
                sums = [a + b for a, b in zip(sums, vector, strict=True)]
            ranked = sorted(zip(sums, own, indices, strict=True))[: 1 + ALTERNATIVES_KEPT]
            self._ranked[key] = ranked
        redist, own_s, index = ranked[0]
        position = list(indices).index(index) if not isinstance(indices, range) else index
        heaviest, heaviest_cost = "", -1.0
        for name, vector in terms:
            if name is not None and vector[position] > heaviest_cost:
                heaviest, heaviest_cost = name, vector[position]
        reached = heaviest or via
        count = len(indices)
        reason = (
            f"propagated from {reached}: least redistribution ({redist:.3g} s), then least own "
            f"cost ({own_s:.3g} s) among {count} candidates"
        )
        if op.name in self.allowed:
            reason = f"annotated ({count} strategies fit the annotation); " + reason
        alternatives = tuple((s[2], s[0] + s[1]) for s in ranked[1 : 1 + ALTERNATIVES_KEPT])
        self.set(op, Decision(index, reason, redist + own_s, alternatives))

    def set(self, op: OpNode, decision: Decision) -> None:
        self.decided[op.name] = decision
        strategy = self.problem.candidates[op.name][decision.index]
        for i, ref in enumerate(op.inputs):
            if ref in self.param_layout or self.producers[op.name][i][0] is not None:
                continue
            source = self.graph.graph_input(ref)
            if source is not None and source.kind == "parameter":
                self.param_layout[ref] = (strategy.inputs[i], op.name)

    def inputs_ready(self, op: OpNode) -> bool:
        """MindSpore's waiting list: an op is decided once every op feeding it is."""
        decided = self.decided
        return all(node is None or node.name in decided for node, _ in self.producers[op.name])

    def neighbours(self, op: OpNode) -> list[OpNode]:
        found = [node for node, _ in self.producers[op.name] if node is not None]
        for readers in self.consumers[op.name]:
            found.extend(c for c, _ in readers)
        return found


_Producers = dict[str, list[tuple[OpNode | None, int]]]
_Consumers = dict[str, list[list[tuple[OpNode, int]]]]
_LAST_GRAPH: list[tuple[OpGraph, _Producers, _Consumers]] = []


def _structure(graph: OpGraph) -> tuple[_Producers, _Consumers]:
    """Per op, the producer of each input (None: a graph input) and the consumers of each
    output; remembered for the last graph (the outer planner searches it once per mesh)."""
    last = _LAST_GRAPH[0] if _LAST_GRAPH else None  # one read: another thread may replace it
    if last is not None and last[0] is graph:
        return last[1], last[2]
    producers: _Producers = {}
    consumers: _Consumers = {}
    for op in graph.ops:
        found: list[tuple[OpNode | None, int]] = []
        for ref in op.inputs:
            node, k = graph.producer(ref)
            found.append((node, k) if isinstance(node, OpNode) else (None, 0))
        producers[op.name] = found
        consumers[op.name] = [
            graph.consumers(op.name if k == 0 else f"{op.name}:{k}") for k in range(len(op.outputs))
        ]
    _LAST_GRAPH[:] = [(graph, producers, consumers)]
    return producers, consumers


def _pending(cost: CostModel, out: TensorLayout, meta: TensorMeta) -> float:
    """Reducing a pending sum for one consumer (0 when the output is whole)."""
    return cost.edge_seconds(out, settled(out), None, meta) if out.partial else 0.0


def _seed(
    walk: _Walk,
    problem: SearchProblem,
    allowed: Mapping[str, Sequence[int]],
    configured: Mapping[str, str],
) -> deque[OpNode]:
    """Configured ops first, in graph order; then the ops that read the batch."""
    queue: deque[OpNode] = deque()
    for op in problem.graph.ops:
        if op.name in configured:
            (index,) = allowed[op.name]
            walk.set(op, Decision(index, configured[op.name], problem.op_seconds(op, index)))
            queue.append(op)
    for op in problem.graph.ops:
        if op.name not in walk.decided and any(r in problem.input_layouts for r in op.inputs):
            walk.decide(op, "the batch")
            queue.append(op)
    return queue


def sharding_propagation(
    problem: SearchProblem,
    allowed: Mapping[str, Sequence[int]] | None = None,
    configured: Mapping[str, str] | None = None,
) -> dict[str, Decision]:
    """Choose one candidate per op by breadth-first propagation.

    Args:
        problem: the graph, candidates and costs.
        allowed: per op, the candidate indices that fit the user's annotations (or a mode's
            defaults, e.g. parameter-reading ops fixed to data parallel in semi_auto).
        configured: ops whose strategy is fixed (exactly one allowed candidate), with the
            reason to record (e.g. "annotated with plait.shard on blocks.0.attn.q").
    """
    allowed = dict(allowed or {})
    walk = _Walk(problem, allowed)
    queue = _seed(walk, problem, allowed, configured or {})
    order = {op.name: n for n, op in enumerate(problem.graph.ops)}
    waiting: dict[str, OpNode] = {}
    while queue or waiting:
        if not queue:  # every reachable op waits on an input: take the earliest
            name = min(waiting, key=order.__getitem__)
            op = waiting.pop(name)
            walk.decide(op, "waiting list")
            queue.append(op)
            continue
        current = queue.popleft()
        for neighbour in walk.neighbours(current):
            if neighbour.name in walk.decided:
                continue
            if walk.inputs_ready(neighbour):
                waiting.pop(neighbour.name, None)
                walk.decide(neighbour, current.name)
                queue.append(neighbour)
            else:
                waiting[neighbour.name] = neighbour
    for op in problem.graph.ops:  # not reachable from any seed: first candidate
        if op.name not in walk.decided:
            indices = allowed.get(op.name) or [0]
            walk.set(
                op,
                Decision(
                    indices[0],
                    "not reached by propagation: first candidate",
                    problem.op_seconds(op, indices[0]),
                ),
            )
    return walk.decided
