"""``search="dynamic_programming"``: graph elimination with (time, memory) cost lists.

MindSpore's dynamic-programming search (``dp_algo_costmodel`` in MindSpore's source; node and
edge elimination after OptCNN: Jia, Lin, Qi and Aiken, ICML 2018), on plait's objective. :meth:`SearchProblem.evaluate` is a sum of terms over one op (compute,
parameter-gradient reduction, batch edges) and over two ops (a value's redistribution between
its producer and a consumer; a parameter's redistribution between its first reader and a later
reader that wants another layout). :func:`cost_graph` writes it down as a cost graph: one cost
vector per op over its allowed candidates, one cost matrix per pair of ops.

Eliminations (each records how to recover the choices it removed):

- **operator elimination** (an op with two neighbours ``u - v - w``): a new ``u - w`` matrix,
  for each ``(s_u, s_w)`` the best ``s_v`` of ``edge(u,v) + op(v) + edge(v,w)``. Undirected,
  so it also covers MindSpore's **triangle elimination** (its ``u`` has two neighbours that
  are joined);
- **edge elimination**: parallel matrices between the same two ops are summed as soon as they
  appear (q, k and v reading one layer norm; a value read twice);
- **merge / contract elimination** (an op with one neighbour): folded into its neighbour's
  cost vector, for each of the neighbour's candidates the best of its own;
- an op with no neighbour left closes a connected component; components are summed.

These five are exact. An op left with three or more neighbours (a graph that is not
series-parallel) is eliminated exactly too, into a cost table over all its neighbours
(ordinary variable elimination, smallest table first), as long as that table has at most
``max_factor_cells`` entries. Beyond that the **star heuristic** (MindSpore's star
elimination is its last resort too) fixes the op with the most neighbours to the candidate
that is best against each neighbour's own best, and the search goes on exactly around it; the
reasons of every decision say when this happened.

Cost lists. Without a memory limit each entry is one number (seconds): the Pareto front of
one objective. With ``memory_limit`` each entry is a list of up to ``pareto_points``
(seconds, bytes) pairs, pruned to the Pareto front after each combination (a pair is dropped
when another is no slower and no larger), and the **memory filter** drops every pair above the
limit. Memory only grows as terms are added, so the filter is sharpened: a partial sum is
dropped when it plus the least memory of every op not yet folded into it exceeds the limit
(it can never be completed under it). The memory of a candidate comes from
:func:`plait.rules.op_memory` of the op under it: the activations its backward keeps, its
outputs, and ``state_factor`` (default 4: fp32 Adam's parameter, gradient and two moments)
times its local pieces of the parameters it is the first to read; a plan's memory is the sum
over ops. It is a planning measure (every op's outputs count, as if nothing were freed), the
one the ilp's memory row uses too. When a front has more pairs than ``pareto_points``, the
fastest, the smallest and pairs evenly spaced between them are kept; the reasons say when
that happened (the result then fits the limit but may not be the fastest that does).

Repeated layers. The eliminations run on the whole graph, op by op, in graph order: a layer
of a transformer reduces to one matrix between the residual values entering and leaving it,
and the chain of layers to one more. What makes 96 layers fast is that the members of a
layer group share everything that costs: their ops share candidate lists and prices
(``planner.prepare`` and :meth:`SearchProblem.op_seconds`), so every cost matrix is computed
once per distinct (producer candidates, consumer candidates, value) and reused by every
member; an elimination is a small numpy min-plus product. This is exact, unlike solving one
member with fixed boundaries and copying it (the best layer in isolation need not be the
best layer in the chain). A 96-layer GPT (2,409 ops, up to 28 candidates each) on 1,024
devices takes about 3 s on a 2-core CPU; with a memory limit, about 10 s.

Ties go to the lowest candidate index.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from plait.errors import PlanError
from plait.rules import op_memory
from plait.search.problem import Edge, SearchProblem, gradient_layout
from plait.search.propagation import Decision

__all__ = [
    "CostGraph",
    "PairTerm",
    "SearchStats",
    "cost_graph",
    "decisions_for",
    "dynamic_programming",
    "eliminate",
]

ALTERNATIVES_KEPT = 3
PARETO_POINTS = 4  # (time, memory) pairs kept per cost-list entry under a memory limit
MAX_FACTOR_CELLS = 1 << 21  # largest cost table an exact elimination may build
# Model-state bytes per parameter byte under a memory limit: fp32 Adam keeps the parameter, its
# gradient and two moments, 4 + 4 + 8 bytes per 4-byte element (ZeRO, Rajbhandari et al., SC 2020)
STATE_FACTOR = 4.0


# ---------------------------------------------------------------------------- the cost graph


@dataclass(frozen=True, eq=False)
class PairTerm:
    """Seconds paid by ops ``u`` and ``v`` together, for every pair of their allowed candidates.

    ``u`` and ``v`` are positions in :attr:`CostGraph.names` with ``u < v``; ``matrix`` is
    indexed by positions in their allowed candidate lists; ``edges`` counts the graph edges
    (values and shared parameters) summed into it.
    """

    u: int
    v: int
    matrix: np.ndarray
    edges: int = 1

    def __post_init__(self) -> None:
        if not self.u < self.v:
            raise PlanError(f"PairTerm({self.u}, {self.v}): ops must be given as u < v")


@dataclass(frozen=True, eq=False)
class CostGraph:
    """:meth:`SearchProblem.evaluate` as unary and pairwise terms over allowed candidates.

    ``choices[k]`` are the candidate indices op ``names[k]`` may take; a *pick* is a position
    in that tuple. ``memory[k]`` (bytes per candidate) is present when a memory limit asks.
    """

    names: tuple[str, ...]
    choices: tuple[tuple[int, ...], ...]
    unary: tuple[np.ndarray, ...]
    pairs: tuple[PairTerm, ...]
    memory: tuple[np.ndarray, ...] | None = None

    def __post_init__(self) -> None:
        sizes = [len(c) for c in self.choices]
        if len(self.unary) != len(sizes) or any(
            u.shape != (n,) for u, n in zip(self.unary, sizes, strict=True)
        ):
            raise PlanError("CostGraph: one cost vector per op, as long as its choices")
        for p in self.pairs:
            if p.matrix.shape != (sizes[p.u], sizes[p.v]):
                raise PlanError(
                    f"CostGraph: matrix of ops {self.names[p.u]}, {self.names[p.v]} has shape "
                    f"{p.matrix.shape}, expected {(sizes[p.u], sizes[p.v])}"
                )

    def total(self, picks: Sequence[int]) -> float:
        """Objective of one pick per op (equals ``problem.evaluate`` of :meth:`choice`)."""
        seconds = sum(float(u[k]) for u, k in zip(self.unary, picks, strict=True))
        return seconds + sum(float(p.matrix[picks[p.u], picks[p.v]]) for p in self.pairs)

    def choice(self, picks: Sequence[int]) -> dict[str, int]:
        """Op name -> candidate index of one pick per op."""
        return {n: c[k] for n, c, k in zip(self.names, self.choices, picks, strict=True)}


def _allowed(problem: SearchProblem, allowed: Mapping[str, Sequence[int]], name: str) -> tuple:
    found = allowed.get(name)
    if found:
        return tuple(found)
    return tuple(range(len(problem.candidates[name])))


@dataclass
class _Builder:
    """Accumulates unary vectors and pair matrices; matrices are shared across layers."""

    problem: SearchProblem
    choices: tuple[tuple[int, ...], ...]
    position: dict[str, int]
    unary: list[np.ndarray]
    pairs: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)
    cache: dict[tuple[object, ...], np.ndarray] = field(default_factory=dict)

    def add_pair(self, u: int, v: int, matrix: np.ndarray) -> None:
        if u == v:  # an op paying against itself (a parameter read twice): the diagonal
            self.unary[u] = self.unary[u] + np.diagonal(matrix)
        elif u < v:
            self.pairs.setdefault((u, v), []).append(matrix)
        else:
            self.pairs.setdefault((v, u), []).append(matrix.T)

    def edge_matrix(self, edge: Edge) -> np.ndarray:
        """``problem.edge_cost`` for every allowed pair; equal edges of equal layers share it."""
        p = self.problem
        u, v = self.position[edge.producer], self.position[edge.consumer]
        producer, consumer = p.candidates[edge.producer], p.candidates[edge.consumer]
        meta = p.graph.meta(edge.ref)
        key: tuple[object, ...] = (id(producer), edge.output, id(consumer), edge.input)
        key += (edge.needs_grad, meta, self.choices[u], self.choices[v])
        key += (p.keeps_pending(edge.ref),)
        found = self.cache.get(key)
        if found is not None:
            return found
        targets = [
            (
                consumer[j].inputs[edge.input],
                gradient_layout(consumer[j], edge.input) if edge.needs_grad else None,
            )
            for j in self.choices[v]
        ]
        keep = p.keeps_pending(edge.ref)
        if keep is None:
            sources = [producer[i].outputs[edge.output] for i in self.choices[u]]
            matrix = _tabulate(
                sources, targets, lambda s, t: p.cost.edge_seconds(s, t[0], t[1], meta)
            )
        else:  # the gradient stays pending into the producer's parameters (its buckets)
            op = p.graph.op(edge.producer)
            pending = [
                (producer[i].outputs[edge.output], p.bucket_seconds(op, i)) for i in self.choices[u]
            ]
            matrix = _tabulate(
                pending,
                targets,
                lambda s, t: p.cost.edge_seconds(s[0], t[0], t[1], meta, keep, s[1]),
            )
        self.cache[key] = matrix
        return matrix

    def shared_matrix(self, first: tuple[int, int], later: tuple[int, int]) -> np.ndarray:
        """A parameter laid out for its first reader, redistributed for a later one."""
        p = self.problem
        (f, fi), (op_pos, i) = first, later
        op = p.graph.ops[op_pos]
        f_cands, cands = p.candidates[p.graph.ops[f].name], p.candidates[op.name]
        key: tuple[object, ...] = ("shared", id(f_cands), fi, id(cands), i, op.input_metas[i])
        key += (self.choices[f], self.choices[op_pos])
        found = self.cache.get(key)
        if found is not None:
            return found
        sources = [f_cands[a].inputs[fi] for a in self.choices[f]]
        targets = [cands[b] for b in self.choices[op_pos]]

        def seconds(src, strategy) -> float:
            if src == strategy.inputs[i]:
                return 0.0
            return p.input_edge_seconds(op, i, strategy, src)

        matrix = _tabulate(sources, targets, seconds)
        self.cache[key] = matrix
        return matrix


def _tabulate(rows: list, cols: list, price) -> np.ndarray:
    """``price(row, col)`` for every pair, computed once per distinct (row, col) object.

    Rows and columns are layouts (or tuples of them) that the candidates of an op share, so
    they are told apart by identity (``price`` is a function of their values: equal objects
    priced twice give the same number).
    """
    row_at, row_first = _firsts(rows)
    col_at, col_first = _firsts(cols)
    small = np.empty((len(row_first), len(col_first)))
    for a, r in enumerate(row_first):
        for b, c in enumerate(col_first):
            small[a, b] = price(r, c)
    return small[np.ix_(np.array(row_at, dtype=np.intp), np.array(col_at, dtype=np.intp))]


def _firsts(items: list) -> tuple[list[int], list]:
    """(for each item the position of its first occurrence among the distinct ones, the
    distinct items), items being told apart by identity (a tuple by its members')."""
    at: list[int] = []
    first: list = []
    seen: dict[object, int] = {}
    for item in items:
        key = tuple(map(id, item)) if isinstance(item, tuple) else id(item)
        k = seen.get(key)
        if k is None:
            k = seen[key] = len(first)
            first.append(item)
        at.append(k)
    return at, first


def cost_graph(
    problem: SearchProblem,
    allowed: Mapping[str, Sequence[int]] | None = None,
    *,
    with_memory: bool = False,
    state_factor: float = STATE_FACTOR,
) -> CostGraph:
    """The objective of ``problem`` over the ``allowed`` candidates as a :class:`CostGraph`.

    ``with_memory`` adds each candidate's bytes (see :func:`_memory`; ``state_factor`` bytes
    of model state per byte of parameter).
    """
    allowed = allowed or {}
    graph = problem.graph
    choices = tuple(_allowed(problem, allowed, op.name) for op in graph.ops)
    position = {op.name: k for k, op in enumerate(graph.ops)}
    unary = _unary(problem, choices)
    builder = _Builder(problem, choices, position, unary)
    for edge in problem.edges():
        builder.add_pair(
            position[edge.producer], position[edge.consumer], builder.edge_matrix(edge)
        )
    first: dict[str, tuple[int, int]] = {}
    for k, op in enumerate(graph.ops):
        for i, ref in enumerate(op.inputs):
            source = graph.graph_input(ref)
            if source is None or source.kind != "parameter":
                continue
            if ref not in first:
                first[ref] = (k, i)
            else:
                builder.add_pair(first[ref][0], k, builder.shared_matrix(first[ref], (k, i)))
    pairs = tuple(
        PairTerm(u, v, ms[0] if len(ms) == 1 else np.sum(ms, axis=0), len(ms))
        for (u, v), ms in sorted(builder.pairs.items())
    )
    memory = _memory(problem, choices, state_factor) if with_memory else None
    return CostGraph(
        tuple(op.name for op in graph.ops), choices, tuple(builder.unary), pairs, memory
    )


def _unary(problem: SearchProblem, choices: tuple[tuple[int, ...], ...]) -> list[np.ndarray]:
    """Own cost plus batch edges of every allowed candidate of every op; ops that price alike
    and read no batch tensor (the same op in every repeated layer) share one vector."""
    shared: dict[tuple[object, ...], np.ndarray] = {}
    out = []
    for op, idx in zip(problem.graph.ops, choices, strict=True):
        if any(ref in problem.input_layouts for ref in op.inputs):
            vector = [problem.op_seconds(op, i) + problem.source_cost(op, i) for i in idx]
            out.append(np.array(vector, float))
            continue
        key = (problem.signature(op), id(problem.candidates[op.name]), idx)
        found = shared.get(key)
        if found is None:  # source_cost is 0.0 here: x + 0.0 is x
            found = shared[key] = np.array([problem.op_seconds(op, i) for i in idx], float)
        out.append(found)
    return out


def _memory(
    problem: SearchProblem, choices: tuple[tuple[int, ...], ...], state_factor: float
) -> tuple:
    """Bytes per device of each allowed candidate: activations, outputs and model states.

    A parameter counts at its first reader, ``state_factor`` times its local piece (the
    parameter, its gradient and the optimizer's moments); a later reader that holds it in
    its own layout counts that copy as an input it keeps.
    """
    out = []
    seen: set[str] = set()
    for op, idx in zip(problem.graph.ops, choices, strict=True):
        params = []
        for i, ref in enumerate(op.inputs):
            if _is_parameter(problem, ref) and ref not in seen:
                seen.add(ref)
                params.append(i)
        cands = problem.candidates[op.name]
        found = [op_memory(op, cands[i], params) for i in idx]
        out.append(np.array([m.total + (state_factor - 1) * m.parameters for m in found], float))
    return tuple(out)


def _is_parameter(problem: SearchProblem, ref: str) -> bool:
    source = problem.graph.graph_input(ref)
    return source is not None and source.kind == "parameter"


# ------------------------------------------------------------------ factors and elimination


@dataclass(eq=False)
class _Factor:
    """A cost table over some ops, each cell a list of (seconds, bytes) pairs.

    ``time``/``mem`` have one axis per op of ``ops`` (sorted) and a last axis for the list
    (``inf`` pads unused slots). A factor made by combining ``parts`` keeps ``back``: for each
    cell and list slot, the flat index into (eliminated ops' picks, each part's list slot)
    that produced it; a factor made by fixing an op keeps ``fixed = (op, pick)``.
    """

    ops: tuple[int, ...]
    time: np.ndarray
    mem: np.ndarray
    parts: tuple[_Factor, ...] = ()
    eliminated: tuple[int, ...] = ()
    back: np.ndarray | None = None
    fixed: tuple[int, int] | None = None
    least: float = 0.0  # least memory of the ops whose own costs are folded into this table

    @property
    def slots(self) -> int:
        return self.time.shape[-1]


@dataclass
class SearchStats:
    """What the elimination did: counts by kind, and whether the result is proven optimal."""

    operator: int = 0  # two neighbours (MindSpore's operator and triangle eliminations)
    edge: int = 0  # parallel cost tables summed
    merge: int = 0  # one neighbour (merge and contract eliminations)
    component: int = 0  # no neighbour left
    higher_order: int = 0  # three or more neighbours, eliminated exactly
    star: list[str] = field(default_factory=list)  # ops fixed by the star heuristic
    truncated: bool = False  # a Pareto front was cut to pareto_points pairs

    @property
    def exact(self) -> bool:
        return not self.star and not self.truncated


def _prune(
    time: np.ndarray, mem: np.ndarray, slots: int, limit: float | None, stats: SearchStats
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the Pareto front of (time, mem) pairs under ``limit``, at most ``slots`` long.

    Returns (time, mem, index into the row) of shape (rows, slots).
    """
    rows = np.arange(time.shape[0])
    if slots == 1 and limit is None:  # one objective: the minimum, lowest index on ties
        idx = np.argmin(time, axis=1)
        return time[rows, idx][:, None], mem[rows, idx][:, None], idx[:, None]
    if limit is not None:
        time = np.where(mem > limit, np.inf, time)
    order = np.lexsort((mem, time), axis=-1)
    t = np.take_along_axis(time, order, axis=1)
    m = np.take_along_axis(mem, order, axis=1)
    before = np.minimum.accumulate(m, axis=1)
    before = np.concatenate([np.full((len(rows), 1), np.inf), before[:, :-1]], axis=1)
    front = (m < before) & np.isfinite(t)
    count = front.sum(axis=1)
    rank = np.cumsum(front, axis=1) - 1
    if (count > slots).any():
        stats.truncated = True
    out_t = np.full((len(rows), slots), np.inf)
    out_m = np.full((len(rows), slots), np.inf)
    out_i = np.zeros((len(rows), slots), dtype=np.intp)
    for q in range(slots):
        # the fastest, the smallest and evenly spaced pairs between them
        spread = np.rint(q * (count - 1) / max(slots - 1, 1)).astype(np.intp)
        target = np.where(count <= slots, q, spread)
        hit = front & (rank == target[:, None])
        pos = hit.argmax(axis=1)
        valid = hit.any(axis=1)
        out_t[:, q] = np.where(valid, t[rows, pos], np.inf)
        out_m[:, q] = np.where(valid, m[rows, pos], np.inf)
        out_i[:, q] = np.where(valid, order[rows, pos], 0)
    return out_t, out_m, out_i


class _Eliminator:
    """Variable elimination over factors, exact pairwise eliminations first, in graph order."""

    def __init__(
        self,
        sizes: Sequence[int],
        slots: int,
        limit: float | None,
        max_cells: int,
        names: Sequence[str],
    ) -> None:
        self.sizes = list(sizes)
        self.slots = slots
        self.limit = limit
        self.least = 0.0  # least memory of the whole graph (the sum over ops' minimum)
        self.max_cells = max_cells
        self.names = names
        self.live: dict[tuple[int, ...], _Factor] = {}
        self.of: list[set[tuple[int, ...]]] = [set() for _ in sizes]
        self.made: list[_Factor] = []
        self.stats = SearchStats()
        one = np.zeros(1)
        self.live[()] = _Factor((), one, one.copy())  # the sum of closed components

    # -- building factors

    def add(self, factor: _Factor) -> None:
        """Add a factor; one already over the same ops is merged with it (edge elimination)."""
        old = self.live.get(factor.ops)
        if old is not None:
            if len(factor.ops) == 2:
                self.stats.edge += 1
            factor = self.combine((old, factor), factor.ops, ())
        self.live[factor.ops] = factor
        for v in factor.ops:
            self.of[v].add(factor.ops)

    def combine(
        self, parts: Sequence[_Factor], keep: tuple[int, ...], eliminated: tuple[int, ...]
    ) -> _Factor:
        """Sum ``parts`` over ``keep + eliminated``, then prune over eliminated ops and lists."""
        axes = keep + eliminated
        full = [self.sizes[a] for a in axes] + [p.slots for p in parts]
        time: np.ndarray | float = 0.0
        mem: np.ndarray | float = 0.0
        for k, p in enumerate(parts):
            perm = [p.ops.index(a) for a in axes if a in p.ops] + [len(p.ops)]
            shape = [self.sizes[a] if a in p.ops else 1 for a in axes]
            shape += [p.slots if j == k else 1 for j in range(len(parts))]
            time = time + p.time.transpose(perm).reshape(shape)
            mem = mem + p.mem.transpose(perm).reshape(shape)
        rows = math.prod(self.sizes[a] for a in keep)
        time = np.broadcast_to(time, full).reshape(rows, -1)
        mem = np.broadcast_to(mem, full).reshape(rows, -1)
        least = sum(p.least for p in parts)
        # what this table's ops may use: the limit less the least the other ops need
        limit = None if self.limit is None else self.limit - (self.least - least)
        t, m, back = _prune(time, mem, self.slots, limit, self.stats)
        shape = [self.sizes[a] for a in keep] + [self.slots]
        made = _Factor(keep, t.reshape(shape), m.reshape(shape), tuple(parts), eliminated, back)
        made.least = least
        self.made.append(made)
        return made

    # -- the elimination loop

    def neighbours(self, v: int) -> tuple[int, ...]:
        return tuple(sorted({a for ops in self.of[v] for a in ops} - {v}))

    def key(self, v: int) -> tuple[int, int, int]:
        """Exact pairwise eliminations first (graph order), then the smallest new table."""
        nb = self.neighbours(v)
        if len(nb) <= 2:
            return (0, 0, v)
        return (1, math.prod(self.sizes[a] for a in nb), v)

    def run(self) -> None:
        heap = [self.key(v) for v in range(len(self.sizes))]
        heapq.heapify(heap)
        done = [False] * len(self.sizes)
        while heap:
            entry = heapq.heappop(heap)
            v = entry[2]
            if done[v] or entry != self.key(v):
                continue  # stale entry
            nb = self.neighbours(v)
            if entry[0] == 1 and entry[1] > self.max_cells:
                v = self._star()
                nb = self.neighbours(v)
                self.fix(v)
            else:
                self.eliminate(v, nb)
            done[v] = True
            for w in nb:
                heapq.heappush(heap, self.key(w))
            if not done[entry[2]]:
                heapq.heappush(heap, self.key(entry[2]))

    def take(self, v: int) -> list[_Factor]:
        """Remove and return the live factors over ``v``, in a fixed order."""
        keys = sorted(self.of[v], key=lambda ops: (len(ops), ops))
        parts = [self.live.pop(ops) for ops in keys]
        for ops in keys:
            for a in ops:
                self.of[a].discard(ops)
        return parts

    def eliminate(self, v: int, nb: tuple[int, ...]) -> None:
        kind = {0: "component", 1: "merge", 2: "operator"}.get(len(nb), "higher_order")
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        parts = self.take(v)
        if self.slots > 1 and len(parts) > 2:
            # fold lists in one part at a time: exact (a dominated partial sum stays dominated)
            # and far smaller than one table over every part's list
            acc = parts[0]
            for p in parts[1:-1]:
                ops = tuple(sorted(set(acc.ops) | set(p.ops)))
                acc = self.combine((acc, p), ops, ())
            parts = [acc, parts[-1]]
        self.add(self.combine(parts, nb, (v,)))

    def _star(self) -> int:
        """The op with the most neighbours (the first in graph order on ties)."""
        alive = [v for v in range(len(self.sizes)) if self.of[v]]
        return min(alive, key=lambda v: (-len(self.neighbours(v)), v))

    def fix(self, v: int) -> None:
        """Star heuristic: fix ``v`` to its best candidate against its neighbours' own best."""
        parts = self.take(v)
        estimate = np.zeros(self.sizes[v])
        for p in parts:
            axis = p.ops.index(v)
            best = np.moveaxis(p.time.min(axis=-1), axis, 0)
            estimate += best.reshape(self.sizes[v], -1).min(axis=1)
        pick = int(np.argmin(estimate))
        self.stats.star.append(self.names[v])
        for p in parts:
            axis = p.ops.index(v)
            ops = tuple(a for a in p.ops if a != v)
            sliced = _Factor(
                ops,
                np.take(p.time, pick, axis=axis),
                np.take(p.mem, pick, axis=axis),
                (p,),
                fixed=(v, pick),
                least=p.least,
            )
            self.made.append(sliced)
            self.add(sliced)
        if not parts:
            self.made.append(_Factor((), np.zeros(1), np.zeros(1), fixed=(v, pick)))

    # -- recovery

    def recover(self) -> tuple[list[int], float, float]:
        """Picks of the best feasible total, and its (seconds, bytes)."""
        root = self.live[()]
        slot = int(np.argmin(root.time))
        seconds, nbytes = float(root.time[slot]), float(root.mem[slot])
        if not math.isfinite(seconds):
            raise _Infeasible
        picks: dict[int, int] = {}
        chosen: dict[int, int] = {id(root): slot}
        for f in reversed(self.made):
            s = chosen.get(id(f))
            if f.fixed is not None:
                picks[f.fixed[0]] = f.fixed[1]
                if f.parts and s is not None:
                    chosen[id(f.parts[0])] = s
                continue
            if s is None or f.back is None:
                continue
            cell = (
                int(np.ravel_multi_index([picks[a] for a in f.ops], [self.sizes[a] for a in f.ops]))
                if f.ops
                else 0
            )
            dims = [self.sizes[a] for a in f.eliminated] + [p.slots for p in f.parts]
            found = np.unravel_index(int(f.back[cell, s]), dims)
            for a, k in zip(f.eliminated, found, strict=False):
                picks[a] = int(k)
            for p, k in zip(f.parts, found[len(f.eliminated) :], strict=True):
                chosen[id(p)] = int(k)
        return [picks[v] for v in range(len(self.sizes))], seconds, nbytes


class _Infeasible(Exception):
    """No assignment fits the memory limit."""


def eliminate(
    graph: CostGraph,
    *,
    memory_limit: float | None = None,
    pareto_points: int = PARETO_POINTS,
    max_factor_cells: int = MAX_FACTOR_CELLS,
) -> tuple[list[int], SearchStats]:
    """The best pick per op of ``graph`` (positions in its choices), and what it took.

    Raises :class:`~plait.errors.PlanError` when no assignment fits ``memory_limit``.
    """
    sizes = [len(c) for c in graph.choices]
    slots = 1 if memory_limit is None else pareto_points
    if memory_limit is not None and graph.memory is None:
        raise PlanError("eliminate: a memory_limit needs a CostGraph built with_memory=True")
    work = _Eliminator(sizes, slots, memory_limit, max_factor_cells, graph.names)
    for k, u in enumerate(graph.unary):
        mem = graph.memory[k] if graph.memory is not None else np.zeros_like(u)
        work.add(_Factor((k,), u[:, None], mem[:, None], least=float(mem.min())))
        work.least += float(mem.min())
    for p in graph.pairs:
        work.add(_Factor((p.u, p.v), p.matrix[:, :, None], np.zeros((*p.matrix.shape, 1))))
    work.run()
    try:
        picks, _, _ = work.recover()
    except _Infeasible:
        least = sum(float(m.min()) for m in graph.memory or ())
        raise PlanError(
            f"dynamic_programming: no choice of strategies keeps the summed op memory under "
            f"memory_limit={memory_limit:.4g} bytes per device (the least any choice could "
            f"need is {least:.4g}); raise memory_limit, use more devices, or allow more "
            "strategies"
        ) from None
    return picks, work.stats


# -------------------------------------------------------------------------------- decisions


def decisions_for(
    problem: SearchProblem,
    graph: CostGraph,
    picks: Sequence[int],
    configured: Mapping[str, str],
    allowed: Mapping[str, Sequence[int]],
    how: str,
) -> dict[str, Decision]:
    """One Decision per op: ``how`` as the reason, local cost and the best other candidates.

    An op's ``cost_s`` is its *local* cost with every other op as chosen: its own cost plus
    every pair term it takes part in; an alternative's cost is the same with only this op
    switched. At an exact optimum no alternative is cheaper.
    """
    touching: list[list[PairTerm]] = [[] for _ in graph.names]
    for p in graph.pairs:
        touching[p.u].append(p)
        touching[p.v].append(p)
    out: dict[str, Decision] = {}
    for k, name in enumerate(graph.names):
        local = graph.unary[k].copy()
        for p in touching[k]:
            local += p.matrix[:, picks[p.v]] if p.u == k else p.matrix[picks[p.u], :]
        order = sorted(range(len(local)), key=lambda a: (local[a], a))
        others = tuple((graph.choices[k][a], float(local[a])) for a in order if a != picks[k])[
            :ALTERNATIVES_KEPT
        ]
        if name in configured:
            reason = configured[name]
        elif allowed.get(name):
            reason = f"annotated ({len(graph.choices[k])} strategies fit the annotation); {how}"
        else:
            reason = how
        out[name] = Decision(graph.choices[k][picks[k]], reason, float(local[picks[k]]), others)
    return out


def _describe(stats: SearchStats, total: float, slots: int, limit: float | None) -> str:
    counts = (
        f"{stats.operator} operator, {stats.merge} merge/contract, {stats.edge} edge, "
        f"{stats.higher_order} higher-order eliminations"
    )
    text = f"dynamic programming over the whole graph ({counts}); plan total {total:.4g} s"
    if limit is not None:
        text += f", memory filter at {limit:.4g} bytes"
    if stats.exact:
        return text + "; optimal"
    notes = []
    if stats.star:
        notes.append(
            f"star heuristic fixed {', '.join(stats.star)} (its exact elimination table "
            "was too large), the rest is optimal around it"
        )
    if stats.truncated:
        notes.append(
            f"a Pareto front was cut to {slots} (time, memory) pairs: the plan fits the "
            "limit but may not be the fastest that does"
        )
    return text + "; NOT proven optimal: " + "; ".join(notes)


def dynamic_programming(
    problem: SearchProblem,
    allowed: Mapping[str, Sequence[int]] | None = None,
    configured: Mapping[str, str] | None = None,
    *,
    memory_limit: float | None = None,
    pareto_points: int = PARETO_POINTS,
    max_factor_cells: int = MAX_FACTOR_CELLS,
    state_factor: float = STATE_FACTOR,
) -> dict[str, Decision]:
    """Choose one candidate per op by graph elimination (see the module doc).

    Args:
        problem: the graph, candidates and costs.
        allowed: per op, the candidate indices it may take (annotations, mode defaults).
        configured: ops whose strategy is fixed (one allowed candidate), with their reason.
        memory_limit: bytes per device for the summed memory of the ops' candidates (see the
            module doc); None: no memory filter.
        pareto_points: (time, memory) pairs kept per cost-list entry under a memory limit.
        max_factor_cells: largest cost table an exact elimination of an op with three or
            more neighbours may build before the star heuristic takes over.
        state_factor: model-state bytes per parameter byte under a memory limit (4: fp32
            Adam; 8 for mixed-precision Adam on 2-byte parameters).
    """
    if pareto_points < 1 or max_factor_cells < 1:
        raise PlanError(
            f"dynamic_programming: pareto_points={pareto_points}, max_factor_cells="
            f"{max_factor_cells}; both must be >= 1"
        )
    allowed = dict(allowed or {})
    graph = cost_graph(
        problem, allowed, with_memory=memory_limit is not None, state_factor=state_factor
    )
    picks, stats = eliminate(
        graph,
        memory_limit=memory_limit,
        pareto_points=pareto_points,
        max_factor_cells=max_factor_cells,
    )
    stats.edge += sum(p.edges - 1 for p in graph.pairs)
    how = _describe(stats, graph.total(picks), pareto_points, memory_limit)
    return decisions_for(problem, graph, picks, configured or {}, allowed, how)
