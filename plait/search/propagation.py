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

from plait.graph import OpNode
from plait.layout import TensorLayout
from plait.search.problem import SearchProblem, gradient_layout, settled

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
    """State of one propagation: decided ops and the layouts of decided values."""

    def __init__(self, problem: SearchProblem, allowed: Mapping[str, Sequence[int]]) -> None:
        self.problem = problem
        self.graph = problem.graph
        self.allowed = allowed
        self.decided: dict[str, Decision] = {}
        self.param_layout: dict[str, tuple[TensorLayout, str]] = {}

    def strategy(self, name: str):  # -> OpStrategy
        return self.problem.candidates[name][self.decided[name].index]

    def source_layout(self, ref: str) -> tuple[TensorLayout, str] | None:
        """Layout of value ``ref`` if already known, with the op (or input) that fixed it."""
        source = self.graph.graph_input(ref)
        if source is not None:
            if source.kind == "parameter":
                return self.param_layout.get(ref)
            fixed = self.problem.input_layouts.get(ref)
            return (fixed, ref) if fixed is not None else None
        node, index = self.graph.producer(ref)
        assert isinstance(node, OpNode)
        if node.name not in self.decided:
            return None
        return self.strategy(node.name).outputs[index], node.name

    def candidate_cost(self, op: OpNode, index: int) -> tuple[float, float, str]:
        """(redistribution seconds over decided edges, own seconds, the op most weighed)."""
        strategy = self.problem.candidates[op.name][index]
        redist = 0.0
        heaviest, heaviest_cost = "", -1.0
        for i, ref in enumerate(op.inputs):
            known = self.source_layout(ref)
            if known is None:
                continue
            c = self.problem.input_edge_seconds(op, i, strategy, known[0])
            redist += c
            if c > heaviest_cost:
                heaviest, heaviest_cost = known[1], c
        for k in range(len(op.outputs)):
            ref = op.name if k == 0 else f"{op.name}:{k}"
            out = strategy.outputs[k]
            for consumer, i in self.graph.consumers(ref):
                if consumer.name not in self.decided:
                    if out.partial:  # a pending sum is priced as if reduced for the consumer
                        whole = settled(out)
                        redist += self.problem.cost.edge_seconds(out, whole, None, op.outputs[k])
                    continue
                target = self.strategy(consumer.name)
                c = self.problem.cost.edge_seconds(
                    strategy.outputs[k],
                    target.inputs[i],
                    gradient_layout(target, i) if self.problem.needs_grad(ref) else None,
                    op.outputs[k],
                )
                redist += c
                if c > heaviest_cost:
                    heaviest, heaviest_cost = consumer.name, c
        return redist, self.problem.op_seconds(op, index), heaviest

    def decide(self, op: OpNode, via: str) -> None:
        indices = self.allowed.get(op.name) or range(len(self.problem.candidates[op.name]))
        scored = []
        for index in indices:
            redist, own, heaviest = self.candidate_cost(op, index)
            scored.append(((redist, own, index), heaviest))
        scored.sort(key=lambda s: s[0])
        (redist, own, index), heaviest = scored[0]
        reached = heaviest or via
        reason = (
            f"propagated from {reached}: least redistribution ({redist:.3g} s), then least own "
            f"cost ({own:.3g} s) among {len(scored)} candidates"
        )
        if op.name in self.allowed:
            reason = f"annotated ({len(scored)} strategies fit the annotation); " + reason
        alternatives = tuple(
            (s[0][2], s[0][0] + s[0][1]) for s in scored[1 : 1 + ALTERNATIVES_KEPT]
        )
        self.set(op, Decision(index, reason, redist + own, alternatives))

    def set(self, op: OpNode, decision: Decision) -> None:
        self.decided[op.name] = decision
        strategy = self.problem.candidates[op.name][decision.index]
        for i, ref in enumerate(op.inputs):
            source = self.graph.graph_input(ref)
            if source is not None and source.kind == "parameter" and ref not in self.param_layout:
                self.param_layout[ref] = (strategy.inputs[i], op.name)

    def inputs_ready(self, op: OpNode) -> bool:
        """MindSpore's waiting list: an op is decided once every op feeding it is."""
        for ref in op.inputs:
            node, _ = self.graph.producer(ref)
            if isinstance(node, OpNode) and node.name not in self.decided:
                return False
        return True

    def neighbours(self, op: OpNode) -> list[OpNode]:
        found: list[OpNode] = []
        for ref in op.inputs:
            node, _ = self.graph.producer(ref)
            if isinstance(node, OpNode):
                found.append(node)
        for k in range(len(op.outputs)):
            ref = op.name if k == 0 else f"{op.name}:{k}"
            found.extend(c for c, _ in self.graph.consumers(ref))
        return found


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
