"""The outer planner's memory floor prunes without changing the choice.

``MeshEstimate.memory_floor`` (the most model states any stage holds) is a lower bound on an
option's predicted memory; an option whose floor is over the limit is not predicted when an
option that fits was found, nor, none fitting so far, when two options already need less
(when nothing fits, the smallest wins). The pruned planner picks what weighing everything
picks, on a free mesh where nothing fits and where some options fit.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from plait.config import ParallelConfig
from plait.graph import capture
from plait.models import ModelSpec, build
from plait.planning.estimate import GraphFacts, MeshEstimate
from plait.planning.outer import auto_plan
from plait.planning.setup import prepare
from plait.search import get_searcher

GPT = ModelSpec(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=128, batch=16)


@functools.cache
def _captured():
    with torch.device("meta"):
        model, batch, loss = build(GPT)
    return model, capture(model, batch, loss)


@functools.cache
def _smallest() -> int:
    """The least memory of any option on 8 devices (what wins when nothing fits)."""
    model, graph = _captured()
    cfg = ParallelConfig(mode="auto", devices=8, hardware="a100-80g", memory_limit=1)
    return auto_plan(graph, cfg, model=model, prune=False).predicted.memory_bytes


def _chosen(plan):
    return dataclasses.replace(plan, options=(), notes=())


def _next_best(plan) -> str:
    return plan.notes[-1].split("next best: ")[1]


@pytest.mark.parametrize("case", ["nothing fits", "some fit"])
def test_pruning_by_memory_floor_keeps_the_choice(case):
    model, graph = _captured()
    # some fit: twice the smallest option's memory, under what a stage without ZeRO holds
    limit = 1 if case == "nothing fits" else 2 * _smallest()
    cfg = ParallelConfig(mode="auto", devices=8, hardware="a100-80g", memory_limit=limit)
    every = auto_plan(graph, cfg, model=model, prune=False)
    pruned = auto_plan(graph, cfg, model=model)
    assert _chosen(pruned) == _chosen(every)
    assert _next_best(pruned) == _next_best(every)  # the runner-up too
    fits = every.predicted.memory_bytes <= limit
    assert fits == (case == "some fit")
    # the floor did prune (else this test would not test it)
    assert any("not predicted in full for memory" in n for n in pruned.notes)
    assert not any("for memory" in n for n in every.notes)


def test_memory_floor_is_below_every_prediction():
    """On a pipeline mesh, every setting's floor is at most its predicted memory, and it
    falls as ZeRO splits the model states it counts."""
    model, graph = _captured()
    base = ParallelConfig(
        mode="auto", mesh={"pp": 2, "dp": 2, "tp": 2}, pipeline_stages=2, micro_batches=4,
        hardware="a100-80g",
    )  # fmt: skip
    setup = prepare(graph, base, model=model)
    decisions = get_searcher("sharding_propagation")(setup.problem, setup.allowed, setup.configured)
    est = MeshEstimate(
        GraphFacts(graph), base, setup.mesh, setup.problem, setup.topology, setup.hardware,
        decisions,
    )  # fmt: skip
    floors = {}
    for zero in (None, 1, 2, 3):
        for recompute in ("none", "full"):
            cfg = dataclasses.replace(base, optimizer_shard=zero, recompute=recompute)
            floor = est.memory_floor(cfg)
            predicted = est.predict(cfg).memory_bytes
            assert 0 < floor <= predicted
            floors[zero] = floor
    assert floors[3] < floors[None]  # ZeRO-3 splits the states the floor counts
