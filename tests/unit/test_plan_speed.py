"""Planning at scale: the shortcuts that make mode auto fast choose what the long way chooses.

- The outer planner predicts every (mesh, ZeRO, recompute, micro-batches) option from its
  mesh's shared work (plait.planning.estimate) and assembles only the winner; assembling
  every option in full (``exhaustive=True``, a fresh predictor per option) gives the same
  plan file, byte for byte.
- One predictor reused across options predicts, for every option (schedules and settings
  included), what a fresh one gives the assembled plan; the plan's listed collectives sum to
  its predicted communication.
- Sharding propagation weighs cost vectors cached across repeated layers; it decides exactly
  what the scalar walk (each candidate priced on its own, as before) decides.
- On a mesh with pipeline stages, candidates come from the mesh without the pipeline axis,
  placed on the whole mesh: the same list as filtering the whole mesh's.

No timings are asserted (bench/plan_scale.py measures them).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
import torch

from plait.config import ParallelConfig
from plait.graph import OpNode, capture
from plait.mesh import MeshSpec
from plait.models import ModelSpec, build
from plait.planning import estimate
from plait.planning.assemble import assemble_plan
from plait.planning.outer import _with, auto_plan
from plait.planning.setup import _candidates, prepare
from plait.planning.timing import PlanTiming
from plait.rules import default_catalogue
from plait.search import propagation, recursive
from plait.search.problem import gradient_layout, settled
from plait.search.propagation import Decision, sharding_propagation
from plait.search.recursive import recursive_programming


@functools.cache
def _graph(spec: ModelSpec, frozen: tuple[str, ...] = ()):
    with torch.device("meta"):
        model, batch, loss = build(spec)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model, capture(model, batch, loss)


GPT = ModelSpec(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=128, batch=16)
LLAMA = ModelSpec(
    kind="llama", layers=2, hidden=64, heads=4, kv_heads=2, seq=32, vocab=128, batch=16, tied=True
)
BERT = ModelSpec(kind="bert", layers=2, hidden=64, heads=4, seq=32, vocab=128, batch=16)


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_predicting_options_chooses_the_plan_assembling_every_option_chooses(fraction) -> None:
    """A 4-layer GPT on 8 devices, free mesh (11 meshes with pipelines): with memory to spare
    and with half the winner's memory (ZeRO and recompute escalate), the plan file of the
    fast planner equals the one of the planner that assembles every option."""
    model, graph = _graph(GPT)
    cfg = ParallelConfig(mode="auto", devices=8, hardware="a100-80g")
    slow = auto_plan(graph, cfg, model=model, exhaustive=True, prune=False)
    if fraction is not None:
        cfg = dataclasses.replace(cfg, memory_limit=int(slow.predicted.memory_bytes * fraction))
        slow = auto_plan(graph, cfg, model=model, exhaustive=True, prune=False)
    timing = PlanTiming()
    fast = auto_plan(graph, cfg, model=model, timing=timing, prune=False)
    assert fast.to_json() == slow.to_json()
    assert timing.searched == timing.meshes > 1 and timing.pruned == 0
    assert timing.reused == timing.options >= timing.meshes and timing.assembled == 1
    assert timing.search_s > 0 and timing.estimate_s > 0 and timing.assemble_s > 0
    assert "searched" in timing.line()


def test_pruned_meshes_change_neither_the_winner_nor_the_runner_up() -> None:
    """A batch of 12 on 8 devices: pp=4 x dp=2 runs 6 rows per replica in at most 6
    micro-batches, pp=8 in none (fewer rows than stages); pipelines' lower bounds
    (that stage's compute with every op cut over all its devices, the fixed op costs its
    micro-batches pay again, and the bubble of that) are above the runner-up found by then,
    and they are not searched. The plan is the one weighing every mesh gives, but for the options
    it lists and a note naming the meshes not searched."""
    model, graph = _graph(dataclasses.replace(GPT, batch=12))
    cfg = ParallelConfig(mode="auto", devices=8, hardware="a100-80g")
    slow = auto_plan(graph, cfg, model=model, exhaustive=True, prune=False)
    timing = PlanTiming()
    fast = auto_plan(graph, cfg, model=model, timing=timing)
    assert timing.pruned >= 1 and timing.searched + timing.pruned == timing.meshes

    def chosen(plan):
        return dataclasses.replace(plan, options=(), notes=()).to_json()

    assert chosen(fast) == chosen(slow)
    assert fast.options[0] == slow.options[0]
    runner_up = fast.notes[-1].split("; next best: ")[1]
    assert runner_up == slow.notes[-1].split("; next best: ")[1]
    # one note names every mesh not searched, each a pipeline here
    (note,) = [n for n in fast.notes if n.startswith(f"{timing.pruned} mesh")]
    assert "not searched (pp=" in note


def _variants(pp: int):
    schedules = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble") if pp > 1 else ("1f1b",)
    micro = (4,) if pp > 1 else (1,)
    return itertools.product((None, 1, 2, 3), ("none", "selective", "full"), micro, schedules)


def _listed_seconds(plan) -> list[float]:
    """Per pipeline stage, the seconds per step of the collectives the plan lists, each at
    the stage of the op (or of the parameter's reader) it names."""
    stage_of = {op: s for s, ops in enumerate(plan.stages) for op in ops}
    reader = {p.name: p.op for p in plan.parameters}
    totals = [0.0] * plan.pipeline_stages
    for c in plan.collectives:
        op = c.op if c.op in stage_of or plan.pipeline_stages == 1 else reader[c.op]
        totals[stage_of.get(op, 0)] += c.seconds * c.count
    return totals


@pytest.mark.parametrize(
    ("spec", "mesh", "extra"),
    [
        (GPT, {"pp": 2, "dp": 2, "tp": 2}, {"grad_accumulation": 2}),
        (GPT, {"dp": 8}, {"optimizer_shard_exclude": ("tok.weight",), "frozen": ("pos.weight",)}),
        (GPT, {"dp": 8}, {"optimizer_weight_shard_size": 2, "optimizer_shard_threshold": 0}),
        (LLAMA, {"pp": 2, "dp": 4}, {"precision": "bf16", "offload": "optimizer"}),
        (BERT, {"dp": 4, "tp": 2}, {"offload": "activations", "optimizer_shard_threshold": 0}),
    ],
)
def test_a_reused_prediction_is_the_assembled_plans(spec, mesh, extra) -> None:
    """Every ZeRO level, recompute policy, micro-batch count and schedule: the predictor the
    outer planner builds once per mesh predicts what a fresh one built for the option gives
    the assembled plan, every field to the last bit (gradient accumulation, bf16, offload,
    HSDP, parameters kept whole by ZeRO and frozen ones included); and the collectives the
    plan lists sum, on one of its stages, to its predicted communication."""
    extra = dict(extra)
    model, graph = _graph(spec, extra.pop("frozen", ()))
    pp = mesh.get("pp", 1)
    with_zero = extra.get("optimizer_weight_shard_size") is not None
    base = ParallelConfig(
        mode="auto",
        mesh=mesh,
        pipeline_stages=pp,
        hardware="a100-80g",
        optimizer_shard=1 if with_zero else None,
        **extra,
    )
    setup = prepare(graph, base, model=model)
    decisions = sharding_propagation(setup.problem, setup.allowed, setup.configured)
    reused = estimate.MeshEstimate(
        estimate.GraphFacts(graph),
        base,
        setup.mesh,
        setup.problem,
        setup.topology,
        setup.hardware,
        decisions,
    )
    for level, recompute, m, schedule in _variants(pp):
        if with_zero and level is None:
            continue  # HSDP's shard groups need optimizer parallel
        key = (level, recompute, m, schedule)
        cfg = _with(
            base,
            optimizer_shard=level,
            recompute=recompute,
            micro_batches=m,
            schedule=schedule,
            virtual_stages=None,
        )
        plan = assemble_plan(
            graph,
            cfg,
            setup.mesh,
            setup.problem,
            decisions,
            setup.topology,
            setup.hardware,
        )
        found = reused.predict(cfg)
        assert found.predicted == plan.predicted, key
        assert found.stage_compute_s == plan.stage_compute_s, key
        listed = _listed_seconds(plan)
        comm = plan.predicted.communication_s
        assert any(math.isclose(t, comm, rel_tol=1e-12, abs_tol=1e-18) for t in listed), key
        if pp == 1:  # one stage: every listed collective is its
            assert math.isclose(listed[0], comm, rel_tol=1e-12, abs_tol=1e-18), key


class _ScalarWalk(propagation._Walk):
    """Sharding propagation as it was: each candidate priced on its own, term by term."""

    def candidate_cost(self, op: OpNode, index: int) -> tuple[float, float, str]:
        problem, graph = self.problem, self.graph
        strategy = problem.candidates[op.name][index]
        redist, heaviest, heaviest_cost = 0.0, "", -1.0
        for i, ref in enumerate(op.inputs):
            known = self.source_layout(op, i)
            if known is None:
                continue
            keep, bucket = problem.keeps_pending(ref), 0.0
            if keep is not None:  # a gradient kept pending into the producer's parameters
                producer = graph.producer(ref)[0]
                bucket = problem.bucket_seconds(producer, self.decided[producer.name].index)
            c = problem.input_edge_seconds(op, i, strategy, known[0], keep, bucket)
            redist += c
            if c > heaviest_cost:
                heaviest, heaviest_cost = known[1], c
        for k in range(len(op.outputs)):
            ref = op.name if k == 0 else f"{op.name}:{k}"
            out = strategy.outputs[k]
            for consumer, i in graph.consumers(ref):
                if consumer.name not in self.decided:
                    if out.partial:
                        redist += problem.cost.edge_seconds(out, settled(out), None, op.outputs[k])
                    continue
                target = self.strategy(consumer.name)
                grad = gradient_layout(target, i) if problem.needs_grad(ref) else None
                keep = problem.keeps_pending(ref)
                bucket = 0.0 if keep is None else problem.bucket_seconds(op, index)
                c = problem.cost.edge_seconds(
                    out, target.inputs[i], grad, op.outputs[k], keep, bucket
                )
                redist += c
                if c > heaviest_cost:
                    heaviest, heaviest_cost = consumer.name, c
        return redist, problem.op_seconds(op, index), heaviest

    def decide(self, op: OpNode, via: str) -> None:
        indices = self.allowed.get(op.name) or range(len(self.problem.candidates[op.name]))
        scored = []
        for index in indices:
            redist, own, heaviest = self.candidate_cost(op, index)
            scored.append(((redist, own, index), heaviest))
        scored.sort(key=lambda s: s[0])
        (redist, own, index), heaviest = scored[0]
        reason = (
            f"propagated from {heaviest or via}: least redistribution ({redist:.3g} s), then "
            f"least own cost ({own:.3g} s) among {len(scored)} candidates"
        )
        if op.name in self.allowed:
            reason = f"annotated ({len(scored)} strategies fit the annotation); " + reason
        alternatives = tuple((s[0][2], s[0][0] + s[0][1]) for s in scored[1:4])
        self.set(op, Decision(index, reason, redist + own, alternatives))


@pytest.mark.parametrize(("spec", "mode"), [(GPT, "auto"), (LLAMA, "semi_auto"), (BERT, "auto")])
def test_propagation_decides_what_the_scalar_walk_decides(spec, mode, monkeypatch) -> None:
    """Index, reason, cost and alternatives of every op, on a mesh with three axes."""
    model, graph = _graph(spec)
    cfg = ParallelConfig(mode=mode, mesh={"pp": 2, "dp": 2, "tp": 2}, pipeline_stages=2)
    setup = prepare(graph, cfg, model=model)
    fast = sharding_propagation(setup.problem, setup.allowed, setup.configured)
    setup = prepare(graph, cfg, model=model)
    monkeypatch.setattr(propagation, "_Walk", _ScalarWalk)
    slow = sharding_propagation(setup.problem, setup.allowed, setup.configured)
    assert fast == slow


@pytest.mark.parametrize("spec", [GPT, LLAMA, BERT, ModelSpec(kind="cnn", layers=2, hidden=8)])
def test_staged_mesh_candidates_are_the_whole_mesh_ones_that_leave_pp_unused(spec) -> None:
    _, graph = _graph(spec)
    catalogue = default_catalogue()
    for axes in ({"pp": 2, "dp": 4, "tp": 2}, {"dp": 2, "pp": 2, "tp": 4}):
        mesh = MeshSpec.from_dict(axes)
        found = _candidates(graph, mesh)
        for op in graph.ops:
            whole = [c for c in catalogue.strategies(op, mesh) if "pp" not in c.used_axes()]
            assert found[op.name] == whole, op.name


@pytest.mark.parametrize("spec", [GPT, BERT])
def test_recursive_lookaheads_shared_across_roles_decide_as_per_role_ones(spec, monkeypatch):
    """While one op's roles are scored nothing is decided, so their lookaheads share answers
    (when no lookahead from the op can reach MAX_HOPS); each role with its own memo, as the
    search was written, gives the same decisions."""
    model, graph = _graph(spec)
    cfg = ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 4})
    setup = prepare(graph, cfg, model=model)
    shared = recursive_programming(setup.problem, setup.allowed, setup.configured)
    monkeypatch.setattr(recursive._Prices, "short_lookahead", lambda self, root: False)
    setup = prepare(graph, cfg, model=model)
    alone = recursive_programming(setup.problem, setup.allowed, setup.configured)
    assert shared == alone


def test_a_zero_bubble_schedule_weighs_only_stages_that_run() -> None:
    """The runtime runs zero-bubble stages without optimizer parallel, and with tensor
    parallel only as compiled stage programs (``stage_programs`` on; fp32 or mixed
    precision, any recompute): the outer planner weighs nothing else there (with
    ``stage_programs`` off no tp at all; the same model on 1f1b may take both)."""
    _, graph = _graph(GPT)
    base = ParallelConfig(
        mode="auto", devices=8, pipeline_stages=2, micro_batches=4, hardware="a100-80g"
    )
    looped = auto_plan(graph, base)
    assert looped.mesh.as_dict().get("tp", 1) > 1  # what the model prefers where it runs
    for schedule in ("zero_bubble", "zero_bubble_v"):
        for extra, compiled in (
            ({}, True), ({"precision": "bf16"}, True), ({"stage_programs": False}, False)
        ):  # fmt: skip
            cfg = dataclasses.replace(base, schedule=schedule, virtual_stages=None, **extra)
            plan = auto_plan(graph, cfg)
            staged = [o for o in plan.options if o.mesh.get("pp", 1) > 1]
            assert staged, (schedule, extra)
            assert all(o.optimizer_shard is None for o in staged)
            with_tp = [o for o in staged if o.mesh.get("tp", 1) > 1]
            assert bool(with_tp) == compiled, (schedule, extra)
            assert plan.optimizer_shard is None
