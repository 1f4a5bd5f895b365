"""Prices shared between problems: ``prepare`` hands out one CostModel per (mesh, profile,
precision) and one candidate list per (graph, mesh); recursive_programming keeps its link
price tables on the cost model, keyed by the candidate lists. Another mesh, shape, profile,
precision or cost model never shares an entry, and sharing never changes a decision."""

from __future__ import annotations

import dataclasses

import torch

from plait.config import ParallelConfig
from plait.cost import get_profile
from plait.graph import capture
from plait.mesh import MeshSpec
from plait.models import ModelSpec, build
from plait.planning.setup import _shared_candidates, cost_model, prepare
from plait.search import recursive
from plait.search.problem import CostModel
from plait.search.recursive import recursive_programming

GPT = ModelSpec(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=128, batch=8)


def _graph(spec: ModelSpec = GPT):
    with torch.device("meta"):
        model, batch, loss = build(spec)
    return model, capture(model, batch, loss)


def _tables(problem) -> dict:
    return {k: v for k, v in problem.cost.scratch.items() if k[0] == "recursive_programming.link"}


def test_cost_model_is_shared_only_by_equal_mesh_profile_and_precision() -> None:
    a100, h100 = get_profile("a100-80g"), get_profile("h100")
    mesh = MeshSpec.from_dict({"dp": 2, "tp": 4})
    one = cost_model(mesh, a100, "bf16")
    assert cost_model(MeshSpec.from_dict({"dp": 2, "tp": 4}), a100, "bf16") is one
    assert cost_model(MeshSpec.from_dict({"dp": 4, "tp": 2}), a100, "bf16") is not one
    assert cost_model(MeshSpec.from_dict({"tp": 4, "dp": 2}), a100, "bf16") is not one
    assert cost_model(mesh, h100, "bf16") is not one
    assert cost_model(mesh, a100, "fp32") is not one
    # a profile equal in value but another number is another cost model
    slower = dataclasses.replace(a100, devices_per_node=2)
    assert cost_model(mesh, slower, "bf16") is not one


def test_candidates_are_shared_only_by_the_same_graph_on_an_equal_mesh() -> None:
    _, graph = _graph()
    _, other = _graph(dataclasses.replace(GPT, seq=16))
    mesh = MeshSpec.from_dict({"dp": 2, "tp": 4})
    first = _shared_candidates(graph, mesh)
    again = _shared_candidates(graph, MeshSpec.from_dict({"dp": 2, "tp": 4}))
    assert again is not first  # a new map, the same lists
    assert all(again[op] is first[op] for op in first)
    elsewhere = _shared_candidates(graph, MeshSpec.from_dict({"dp": 4, "tp": 2}))
    assert not any(elsewhere[op] is first[op] for op in first)
    shapes = _shared_candidates(other, mesh)
    assert not any(shapes[op] is first[op] for op in first)


def test_link_tables_never_cross_meshes_shapes_or_cost_models() -> None:
    model, graph = _graph()
    _, shorter = _graph(dataclasses.replace(GPT, seq=16))
    cfg = ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 4})
    a = prepare(graph, cfg, model=model)
    recursive_programming(a.problem, a.allowed, a.configured)
    b = prepare(graph, cfg, model=model)
    assert b.problem.cost is a.problem.cost  # shared: the tables carry over
    tables = _tables(a.problem)
    assert tables
    # another mesh: another cost model, its own tables
    c = prepare(graph, ParallelConfig(mode="auto", mesh={"dp": 4, "tp": 2}), model=model)
    assert c.problem.cost is not a.problem.cost
    recursive_programming(c.problem, c.allowed, c.configured)
    assert not set(map(id, _tables(c.problem).values())) & set(map(id, tables.values()))
    # another shape on the same mesh: the same cost model, other candidate lists, new keys
    d = prepare(shorter, cfg, model=model)
    assert d.problem.cost is a.problem.cost
    before = set(_tables(a.problem))
    recursive_programming(d.problem, d.allowed, d.configured)
    lists = {id(d.problem.candidates[op.name]) for op in shorter.ops}
    added = set(_tables(a.problem)) - before
    assert added and all(key[1] in lists and key[2] in lists for key in added)
    # a cost model built by hand never sees the shared one's tables
    own = CostModel(a.problem.cost.axis_seconds, a.problem.cost.op_compute)
    assert not own.scratch


def test_shared_prices_decide_as_fresh_ones() -> None:
    """Decisions (index, reason, cost, alternatives) with every cache warm equal those of a
    search on a cost model of its own with the recursive caches emptied."""
    model, graph = _graph()
    cfg = ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 4})
    warm = prepare(graph, cfg, model=model)
    recursive_programming(warm.problem, warm.allowed, warm.configured)
    warm = prepare(graph, cfg, model=model)
    shared = recursive_programming(warm.problem, warm.allowed, warm.configured)
    fresh = prepare(graph, cfg, model=model)
    cost = CostModel(fresh.problem.cost.axis_seconds, fresh.problem.cost.op_compute)
    recursive._ROLE_LISTS.clear()
    problem = dataclasses.replace(fresh.problem, cost=cost, _op_cost={}, _op_keys={})
    alone = recursive_programming(problem, fresh.allowed, fresh.configured)
    assert shared == alone


def test_link_table_entry_holds_its_lists() -> None:
    """An entry keeps the candidate lists it was keyed by (an id is never reused while the
    entry lives), and an entry whose lists are not the asker's is replaced, not read."""
    model, graph = _graph()
    cfg = ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 4})
    setup = prepare(graph, cfg, model=model)
    recursive_programming(setup.problem, setup.allowed, setup.configured)
    for key, entry in _tables(setup.problem).items():
        assert id(entry[0]) == key[1] and id(entry[1]) == key[2]
