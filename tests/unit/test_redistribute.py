"""The redistribution planner: step lists for the classic moves, bytes, no-ops, errors, cache.

Execution of every plan on simulated ranks is in tests/sim/test_redistribute_exec.py; here
the plans themselves, and their bytes against an exhaustive search over the same steps.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time

import pytest

from plait import Layout, LayoutError, TensorLayout
from plait.layout import Redistribution, RedistStep, plan_redistribution, redistribute
from plait.layout.redistribute import STEP_BYTES
from plait.mesh import MeshSpec

LAY = Layout((2, 2), ("a", "b"))
SHAPE = (8, 12)  # 96 elements, 384 B in float32


def steps(src: TensorLayout, dst: TensorLayout, shape=SHAPE, itemsize=4):
    plan = plan_redistribution(src, dst, shape, itemsize)
    return [(s.kind, s.axis, s.nbytes) for s in plan.steps]


def P(layout: TensorLayout, *axes: str, op="sum") -> TensorLayout:
    return layout.with_partial(axes, op)


# -- the classic moves -------------------------------------------------------------------------
def test_shard_to_replicate_is_one_all_gather_of_the_shard():
    assert steps(LAY("a", "None"), LAY("None", "None")) == [("all_gather", "a", 192)]


def test_replicate_to_shard_is_a_free_local_slice():
    plan = plan_redistribution(LAY("None", "None"), LAY("a", "b"), SHAPE)
    assert [(s.kind, s.axis, s.nbytes) for s in plan.steps] == [
        ("slice", "a", 384),
        ("slice", "b", 192),
    ]
    assert plan.kinds() == {} and plan.moved_bytes() == 0


def test_shard_to_other_dim_on_the_same_axis_is_one_all_to_all():
    plan = plan_redistribution(LAY("a", "None"), LAY("None", "a"), SHAPE)
    assert [(s.kind, s.axis, s.nbytes) for s in plan.steps] == [("all_to_all", "a", 192)]
    (step,) = plan.steps
    assert (step.from_dim, step.to_dim) == (0, 1)
    assert step.moved_bytes() == 96  # half of the piece leaves the device


def test_partial_to_replicate_is_all_reduce_and_to_shard_is_reduce_scatter():
    assert steps(P(LAY("None", "None"), "a"), LAY("None", "None")) == [("all_reduce", "a", 384)]
    assert steps(P(LAY("None", "None"), "a"), LAY("None", "a")) == [("reduce_scatter", "a", 384)]


def test_replicate_to_partial_is_local_as_dtensor_does_it():
    plan = plan_redistribution(LAY("None", "None"), P(LAY("None", "None"), "b"), SHAPE)
    assert [(s.kind, s.axis) for s in plan.steps] == [("partition", "b")]
    assert plan.kinds() == {} and plan.steps[0].is_local


def test_shard_to_partial_gathers_first():
    # DTensor refuses Shard -> Partial; the plan gathers, then partitions the replica.
    assert [k for k, _, _ in steps(LAY("a", "None"), P(LAY("None", "None"), "a"))] == [
        "all_gather",
        "partition",
    ]


def test_two_axis_dim_gathers_inner_axis_before_outer():
    assert steps(LAY(("a", "b"), "None"), LAY("None", "None")) == [
        ("all_gather", "b", 96),
        ("all_gather", "a", 192),
    ]
    assert steps(LAY(("b", "a"), "None"), LAY("None", "None")) == [
        ("all_gather", "a", 96),
        ("all_gather", "b", 192),
    ]


def test_slices_outer_axis_first_and_only_appends_inner():
    assert steps(LAY("None", "None"), LAY("None", ("b", "a"))) == [
        ("slice", "b", 384),
        ("slice", "a", 192),
    ]


def test_reduce_scatter_and_slice_come_before_the_all_gather():
    # a: partial -> splits dim 1; b: splits dim 0 -> replicated. Reducing first halves what
    # the gather carries: 384 B reduce-scattered, then a 192 B piece gathered.
    plan = plan_redistribution(P(LAY("b", "None"), "a"), LAY("None", "a"), SHAPE)
    assert [(s.kind, s.axis, s.nbytes) for s in plan.steps] == [
        ("reduce_scatter", "a", 192),
        ("all_gather", "b", 96),
    ]


def test_all_reduce_runs_on_the_small_piece_before_a_gather():
    plan = plan_redistribution(P(LAY("b", "None"), "a"), LAY("None", "None"), SHAPE)
    kinds = [s.kind for s in plan.steps]
    assert kinds.index("all_reduce") < kinds.index("all_gather") or "all_reduce" not in kinds
    assert plan.moved_bytes() <= 2 * 192 * 0.5 + 192  # all-reduce of 192 B, gather of 192 B


def test_axes_swapping_dims_break_the_cycle_with_one_gather():
    plan = plan_redistribution(LAY("a", "b"), LAY("b", "a"), SHAPE)
    assert plan.kinds() == {"all_gather": 1, "all_to_all": 1}


def test_several_axes_changing_at_once_chain_exactly():
    src, dst = P(LAY(("a", "b"), "None")), P(LAY("None", "b"), "a")
    plan = plan_redistribution(src, dst, SHAPE)
    assert plan.steps[0].before == src and plan.steps[-1].after == dst
    for prev, nxt in itertools.pairwise(plan.steps):
        assert prev.after == nxt.before


# -- no-ops, partial ops, unit axes ------------------------------------------------------------
def test_same_layout_is_a_noop():
    plan = plan_redistribution(LAY("a", "b"), LAY("a", "b"), SHAPE)
    assert plan.is_noop() and plan.steps == () and plan.moved_bytes() == 0
    assert plan.seconds(lambda kind, axis, nbytes: 1.0) == 0.0


def test_partial_axis_order_and_unused_reduce_op_are_no_change():
    a = TensorLayout(LAY.mesh, ((), ()), ("a", "b"))
    b = TensorLayout(LAY.mesh, ((), ()), ("b", "a"))
    assert plan_redistribution(a, b, SHAPE).is_noop()
    assert plan_redistribution(LAY("a", "None"), P(LAY("a", "None"), op="max"), SHAPE).is_noop()


def test_other_reduce_op_is_reduced_then_partitioned():
    src, dst = P(LAY("None", "None"), "a", op="max"), P(LAY("None", "None"), "a")
    assert [s.kind for s in plan_redistribution(src, dst, SHAPE).steps] == [
        "all_reduce",
        "partition",
    ]


def test_axes_of_size_one_issue_nothing():
    lay = Layout((1, 4), ("dp", "tp"))
    plan = plan_redistribution(lay(("dp", "tp"), "None"), lay("None", "tp"), (8, 12))
    assert [(s.kind, s.axis) for s in plan.steps] == [("all_to_all", "tp")]
    assert plan.steps[0].before == plan.src and plan.steps[-1].after == plan.dst
    assert plan_redistribution(lay("dp", "None"), lay("None", "None"), (8, 12)).is_noop()


# -- bytes and the cost hook -------------------------------------------------------------------
def test_nbytes_is_the_local_piece_before_the_step():
    plan = plan_redistribution(LAY(("a", "b"), "None"), LAY("None", "None"), (1024, 256), 2)
    assert [s.nbytes for s in plan.steps] == [1024 * 256 * 2 // 4, 1024 * 256 * 2 // 2]
    # ring traffic: gather of b sends its quarter once, then a sends its half once
    assert plan.moved_bytes() == 1024 * 256 * 2 * (1 / 4 + 1 / 2)


def test_seconds_sums_the_callable_over_every_step():
    plan = plan_redistribution(P(LAY("None", "None"), "a"), LAY("b", "a"), SHAPE)
    seen = []

    def cost(kind: str, axis: str, nbytes: int) -> float:
        seen.append((kind, axis, nbytes))
        return 0.0 if kind in ("slice", "partition") else nbytes * 1e-9

    total = plan.seconds(cost)
    assert seen == [(s.kind, s.axis, s.nbytes) for s in plan.steps]
    assert total == pytest.approx(sum(n * 1e-9 for k, _, n in seen if k != "slice"))


# -- errors ------------------------------------------------------------------------------------
def test_uneven_shape_is_refused_naming_dim_and_split():
    with pytest.raises(LayoutError, match=r"target layout .*dim 1 has size 6.*4 pieces"):
        plan_redistribution(LAY("None", "None"), LAY("None", ("a", "b")), (8, 6))
    with pytest.raises(LayoutError, match=r"source layout .*dim 0 has size 3.*2 pieces"):
        plan_redistribution(LAY("a", "None"), LAY("None", "None"), (3, 4))


def test_other_mesh_rank_and_itemsize_are_refused():
    other = Layout((4,), ("a",))
    with pytest.raises(LayoutError, match="different meshes"):
        plan_redistribution(LAY("a", "None"), other("a", "None"), SHAPE)
    with pytest.raises(LayoutError, match="layout has 2 dims"):
        plan_redistribution(LAY("a", "None"), LAY("None", "a"), (8, 12, 2))
    with pytest.raises(LayoutError, match="itemsize=0"):
        plan_redistribution(LAY("a", "None"), LAY("None", "a"), SHAPE, 0)


def test_steps_must_chain():
    a, b = LAY("a", "None"), LAY("None", "None")
    step = RedistStep("all_gather", "a", a, b, 192)
    with pytest.raises(LayoutError, match="do not chain"):
        Redistribution(b, a, SHAPE, 4, (step,))
    with pytest.raises(LayoutError, match="kind 'gather'"):
        RedistStep("gather", "a", a, b, 192)  # type: ignore[arg-type]


# -- cache and speed ---------------------------------------------------------------------------
def test_plans_are_cached_and_fast():
    src, dst = P(LAY(("a", "b"), "None"), op="sum"), LAY("None", "b")
    first = plan_redistribution(src, dst, [8, 12])
    assert plan_redistribution(src, dst, (8, 12)) is first  # a list shape hits the same entry
    start = time.perf_counter()
    for _ in range(2000):
        plan_redistribution(src, dst, (8, 12))
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per cached call"


# -- against an exhaustive search ----------------------------------------------------------------
def _moves(state, sizes, shape, itemsize):
    """Every single step from a state: (bytes sent, collective?, next state).

    All steps on all axes, with no restriction: the planner's own search leaves axes in
    place and offers slices only towards the target; this one checks that loses nothing.
    """
    dims, partial = state
    split = {a for axes in dims for a in axes}
    local = math.prod(shape) * itemsize // math.prod(sizes[a] for a in split)

    def fits(new_dims, e):
        return shape[e] % math.prod(sizes[a] for a in new_dims[e]) == 0

    for d, axes in enumerate(dims):
        if axes:
            x, n = axes[-1], sizes[axes[-1]]
            popped = tuple(a[:-1] if i == d else a for i, a in enumerate(dims))
            yield local * (n - 1), True, (popped, partial)
            for e in range(len(dims)):
                moved = tuple((*a, x) if i == e else a for i, a in enumerate(popped))
                if e != d and fits(moved, e):
                    yield local * (n - 1) / n, True, (moved, partial)
    for x, n in sizes.items():
        if x in split:
            continue
        if x in partial:
            yield 2 * local * (n - 1) / n, True, (dims, partial - {x})
        else:
            yield 0.0, False, (dims, partial | {x})
        for e in range(len(dims)):
            pushed = tuple((*a, x) if i == e else a for i, a in enumerate(dims))
            if fits(pushed, e):
                sent = local * (n - 1) / n if x in partial else 0.0
                yield sent, x in partial, (pushed, partial - {x})


def cheapest(src: TensorLayout, dst: TensorLayout, shape, itemsize=4) -> float:
    """Dijkstra over all layouts: the least ``bytes + STEP_BYTES * collectives`` to dst."""
    sizes = src.mesh.as_dict()
    start, goal = (src.dims, frozenset(src.partial)), (dst.dims, frozenset(dst.partial))
    best, heap, tie = {start: 0.0}, [(0.0, 0, start)], itertools.count(1)
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state == goal:
            return cost
        if cost > best[state]:
            continue
        for sent, collective, nxt in _moves(state, sizes, shape, itemsize):
            new = cost + sent + (STEP_BYTES if collective else 0)
            if new < best.get(nxt, math.inf) - 1e-9:
                best[nxt] = new
                heapq.heappush(heap, (new, next(tie), nxt))
    raise AssertionError("target unreachable")


def objective(plan: Redistribution) -> float:
    return plan.moved_bytes() + STEP_BYTES * sum(plan.kinds().values())


def all_layouts(lay: Layout, axes: tuple[str, ...], ndim: int = 2) -> list[TensorLayout]:
    specs: list[str | tuple[str, ...]] = ["None"]
    for k in range(1, len(axes) + 1):
        specs += [p[0] if k == 1 else p for p in itertools.permutations(axes, k)]
    out = []
    for combo in itertools.product(specs, repeat=ndim):
        used = [a for d in combo if d != "None" for a in ((d,) if isinstance(d, str) else d)]
        if len(used) != len(set(used)):
            continue
        free = [a for a in axes if a not in used]
        for k in range(len(free) + 1):
            out += [lay(*combo).with_partial(p) for p in itertools.combinations(free, k)]
    return out


@pytest.mark.parametrize("shape", [SHAPE, (4096, 6144)], ids=["small", "large"])
def test_every_plan_is_the_cheapest_on_a_2x2_mesh(shape):
    """Small tensors: fewest collectives, then bytes; large ones (96 MiB): fewest bytes."""
    layouts = all_layouts(LAY, ("a", "b"))
    assert len(layouts) == 18
    for src, dst in itertools.product(layouts, repeat=2):
        plan = plan_redistribution(src, dst, shape)
        assert objective(plan) == pytest.approx(cheapest(src, dst, shape)), plan.describe()


def test_large_tensors_take_detours_that_send_fewer_bytes():
    # Parking b on dim 0 (all-to-all there and back) instead of gathering it: 3/4 the bytes.
    src, dst = LAY("None", "b"), LAY("None", ("a", "b"))
    small, large = plan_redistribution(src, dst, SHAPE), plan_redistribution(src, dst, (4096, 6144))
    assert [s.kind for s in small.steps] == ["all_gather", "slice", "slice"]
    assert [(s.kind, s.axis) for s in large.steps] == [
        ("all_to_all", "b"),
        ("slice", "a"),
        ("all_to_all", "b"),
    ]
    assert large.moved_bytes() == 0.75 * 4096 * 6144 * 4 / 2
    # Two pending sums: reduce-scatter, all-reduce, all-gather sends 3/4 of two all-reduces.
    two = plan_redistribution(P(LAY("None", "None"), "a", "b"), LAY("None", "None"), (4096, 6144))
    assert two.kinds() == {"reduce_scatter": 1, "all_reduce": 1, "all_gather": 1}
    assert two.moved_bytes() == 0.75 * 2 * 4096 * 6144 * 4


def test_mesh_spec_reuse_keeps_cache_keys_equal():
    # Layouts built separately on equal meshes are equal and hash alike (lru_cache keys).
    a = Layout((2, 2), ("a", "b"))("a", "None")
    b = TensorLayout(MeshSpec(("a", "b"), (2, 2)), (("a",), ()))
    assert a == b and hash(a) == hash(b)


def test_axes_replicated_in_both_layouts_carry_nothing():
    # Slicing dp to shrink the reduce-scatter would send fewer bytes, but dp may cross nodes.
    lay = Layout((2, 4), ("dp", "tp"))
    plan = plan_redistribution(P(lay("None", "None"), "tp"), lay("tp", "None"), (4096, 4096))
    assert [(s.kind, s.axis) for s in plan.steps] == [("reduce_scatter", "tp")]


def test_many_moving_axes_fall_back_to_the_greedy_plan_and_still_chain():
    lay = Layout((2, 2, 2, 2), ("w", "x", "y", "z"))
    src, dst = P(lay(("w", "x"), "y", "None"), "z"), lay("y", ("z", "x"), "w")
    shape = (64, 64, 64)
    # four axes move: more than the search takes on (its space grows factorially)
    assert redistribute._search(src, dst, shape, 64**3 * 4, math.inf) is None
    plan = plan_redistribution(src, dst, shape)
    assert plan.steps[0].before == src and plan.steps[-1].after == dst
    for prev, nxt in itertools.pairwise(plan.steps):
        assert prev.after == nxt.before
    assert plan.kinds()["reduce_scatter"] == 1  # the pending sum is reduced once, never twice
