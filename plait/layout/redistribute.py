"""The redistribution planner: layout A to layout B as single-axis steps, with bytes and a cost.

MindSpore's tensor redistribution (``RedistributionOperatorInfer``) turns a pair of tensor maps
into Split / AllToAll / AllGather ops, one device-matrix axis at a time. plait does the same on
:class:`~plait.layout.TensorLayout`, and adds DTensor's ``Partial`` as a state of an axis, so a
pending sum is reduced by the cheapest collective that the target allows. Pure: no process
group, no ``torch.distributed``.

Model. Each mesh axis ``X`` is in one of three states: it splits one tensor dim (at some
position of that dim's axes, outermost first), it holds a pending reduction (partial), or it
is replicated. A dim's axes behave as a stack: a rank's piece of a dim split ``(a, b)`` is
block ``index_a * size_b + index_b``, so only the innermost axis can be gathered or moved in
one collective, and a local slice can only add a new innermost axis. The steps:

=================  ======================================  =================================
kind               state change on axis ``X``              communication (group of ``X``)
=================  ======================================  =================================
``slice``          replicated -> innermost split of dim d  none: each rank keeps its chunk
``partition``      replicated -> partial                   none: DTensor's choice, see below
``all_gather``     innermost split of dim d -> replicated  gather the pieces along dim d
``all_to_all``     innermost of dim d -> innermost of e    exchange: split e, concatenate d
``all_reduce``     partial -> replicated                   reduce
``reduce_scatter`` partial -> innermost split of dim d     reduce, each rank keeps its chunk
=================  ======================================  =================================

``partition`` does what DTensor does for ``Replicate -> Partial``
(``Partial._partition_value``, torch 2.13): a pending ``sum`` divides the value by the axis
size on every rank; ``avg``, ``max`` and ``min`` keep the value. A split axis that must become
partial is first gathered (DTensor refuses ``Shard -> Partial`` outright).

Order. A plan minimises ``moved_bytes + STEP_BYTES * collectives`` (bytes one device sends in
ring collectives, :meth:`RedistStep.moved_bytes`, plus a start-up charge per collective), so
small tensors get the fewest collectives and large ones the fewest bytes. A greedy walk gives
a first plan: each changing axis takes its direct route (a partial axis that ends split is
reduce-scattered; an axis that moves between dims is one all-to-all unless a cycle forces a
gather, as in MindSpore), scheduled free local steps first (slices shrink every later
message), then reduce-scatters, all-to-alls, all-reduces, and all-gathers last. An A* search
over layouts, bounded by that plan, then looks for a cheaper one: it finds detours such as
parking an axis on another dim with an all-to-all instead of gathering it, or
reduce-scatter + all-reduce + all-gather instead of two all-reduces (3/4 of the bytes). The
search leaves axes replicated in both layouts alone (a plan sends nothing over a link the
change does not involve: it may cross nodes, and the plan does not know link speeds), moves at
most ``_SEARCH_AXES`` axes and expands at most ``_SEARCH_BUDGET`` states; beyond that the
greedy plan stands. Against an exhaustive search over all steps the plans are the cheapest on
every pair of layouts of a 2-D tensor on a 2x2 mesh, small and large tensors
(tests/unit/test_redistribute.py); on 800 sampled pairs on 2x2x2 and 2x4x2 meshes with 64 MiB
tensors, 779 are the cheapest, 20 would gain by borrowing an uninvolved axis (refused, above)
and 1 by re-reducing a pending sum both layouts share (1% of its cost).

Axes of size 1 move nothing: changes on them are folded into the neighbouring step, so a plan
never holds a collective over a group of one device.

``RedistStep.nbytes`` is the size of ONE device's local piece BEFORE the step, the convention
of :mod:`plait.cost` (``all_gather``: the input shard; ``reduce_scatter``: the full input;
``all_reduce``: the buffer; ``all_to_all``: the local buffer). The cost model converts it to
the message size of its formula.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from plait.errors import LayoutError
from plait.layout.layout import TensorLayout
from plait.layout.placement import ReduceOp
from plait.mesh import MeshSpec

__all__ = [
    "LOCAL_KINDS",
    "STEP_BYTES",
    "CollectiveKind",
    "RedistStep",
    "Redistribution",
    "plan_redistribution",
]

CollectiveKind = Literal[
    "all_gather", "all_to_all", "reduce_scatter", "all_reduce", "slice", "partition"
]
KINDS: frozenset[str] = frozenset(get_args(CollectiveKind))
LOCAL_KINDS: frozenset[str] = frozenset({"slice", "partition"})
"""Step kinds that need no communication (each rank works on its own piece)."""

# Fraction of the local piece one device sends (= receives) per step, ring algorithms on a
# group of n: all-gather sends its piece n-1 times; reduce-scatter and all-to-all send
# (n-1)/n of the buffer; all-reduce is a reduce-scatter plus an all-gather.
_TRAFFIC: dict[str, Callable[[int], float]] = {
    "all_gather": lambda n: n - 1.0,
    "all_to_all": lambda n: (n - 1.0) / n,
    "reduce_scatter": lambda n: (n - 1.0) / n,
    "all_reduce": lambda n: 2.0 * (n - 1.0) / n,
    "slice": lambda n: 0.0,
    "partition": lambda n: 0.0,
}

_CACHE_SIZE = 1 << 16  # distinct (src, dst, shape, itemsize) keys one search keeps hot

STEP_BYTES = 256 * 1024
"""What one collective's start-up is worth in bytes sent, when plans are compared.

About NCCL's ring base latency (8.4 us, Simple protocol, in NCCL's tuning tables) times 25-50 GB/s of inter-node
bandwidth, or a gloo round trip on CPUs; so small tensors get the fewest collectives and
large ones the fewest bytes. The planner minimises ``moved_bytes + STEP_BYTES * collectives``.
"""

_SEARCH_BUDGET = 1000  # states the exact search may expand before it keeps the greedy plan
_SEARCH_AXES = 3  # more axes to move than this: the greedy plan (the space grows factorially)


@dataclass(frozen=True, slots=True)
class RedistStep:
    """One step of a redistribution: a collective over one mesh axis, or a local op.

    Attributes:
        kind: the collective (or ``slice`` / ``partition``, local).
        axis: the mesh axis whose device groups run it.
        before: the tensor's layout before the step; ``after``: after it.
        nbytes: bytes of ONE device's local piece BEFORE the step.
    """

    kind: CollectiveKind
    axis: str
    before: TensorLayout
    after: TensorLayout
    nbytes: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(
                f"redistribution step kind {self.kind!r} is unknown; use one of {sorted(KINDS)}"
            )
        if self.before.mesh != self.after.mesh:
            raise LayoutError(
                f"redistribution step {self.kind}@{self.axis}: layouts {self.before.describe()} "
                f"and {self.after.describe()} are on different meshes; a step stays on one mesh"
            )
        self.before.mesh.axis_index(self.axis)
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise LayoutError(
                f"redistribution step {self.kind}@{self.axis}: nbytes={self.nbytes!r}; "
                "give the local piece's size in bytes, an integer >= 0"
            )

    @property
    def group_size(self) -> int:
        """Devices in each group of the step (the size of ``axis``)."""
        return self.before.mesh.axis_size(self.axis)

    @property
    def is_local(self) -> bool:
        """True for steps without communication (``slice``, ``partition``)."""
        return self.kind in LOCAL_KINDS

    @property
    def from_dim(self) -> int | None:
        """The tensor dim ``axis`` splits before the step (None: replicated or partial)."""
        return _dim_of(self.before, self.axis)

    @property
    def to_dim(self) -> int | None:
        """The tensor dim ``axis`` splits after the step (None: replicated or partial)."""
        return _dim_of(self.after, self.axis)

    def moved_bytes(self) -> float:
        """Bytes one device sends (and receives) in a ring implementation of the step."""
        return self.nbytes * _TRAFFIC[self.kind](self.group_size)

    def describe(self) -> str:
        return (
            f"{self.kind}@{self.axis}: {self.before.describe()} -> {self.after.describe()} "
            f"({self.nbytes} B local)"
        )


@dataclass(frozen=True, slots=True)
class Redistribution:
    """How a tensor of ``shape`` goes from layout ``src`` to layout ``dst``, step by step.

    ``steps[0].before == src``, ``steps[-1].after == dst`` and each step starts from the
    layout the previous one left; no steps when the two layouts place the tensor alike.
    """

    src: TensorLayout
    dst: TensorLayout
    shape: tuple[int, ...]
    itemsize: int
    steps: tuple[RedistStep, ...]

    def __post_init__(self) -> None:
        chain = [self.src, *(x for s in self.steps for x in (s.before, s.after)), self.dst]
        if self.steps and any(chain[i] != chain[i + 1] for i in range(0, len(chain), 2)):
            raise LayoutError(
                f"redistribution {self.src.describe()} -> {self.dst.describe()}: steps "
                f"{[s.describe() for s in self.steps]} do not chain from the source to the "
                "target; each step must start where the previous one ended"
            )

    def kinds(self) -> Counter[str]:
        """Collective kind -> how many steps use it; local steps are left out."""
        return Counter(s.kind for s in self.steps if s.kind not in LOCAL_KINDS)

    def is_noop(self) -> bool:
        """True when nothing needs to happen: the layouts place the tensor alike."""
        return not self.steps

    def moved_bytes(self) -> float:
        """Bytes one device sends over the whole plan (ring algorithms)."""
        return sum(s.moved_bytes() for s in self.steps)

    def seconds(self, collective_seconds: Callable[[str, str, int], float]) -> float:
        """Predicted time: the sum of ``collective_seconds(kind, axis, nbytes)`` over the steps.

        Every step is passed, local ones (``slice``, ``partition``) included, so that a cost
        model may charge their memory traffic; one that returns 0 for them makes them free.
        ``nbytes`` follows the convention of :class:`RedistStep`.
        """
        return sum(collective_seconds(s.kind, s.axis, s.nbytes) for s in self.steps)

    def describe(self) -> str:
        """One line per step, for people."""
        head = f"{self.src.describe()} -> {self.dst.describe()} shape {self.shape}"
        if not self.steps:
            return head + ": no-op"
        return "\n".join([head + ":", *(f"  {s.describe()}" for s in self.steps)])


def plan_redistribution(
    src: TensorLayout, dst: TensorLayout, shape: Sequence[int], itemsize: int = 4
) -> Redistribution:
    """Plan how a tensor of ``shape`` (``itemsize`` bytes per element) goes from ``src`` to ``dst``.

    Both layouts must be on the same mesh and split every dim evenly. Deterministic, and
    cached on its arguments: search calls it for the same pairs many times. The steps are
    also shared by tensors of one size whose dims the mesh's axes divide alike
    (:func:`_steps_cached`), and the greedy walk by every size (:func:`_greedy_chain`).

    Example:
        >>> from plait import Layout
        >>> lay = Layout((2, 2), ("dp", "tp"))
        >>> plan = plan_redistribution(lay("tp", "None"), lay("None", "tp"), (8, 12))
        >>> [(s.kind, s.axis, s.nbytes) for s in plan.steps]
        [('all_to_all', 'tp', 192)]
    """
    key = shape if type(shape) is tuple else tuple(shape)
    return _plan_cached(src, dst, key, itemsize)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _plan_cached(
    src: TensorLayout, dst: TensorLayout, shape: tuple[int, ...], itemsize: int
) -> Redistribution:
    _check_inputs(src, dst, shape, itemsize)
    if src == dst:
        return Redistribution(src, dst, shape, itemsize, ())
    total = math.prod(shape) * itemsize
    steps = _steps_cached(src, dst, total, _divisibility(shape, src.mesh.size))
    return Redistribution(src, dst, shape, itemsize, steps)


def _divisibility(shape: tuple[int, ...], mesh_size: int) -> tuple[int, ...]:
    """Per dim, ``gcd(size, mesh_size)``: all the plan needs to know of the shape.

    A dim's split is the product of distinct mesh axes, which divides the mesh size, so it
    divides the dim exactly when it divides this gcd: every ``fits`` test of the search has
    the same answer on the gcds as on the shape.
    """
    return tuple(math.gcd(n, mesh_size) for n in shape)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _steps_cached(
    src: TensorLayout, dst: TensorLayout, total: int, fits: tuple[int, ...]
) -> tuple[RedistStep, ...]:
    """The steps from ``src`` to ``dst`` of a tensor of ``total`` bytes whose dims divide as
    ``fits`` (:func:`_divisibility`).

    The plan depends on the shape only through these two: the walk, the bound and every
    cost of the search through the bytes of a piece (``total`` over the splits), the
    search's moves through which splits divide a dim. So tensors of one size (q, k and v
    viewed as heads ``(b, h, s, d)`` or ``(b, s, h, d)``) share one plan.
    """
    greedy = _with_bytes(_greedy_chain(src, dst), total)
    if _greedy_is_cheapest(src, dst, total, greedy):
        return _fold_unit_axes(greedy, src, dst)
    better = _search(src, dst, fits, total, _objective(greedy))
    if better is None:
        return _fold_unit_axes(greedy, src, dst)
    return _fold_unit_axes(_with_bytes(_replayed_chain(src, dst, tuple(better)), total), src, dst)


# A walk's steps without their bytes: (kind, axis, before, after, pieces of the tensor before
# the step). Which steps a walk takes and the layouts it passes do not depend on the tensor's
# size, so one chain serves every size; a step's bytes are the size over its pieces.
_Chain = tuple[tuple[CollectiveKind, str, TensorLayout, TensorLayout, int], ...]


def _chain_of(steps: Sequence[RedistStep]) -> _Chain:
    return tuple((s.kind, s.axis, s.before, s.after, math.prod(_splits(s.before))) for s in steps)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _greedy_chain(src: TensorLayout, dst: TensorLayout) -> _Chain:
    """The greedy walk from ``src`` to ``dst`` (its order never looks at the bytes)."""
    walk = _Walk(src, dst, 0)
    walk.run()
    return _chain_of(walk.steps)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _replayed_chain(src: TensorLayout, dst: TensorLayout, moves: tuple[_Move, ...]) -> _Chain:
    """The steps of ``moves`` (a plan the search found) from ``src``."""
    walk = _Walk(src, dst, 0)
    for kind, axis, to_dim in moves:
        walk.apply(kind, axis, to_dim)
    return _chain_of(walk.steps)


def _with_bytes(chain: _Chain, total: int) -> list[RedistStep]:
    """The steps of ``chain`` for a tensor of ``total`` bytes (a local piece is exact: the
    layouts split every dim evenly)."""
    return [RedistStep(kind, axis, a, b, total // pieces) for kind, axis, a, b, pieces in chain]


def _check_inputs(
    src: TensorLayout, dst: TensorLayout, shape: tuple[int, ...], itemsize: int
) -> None:
    if not isinstance(src, TensorLayout) or not isinstance(dst, TensorLayout):
        raise LayoutError(
            f"plan_redistribution takes two TensorLayouts, got {type(src).__name__} and "
            f"{type(dst).__name__}; build them with Layout(...)(...) or TensorLayout(...)"
        )
    if src.mesh != dst.mesh:
        raise LayoutError(
            f"redistribution {src.describe()} -> {dst.describe()}: the layouts are on different "
            f"meshes {src.mesh.as_dict()} and {dst.mesh.as_dict()}; redistribution stays on one "
            "mesh: lay both out on the same MeshSpec"
        )
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise LayoutError(
            f"redistribution of shape {shape!r}: sizes must be integers >= 0; pass the "
            "tensor's shape"
        )
    if not isinstance(itemsize, int) or itemsize < 1:
        raise LayoutError(
            f"redistribution itemsize={itemsize!r}: give bytes per element, an integer >= 1"
        )
    # the messages are built only for a shape that does not fit (describe() is not free)
    if not _divides(src, shape):
        src.check_shape(shape, f"redistribution source layout {src.describe()}")
    if not _divides(dst, shape):
        dst.check_shape(shape, f"redistribution target layout {dst.describe()}")


def _divides(layout: TensorLayout, shape: tuple[int, ...]) -> bool:
    """``layout.check_shape(shape)`` would pass: one entry per dim, each split evenly."""
    return len(shape) == layout.ndim and not any(
        n % k for n, k in zip(shape, _splits(layout), strict=True)
    )


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _splits(layout: TensorLayout) -> tuple[int, ...]:
    """``layout.splits()``, kept per layout (a search meets the same few layouts often)."""
    return layout.splits()


def _dim_of(layout: TensorLayout, axis: str) -> int | None:
    for d, axes in enumerate(layout.dims):
        if axis in axes:
            return d
    return None


# Step priorities, lowest first: free steps, then shrinking, neutral and growing collectives.
_SLICE, _PARTITION, _RS, _A2A, _AR, _GATHER_USEFUL, _GATHER_FORCED, _GATHER_LAST = range(8)


class _Walk:
    """Mutable working state of one planning call (never shared, never global)."""

    def __init__(self, src: TensorLayout, dst: TensorLayout, total_bytes: int) -> None:
        self.mesh = src.mesh
        self.dst = dst
        self.total_bytes = total_bytes
        self.dims: list[list[str]] = [list(axes) for axes in src.dims]
        self.partial: list[str] = list(src.partial)
        self.reduce_op: ReduceOp = src.reduce_op
        self.layout = src
        self.steps: list[RedistStep] = []
        self.target_dim = {a: d for d, axes in enumerate(dst.dims) for a in axes}
        self.order = {a: i for i, a in enumerate(self.mesh.axis_names)}

    # -- reading the state ------------------------------------------------------------------
    def level(self, d: int) -> int:
        """Length of the common prefix of dim ``d``'s current and target axes."""
        cur, want = self.dims[d], self.dst.dims[d]
        n = 0
        for a, b in zip(cur, want, strict=False):
            if a != b:
                break
            n += 1
        return n

    def next_push(self, d: int) -> str | None:
        """The axis dim ``d`` takes next, once its extra axes are gone; else None."""
        lvl = self.level(d)
        if len(self.dims[d]) == lvl < len(self.dst.dims[d]):
            return self.dst.dims[d][lvl]
        return None

    def partial_settled(self, axis: str) -> bool:
        return axis in self.dst.partial and self.reduce_op == self.dst.reduce_op

    def gather_unblocks(self, d: int) -> bool:
        """True if popping dim ``d``'s innermost axis clears the way for other steps."""
        rest = self.dims[d][self.level(d) : -1]
        moving = any(self.target_dim.get(a, d) != d for a in rest)
        return moving or len(self.dst.dims[d]) > self.level(d)

    # -- choosing the next step ---------------------------------------------------------------
    def candidates(self) -> list[tuple[int, int, str, str, int | None]]:
        """(priority, axis order, kind, axis, target dim) of every step allowed now."""
        out: list[tuple[int, int, str, str, int | None]] = []
        out += self._pop_candidates()
        out += self._push_candidates()
        out += self._partial_candidates()
        return out

    def _pop_candidates(self) -> list[tuple[int, int, str, str, int | None]]:
        out: list[tuple[int, int, str, str, int | None]] = []
        for d, axes in enumerate(self.dims):
            if len(axes) <= self.level(d):
                continue
            x = axes[-1]
            e = self.target_dim.get(x)
            if e is not None and e != d:
                if self.next_push(e) == x:
                    out.append((_A2A, self.order[x], "all_to_all", x, e))
                else:  # blocked move: gather only if nothing else can go
                    out.append((_GATHER_FORCED, self.order[x], "all_gather", x, None))
                continue
            prio = _GATHER_USEFUL if self.gather_unblocks(d) else _GATHER_LAST
            out.append((prio, self.order[x], "all_gather", x, None))
        return out

    def _push_candidates(self) -> list[tuple[int, int, str, str, int | None]]:
        out: list[tuple[int, int, str, str, int | None]] = []
        split = {a for axes in self.dims for a in axes}
        for e in range(len(self.dims)):
            y = self.next_push(e)
            if y is None or y in split:
                continue  # nothing to take, or an all-to-all found by _pop_candidates
            if y in self.partial:
                out.append((_RS, self.order[y], "reduce_scatter", y, e))
            else:
                out.append((_SLICE, self.order[y], "slice", y, e))
        return out

    def _partial_candidates(self) -> list[tuple[int, int, str, str, int | None]]:
        out: list[tuple[int, int, str, str, int | None]] = []
        for x in self.partial:
            if not self.partial_settled(x) and x not in self.target_dim:
                out.append((_AR, self.order[x], "all_reduce", x, None))
        split = {a for axes in self.dims for a in axes}
        mixed = bool(self.partial) and self.reduce_op != self.dst.reduce_op
        for x in self.dst.partial:
            if x not in self.partial and x not in split and not mixed:
                out.append((_PARTITION, self.order[x], "partition", x, None))
        return out

    # -- applying a step ----------------------------------------------------------------------
    def apply(self, kind: str, axis: str, to_dim: int | None) -> None:
        before = self.layout
        nbytes = self.total_bytes // math.prod(_splits(before))
        for axes in self.dims:
            if axis in axes:
                axes.remove(axis)  # always the innermost: see _pop_candidates
        if axis in self.partial:
            self.partial.remove(axis)
        if to_dim is not None:
            self.dims[to_dim].append(axis)
        if kind == "partition":
            self.partial.append(axis)
            self.reduce_op = self.dst.reduce_op
        self.layout = self._current_layout()
        self.steps.append(RedistStep(kind, axis, before, self.layout, nbytes))  # type: ignore[arg-type]

    def _current_layout(self) -> TensorLayout:
        # Target order first so the last layout equals dst exactly; with no pending
        # reduction the op is dst's (TensorLayout compares it even then).
        rank = {a: i for i, a in enumerate(self.dst.partial)}
        partial = tuple(sorted(self.partial, key=lambda a: (rank.get(a, len(rank)), self.order[a])))
        op = self.reduce_op if partial else self.dst.reduce_op
        return TensorLayout(self.mesh, tuple(map(tuple, self.dims)), partial, op)

    def run(self) -> None:
        # Each step pops an extra axis, pushes a wanted one or settles a partial axis, so
        # the walk ends; the bound only guards against a planner bug.
        for _ in range(4 * self.mesh.ndim + 4):
            found = self.candidates()
            if not found:
                break
            _, _, kind, axis, to_dim = min(found)
            self.apply(kind, axis, to_dim)
        else:  # pragma: no cover - would be a planner bug
            raise AssertionError(f"redistribution did not converge: {self.steps}")
        if self.layout != self.dst and not _alike(self.layout, self.dst):  # pragma: no cover
            raise AssertionError(f"redistribution ended at {self.layout} not {self.dst}")


def _alike(a: TensorLayout, b: TensorLayout) -> bool:
    """Same placement of the tensor (partial axis order and an unused reduce op aside)."""
    return (
        a.dims == b.dims
        and set(a.partial) == set(b.partial)
        and (not a.partial or a.reduce_op == b.reduce_op)
    )


def _fold_unit_axes(
    steps: list[RedistStep], src: TensorLayout, dst: TensorLayout
) -> tuple[RedistStep, ...]:
    """Drop steps on axes of size 1, stretching the neighbours so the chain stays exact."""
    kept = [s for s in steps if s.group_size > 1]
    if len(kept) == len(steps) and (not steps or steps[-1].after == dst):
        return tuple(steps)
    out: list[RedistStep] = []
    before = src
    for i, s in enumerate(kept):
        after = dst if i == len(kept) - 1 else s.after
        out.append(RedistStep(s.kind, s.axis, before, after, s.nbytes))
        before = after
    return tuple(out)


# -- the exact search -----------------------------------------------------------------------------
# A* over layouts, from src, with the steps of the table in the module docstring, cost
# ``moved_bytes + STEP_BYTES`` per collective. Axes already in place (a common outer prefix of
# a dim, a pending reduction both layouts share) and axes replicated in both layouts never
# move; every other axis may take any step, e.g. a slice for a while to shrink the messages
# of the others before it is gathered.
# The greedy plan bounds the search, and _Space.floor (one collective per axis that must still
# leave its place) guides it.

_State = tuple[tuple[tuple[str, ...], ...], frozenset[str]]
_Move = tuple[str, str, int | None]


def _objective(steps: Sequence[RedistStep]) -> float:
    return sum(s.moved_bytes() + _step_penalty(s.kind, s.group_size) for s in steps)


def _step_penalty(kind: str, n: int) -> float:
    return 0.0 if kind in LOCAL_KINDS or n == 1 else STEP_BYTES


def _search(
    src: TensorLayout, dst: TensorLayout, shape: tuple[int, ...], total: int, bound: float
) -> list[_Move] | None:
    """A cheaper plan than ``bound`` as (kind, axis, to_dim) moves, or None (A*)."""
    if src.partial and dst.partial and src.reduce_op != dst.reduce_op:
        return None  # reduce, then partition: the walk's order is the only one
    space = _Space(src, dst, shape, total)
    if len(space.free) > _SEARCH_AXES:
        return None
    start: _State = (src.dims, frozenset(src.partial))
    goal: _State = (dst.dims, frozenset(dst.partial))
    best: dict[_State, float] = {start: 0.0}
    back: dict[_State, tuple[_State, _Move]] = {}
    heap: list[tuple[float, int, _State]] = [(space.floor(start), 0, start)]
    tie = 1
    for _ in range(_SEARCH_BUDGET):
        if not heap:
            return None
        _, _, state = heapq.heappop(heap)
        cost = best[state]
        if state == goal:
            return _path(back, start, goal) if cost < bound - 1e-6 else None
        for weight, move, nxt in space.moves(state):
            new = cost + weight
            if new < best.get(nxt, math.inf) - 1e-9 and new + space.floor(nxt) < bound - 1e-6:
                best[nxt], back[nxt] = new, (state, move)
                heapq.heappush(heap, (new + space.floor(nxt), tie, nxt))
                tie += 1
    return None


def _greedy_is_cheapest(
    src: TensorLayout, dst: TensorLayout, total: int, steps: Sequence[RedistStep]
) -> bool:
    """True when no plan of the search's moves is cheaper than the greedy ``steps``, so
    :func:`_search` would return None: the greedy plan costs exactly :func:`_least_cost`.

    Compared in exact arithmetic (costs times the mesh size are integers); only where the
    floats of the search cannot tell a plan of equal cost from a cheaper one (its tolerance,
    1e-6 bytes, exceeds the rounding error of any plan that could compete: at most
    ``bound / STEP_BYTES`` collectives).
    """
    scale = src.mesh.size  # every group size divides it
    bound = 0  # the greedy plan's cost, times scale
    for s in steps:
        n = s.group_size
        if s.kind in LOCAL_KINDS or n == 1:
            continue
        num, den = _EXACT_TRAFFIC[s.kind](n)
        bound += s.nbytes * num * (scale // den) + STEP_BYTES * scale
    terms = bound / scale / STEP_BYTES + len(steps) + 4
    if terms * (bound / scale) * 2.3e-16 > 1e-6:
        return False
    least = _least_cost(src, dst, total)
    return least is not None and least >= bound


_EXACT_TRAFFIC: dict[str, Callable[[int], tuple[int, int]]] = {
    "all_gather": lambda n: (n - 1, 1),
    "all_to_all": lambda n: (n - 1, n),
    "reduce_scatter": lambda n: (n - 1, n),
    "all_reduce": lambda n: (2 * (n - 1), n),
}
"""``_TRAFFIC`` of the collectives as (numerator, denominator)."""


def _least_cost(src: TensorLayout, dst: TensorLayout, total: int) -> int | None:
    """A lower bound, exact (rounded down) and times the mesh size, on the cost of any plan
    of :func:`_search`'s moves; None when it would not search.

    Each axis the search may move that must change its state (a *leg*) does so by its own
    collective, on its own group. The piece a step carries is at least the tensor split over
    every axis that can be split then: the axes that stay in place, and the free axes
    except those still holding a pending sum (an axis that is partial splits nothing until
    it is reduced). So the bound depends on the order in which the pending sums are
    reduced; it is the least over the orders of the legs (at most ``_SEARCH_AXES!``) of the
    larger of two sums, each a lower bound of every plan that takes the legs in that order
    (:func:`_legs_by_step`, :func:`_legs_by_growth`).
    """
    if src.partial and dst.partial and src.reduce_op != dst.reduce_op:
        return None
    free, target_dim, _ = _free_axes(src, dst)
    if len(free) > _SEARCH_AXES:
        return None
    scale = src.mesh.size
    size = src.mesh.as_dict()
    split_in_place = math.prod(size[a] for axes in src.dims for a in axes if a not in free)
    every = split_in_place * math.prod(size[a] for a in free)
    legs: list[tuple[str, int]] = []
    for x in free:
        n = size[x]
        if n == 1:
            continue  # moves nothing, charges nothing
        d, e = _dim_of(src, x), target_dim.get(x)
        if d is not None:
            legs.append(("gather" if e is None else "move", n))
        elif x in src.partial:
            legs.append(("reduce" if e is not None else "reduce_all", n))
        elif e is not None:
            legs.append(("slice", n))
    # a piece over the splits of every axis that can be split, times the mesh size
    unit = total * (scale // every)
    # the change of a device's piece from the source to the target, times the mesh size
    net = total * (scale // math.prod(_splits(src))) - total * (scale // math.prod(_splits(dst)))
    starts = STEP_BYTES * scale * sum(1 for kind, _ in legs if kind != "slice")
    least: int | None = None
    # the order of the legs matters only through the pending sums (a piece is the same
    # for every leg when none is pending): then one order is every order
    orders = (
        itertools.permutations(legs) if any(k.startswith("reduce") for k, _ in legs) else [legs]
    )
    for order in orders:
        found = max(_legs_by_step(order, unit), _legs_by_growth(order, unit) - net) + starts
        least = found if least is None else min(least, found)
    return starts if least is None else least


def _pending_after(order: Sequence[tuple[str, int]]) -> list[int]:
    """Per leg, the product of the sizes of the pending sums not reduced before it (its own
    included): axes that split nothing when the leg's step runs."""
    out: list[int] = []
    for k in range(len(order)):
        out.append(math.prod(n for kind, n in order[k:] if kind.startswith("reduce")))
    return out


def _legs_by_step(order: Sequence[tuple[str, int]], unit: int) -> int:
    """Bytes sent (times the mesh size) by the leg steps alone, in ``order``: per leg its
    cheapest collective on the smallest piece it can carry then.

    - split -> not split (replicated or partial): only an all-gather unsplits, ``n - 1``;
    - split -> split elsewhere (another dim, or the same dim under other outer axes): an
      all-to-all or an all-gather, at least ``(n - 1) / n``;
    - partial -> split: a reduce-scatter or an all-reduce, at least ``(n - 1) / n``;
    - partial -> replicated: an all-reduce, ``2 (n - 1) / n``, or a reduce-scatter and later
      an all-gather on a piece at least ``unit``;
    - replicated -> split: a slice, free.
    """
    sent = 0
    for (kind, n), pending in zip(order, _pending_after(order), strict=True):
        piece = unit * pending
        if kind == "gather":
            sent += piece * (n - 1)
        elif kind == "move":
            sent += piece * (n - 1) // n
        elif kind == "reduce":
            sent += piece // n * (n - 1)
        elif kind == "reduce_all":
            sent += min(2 * (piece // n * (n - 1)), piece // n * (n - 1) + unit * (n - 1))
    return sent


def _legs_by_growth(order: Sequence[tuple[str, int]], unit: int) -> int:
    """A second bound on the bytes sent (times the mesh size), plus the net change of the
    piece (``net`` in :func:`_least_cost`), in ``order``.

    An all-gather sends what the piece grows by, a reduce-scatter what it shrinks by, a
    slice shrinks it for free, and no other step changes it. So the bytes sent are the net
    growth of the piece, plus what slices cut, plus twice what reduce-scatters send, plus
    what all-to-alls and all-reduces send. Per leg, the least its own steps add to the
    last three (a gather leg adds nothing beyond the net growth):

    - a pending sum is reduced by a reduce-scatter (twice ``(n - 1) / n``) or an all-reduce
      (``2 (n - 1) / n``) of its piece;
    - an axis that moves to another place leaves by an all-to-all (``(n - 1) / n`` of its
      piece) or by an all-gather, and is split again later by a slice or a reduce-scatter
      that cuts ``(n - 1) / n`` of a piece the axis does not split (``(n - 1)`` times at
      least ``unit``);
    - an axis replicated in the source and split in the target is split by such a slice or
      reduce-scatter, on a piece the axis does not split yet.
    """
    added = 0
    for (kind, n), pending in zip(order, _pending_after(order), strict=True):
        piece = unit * pending
        if kind.startswith("reduce"):
            added += 2 * (piece // n * (n - 1))
        elif kind == "move":
            added += min(piece * (n - 1) // n, unit * (n - 1))
        elif kind == "slice":
            added += piece * (n - 1)
    return added


def _path(back: dict[_State, tuple[_State, _Move]], start: _State, goal: _State) -> list[_Move]:
    out: list[_Move] = []
    state = goal
    while state != start:
        state, move = back[state]
        out.append(move)
    return out[::-1]


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _free_axes(
    src: TensorLayout, dst: TensorLayout
) -> tuple[tuple[str, ...], dict[str, int], frozenset[str]]:
    """The axes the search may move (mesh order), the target dim of each split axis and the
    target's partial axes, for one pair of layouts.

    Fixed: axes already in place (a common outer prefix of a dim, a pending reduction both
    layouts share) and axes replicated in both layouts: a plan sends nothing over a link that
    the change does not involve (it may cross nodes; the plan does not know link speeds).
    """
    fixed: set[str] = set()
    for s_axes, d_axes in zip(src.dims, dst.dims, strict=True):
        for a, b in zip(s_axes, d_axes, strict=False):
            if a != b:
                break
            fixed.add(a)
    fixed |= set(src.partial) & set(dst.partial)
    moving = {a for axes in src.dims + dst.dims for a in axes} | set(src.partial + dst.partial)
    fixed |= set(src.mesh.axis_names) - moving
    free = tuple(a for a in src.mesh.axis_names if a not in fixed)
    target_dim = {a: d for d, axes in enumerate(dst.dims) for a in axes}
    return free, target_dim, frozenset(dst.partial)


@functools.lru_cache(maxsize=256)
def _axis_rates(mesh: MeshSpec) -> dict[str, dict[str, tuple[float, float]]]:
    """Per step kind and mesh axis, (share of the piece sent, start-up charge): a step costs
    ``piece * share + charge``, the same floats as ``_TRAFFIC`` and ``_step_penalty``."""
    sizes = mesh.as_dict()
    return {
        kind: {a: (traffic(n), _step_penalty(kind, n)) for a, n in sizes.items()}
        for kind, traffic in _TRAFFIC.items()
    }


class _Space:
    """The moves the search may make from a state, with their costs.

    What a step costs on each axis comes from :func:`_axis_rates` (once per mesh), which
    axes move from :func:`_free_axes` (once per pair of layouts), and each state's floor is
    kept for the search (states are reached from many others). The moves come in a fixed
    order (pops by dim, each gather before its all-to-alls by target dim; then per free axis
    in mesh order its reduction, partition and pushes by dim), which the heap's ties follow.
    """

    def __init__(
        self, src: TensorLayout, dst: TensorLayout, shape: tuple[int, ...], total: int
    ) -> None:
        mesh = src.mesh
        self.size = mesh.as_dict()
        self.shape = shape
        self.total = total
        self.free, self.target_dim, self.target_partial = _free_axes(src, dst)
        smallest = total / mesh.size
        self._rates = _axis_rates(mesh)
        share, charge = self._rates["reduce_scatter"], self._rates["all_gather"]
        self.least = {a: smallest * share[a][0] + charge[a][1] for a in self.size}
        self._floors: dict[_State, float] = {}

    def floor(self, state: _State) -> float:
        """A lower bound on the cost left: one collective per axis that must still leave.

        An axis that splits a dim its target does not, or holds a pending reduction its
        target does not, needs a collective on its own group; the smallest piece any step
        can carry is the tensor split over the whole mesh. Kept per state (states are
        reached from many others).
        """
        found = self._floors.get(state)
        if found is not None:
            return found
        dims, partial = state
        need = 0.0
        for d, axes in enumerate(dims):
            for a in axes:
                if a in self.free and self.target_dim.get(a) != d:
                    need += self.least[a]
        for a in partial:
            if a in self.free and a not in self.target_partial:
                need += self.least[a]
        self._floors[state] = need
        return need

    def fits(self, dims: tuple[tuple[str, ...], ...], e: int) -> bool:
        return self.shape[e] % math.prod(self.size[a] for a in dims[e]) == 0

    def moves(self, state: _State) -> list[tuple[float, _Move, _State]]:
        dims, partial = state
        size = self.size
        splits = [math.prod(size[a] for a in axes) for axes in dims]
        local = self.total // math.prod(splits)
        out = self._pops(dims, partial, local, splits)
        split = {a for axes in dims for a in axes}
        for x in self.free:
            if x not in split:
                self._unsplit(x, dims, partial, local, splits, out)
        return out

    def _pops(
        self,
        dims: tuple[tuple[str, ...], ...],
        partial: frozenset[str],
        local: int,
        splits: list[int],
    ) -> list[tuple[float, _Move, _State]]:
        out: list[tuple[float, _Move, _State]] = []
        free, shape, size = self.free, self.shape, self.size
        gathers, swaps = self._rates["all_gather"], self._rates["all_to_all"]
        ndim = len(dims)
        for d, axes in enumerate(dims):
            if not axes or axes[-1] not in free:
                continue
            x = axes[-1]
            popped = (*dims[:d], axes[:-1], *dims[d + 1 :])
            share, charge = gathers[x]
            out.append((local * share + charge, ("all_gather", x, None), (popped, partial)))
            share, charge = swaps[x]
            n = size[x]
            for e in range(ndim):
                if e != d and shape[e] % (splits[e] * n) == 0:
                    moved = (*popped[:e], (*popped[e], x), *popped[e + 1 :])
                    out.append((local * share + charge, ("all_to_all", x, e), (moved, partial)))
        return out

    def _unsplit(
        self,
        x: str,
        dims: tuple[tuple[str, ...], ...],
        partial: frozenset[str],
        local: int,
        splits: list[int],
        out: list[tuple[float, _Move, _State]],
    ) -> None:
        """Append the moves of ``x``, an axis that splits nothing now, to ``out``."""
        if x in partial and x in self.target_partial:
            return  # partitioned on the way: in place
        rest = partial - {x}
        if x in partial:
            if x not in self.target_partial:
                share, charge = self._rates["all_reduce"][x]
                out.append((local * share + charge, ("all_reduce", x, None), (dims, rest)))
            kind = "reduce_scatter"
        else:
            if x in self.target_partial:
                out.append((0.0, ("partition", x, None), (dims, partial | {x})))
            kind = "slice"
        share, charge = self._rates[kind][x]
        weight = local * share + charge
        n, shape = self.size[x], self.shape
        for e in range(len(dims)):
            if shape[e] % (splits[e] * n) == 0:
                pushed = (*dims[:e], (*dims[e], x), *dims[e + 1 :])
                out.append((weight, (kind, x, e), (pushed, rest)))  # type: ignore[arg-type]
