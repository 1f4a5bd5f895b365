"""``search="recursive_programming"``: MindSpore's double recursive search on named meshes.

MindSpore's SAPP planner (its auto-parallel docs, "recursive_programming"; Wang et al.,
"Efficient and Systematic Partitioning of Large and Deep Neural Networks for Parallelization",
Euro-Par 2021) cuts every operator in two, ``log2(N)`` times: the outer recursion walks the bisections of
the cluster, the inner one walks the operators in decreasing weight, and each operator picks
the dimension to cut given the cuts its heavier neighbours already made. plait's candidates
split whole named mesh axes, so here the outer recursion is **one round per mesh axis**
(mesh order first, outermost axis first, as MindSpore's first bisection cuts the slowest
links; other orders are tried too, below). An axis of any size is one round, so meshes such
as ``{dp: 3, tp: 2}`` need no power of two; the candidates already refuse dims that an axis
does not divide.

**Roles.** Projected on one mesh axis, a candidate says what that axis does to each of the op's
tensors: which dim of each input and output it splits, or that an output holds a pending sum
over it. That projection is the axis's *role* (the "dimension cut" of MindSpore). A candidate is
the tuple of its roles, one per axis; after round ``r`` an op holds the roles of the first
``r + 1`` axes, and is priced as the candidate with those roles and the later axes unused
(its *completion*: the op as it runs when only those axes exist). Round ``r`` offers an op only
the roles some allowed candidate extends, so the final tuple always maps back to a candidate;
``configured`` ops hold their fixed candidate's roles in every round.

**Costs.** An op's choice in a round is priced with the problem's own closed-form costs
(:class:`~plait.search.problem.SearchProblem`), on the completion:

- its compute share and its parameters' gradient reduction (``SearchProblem.op_seconds``;
  MindSpore's "cut i" cost of a MatMul);
- on each edge to an op already decided in this round, the redistribution both ways;
- on each edge to an undecided op, a lookahead: the cheapest choice of that neighbour given
  this one, itself priced the same way up to ``LOOKAHEAD_DEPTH`` ops away; ops that only
  pass a value on (no FLOPs, one producer, one consumer: views, transposes) do not count,
  so a linear sees the next matmul through them, as MindSpore sees it through the ops it
  eliminates. At the end of the lookahead an edge costs what the op alone makes it cost:
  the reduction of a pending sum it outputs (MindSpore's "cut k") and of a partial gradient
  it hands back (its "cut j").

Batch tensors enter with their fixed layouts restricted to the axes cut so far.

**Order.** Each round visits ops by decreasing *weight*: compute seconds of the whole op
(FLOPs and bytes on the hardware profile, forward and backward) times the number of layers
it stands for; ties go to the earlier op. Ties between roles go to the unused role, then to
the lower dim, so the search is deterministic.

**Axis orders.** MindSpore's greedy rounds price an early cut as if the later axes did not
exist (a data-parallel cut pays the whole weight's gradient reduction before tensor
parallelism shrinks it), so the order of the rounds matters. The rounds run once per order of
the axes that cut (mesh order first, at most ``MAX_ORDERS``), and the order whose result
:meth:`SearchProblem.evaluate` prices lowest wins.

**Folding.** Members of a :class:`~plait.graph.LayerGroup` correspond op for op, so the search
runs on a quotient graph: one node per op of the first member (as
``OpGraph.representative``), standing for the matching op of every member; edges between members (layer ``i`` to ``i + 1``) become edges
between representatives, counted once per member pair. Members fold together only when their
ops have equal candidates and equal constraints (members that differ, e.g. the one layer a
user annotated, stand for themselves); a GPT of 96 layers is searched as one layer plus
embedding and head.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

from plait.graph import OpGraph, OpNode, TensorMeta
from plait.layout import TensorLayout
from plait.rules.registry import OpStrategy
from plait.search.problem import SearchProblem, gradient_layout, settled
from plait.search.propagation import Decision

__all__ = ["LOOKAHEAD_DEPTH", "MAX_ORDERS", "axis_orders", "recursive_programming"]

LOOKAHEAD_DEPTH = 2  # ops with FLOPs an edge cost looks through (views and transposes are free)
MAX_HOPS = 8  # ops a lookahead visits in all, free ones included
MAX_ORDERS = 6  # axis orders tried (all of them up to three axes cut)
ALTERNATIVES_KEPT = 3
PARTIAL = -2  # role entry of an output holding a pending sum over the axis
UNSPLIT = -1  # role entry of a tensor the axis does not split

Role = tuple[tuple[int, ...], tuple[int, ...]]
"""What one mesh axis does to an op: per input the dim it splits, per output the dim or PARTIAL."""


# --------------------------------------------------------------------------- roles


def _axis_role(strategy: OpStrategy, axis: str) -> Role:
    def dim_of(layout: TensorLayout) -> int:
        d = layout._axis_dim.get(axis)  # an axis splits at most one dim
        if d is not None:
            return d
        return PARTIAL if axis in layout.partial else UNSPLIT

    return tuple(map(dim_of, strategy.inputs)), tuple(map(dim_of, strategy.outputs))


def _is_unused(role: Role) -> bool:
    return all(d == UNSPLIT for part in role for d in part)


def _role_key(role: Role) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Sort key: the unused role first, then lower dims (determinism)."""
    return (0 if _is_unused(role) else 1, role[0], role[1])


def _describe_role(role: Role) -> str:
    """``in d0, d1 -> out d1``-style text: per tensor the dim split, ``-`` or ``P``."""

    def entry(d: int) -> str:
        return "-" if d == UNSPLIT else "P" if d == PARTIAL else f"d{d}"

    ins = ",".join(entry(d) for d in role[0])
    outs = ",".join(entry(d) for d in role[1])
    return f"in {ins} -> out {outs}"


@dataclass(frozen=True, slots=True)
class _Roles:
    """Roles of every candidate of one candidate list, and the completion of each prefix."""

    per_candidate: tuple[tuple[Role, ...], ...]
    completion: Mapping[tuple[Role, ...], int]
    labels: Mapping[tuple[int, Role], str]  # (round, role) -> label of the one-axis candidate
    ordered: tuple[bool, ...]  # every layout lists its axes in mesh order


def _roles_of(
    candidates: Sequence[OpStrategy],
    axes: tuple[str, ...],
    by_axis: Sequence[Mapping[str, Role]] | None = None,
    ordered: tuple[bool, ...] | None = None,
) -> _Roles:
    """``by_axis`` (per candidate, axis -> role) and ``ordered``: as :func:`_axis_roles` and
    :func:`_mesh_ordered` find them, when the caller has them already."""
    if by_axis is None:
        by_axis = _axis_roles(candidates, axes)
    per = tuple(tuple(roles[a] for a in axes) for roles in by_axis)
    best: dict[tuple[Role, ...], tuple[int, int]] = {}
    labels: dict[tuple[int, Role], str] = {}
    for index, roles in enumerate(per):
        used = [not _is_unused(r) for r in roles]
        for n in range(len(roles) + 1):
            # the completion of a prefix leaves as many later axes unused as it can
            key = (sum(used[n:]), index)
            prefix = roles[:n]
            if prefix not in best or key < best[prefix]:
                best[prefix] = key
        if sum(used) == 1:
            r = used.index(True)
            labels.setdefault((r, roles[r]), candidates[index].label)
    if ordered is None:
        ordered = _mesh_ordered(candidates)
    return _Roles(per, {p: k[1] for p, k in best.items()}, labels, ordered)


def _axis_roles(candidates: Sequence[OpStrategy], axes: Sequence[str]) -> list[dict[str, Role]]:
    """Per candidate, the role of each axis."""
    return [{a: _axis_role(s, a) for a in axes} for s in candidates]


def _mesh_ordered(candidates: Sequence[OpStrategy]) -> tuple[bool, ...]:
    """Per candidate: every layout lists its axes in mesh order."""
    seen: dict[int, bool] = {}  # layouts are shared between candidates: each asked once

    def ordered(layout: TensorLayout) -> bool:
        found = seen.get(id(layout))
        if found is None:
            found = seen[id(layout)] = layout.is_mesh_ordered()
        return found

    return tuple(all(map(ordered, (*s.inputs, *s.outputs))) for s in candidates)


@lru_cache(maxsize=1 << 12)
def _restrict(layout: TensorLayout, axes: frozenset[str]) -> TensorLayout:
    """``layout`` as it is when only ``axes`` exist (the others replicate)."""
    return TensorLayout(
        layout.mesh,
        tuple(tuple(a for a in dim if a in axes) for dim in layout.dims),
        tuple(a for a in layout.partial if a in axes),
        layout.reduce_op,
    )


# --------------------------------------------------------------------------- folding

VALUE, PARAM = 0, 1  # a link carries an op's output, or a parameter its first reader laid out


@dataclass(frozen=True, slots=True)
class _Link:
    """An edge of the folded graph: ``count`` edges of the op graph with one price each."""

    kind: int  # VALUE: src's output src_slot; PARAM: src's input src_slot (a shared parameter)
    src: str
    src_slot: int
    dst: str
    dst_slot: int
    meta: TensorMeta
    needs_grad: bool
    keep: str | None  # the axis whose pending gradient sum stays into src's parameters
    count: int


@dataclass(frozen=True, slots=True)
class _Source:
    """Batch tensors with a fixed layout feeding input ``slot`` of an op, ``count`` times."""

    slot: int
    layout: TensorLayout
    meta: TensorMeta
    needs_grad: bool
    count: int


@dataclass(frozen=True, slots=True)
class _Folded:
    """The quotient graph: representatives, how many ops each stands for, links, sources."""

    nodes: tuple[str, ...]  # representative ops, graph order
    node_of: Mapping[str, str]  # op -> its representative
    count: Mapping[str, int]
    links: tuple[_Link, ...]
    links_of: Mapping[str, tuple[int, ...]]  # node -> ids of links touching it
    sources: Mapping[str, tuple[_Source, ...]]


def _representatives(
    problem: SearchProblem,
    allowed: Mapping[str, Sequence[int]],
    configured: Mapping[str, str],
) -> dict[str, str]:
    """Op -> the op that stands for it in the search.

    Members of a layer group whose ops have the same candidates and the same constraints,
    op for op, share one solution: each op maps to the matching op of the first such member
    (``blocks.1`` .. ``blocks.95`` fold together when only ``blocks.0`` is annotated).
    """
    graph = problem.graph
    canonical: dict[int, int] = {}  # id of a candidate list -> id of the first equal list
    lists: dict[tuple[OpStrategy, ...], int] = {}

    def list_key(name: str) -> int:
        cands = problem.candidates[name]
        found = canonical.get(id(cands))
        if found is None:
            found = canonical[id(cands)] = lists.setdefault(tuple(cands), id(cands))
        return found

    node_of: dict[str, str] = {}
    for group in graph.layers:
        first_member: dict[tuple[object, ...], tuple[OpNode, ...]] = {}
        for member in group.members:
            ops = graph.layer_ops(member)
            key = tuple(
                (list_key(op.name), tuple(allowed.get(op.name, ())), op.name in configured)
                for op in ops
            )
            stands_for = first_member.setdefault(key, ops)
            for op, rep in zip(ops, stands_for, strict=True):
                node_of[op.name] = rep.name
    for op in graph.ops:
        node_of.setdefault(op.name, op.name)
    return node_of


LinkKey = tuple[int, str, int, str, int, TensorMeta, bool, str | None]  # a _Link's but count
SourceKey = tuple[str, int, TensorLayout, TensorMeta, bool]  # node, then a _Source's fields
LinkCounts = dict[LinkKey, int]
SourceCounts = dict[SourceKey, int]


def _value_links(problem: SearchProblem, node_of: Mapping[str, str]) -> LinkCounts:
    """Op-to-op edges, mapped onto representatives and counted."""
    links: LinkCounts = {}
    for e in problem.edges():
        key = (
            VALUE,
            node_of[e.producer],
            e.output,
            node_of[e.consumer],
            e.input,
            problem.graph.meta(e.ref),
            e.needs_grad,
            problem.keeps_pending(e.ref),
        )
        links[key] = links.get(key, 0) + 1
    return links


def _input_links(
    problem: SearchProblem, node_of: Mapping[str, str], links: LinkCounts
) -> SourceCounts:
    """Batch tensors feeding ops (returned) and shared parameters (added to ``links``).

    A parameter's layout is the one its first reader wants (as in
    :meth:`SearchProblem.shared_parameter_seconds`): each later reader is linked to it.
    """
    graph = problem.graph
    sources: SourceCounts = {}
    first_reader: dict[str, tuple[str, int]] = {}
    for op in graph.ops:
        node = node_of[op.name]
        for i, ref in enumerate(op.inputs):
            meta = op.input_metas[i]
            if ref in problem.input_layouts:
                fed = (node, i, problem.input_layouts[ref], meta, problem.needs_grad(ref))
                sources[fed] = sources.get(fed, 0) + 1
                continue
            source = graph.graph_input(ref)
            if source is None or source.kind != "parameter":
                continue
            if ref not in first_reader:
                first_reader[ref] = (node, i)
                continue
            src, slot = first_reader[ref]
            key = (PARAM, src, slot, node, i, meta, problem.needs_grad(ref), None)
            links[key] = links.get(key, 0) + 1
    return sources


def _fold(
    problem: SearchProblem,
    allowed: Mapping[str, Sequence[int]],
    configured: Mapping[str, str],
) -> _Folded:
    graph = problem.graph
    node_of = _representatives(problem, allowed, configured)
    nodes = tuple(op.name for op in graph.ops if node_of[op.name] == op.name)
    count: dict[str, int] = dict.fromkeys(nodes, 0)
    for op in graph.ops:
        count[node_of[op.name]] += 1
    links = _value_links(problem, node_of)
    sources = _input_links(problem, node_of, links)
    folded_links = tuple(_Link(*key, n) for key, n in links.items())
    touching: dict[str, list[int]] = {n: [] for n in nodes}
    for lid, link in enumerate(folded_links):
        touching[link.src].append(lid)
        if link.dst != link.src:
            touching[link.dst].append(lid)
    by_node: dict[str, list[_Source]] = {}
    for (node, slot, layout, meta, grad), n in sources.items():
        by_node.setdefault(node, []).append(_Source(slot, layout, meta, grad, n))
    return _Folded(
        nodes,
        node_of,
        count,
        folded_links,
        {n: tuple(ids) for n, ids in touching.items()},
        {n: tuple(s) for n, s in by_node.items()},
    )


# --------------------------------------------------------------------------- the search


_TABLES_KEPT = 1 << 12  # link classes kept per cost model (then the tables start again)
_ROLE_LISTS_KEPT = 1 << 10  # candidate lists whose roles are kept (then they start again)

LinkTables = tuple[dict[tuple[int, int], float], dict[tuple[int, bool], float]]
_TableEntry = tuple[
    Sequence[OpStrategy],
    Sequence[OpStrategy],
    dict[tuple[int, int], float],
    dict[tuple[int, bool], float],
]


def _link_tables(problem: SearchProblem, link: _Link) -> LinkTables:
    """The price tables of ``link``'s class: exact ``(src index, dst index) -> seconds`` and
    one-sided ``(index, end is the source) -> seconds``, both times ``link.count``.

    Kept on the problem's cost model (its prices are a pure function of the two candidate
    lists, the slots, the tensor, whether a gradient flows back and the count), so searches
    of problems sharing a cost model and candidate lists (``prepare`` shares both per graph,
    mesh and profile) share them. Lists are keyed by identity and held by the entry, so an
    id is never reused while its entry lives; another cost model never sees the entry.
    """
    src_list = problem.candidates[link.src]
    dst_list = problem.candidates[link.dst]
    key = (
        "recursive_programming.link",
        id(src_list),
        id(dst_list),
        link.kind,
        link.src_slot,
        link.dst_slot,
        link.src == link.dst,
        link.meta,
        link.needs_grad,
        link.count,
    )
    scratch = problem.cost.scratch
    found = cast("_TableEntry | None", scratch.get(key))
    if found is None or found[0] is not src_list or found[1] is not dst_list:
        if len(scratch) >= _TABLES_KEPT:
            scratch.clear()
        found = scratch[key] = (src_list, dst_list, {}, {})
    return found[2], found[3]


_RoleEntry = tuple[
    Sequence[OpStrategy], list[dict[str, Role]], tuple[bool, ...], dict[tuple[str, ...], _Roles]
]
_ROLE_LISTS: dict[tuple[int, tuple[str, ...]], _RoleEntry] = {}


def _roles_for(
    candidates: Sequence[OpStrategy], mesh_axes: tuple[str, ...], axes: tuple[str, ...]
) -> _Roles:
    """:func:`_roles_of` for one axis order, kept per candidate list (by identity, the list
    held by its entry) and mesh axes: what does not depend on the order is found once."""
    key = (id(candidates), mesh_axes)
    entry = _ROLE_LISTS.get(key)
    if entry is None or entry[0] is not candidates:
        if len(_ROLE_LISTS) >= _ROLE_LISTS_KEPT:
            _ROLE_LISTS.clear()
        entry = _ROLE_LISTS[key] = (
            candidates,
            _axis_roles(candidates, mesh_axes),
            _mesh_ordered(candidates),
            {},
        )
    _, by_axis, ordered, per_order = entry
    found = per_order.get(axes)
    if found is None:
        found = per_order[axes] = _roles_of(candidates, axes, by_axis, ordered)
    return found


@dataclass(frozen=True, slots=True)
class _Pick:
    """One round's choice for one op, kept for its Decision's reason."""

    role: Role
    cost: float
    runner_up: tuple[Role, float] | None
    options: int


@dataclass(frozen=True, slots=True)
class _Structure:
    """What a search derives from its problem and constraints alone, whatever it decides: the
    folded graph, the allowed and configured candidates of its nodes, their weights and order,
    who neighbours whom, each link's price tables and each node's own prices (the last two
    filled as the searches ask)."""

    fold: _Folded
    allowed: dict[str, tuple[int, ...]]
    configured: dict[str, int]
    weight: dict[str, float]
    order: list[str]
    exact_of: tuple[dict[tuple[int, int], float], ...]
    alone_of: tuple[dict[tuple[int, bool], float], ...]
    neighbours: dict[str, tuple[str, ...]]
    # node -> (link id, the other end (the node itself for a self link), node is the source)
    ends: dict[str, tuple[tuple[int, str, bool], ...]]
    passing: frozenset[str]
    short: dict[str, bool]  # root -> its lookaheads stop before MAX_HOPS (filled as asked)
    # prices of a node's candidates alone (filled as asked; see _Prices.own and .base)
    own: dict[tuple[str, int], float]
    base: dict[tuple[str, int, frozenset[str] | None], float]


def _structure(
    problem: SearchProblem, allowed: Mapping[str, Sequence[int]], configured: Mapping[str, str]
) -> _Structure:
    """:class:`_Structure` of a problem, kept on its cost model per graph, candidate lists,
    constraints, batch layouts, data-parallel and fused axes: all it and its nodes' own
    prices are made of (``prepare`` of a graph on a mesh shares the cost model and the
    lists, so a second search of the graph folds and prices no node again). The entry holds
    the graph and the candidate map it is keyed by (ids are never reused while it lives); an
    entry that is not the asker's is replaced."""
    graph = problem.graph
    lists = tuple(id(problem.candidates[op.name]) for op in graph.ops)
    key = (
        "recursive_programming.structure",
        id(graph),
        lists,
        tuple((name, tuple(at)) for name, at in allowed.items()),
        frozenset(configured),
        tuple(problem.input_layouts.items()),
        problem.dp_axis,
        problem.fused_axis,
        problem.mesh,
    )
    scratch = problem.cost.scratch
    entry = cast(
        "tuple[OpGraph, Mapping[str, Sequence[OpStrategy]], _Structure] | None", scratch.get(key)
    )
    if entry is None or entry[0] is not graph:
        if len(scratch) >= _TABLES_KEPT:
            scratch.clear()
        entry = scratch[key] = (
            graph,
            problem.candidates,
            _build_structure(problem, allowed, configured),
        )
    return entry[2]


def _build_structure(
    problem: SearchProblem, allowed: Mapping[str, Sequence[int]], configured: Mapping[str, str]
) -> _Structure:
    graph = problem.graph
    fold = _fold(problem, allowed, configured)
    allowed_of: dict[str, tuple[int, ...]] = {
        n: tuple(allowed.get(n) or range(len(problem.candidates[n]))) for n in fold.nodes
    }
    position = {name: k for k, name in enumerate(fold.nodes)}
    weight = {n: fold.count[n] * problem.cost.op_compute(graph.op(n), 1) for n in fold.nodes}
    # links between ops with the same candidate lists, slots and tensors share prices
    # (the same edge in every unfolded layer, and in every search on the same cost model
    # and candidate lists): per link, its class's tables of exact and one-sided prices
    tables = [_link_tables(problem, link) for link in fold.links]
    neighbours = {n: _neighbours_of(fold, n) for n in fold.nodes}
    ends = {
        n: tuple(
            (
                lid,
                fold.links[lid].dst if fold.links[lid].src == n else fold.links[lid].src,
                fold.links[lid].src == n,
            )
            for lid in fold.links_of[n]
        )
        for n in fold.nodes
    }
    return _Structure(
        fold=fold,
        allowed=allowed_of,
        configured={n: allowed_of[n][0] for n in fold.nodes if n in configured},
        weight=weight,
        order=sorted(fold.nodes, key=lambda n: (-weight[n], position[n])),
        exact_of=tuple(t[0] for t in tables),
        alone_of=tuple(t[1] for t in tables),
        neighbours=neighbours,
        ends=ends,
        passing=frozenset(
            n for n in fold.nodes if graph.op(n).flops == 0 and len(neighbours[n]) <= 2
        ),
        short={},
        own={},
        base={},
    )


def _neighbours_of(fold: _Folded, node: str) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for lid in fold.links_of[node]:
        link = fold.links[lid]
        other = link.dst if link.src == node else link.src
        if other != node:
            seen.setdefault(other, None)
    return tuple(seen)


class _Prices:
    """The folded graph and every price a search asks for, cached (shared by all axis orders)."""

    def __init__(
        self,
        problem: SearchProblem,
        allowed: Mapping[str, Sequence[int]],
        configured: Mapping[str, str],
    ) -> None:
        self.problem = problem
        self.graph: OpGraph = problem.graph
        self.cost = problem.cost
        structure = _structure(problem, allowed, configured)
        self.fold = structure.fold
        self.allowed = structure.allowed
        self.configured = structure.configured
        self.weight = structure.weight
        self.order = structure.order
        self._exact_of = structure.exact_of
        self._alone_of = structure.alone_of
        self.neighbours = structure.neighbours
        self.ends = structure.ends
        self.passing = structure.passing
        self._short = structure.short
        self._own = structure.own
        self._base = structure.base

    def short_lookahead(self, root: str) -> bool:
        """Does every lookahead from ``root`` stop before MAX_HOPS, whatever is decided?"""
        found = self._short.get(root)
        if found is None:
            found = self._short[root] = all(
                self._hops(other, root, LOOKAHEAD_DEPTH, 1, root) < MAX_HOPS
                for other in self.neighbours[root]
            )
        return found

    def _hops(self, node: str, parent: str, depth: int, hops: int, root: str) -> int:
        """The most hops a lookahead entering ``node`` from ``parent`` can reach."""
        ahead = depth if node in self.passing else depth - 1
        if hops >= MAX_HOPS or ahead < 1:
            return hops
        return max(
            (
                self._hops(other, node, ahead, hops + 1, root)
                for other in self.neighbours[node]
                if other != parent and other != root
            ),
            default=hops,
        )

    def roles(self, node: str, axes: tuple[str, ...]) -> _Roles:
        """Roles of the node's candidates for one axis order (shared by equal candidate lists)."""
        return _roles_for(self.problem.candidates[node], self.problem.mesh.axis_names, axes)

    def own(self, node: str, index: int) -> float:
        """Compute share plus parameter-gradient reduction, times the ops the node stands for."""
        key = (node, index)
        found = self._own.get(key)
        if found is None:
            op = self.graph.op(node)
            found = self._own[key] = self.fold.count[node] * self.problem.op_seconds(op, index)
        return found

    def exact(self, lid: int, src_index: int, dst_index: int) -> float:
        """Seconds of a link, both ends decided (forward and backward)."""
        table = self._exact_of[lid]
        found = table.get((src_index, dst_index))
        if found is None:
            return self._exact_new(lid, table, src_index, dst_index)
        return found

    def _exact_new(
        self, lid: int, table: dict[tuple[int, int], float], src_index: int, dst_index: int
    ) -> float:
        """:meth:`exact` priced the first time."""
        link = self.fold.links[lid]
        s = self.problem.candidates[link.src][src_index]
        d = self.problem.candidates[link.dst][dst_index]
        src = (s.outputs if link.kind == VALUE else s.inputs)[link.src_slot]
        grad = gradient_layout(d, link.dst_slot) if link.needs_grad else None
        bucket = 0.0
        if link.keep is not None:
            bucket = self.problem.bucket_seconds(self.problem.graph.op(link.src), src_index)
        seconds = self.cost.edge_seconds(
            src, d.inputs[link.dst_slot], grad, link.meta, link.keep, bucket
        )
        found = table[(src_index, dst_index)] = seconds * link.count
        return found

    def alone(self, lid: int, index: int, as_src: bool) -> float:
        """What one end makes a link cost whatever the other end does.

        A producer's pending sum must be reduced (MindSpore's "cut k" cost); a consumer whose
        work is split over an axis its input is not hands back a partial gradient to reduce
        ("cut j").
        """
        table = self._alone_of[lid]
        key = (index, as_src)
        found = table.get(key)
        if found is None:
            link = self.fold.links[lid]
            if as_src:
                s = self.problem.candidates[link.src][index]
                seconds = 0.0
                if link.kind == VALUE and s.outputs[link.src_slot].partial:
                    out = s.outputs[link.src_slot]
                    seconds = self.cost.edge_seconds(out, settled(out), None, link.meta)
            else:
                d = self.problem.candidates[link.dst][index]
                need = d.inputs[link.dst_slot]
                grad = gradient_layout(d, link.dst_slot) if link.needs_grad else None
                # a sum kept pending adds the producer's bucket share: at least 0
                seconds = self.cost.edge_seconds(need, need, grad, link.meta, link.keep)
            found = table[key] = seconds * link.count
        return found

    def base(self, node: str, index: int, axes: frozenset[str] | None) -> float:
        """Own cost plus batch inputs (see :meth:`source_seconds`), cached."""
        key = (node, index, axes)
        found = self._base.get(key)
        if found is None:
            found = self._base[key] = self.own(node, index) + self.source_seconds(node, index, axes)
        return found

    def end_seconds(self, lid: int, as_src: bool, index: int, other_index: int) -> float:
        """A link seen from one end (at ``index``), the other end at ``other_index``."""
        if as_src:
            return self.exact(lid, index, other_index)
        return self.exact(lid, other_index, index)

    def source_seconds(self, node: str, index: int, axes: frozenset[str] | None) -> float:
        """Batch tensors feeding the node, their layouts restricted to ``axes`` (None: all)."""
        seconds = 0.0
        strategy = self.problem.candidates[node][index]
        for src in self.fold.sources.get(node, ()):
            layout = src.layout if axes is None else _restrict(src.layout, axes)
            need = strategy.inputs[src.slot]
            grad = gradient_layout(strategy, src.slot) if src.needs_grad else None
            seconds += self.cost.edge_seconds(layout, need, grad, src.meta) * src.count
        return seconds

    def link_seconds(self, lid: int, node: str, index: int, other_index: int) -> float:
        """A link of ``node`` (at ``index``) to its other end (at ``other_index``)."""
        link = self.fold.links[lid]
        if link.src == link.dst:
            return self.exact(lid, index, index)
        if link.src == node:
            return self.exact(lid, index, other_index)
        return self.exact(lid, other_index, index)

    def local(self, node: str, index: int, chosen: Mapping[str, int]) -> float:
        """Everything the objective pays that depends on ``node``'s candidate, all else fixed."""
        seconds = self.own(node, index) + self.source_seconds(node, index, None)
        for lid in self.fold.links_of[node]:
            link = self.fold.links[lid]
            other = link.dst if link.src == node else link.src
            seconds += self.link_seconds(lid, node, index, chosen.get(other, index))
        return seconds

    def objective(self, chosen: Mapping[str, int]) -> float:
        """:meth:`SearchProblem.evaluate` on the folded graph (every member as its node)."""
        total = 0.0
        for node in self.fold.nodes:
            total += self.own(node, chosen[node]) + self.source_seconds(node, chosen[node], None)
        for lid, link in enumerate(self.fold.links):
            total += self.exact(lid, chosen[link.src], chosen[link.dst])
        return total


# in place of a candidate index (_Rounds._terms): a link of an op to itself, or one priced
# from one side alone
_ITSELF, _ALONE = -1, -2


class _Rounds:
    """One search for one axis order: per node its roles so far and its completion."""

    def __init__(self, prices: _Prices, axes: tuple[str, ...]) -> None:
        self.prices = prices
        self.axes = axes
        nodes = prices.fold.nodes
        self.roles = {n: prices.roles(n, axes) for n in nodes}
        self.prefix: dict[str, tuple[Role, ...]] = dict.fromkeys(nodes, ())
        self.current: dict[str, int] = {n: self.roles[n].completion[()] for n in nodes}
        self.picks: dict[str, list[_Pick]] = {n: [] for n in nodes}

    def options(self, node: str, r: int) -> list[Role]:
        """Roles of axis ``r`` that some allowed candidate extends the node's prefix with."""
        roles = self.roles[node].per_candidate
        prefix = self.prefix[node]
        found = {roles[i][r] for i in self.prices.allowed[node] if roles[i][:r] == prefix}
        return sorted(found, key=_role_key)

    def run_round(self, r: int) -> None:
        axis_set = frozenset(self.axes[: r + 1])
        decided: set[str] = set()
        for node, index in self.prices.configured.items():
            self.prefix[node] = self.roles[node].per_candidate[index][: r + 1]
            self.current[node] = self.roles[node].completion[self.prefix[node]]
            decided.add(node)
        round_options: dict[str, list[Role]] = {
            n: self.options(n, r) for n in self.prices.fold.nodes if n not in decided
        }
        # per undecided node, the candidate completing each of its options, in option order
        # (prefixes of undecided nodes do not change during the round)
        self._opts = {
            n: [self.roles[n].completion[(*self.prefix[n], role)] for role in options]
            for n, options in round_options.items()
        }
        self._bases: dict[str, list[float]] = {}
        self._rows_of: dict[tuple[int, bool], list[list[float]]] = {}
        self._terms_of: dict[tuple[int, bool, int], list[float]] = {}
        for node in self.prices.order:
            if node in decided:
                continue
            scored: list[tuple[float, tuple[object, ...], Role]] = []
            if self.prices.short_lookahead(node):
                # While one node is scored nothing is decided, so what its roles' lookaheads
                # ask of the same neighbours at the same candidates has one answer: each
                # lookahead is found once for every candidate of the op that asks (_vector)
                costs = self._score_all(node, decided, axis_set)
                for role, cost in zip(round_options[node], costs, strict=True):
                    scored.append((cost, _role_key(role), role))
            else:
                # a lookahead from this node could reach MAX_HOPS: its answers depend on the
                # path, and each role keeps its own memo as the search is defined
                for role in round_options[node]:
                    index = self.roles[node].completion[(*self.prefix[node], role)]
                    cost = self._score(node, index, decided, axis_set, round_options, {})
                    scored.append((cost, _role_key(role), role))
            scored.sort(key=lambda s: (s[0], s[1]))
            cost, _, role = scored[0]
            runner = (scored[1][2], scored[1][0]) if len(scored) > 1 else None
            self.picks[node].append(_Pick(role, cost, runner, len(scored)))
            self.prefix[node] = (*self.prefix[node], role)
            self.current[node] = self.roles[node].completion[self.prefix[node]]
            decided.add(node)

    def _base_list(self, node: str, axes: frozenset[str]) -> list[float]:
        """:meth:`_Prices.base` of each of the node's options this round."""
        found = self._bases.get(node)
        if found is None:
            base = self.prices.base
            found = self._bases[node] = [base(node, i, axes) for i in self._opts[node]]
        return found

    def _rows(self, lid: int, as_src: bool, node: str, other: str) -> list[list[float]]:
        """Per option of ``node``, link ``lid`` from it to each option of its other end
        ``other`` (this round's options of both)."""
        key = (lid, as_src)
        found = self._rows_of.get(key)
        if found is None:
            exact = self.prices.exact
            columns = self._opts[other]
            if as_src:
                found = [[exact(lid, i, j) for j in columns] for i in self._opts[node]]
            else:
                found = [[exact(lid, j, i) for j in columns] for i in self._opts[node]]
            self._rows_of[key] = found
        return found

    def _score_all(self, node: str, decided: set[str], axes: frozenset[str]) -> list[float]:
        """:meth:`_score` of every option of ``node``, in option order (the same sums).

        Only for a node whose lookaheads cannot reach MAX_HOPS (their answers do not depend on
        the path, so one memo serves all its options).
        """
        prices = self.prices
        exact = prices.exact
        memo: dict[tuple[str, str, int], list[float]] = {}
        looks = [
            self._vector(other, node, LOOKAHEAD_DEPTH, node, decided, axes, memo)
            for other in prices.neighbours[node]
            if other not in decided
        ]
        bases = self._base_list(node, axes)
        ends = prices.ends[node]
        costs: list[float] = []
        for k, index in enumerate(self._opts[node]):
            seconds = bases[k]
            for lid, other, as_src in ends:
                if other == node:
                    seconds += exact(lid, index, index)
                elif other in decided:
                    at = self.current[other]
                    seconds += exact(lid, index, at) if as_src else exact(lid, at, index)
            for look in looks:
                seconds += look[k]
            costs.append(seconds)
        return costs

    def _links_by_option(
        self, node: str, parent: str, ahead: int, root: str, decided: set[str]
    ) -> tuple[list[float], list[list[list[float]]]]:
        """Per option of looked-at ``node``, what :meth:`_known_links` sums, split where its
        first link to ``parent`` comes: the sum before it, then the rows (over the parent's
        options) to add in link order (a link to another op: its price in every column).

        What each link is (to the parent, to itself, to a decided op, priced from this side
        alone, or left to the lookahead) does not depend on the option, and its prices over
        the options are kept for the round (:meth:`_terms`, :meth:`_rows`)."""
        width = len(self._opts[parent])
        # per link in order: its rows (a link to the parent) or its prices, per option
        links: list[tuple[list[list[float]] | None, list[float]]] = []
        for lid, other, as_src in self.prices.ends[node]:
            if other == parent:
                links.append((self._rows(lid, as_src, node, parent), []))
            elif other == node:
                links.append((None, self._terms(lid, as_src, node, _ITSELF)))
            elif other in decided:
                links.append((None, self._terms(lid, as_src, node, self.current[other])))
            elif ahead < 1 or other == root:
                links.append((None, self._terms(lid, as_src, node, _ALONE)))
        heads: list[float] = []
        tails: list[list[list[float]]] = []
        for k in range(len(self._opts[node])):
            head = 0.0
            tail: list[list[float]] = []
            for rows, terms in links:
                if rows is not None:
                    tail.append(rows[k])
                elif tail:
                    tail.append([terms[k]] * width)
                else:
                    head += terms[k]
            heads.append(head)
            tails.append(tail)
        return heads, tails

    def _terms(self, lid: int, as_src: bool, node: str, at: int) -> list[float]:
        """Per option of ``node``, link ``lid`` to its other end at candidate ``at`` (a decided
        op), or (``_ITSELF``) a link of the node to itself, or (``_ALONE``) priced from this
        side alone; kept for the round."""
        key = (lid, as_src, at)
        found = self._terms_of.get(key)
        if found is None:
            prices = self.prices
            exact = prices.exact
            options = self._opts[node]
            if at == _ITSELF:
                found = [exact(lid, i, i) for i in options]
            elif at == _ALONE:
                found = [prices.alone(lid, i, as_src) for i in options]
            elif as_src:
                found = [exact(lid, i, at) for i in options]
            else:
                found = [exact(lid, at, i) for i in options]
            self._terms_of[key] = found
        return found

    def _vector(
        self,
        node: str,
        parent: str,
        depth: int,
        root: str,
        decided: set[str],
        axes: frozenset[str],
        memo: dict[tuple[str, str, int], list[float]],
    ) -> list[float]:
        """:meth:`_lookahead` of undecided ``node`` for every option of ``parent``, in order.

        The same sums in the same order as :meth:`_lookahead` (no hop limit: the caller
        checked that none is reached): per option of ``node``, its base, plus its links summed
        in link order (those to ``parent`` read from a row over the parent's options), plus
        the lookaheads beyond it; the cheapest option per parent option, the first on ties,
        stopping at 0 as :meth:`_lookahead` does. What does not depend on the parent's
        option (base, other links, lookaheads beyond) is found once.
        """
        key = (node, parent, depth)
        found = memo.get(key)
        if found is not None:
            return found
        prices = self.prices
        ahead = depth if node in prices.passing else depth - 1
        beyond = (
            [
                self._vector(other, node, ahead, root, decided, axes, memo)
                for other in prices.neighbours[node]
                if other != parent and other != root and other not in decided
            ]
            if ahead >= 1
            else []
        )
        bases = self._base_list(node, axes)
        heads, tails = self._links_by_option(node, parent, ahead, root, decided)
        width = len(self._opts[parent])
        found = []
        options = range(len(heads))
        for p in range(width):
            best = math.inf
            for k in options:
                links = heads[k]
                for row in tails[k]:
                    links += row[p]
                seconds = bases[k] + links
                for look in beyond:
                    seconds += look[k]
                if seconds < best:
                    best = seconds
                if best == 0.0:
                    break
            found.append(best)
        memo[key] = found
        return found

    def _score(
        self,
        node: str,
        index: int,
        decided: set[str],
        axes: frozenset[str],
        round_options: Mapping[str, list[Role]],
        memo: dict[tuple[str, str, int, int], float],
    ) -> float:
        """Price of ``node`` at candidate ``index`` this round, with a lookahead."""
        prices = self.prices
        seconds = prices.base(node, index, axes)
        for lid, other, as_src in prices.ends[node]:
            if other == node:
                seconds += prices.exact(lid, index, index)
            elif other in decided:
                seconds += prices.end_seconds(lid, as_src, index, self.current[other])
        for other in self.prices.neighbours[node]:
            if other not in decided:
                seconds += self._lookahead(
                    other, node, index, LOOKAHEAD_DEPTH, node, decided, axes, round_options, memo
                )
        return seconds

    def _lookahead(
        self,
        node: str,
        parent: str,
        parent_index: int,
        depth: int,
        root: str,
        decided: set[str],
        axes: frozenset[str],
        round_options: Mapping[str, list[Role]],
        memo: dict[tuple[str, str, int, int], float],
        hops: int = 1,
    ) -> float:
        """Cheapest role of undecided ``node`` given ``parent`` at ``parent_index``.

        ``depth`` ops are looked through; an op that only passes a value on (no FLOPs, one
        producer and one consumer: views, transposes) does not count. Links back to the op
        being scored (``root``, other than through ``parent``) are priced from this side
        alone, so the memo holds for the whole scoring of ``root``.
        """
        key = (node, parent, parent_index, depth)
        found = memo.get(key)
        if found is not None:
            return found
        prices = self.prices
        ahead = depth if node in prices.passing else depth - 1
        if hops >= MAX_HOPS:
            ahead = 0
        best = math.inf
        for role in round_options[node]:
            index = self.roles[node].completion[(*self.prefix[node], role)]
            seconds = prices.base(node, index, axes)
            seconds += self._known_links(node, index, parent, parent_index, decided, root, ahead)
            if ahead >= 1:
                for other in prices.neighbours[node]:
                    if other != parent and other != root and other not in decided:
                        seconds += self._lookahead(
                            other,
                            node,
                            index,
                            ahead,
                            root,
                            decided,
                            axes,
                            round_options,
                            memo,
                            hops + 1,
                        )
            if seconds < best:
                best = seconds
            if best == 0.0:
                break
        memo[key] = best
        return best

    def _known_links(
        self,
        node: str,
        index: int,
        parent: str,
        parent_index: int,
        decided: set[str],
        root: str,
        ahead: int,
    ) -> float:
        """Links of a looked-at node priced without looking further.

        Exact to its parent and to decided ops; from its own side alone to the scored op and,
        when the lookahead stops here (``ahead < 1``), to undecided ops.
        """
        prices = self.prices
        exact = prices.exact
        seconds = 0.0
        for lid, other, as_src in prices.ends[node]:
            if other == parent:
                seconds += (
                    exact(lid, index, parent_index) if as_src else exact(lid, parent_index, index)
                )
            elif other == node:
                seconds += exact(lid, index, index)
            elif other in decided:
                at = self.current[other]
                seconds += exact(lid, index, at) if as_src else exact(lid, at, index)
            elif ahead < 1 or other == root:
                seconds += prices.alone(lid, index, as_src)
        return seconds

    def runners_up(self, node: str, final: int) -> list[int]:
        """Per round, the allowed candidate closest to ``final`` that took the runner-up role.

        Closest: same roles in earlier rounds, runner-up role in that round, as many later
        roles as possible equal to the final ones; the lowest index on ties.
        """
        roles = self.roles[node].per_candidate
        mine = roles[final]
        found: list[int] = []
        for r, pick in enumerate(self.picks[node]):
            if pick.runner_up is None:
                continue
            role = pick.runner_up[0]
            fits = [
                i
                for i in self.prices.allowed[node]
                if roles[i][:r] == mine[:r] and roles[i][r] == role
            ]
            if fits:
                same = [sum(x == y for x, y in zip(roles[i], mine, strict=True)) for i in fits]
                found.append(fits[max(range(len(fits)), key=lambda k: (same[k], -fits[k]))])
        return list(dict.fromkeys(found))

    def finals(self) -> dict[str, int]:
        """Map every node's full role tuple to an allowed candidate (mesh-ordered first)."""
        chosen: dict[str, int] = {}
        for node in self.prices.fold.nodes:
            if node in self.prices.configured:
                chosen[node] = self.prices.configured[node]
                continue
            roles = self.roles[node]
            fits = [
                i for i in self.prices.allowed[node] if roles.per_candidate[i] == self.prefix[node]
            ]
            fits.sort(key=lambda i: (not roles.ordered[i], i))
            chosen[node] = fits[0]
        return chosen


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class _Outcome:
    """One axis order's result: its rounds, the final candidates and their objective."""

    rounds: _Rounds
    chosen: dict[str, int]
    seconds: float  # the objective


def _round_text(rounds: _Rounds, node: str, r: int, pick: _Pick) -> str:
    roles = rounds.roles[node]
    axis = rounds.axes[r]

    def name(role: Role) -> str:
        if _is_unused(role):
            return "not split"
        label = roles.labels.get((r, role))
        return f"{label} ({_describe_role(role)})" if label else _describe_role(role)

    text = f"round {r + 1} (axis {axis}): {name(pick.role)}"
    if pick.runner_up is None:
        return text + " (only option)"
    other, cost = pick.runner_up
    return text + f" at {pick.cost:.3g} s, next best {name(other)} at {cost:.3g} s"


def _orders_text(best: _Outcome, outcomes: Sequence[_Outcome]) -> str:
    order = ", ".join(best.rounds.axes)
    if len(outcomes) == 1:
        return f"axis order {order}"
    others = ", ".join(
        f"{'/'.join(o.rounds.axes)} {o.seconds:.4g} s" for o in outcomes if o is not best
    )
    return f"axis order {order} ({best.seconds:.4g} s; other orders: {others})"


def _decisions(
    prices: _Prices,
    best: _Outcome,
    outcomes: Sequence[_Outcome],
    configured: Mapping[str, str],
) -> dict[str, Decision]:
    fold = prices.fold
    chosen = best.chosen
    rank = {n: k + 1 for k, n in enumerate(prices.order)}
    orders = _orders_text(best, outcomes)
    per_node: dict[str, Decision] = {}
    for node in fold.nodes:
        count = fold.count[node]
        index = chosen[node]
        scored = sorted(
            (prices.local(node, i, chosen) / count, i) for i in best.rounds.runners_up(node, index)
        )
        alternatives = tuple((i, c) for c, i in scored[:ALTERNATIVES_KEPT])
        cost = prices.local(node, index, chosen) / count
        layers = f" x{count} ops" if count > 1 else ""
        rounds = "; ".join(
            _round_text(best.rounds, node, r, p) for r, p in enumerate(best.rounds.picks[node])
        )
        reason = (
            f"recursive_programming {rounds}; weight {prices.weight[node]:.3g} s{layers} "
            f"(rank {rank[node]} of {len(fold.nodes)}); {orders}"
        )
        per_node[node] = Decision(index, reason, cost, alternatives)
    out: dict[str, Decision] = {}
    for op in prices.graph.ops:
        decision = per_node[fold.node_of[op.name]]
        if op.name in configured:
            decision = Decision(decision.index, configured[op.name], decision.cost_s)
        out[op.name] = decision
    return out


def axis_orders(sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
    """Orders in which the rounds cut the axes: mesh order first, at most ``MAX_ORDERS``.

    Axes of size 1 cut nothing and go last in every order.
    """
    cut = [a for a, n in sizes.items() if n > 1]
    idle = tuple(a for a, n in sizes.items() if n <= 1)
    orders = [(*perm, *idle) for perm in itertools.permutations(cut)]
    return orders[:MAX_ORDERS]


def recursive_programming(
    problem: SearchProblem,
    allowed: Mapping[str, Sequence[int]] | None = None,
    configured: Mapping[str, str] | None = None,
) -> dict[str, Decision]:
    """Choose one candidate per op by one weighted greedy round per mesh axis.

    The rounds run once per axis order (:func:`axis_orders`); the order whose result the
    objective prices lowest wins (the earlier order on ties).

    Args:
        problem: the graph, candidates and costs.
        allowed: per op, the candidate indices that fit the user's annotations or the mode.
        configured: ops whose strategy is fixed (exactly one allowed candidate), with the
            reason to record.

    Returns:
        op name -> :class:`~plait.search.propagation.Decision`; members of a folded layer
        group share their representative's decision.

    Example:
        >>> decisions = recursive_programming(setup.problem, setup.allowed, setup.configured)
        >>> setup.problem.evaluate({op: d.index for op, d in decisions.items()})
    """
    allowed = allowed or {}
    configured = configured or {}
    prices = _Prices(problem, allowed, configured)
    mesh = problem.mesh
    outcomes: list[_Outcome] = []
    for axes in axis_orders({a: mesh.axis_size(a) for a in mesh.axis_names}):
        rounds = _Rounds(prices, axes)
        for r in range(len(axes)):
            rounds.run_round(r)
        chosen = rounds.finals()
        outcomes.append(_Outcome(rounds, chosen, prices.objective(chosen)))
    best = min(outcomes, key=lambda o: o.seconds)  # min keeps the first of equals
    return _decisions(prices, best, outcomes, configured)
