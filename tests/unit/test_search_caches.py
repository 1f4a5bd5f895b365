"""Caches behind fast searches: equal keys share an entry, different meshes or shapes never do.

- ``TensorLayout`` hashes once (its hash rebuilt, not carried, when it is pickled);
- ``CostModel`` caches redistribution and edge seconds per (layouts, tensor);
- gradient and settled layouts are interned (one object per value, per mesh);
- the redistribution planner skips its A* search only where the search would keep the
  greedy plan.
"""

from __future__ import annotations

import itertools
import pickle

from plait.graph import TensorMeta
from plait.layout import TensorLayout
from plait.layout import redistribute as rd
from plait.mesh import MeshSpec
from plait.rules.registry import OpStrategy
from plait.search.problem import CostModel, gradient_layout, settled

MESH = MeshSpec.from_dict({"dp": 2, "tp": 4})
OTHER = MeshSpec.from_dict({"dp": 4, "tp": 2})


def _seconds(kind: str, axis: str, nbytes: int) -> float:
    return 1e-6 + nbytes * (2e-9 if axis == "tp" else 1e-8) * (2 if kind == "all_reduce" else 1)


def _cost() -> CostModel:
    return CostModel(_seconds, lambda op, pieces: 0.0)


def test_layout_hash_is_its_value_and_survives_pickle() -> None:
    a = TensorLayout(MESH, (("dp",), ("tp",)))
    b = TensorLayout(MeshSpec.from_dict({"dp": 2, "tp": 4}), (("dp",), ("tp",)))
    assert a == b and hash(a) == hash(b)
    assert a != TensorLayout(OTHER, (("dp",), ("tp",)))  # same dims, another mesh
    assert a != TensorLayout(MESH, (("dp",), ("tp",)), (), "max")  # the reduce op counts
    back = pickle.loads(pickle.dumps(a))
    assert back == a and hash(back) == hash(a) and {a: 1}[back] == 1
    assert back._axis_dim == {"dp": 0, "tp": 1}


def test_move_seconds_keys_on_mesh_and_shape() -> None:
    cost = _cost()
    meta, bigger = TensorMeta((8, 16)), TensorMeta((8, 32))
    src, dst = TensorLayout(MESH, (("tp",), ())), TensorLayout(MESH, ((), ("tp",)))
    src2, dst2 = TensorLayout(OTHER, (("tp",), ())), TensorLayout(OTHER, ((), ("tp",)))
    for s, d, m in ((src, dst, meta), (src, dst, bigger), (src2, dst2, meta)):
        fresh = rd.plan_redistribution(s, d, m.shape, m.itemsize).seconds(_seconds)
        assert cost.move_seconds(s, d, m) == fresh
    assert cost.move_seconds(src, dst, meta) != cost.move_seconds(src, dst, bigger)
    assert cost.move_seconds(src, dst, meta) != cost.move_seconds(src2, dst2, meta)
    assert len(cost._moves) == 3
    assert cost.move_seconds(src, src, meta) == 0.0
    # a new cost model (another hardware profile, another mesh) starts empty
    assert _cost()._moves == {}


def test_edge_seconds_is_forward_plus_backward() -> None:
    cost = _cost()
    meta = TensorMeta((8, 16))
    src = TensorLayout(MESH, ((), ()), ("tp",))  # a pending sum
    dst = TensorLayout(MESH, (("dp",), ()))
    grad = TensorLayout(MESH, (("dp",), ()), ("tp",))
    fwd = rd.plan_redistribution(src, dst, meta.shape).seconds(_seconds)
    bwd = rd.plan_redistribution(grad, settled(src), meta.shape).seconds(_seconds)
    assert cost.edge_seconds(src, dst, grad, meta) == fwd + bwd
    assert cost.edge_seconds(src, dst, None, meta) == fwd
    assert cost.edge_seconds(src, dst, grad, TensorMeta((8, 32))) != fwd + bwd


def test_interned_layouts_are_one_object_per_value() -> None:
    one = TensorLayout(MESH, ((), ("tp",)), ("dp",))
    two = TensorLayout(MESH, ((), ("tp",)), ("dp",))
    assert settled(one) is settled(two) and settled(one) == TensorLayout(MESH, ((), ("tp",)))
    elsewhere = TensorLayout(OTHER, ((), ("tp",)), ("dp",))
    assert settled(elsewhere) != settled(one) and settled(elsewhere).mesh == OTHER
    plain = TensorLayout(MESH, ((), ()))
    assert settled(plain) is plain

    def linear(mesh: MeshSpec) -> OpStrategy:  # batch-split input, column-parallel weight
        x = TensorLayout(mesh, (("dp",), ()))
        w = TensorLayout(mesh, (("tp",), ()))
        return OpStrategy((x, w), (TensorLayout(mesh, (("dp",), ("tp",))),), "col")

    a, b = linear(MESH), linear(MeshSpec.from_dict({"dp": 2, "tp": 4}))
    assert gradient_layout(a, 0) is gradient_layout(b, 0)
    assert gradient_layout(a, 0) == TensorLayout(MESH, (("dp",), ()), ("tp",))
    assert gradient_layout(a, 1) == TensorLayout(MESH, (("tp",), ()), ("dp",))
    assert gradient_layout(linear(OTHER), 0).mesh == OTHER


def _layouts(mesh: MeshSpec, ndim: int) -> list[TensorLayout]:
    out = []
    axes = mesh.axis_names
    for states in itertools.product(range(ndim + 2), repeat=len(axes)):
        for order in (axes, axes[::-1]):
            dims: list[list[str]] = [[] for _ in range(ndim)]
            partial = []
            for a in order:
                st = states[axes.index(a)]
                if st == ndim + 1:
                    partial.append(a)
                elif st < ndim:
                    dims[st].append(a)
            out.append(TensorLayout(mesh, tuple(map(tuple, dims)), tuple(partial)))
    return list(dict.fromkeys(out))


def test_skipping_the_search_keeps_the_plan() -> None:
    """Wherever the greedy plan costs the lower bound, the A* search finds nothing cheaper;
    and the bound is a bound: no plan the search returns costs less."""
    skipped = searched = 0
    for mesh, shape in (
        (MESH, (8, 16, 32)),
        (MeshSpec.from_dict({"a": 2, "b": 2, "c": 2}), (8, 8)),
    ):
        scale = mesh.size
        for src, dst in itertools.product(_layouts(mesh, len(shape)), repeat=2):
            if src == dst:
                continue
            total = 8 * 16 * 32 * 4 if len(shape) == 3 else 8 * 8 * 4
            walk = rd._Walk(src, dst, total)
            walk.run()
            bound = rd._objective(walk.steps)
            better = rd._search(src, dst, shape, total, bound)
            least = rd._least_cost(src, dst, total)
            if rd._greedy_is_cheapest(src, dst, total, walk.steps):
                skipped += 1
                assert better is None, (src, dst)
            else:
                searched += 1
            if better is not None and least is not None:
                replay = rd._Walk(src, dst, total)
                for move in better:
                    replay.apply(*move)
                assert rd._objective(replay.steps) * scale >= least - 1e-6 * scale
    assert skipped > 100 and searched > 100


def test_tensors_of_one_size_whose_dims_divide_alike_share_one_plan() -> None:
    """The redistribution plan depends on a shape only through its bytes and which of the
    mesh's splits divide each dim: (8, 16, 32) and (16, 8, 32) share one entry (the same steps
    object), (4, 64, 16) has another (4 is not divisible by the mesh's 8); every shared plan
    equals the one planned from scratch for its own shape."""
    pairs = [(s, d) for s, d in itertools.product(_layouts(MESH, 3), repeat=2) if s != d]
    pairs = [(s, d) for s, d in pairs if all(len(x) <= 1 for x in s.dims + d.dims)][:150]

    def divides(layout: TensorLayout, shape: tuple[int, ...]) -> bool:
        return all(n % k == 0 for n, k in zip(shape, layout.splits(), strict=True))

    shapes = [(8, 16, 32), (16, 8, 32), (4, 64, 16)]
    shared = kept_apart = 0
    for src, dst in pairs:
        if not all(divides(x, s) for x in (src, dst) for s in shapes):
            continue
        rd._plan_cached.cache_clear()
        rd._steps_cached.cache_clear()
        plans = [rd.plan_redistribution(src, dst, s) for s in shapes]
        assert plans[0].steps is plans[1].steps  # one entry for the two alike shapes
        shared += 1
        kept_apart += rd._steps_cached.cache_info().currsize == 2  # the third: its own
        for shape, plan in zip(shapes, plans, strict=True):  # each equals a fresh plan
            rd._plan_cached.cache_clear()
            rd._steps_cached.cache_clear()
            assert rd.plan_redistribution(src, dst, shape).steps == plan.steps, (src, dst, shape)
    assert shared > 20 and kept_apart == shared


def test_a_second_search_of_a_graph_reuses_its_folded_structure_and_decides_the_same() -> None:
    """prepare of one graph on one mesh shares the cost model, so recursive_programming's
    folded graph (and its nodes' own prices) is made once; the decisions equal those of a
    search whose cost model kept nothing; another mesh gets its own structure."""
    import torch

    from plait.config import ParallelConfig
    from plait.graph import capture
    from plait.models import ModelSpec, build
    from plait.planning.setup import prepare
    from plait.search import recursive

    spec = ModelSpec(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=128, batch=8)
    with torch.device("meta"):
        model, batch, loss = build(spec)
    graph = capture(model, batch, loss)

    def searched(mesh: dict[str, int]):
        cfg = ParallelConfig(mode="auto", mesh=mesh, hardware="a100-80g")
        setup = prepare(graph, cfg, model=model)
        decisions = recursive.recursive_programming(setup.problem, setup.allowed, setup.configured)
        structure = recursive._structure(setup.problem, setup.allowed, setup.configured)
        return setup, decisions, structure

    first, decided, structure = searched({"dp": 2, "tp": 2})
    again, decided_again, structure_again = searched({"dp": 2, "tp": 2})
    assert again.problem.cost is first.problem.cost and structure_again is structure
    assert decided_again == decided
    first.problem.cost.scratch.clear()  # nothing kept: folded and priced from scratch
    fresh = recursive.recursive_programming(first.problem, first.allowed, first.configured)
    assert fresh == decided
    assert recursive._structure(first.problem, first.allowed, first.configured) is not structure
    _, _, other = searched({"dp": 4})
    assert other is not structure
