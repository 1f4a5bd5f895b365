"""The outer planner of ``mode="auto"``: mesh shape, ZeRO level, recompute, micro-batches.

It weighs every option a user could pin, and takes the fastest that fits the memory limit
(``memory_limit``, default the profile's device memory; when none fits, the smallest):

- meshes ``pp x dp x tp``: every pipeline degree that divides the devices (3, 5, 35 as well
  as powers of two; no more stages than repeated layers), every tensor-parallel degree that
  divides a node's devices (at most :data:`MAX_TP`), data parallel over the rest where the
  global batch divides over it (:func:`mesh_candidates`); and, without stages, ``dp x tpx x
  tp``: model parallel over more than a node as two axes, ``tp`` inside the node and ``tpx``
  across nodes (2-D tensor parallel, :func:`_two_model_axes`);
- per mesh, every micro-batch count the pipeline runs (each divisor of the per-replica batch,
  at least ``pp`` but under GPipe, whole rounds under the interleaved schedules; 1 without
  stages), every recompute policy (none, selective, full: "auto" is one of them) and ZeRO
  level (off, 1, 2, 3).

What the user fixes stays fixed: ``mesh`` (only strategies inside it are searched),
``pipeline_stages`` other than 1, ``micro_batches`` other than 1, ``optimizer_shard``, and
``recompute`` other than "none". Only options that run are weighed: with a zero-bubble
schedule the pipeline's stages hold no optimizer parallel, and tensor parallel only where
they run as compiled stage programs (``stage_programs`` on: docs/pipeline.md). The plan
keeps the options it weighed (``Plan.options``) and notes why the winner won.

What it costs (docs/benchmarks.md, "Planning at scale"): each mesh is searched once; its
options are predicted (step time and memory) from the mesh's shared work by
:class:`~plait.planning.estimate.MeshEstimate`, and only the winner is assembled, with the same
predictor (its prediction is the plan's). Lower bounds skip what cannot be the winner or the
runner-up, each compared with the runner-up's step time found so far (so the winner and the
runner-up are those weighing everything gives; a note counts what was skipped):

1. a mesh, before its search (:func:`_presearch_bounds`): its busiest stage computes at least
   ``1 / pp`` of every op and the lightest bottleneck of any partition into ``pp`` stages,
   each op cut over all the stage's devices, plus the fixed costs its micro-batches pay
   again, and the pipeline bubble of that (:func:`_bound`);
2. a micro-batch count of a searched mesh, before its predictor is built
   (:func:`_searched_bounds`): the busiest stage computes at least the lightest bottleneck any
   partition of the chosen strategies' ops has, and the bubble of that;
3. an option, before its memory walk: its step time alone
   (:meth:`~plait.planning.estimate.MeshEstimate.step_time_s`), the same float the prediction
   gives. Meshes are searched in the order of their bound, so the runner-up comes early.

And one lower bound on memory skips what cannot fit and cannot win for memory either
(:meth:`_Fits.outgrown_by`): an option, before its step time and memory walk, whose floor
(:meth:`~plait.planning.estimate.MeshEstimate.memory_floor`: the most model states any of its
stages holds after the step, parameters, gradients and optimizer states by its ZeRO level,
which every stage's peak counts at its optimizer step) is over the limit, when an option that
fits was found before (only those are ranked then), or, none fitting so far, when two options
found before need less than that floor (when none fits the smallest wins, the next smallest
is the runner-up). With nothing fitting no step-time bound prunes (the 1T GPT on 3,072
devices in fp32 weighs half its options instead of all 1,824).

Where the time went: :class:`~plait.planning.timing.PlanTiming`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from plait import support
from plait.config import ParallelConfig
from plait.cost.compute import optimizer_seconds
from plait.errors import ConfigError, PlaitError
from plait.graph import OpGraph, OpNode
from plait.planning.assemble import assemble_plan
from plait.planning.copies import runs_copies
from plait.planning.estimate import PP_AXIS, GraphFacts, MeshEstimate, work_pieces
from plait.planning.records import Plan, PlanOption
from plait.planning.report import fmt_bytes, fmt_seconds
from plait.planning.setup import SearchSetup, compute_model, hardware_of, mesh_of, prepare
from plait.planning.timeline import SPLIT_BACKWARD
from plait.planning.timing import PlanTiming
from plait.search import Decision, get_searcher
from plait.search.problem import OpCompute
from plait.search.stages import allowed_cuts
from plait.support import Where

__all__ = ["auto_plan", "mesh_candidates"]

MAX_TP = 8  # tensor parallel beyond one node's NVLink domain rarely pays (Megatron, 2021)
LEVELS: tuple[int | None, ...] = (None, 1, 2, 3)
RECOMPUTES = ("none", "selective", "full")
KEPT_OPTIONS = 12


@dataclass(frozen=True)
class _Variant:
    optimizer_shard: int | None
    recompute: str
    micro_batches: int


def _divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of ``n`` (at most ``limit``), ascending."""
    top = n if limit is None else min(n, limit)
    return [d for d in range(1, top + 1) if n % d == 0]


def mesh_candidates(
    devices: int, cfg: ParallelConfig, graph: OpGraph, devices_per_node: int
) -> list[dict[str, int]]:
    """Mesh factorisations ``{pp, dp, tp}`` worth trying (axes of size 1 left out): every
    pipeline degree that divides the devices (no more stages than repeated layers), every
    tensor-parallel degree that divides a node (at most :data:`MAX_TP`), the rest data
    parallel, when the global batch divides over it and a micro-batch count runs."""
    batch = _global_batch(graph)
    layers = max((len(g.members) for g in graph.layers), default=1)
    stages = [cfg.pipeline_stages] if cfg.pipeline_stages != 1 else _divisors(devices, layers)
    found: list[dict[str, int]] = []
    for pp in stages:
        for tp in _divisors(devices_per_node, MAX_TP):
            if devices % (pp * tp):
                continue
            if pp > 1 and _refused_stages(cfg, pp, tp):
                continue  # stages the runtime would refuse (plait.support's table)
            dp = devices // (pp * tp)
            if batch % dp:
                continue
            if dp % (cfg.optimizer_weight_shard_size or 1):
                continue  # HSDP's shard groups must cut the dp axis evenly
            if not _micro_batch_counts(cfg, pp, batch // dp):
                continue  # fewer rows per replica than the schedule needs micro-batches
            mesh = {"pp": pp, cfg.dp_axis: dp, "tp": tp}
            found.append({k: v for k, v in mesh.items() if v > 1 or k == cfg.dp_axis})
    if 1 in stages:
        found += _two_model_axes(devices, cfg, batch, devices_per_node)
    if not found:
        raise ConfigError(
            f"no mesh of {devices} devices fits: the global batch {batch} must divide over the "
            "data-parallel axis; use a batch that is a multiple of the devices, or give mesh={...}"
        )
    return found


TPX = "tpx"
"""The outer of the two model axes of 2-D tensor parallel meshes (``dp x tpx x tp``): ``tp``
inside a node, ``tpx`` across nodes."""


def _two_model_axes(
    devices: int, cfg: ParallelConfig, batch: int, devices_per_node: int
) -> list[dict[str, int]]:
    """Meshes ``dp x tpx x tp`` whose model axes span more than a node, without stages: ``tp``
    the whole node's tensor-parallel degree (:data:`MAX_TP` at most), ``tpx`` 2 to
    :data:`MAX_TP` nodes' worth, the rest data parallel. One model axis that large crosses
    nodes in every collective; two let the search reduce inside the node first and across
    nodes on the piece left (and split a weight's two dims one axis each: MindSpore's 2-D
    tensor parallel), which the cost model weighs against ``pp x dp x tp``."""
    tp = max(_divisors(devices_per_node, MAX_TP))
    found: list[dict[str, int]] = []
    if tp < 2 or devices % tp:
        return found
    for tpx in _divisors(devices // tp, MAX_TP):
        dp = devices // (tp * tpx)
        if tpx < 2 or batch % dp or dp % (cfg.optimizer_weight_shard_size or 1):
            continue
        found.append({cfg.dp_axis: dp, TPX: tpx, "tp": tp})
    return found


def _micro_batch_counts(cfg: ParallelConfig, pp: int, replica_batch: int) -> list[int]:
    """Every micro-batch count a user could give on ``pp`` stages: 1 without stages
    (parallelize refuses micro-batches there), the user's when given, else each divisor of
    the per-replica batch the schedule runs (at least ``pp`` except under GPipe, as the
    pipeline checks; whole rounds under the interleaved schedules, as the timeline needs)."""
    if pp == 1:
        return [1]
    if cfg.micro_batches != 1:
        return [cfg.micro_batches]
    least = 1 if cfg.schedule == "gpipe" else pp
    rounds = cfg.schedule in ("interleaved_1f1b", "zero_bubble")
    return [
        m for m in _divisors(replica_batch) if m >= least and not (rounds and m % max(1, m // pp))
    ]


def _counts_on(cfg: ParallelConfig, pp: int, replica_batch: int) -> list[int]:
    """:func:`_micro_batch_counts`, or one micro-batch on a mesh the user gave whose replicas
    have fewer rows than the schedule needs micro-batches (the free mesh leaves it out; the
    pipeline names the rule when it is run)."""
    return _micro_batch_counts(cfg, pp, replica_batch) or [1]


def _refused_stages(cfg: ParallelConfig, pp: int, tp: int) -> bool:
    """Whether ``parallelize`` would refuse ``cfg``'s plan on ``pp`` stages with ``tp``
    inside them (a zero-bubble schedule with tp on stages that do not compile, say)."""
    staged = dataclasses.replace(cfg, mesh=None, devices=None, pipeline_stages=pp)
    inner = ("tp",) if tp > 1 else ()
    return support.refusal(staged, Where("pipeline", inner, planned=True)) is not None


def _splits_backward(cfg: ParallelConfig, pp: int) -> bool:
    """A zero-bubble schedule over ``pp > 1`` stages: its separate weight-gradient passes run
    without optimizer parallel (plait.support's ``zero_bubble_zero`` rule), so no ZeRO level
    is weighed there."""
    return pp > 1 and cfg.schedule in SPLIT_BACKWARD


def _global_batch(graph: OpGraph) -> int:
    for g in graph.inputs:
        if g.kind == "input" and g.meta.ndim:
            return g.meta.shape[0]
    return 1


def _variants(cfg: ParallelConfig, pp: int, replica_batch: int) -> list[_Variant]:
    """Every setting a user could give on a mesh of ``pp`` stages (what they fixed stays
    fixed): each micro-batch count (:func:`_micro_batch_counts`), each recompute policy,
    each ZeRO level that runs there."""
    if cfg.optimizer_shard is not None:
        levels: tuple[int | None, ...] = (cfg.optimizer_shard,)
    else:  # optimizer parallel in zero-bubble stages does not run
        levels = (None,) if _splits_backward(cfg, pp) else LEVELS
    recomputes = RECOMPUTES if cfg.recompute in ("none", "auto") else (cfg.recompute,)
    return [
        _Variant(level, recompute, m)
        for m in _counts_on(cfg, pp, replica_batch)
        for recompute in recomputes
        for level in levels
    ]


@dataclass
class _Trial:
    """One option weighed: its record, the config it was weighed under, its mesh's search."""

    option: PlanOption
    cfg: ParallelConfig | None = None  # None: the mesh was skipped (no search)
    search: int = -1  # index into the searched meshes
    plan: Plan | None = None  # when assembled


@dataclass
class _Searched:
    """One mesh's search, and every setting weighed on it."""

    mesh: dict[str, int]
    setup: SearchSetup
    decisions: dict[str, Decision]
    variants: list[tuple[_Variant, ParallelConfig]]
    estimate: MeshEstimate | None = None


@dataclass
class _Pruned:
    """What the bounds kept from being weighed: meshes not searched (each with its bound),
    options of searched meshes not predicted, and the least of their bounds."""

    meshes: list[tuple[dict[str, int], float]] = dataclasses.field(default_factory=list)
    options: int = 0
    option_bound: float = math.inf
    # options of the meshes searched not predicted for their memory floor, the least floor
    too_big: int = 0
    memory_bound: int | None = None

    def memory(self, floor: int) -> None:
        self.too_big += 1
        self.memory_bound = floor if self.memory_bound is None else min(self.memory_bound, floor)


class _Fits:
    """Step times of the options that fit so far, fastest first; the runner-up's is the
    threshold a bound must beat (pruning against it keeps the winner and the runner-up).
    Also the two smallest memories of every option weighed so far, for the options that
    cannot fit (:meth:`outgrown_by`)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.memories: list[int] = []

    def copy(self) -> _Fits:
        out = _Fits()
        out.times, out.memories = list(self.times), list(self.memories)
        return out

    def add(self, step: float) -> None:
        bisect.insort(self.times, step)

    def weighed(self, memory: int) -> None:
        """An option weighed (fitting or not) needs ``memory``."""
        bisect.insort(self.memories, memory)
        del self.memories[2:]  # the runner-up's memory is all the rule reads

    def beaten_by(self, bound: float) -> bool:
        """Whether no option with this lower bound can be the winner or the runner-up."""
        return len(self.times) >= 2 and bound > self.times[1] * (1 + 1e-9)

    def outgrown_by(self, floor: int, limit: int) -> bool:
        """Whether no option needing at least ``floor`` bytes can be the winner or the
        runner-up: it cannot fit the limit, and either some option fits (only those are
        ranked) or, none fitting so far, two options need less (when none fits, the options
        are ranked by memory, the smallest first)."""
        if floor <= limit:
            return False
        return bool(self.times) or (len(self.memories) >= 2 and floor > self.memories[1])


def auto_plan(
    graph: OpGraph,
    cfg: ParallelConfig,
    *,
    model: nn.Module | None = None,
    hardware_file: str | None = None,
    runnable_only: bool = False,
    timing: PlanTiming | None = None,
    exhaustive: bool = False,
    prune: bool = True,
) -> Plan:
    """The fastest plan that fits, over meshes and settings (module doc).

    ``runnable_only``: no pipeline stages (what ``parallelize`` runs today). ``timing``, when
    given, receives the seconds per phase and the option counts. ``exhaustive`` assembles
    every option in full instead of predicting it from its mesh's shared work (the same
    choice, slower; for tests and benchmarks). ``prune``: a mesh or option whose lower bound
    (module doc) is slower than the runner-up found so far is not searched or not predicted,
    nor is an option whose memory floor rules it out (:meth:`_Fits.outgrown_by`); the
    winner and the runner-up stay the same, ``Plan.options`` lists only options
    predicted and a note names what was not.
    """
    timing = timing if timing is not None else PlanTiming()
    searcher = get_searcher(cfg.search or "sharding_propagation")
    hardware = hardware_of(cfg, hardware_file)
    # ParallelConfig parsed a memory_limit given as text ("80GiB") to bytes
    limit = cast("int | None", cfg.memory_limit) or hardware.memory_bytes
    model_name = type(model).__name__ if model is not None else ""
    facts = GraphFacts(graph)
    op_compute = compute_model(hardware, cfg.precision)
    classes = _OpClasses(graph, op_compute)
    most_update = _most_update(facts, hardware)
    meshes = []
    for mesh in _meshes(cfg, graph, hardware.devices_per_node, runnable_only):
        pp = mesh.get("pp", 1)
        base = _with(
            cfg,
            mesh=mesh,
            pipeline_stages=pp,
            devices=None,
            micro_batches=cfg.micro_batches if pp > 1 else 1,
        )
        replica_batch = _global_batch(graph) // mesh.get(cfg.dp_axis, 1)
        variants = [
            (v, _with(base, optimizer_shard=v.optimizer_shard, recompute=v.recompute,
                      micro_batches=v.micro_batches))
            for v in _variants(cfg, pp, replica_batch)
        ]  # fmt: skip
        bounds, order = _presearch_bounds(classes, variants, most_update)
        meshes.append((mesh, base, variants, bounds, order))
    # the most promising meshes first: the runner-up is found early, and more are pruned
    meshes.sort(key=lambda t: t[4])
    searched: list[_Searched] = []
    trials: list[_Trial] = []
    errors: list[PlaitError] = []
    pruned = _Pruned()
    fits = _Fits()
    timing.meshes += len(meshes)
    for mesh, base, variants, bounds, _ in meshes:
        least = min(bounds.values())
        if prune and fits.beaten_by(least):
            pruned.meshes.append((mesh, least))
            timing.pruned += 1
            continue
        try:
            with timing.phase("candidates"):
                setup = prepare(graph, base, model=model, hardware=hardware)
        except PlaitError as e:  # e.g. an annotation that does not fit this mesh
            errors.append(e)
            option = PlanOption(mesh, 1, None, "none", 0.0, 0, False, f"skipped: {e}")
            trials.append(_Trial(option))
            continue
        with timing.phase("search"):
            decisions = searcher(setup.problem, setup.allowed, setup.configured)
        timing.searched += 1
        searched.append(_Searched(mesh, setup, decisions, variants))
        if exhaustive:
            found = _assemble_all(len(searched) - 1, searched, limit, timing, graph, model_name)
        else:
            done = searched[-1]
            with timing.phase("estimate"):
                after = _searched_bounds(graph, setup, decisions, variants, classes, most_update)
                least = min(after.values())
                if prune and fits.beaten_by(least):  # no predictor needed: none is as fast
                    pruned.options += len(variants)
                    pruned.option_bound = min(pruned.option_bound, least)
                    continue
                # at the most promising micro-batch count: it weighs in the stage partition
                at_m = _with(base, micro_batches=min(after, key=lambda m: after[m]))
                done.estimate = MeshEstimate(
                    facts, at_m, setup.mesh, setup.problem, setup.topology, setup.hardware,
                    decisions,
                )  # fmt: skip
                found = _weigh(done, len(searched) - 1, limit, timing, fits, pruned, prune,
                               after)  # fmt: skip
        for t in found:
            if t.option.feasible:
                fits.add(t.option.step_time_s)
            fits.weighed(t.option.memory_bytes)
        trials += found
    if len(errors) == len(meshes):
        raise errors[0]  # no mesh works: the first mesh's error says why
    best, ranked, real, feasible = _rank(trials)
    if best.plan is None:
        assert best.cfg is not None
        with timing.phase("assemble"):
            best.plan = _assemble(graph, best.cfg, searched[best.search], model_name)
        timing.assembled += 1
    plan = _winner(best, ranked, real, feasible, limit, cfg)
    notes = _pruned_notes(pruned)
    if notes:  # before the note on why the winner won, which stays last
        plan = dataclasses.replace(plan, notes=(*plan.notes[:-1], *notes, plan.notes[-1]))
    return plan


def _first_per_count(
    variants: Sequence[tuple[_Variant, ParallelConfig]],
) -> dict[int, ParallelConfig]:
    """One config per micro-batch count (the bounds read only the count and the mesh)."""
    out: dict[int, ParallelConfig] = {}
    for v, vcfg in variants:
        out.setdefault(v.micro_batches, vcfg)
    return out


class _OpClasses:
    """The graph's ops grouped by what their compute price reads (target, shapes, FLOPs and
    bytes): a repeated layer's ops are priced once per group, not once per layer, so the
    bounds over every mesh and micro-batch count cost little."""

    def __init__(self, graph: OpGraph, op_compute: OpCompute) -> None:
        self.op_compute = op_compute
        groups: dict[tuple[object, ...], list[OpNode]] = {}
        for op in graph.ops:
            key = (op.target, op.flops, op.bytes, op.input_metas, op.outputs)
            groups.setdefault(key, []).append(op)
        self.groups = [(ops[0], len(ops)) for ops in groups.values()]
        self.key_of = {op.name: n for n, ops in enumerate(groups.values()) for op in ops}
        # the stage partitioner's blocks (runs of ops between the cuts it may make)
        starts = set(allowed_cuts(graph))
        self.block_of: list[int] = []
        block = 0
        for n in range(len(graph.ops)):
            block += n in starts
            self.block_of.append(block)
        self.blocks = block + 1
        self.group_of = [self.key_of[op.name] for op in graph.ops]

    def lightest_bottleneck(self, op_seconds: Sequence[float], stages: int) -> float:
        """At most the busiest stage's seconds of any partition of the ops (``op_seconds``,
        in graph order) into ``stages`` (:func:`lightest_bottleneck` over the blocks)."""
        times = [0.0] * self.blocks
        for b, t in zip(self.block_of, op_seconds, strict=True):
            times[b] += t
        return lightest_bottleneck(times, stages)

    def floor(self, pieces: int, stages: int) -> float:
        """At most the busiest stage's compute of any partition into ``stages`` with every op
        cut into ``pieces`` (an op's roofline time only falls as its pieces grow)."""
        priced = [self.op_compute(op, pieces) for op, _ in self.groups]
        return self.lightest_bottleneck([priced[g] for g in self.group_of], stages)

    def compute(self, pieces: int) -> float:
        """Every op's forward and backward, each cut into ``pieces``."""
        return sum(self.op_compute(op, pieces) * n for op, n in self.groups)

    def again(self, pieces: Sequence[tuple[int, int, int]], m: int) -> float:
        """What ``m`` micro-batches add (:func:`micro_batch_seconds`, summed over stages):
        ``pieces`` lists (group, pieces, how many ops of the group are cut so)."""
        if m == 1:
            return 0.0
        f = self.op_compute
        total = 0.0
        for g, p, n in pieces:
            op = self.groups[g][0]
            total += max(0.0, m * f(op, p * m) - f(op, p)) * n
        return total


def lightest_bottleneck(times: Sequence[float], stages: int) -> float:
    """A lower bound, within a relative ``1e-9``, of the busiest stage's time of the lightest
    partition of the blocks ``times`` (in order) into ``stages`` contiguous non-empty stages,
    the partitioner's objective (:func:`~plait.search.stages.balanced_cuts`, memory aside):
    bisection on the bottleneck, each probe packing blocks greedily (a stage takes blocks
    while it stays within the probe; fewer stages than ``stages`` can be split further)."""
    if stages <= 1 or len(times) <= 1:
        return float(sum(times))
    low = max(max(times), sum(times) / stages)
    high = float(sum(times))

    def fits(bottleneck: float) -> bool:
        used, acc = 1, 0.0
        for t in times:
            if acc + t > bottleneck:
                used, acc = used + 1, t
                if used > stages:
                    return False
            else:
                acc += t
        return True

    if fits(low):
        return low
    while high - low > high * 1e-9:  # low never fits: the lightest is above it
        mid = (low + high) / 2
        if fits(mid):
            high = mid
        else:
            low = mid
    return low


def _most_update(facts: GraphFacts, hardware: Any) -> float:
    """More than any device's optimizer step takes: every trainable parameter, whole."""
    trainable = [g for g in facts.parameters if g.requires_grad]
    return optimizer_seconds(len(trainable), float(sum(g.meta.numel for g in trainable)), hardware)


def _bound(cfg: ParallelConfig, busiest: float, most_update: float) -> float:
    """A step's lower bound from one on its busiest stage's compute (``busiest``).

    The step is the busiest stage's ``X = compute + communication - hidden + update`` plus
    the bubble, ``X >= busiest`` (what hides is communication). With GPipe, 1F1B and the
    interleaved 1F1B the bubble is ``(pp - 1) / (v m)`` of that stage's compute and
    communication, at least ``X - update`` (:func:`schedule_bubble`); the zero-bubble
    schedules get no bubble in the bound."""
    pp, m = cfg.pipeline_stages, cfg.micro_batches
    if pp == 1 or cfg.schedule not in ("gpipe", "1f1b", "interleaved_1f1b"):
        return busiest
    v = (cfg.virtual_stages or 1) if cfg.schedule == "interleaved_1f1b" else 1
    return busiest + (pp - 1) / (v * m) * max(0.0, busiest - most_update)


def _presearch_bounds(
    classes: _OpClasses, variants: Sequence[tuple[_Variant, ParallelConfig]], most_update: float
) -> tuple[dict[int, float], float]:
    """Per micro-batch count, no option of the variants' mesh predicts a faster step; and
    the least of those bounds without the bottleneck (every stage as busy as the average),
    the order meshes are searched in (it puts the deep pipelines that fit early).

    Its busiest stage computes at least ``1 / pp`` of every op, and at least the lightest
    bottleneck of any partition into ``pp`` stages, each op at best cut over all the stage's
    devices (an op's roofline time only falls as its pieces grow), plus ``1 / pp`` of the
    fixed costs micro-batches pay again, each op at worst whole (what an op pays again only
    grows as its pieces do: :func:`~plait.planning.estimate.micro_batch_seconds`); then
    :func:`_bound`.
    """
    first = variants[0][1]
    pp, ga = first.pipeline_stages, first.grad_accumulation
    pieces = math.prod(n for a, n in first.mesh_dict.items() if a != PP_AXIS)
    total = classes.compute(pieces) * ga
    floor = classes.floor(pieces, pp) * ga if pp > 1 else 0.0
    whole = [(g, 1, n) for g, (_, n) in enumerate(classes.groups)]
    spread = {  # every stage as busy as the average
        m: (total + classes.again(whole, m) * ga) / pp for m in _first_per_count(variants)
    }
    return (
        {
            m: _bound(vcfg, max(floor, spread[m]), most_update)
            for m, vcfg in _first_per_count(variants).items()
        },
        min(_bound(vcfg, spread[m], most_update) for m, vcfg in _first_per_count(variants).items()),
    )


def _searched_bounds(
    graph: OpGraph,
    setup: SearchSetup,
    decisions: Mapping[str, Decision],
    variants: Sequence[tuple[_Variant, ParallelConfig]],
    classes: _OpClasses,
    most_update: float,
) -> dict[int, float]:
    """Per micro-batch count, no option of the searched mesh predicts a faster step: the
    busiest stage computes at least the lightest bottleneck any partition of the chosen
    strategies' ops into its stages has, memory aside (the partitioner prefers a partition
    within the memory limit, never a faster one), and at least ``1 / pp`` of every
    op's time with what the micro-batches pay again (recompute only adds); then
    :func:`_bound`. Read from the search alone, before the mesh's predictor is built."""
    op_compute, candidates = setup.problem.cost.op_compute, setup.problem.candidates
    priced: dict[tuple[int, int], float] = {}  # per op group and pieces: its time
    counted: dict[tuple[int, int], int] = {}  # and how many ops
    seconds: list[float] = []  # per op, in graph order
    for op in graph.ops:
        key = (
            classes.key_of[op.name],
            work_pieces(setup.mesh, candidates[op.name][decisions[op.name].index]),
        )
        found = priced.get(key)
        if found is None:
            found = priced[key] = op_compute(op, key[1])
        seconds.append(found)
        counted[key] = counted.get(key, 0) + 1
    first = variants[0][1]
    pp, ga = first.pipeline_stages, first.grad_accumulation
    floor, total = classes.lightest_bottleneck(seconds, pp) * ga, sum(seconds) * ga
    cut = [(g, p, n) for (g, p), n in counted.items()]
    return {
        m: _bound(vcfg, max(floor, (total + classes.again(cut, m) * ga) / pp), most_update)
        for m, vcfg in _first_per_count(variants).items()
    }


def _weigh(
    done: _Searched,
    k: int,
    limit: int,
    timing: PlanTiming,
    fits: _Fits,
    pruned: _Pruned,
    prune: bool,
    bounds: Mapping[int, float],
) -> list[_Trial]:
    """Mesh ``k``'s options predicted by its :class:`MeshEstimate`, in the variants' order.

    With ``prune``, micro-batch counts go from the lowest bound up; a count whose bound is
    above the runner-up found so far is not weighed (nor the counts after it), and an
    option whose step time alone is above it is not walked for memory; nor is one whose
    memory floor (:meth:`MeshEstimate.memory_floor`, before its step time) rules it out
    (:meth:`_Fits.outgrown_by`). Options found here join ``fits`` as they are found."""
    est = done.estimate
    assert est is not None
    by_count: dict[int, list[int]] = {}
    for i, (v, _) in enumerate(done.variants):
        by_count.setdefault(v.micro_batches, []).append(i)
    found: dict[int, _Trial] = {}
    local = fits.copy()  # this mesh's options, beside those found before it
    counts = sorted(by_count, key=lambda m: bounds[m])
    floors: dict[int, int] = {}
    for n, m in enumerate(counts):
        if prune and local.beaten_by(bounds[m]):  # and so is every count after it
            pruned.options += sum(len(by_count[c]) for c in counts[n:])
            pruned.option_bound = min(pruned.option_bound, bounds[m])
            break
        left = []
        for i in by_count[m]:
            if prune:  # its model states alone, before its step time
                floors[i] = est.memory_floor(done.variants[i][1])
                if local.outgrown_by(floors[i], limit):
                    pruned.memory(floors[i])
                    continue
            left.append(i)
        timed = sorted(
            ((est.step_time_s(done.variants[i][1]), i) for i in left), key=lambda t: t[0]
        )
        for step, i in timed:
            if prune and local.beaten_by(step):
                pruned.options += 1
                pruned.option_bound = min(pruned.option_bound, step)
                continue
            if prune and local.outgrown_by(floors[i], limit):  # smaller ones found since
                pruned.memory(floors[i])
                continue
            variant, vcfg = done.variants[i]
            estimate = est.predict(vcfg)
            timing.reused += 1
            timing.options += 1
            option = _option(
                done.mesh, variant, estimate.step_time_s, estimate.memory_bytes, limit, vcfg.copies
            )
            found[i] = _Trial(option, vcfg, k)
            if option.feasible:
                local.add(option.step_time_s)
            local.weighed(option.memory_bytes)
    return [found[i] for i in sorted(found)]


def _pruned_notes(pruned: _Pruned) -> list[str]:
    notes = []
    if pruned.meshes:
        ms = pruned.meshes
        names = ", ".join(" x ".join(f"{k}={v}" for k, v in m.items()) for m, _ in ms)
        least = min(b for _, b in ms)
        notes.append(
            f"{len(ms)} mesh{'es' if len(ms) > 1 else ''} not searched ({names}): no "
            f"option of {'theirs' if len(ms) > 1 else 'its'} could be faster "
            f"than {fmt_seconds(least)} (the busiest stage's compute, each op cut over all "
            "its devices and whole layers a stage, and the pipeline bubble of that), slower "
            "than the runner-up found "
            f"before {'them' if len(ms) > 1 else 'it'}"
        )
    if pruned.options:
        notes.append(
            f"{pruned.options} option{'s' if pruned.options > 1 else ''} of the meshes searched "
            f"not predicted in full: none could be faster than {fmt_seconds(pruned.option_bound)} "
            "(a bound on its micro-batch count's step, or its step time before memory), "
            "slower than the runner-up found before"
        )
    if pruned.too_big and pruned.memory_bound is not None:
        n = pruned.too_big
        notes.append(
            f"{n} option{'s' if n > 1 else ''} of the meshes searched not predicted in full "
            f"for memory: {'each needs' if n > 1 else 'it needs'} at least "
            f"{fmt_bytes(pruned.memory_bound)} of model states on its fullest stage (parameters, "
            "gradients and optimizer states by its ZeRO level): more than the limit, with an "
            "option that fits found before, or, none fitting, than the runner-up's memory"
        )
    return notes


def _meshes(
    cfg: ParallelConfig, graph: OpGraph, devices_per_node: int, runnable_only: bool
) -> list[dict[str, int]]:
    if cfg.mesh is not None:
        return [mesh_of(cfg).as_dict()]
    if cfg.devices is None:
        mesh_of(cfg)  # raises the clear "needs the number of devices" error
    meshes = mesh_candidates(cfg.devices, cfg, graph, devices_per_node)  # type: ignore[arg-type]
    if runnable_only:
        meshes = [m for m in meshes if m.get("pp", 1) == 1]
    if cfg.copies > 1:  # copies run without stages, beside an axis other than dp
        meshes = [m for m in meshes if runs_copies(cfg, m)]
        if not meshes:
            raise ConfigError(
                f"interleave_num={cfg.copies} on {cfg.devices} devices: no mesh runs copies "
                "(each needs an axis besides data parallel and no pipeline stages); leave "
                "interleave_num out or give more devices"
            )
    return meshes


def _assemble_all(
    k: int,
    searched: Sequence[_Searched],
    limit: int,
    timing: PlanTiming,
    graph: OpGraph,
    model_name: str,
) -> list[_Trial]:
    """Mesh ``k``'s options, each assembled in full (``exhaustive``)."""
    done = searched[k]
    out: list[_Trial] = []
    for variant, vcfg in done.variants:
        with timing.phase("assemble"):
            plan = _assemble(graph, vcfg, done, model_name)
        timing.assembled += 1
        timing.options += 1
        step, memory = plan.predicted.step_time_s, plan.predicted.memory_bytes
        option = _option(done.mesh, variant, step, memory, limit, vcfg.copies)
        out.append(_Trial(option, vcfg, k, plan))
    return out


def _assemble(graph: OpGraph, cfg: ParallelConfig, done: _Searched, model_name: str) -> Plan:
    setup = done.setup
    return assemble_plan(
        graph,
        cfg,
        setup.mesh,
        setup.problem,
        done.decisions,
        setup.topology,
        setup.hardware,
        model_name,
        estimate=done.estimate,  # None when every option is assembled (exhaustive)
    )


def _option(
    mesh: dict[str, int], variant: _Variant, step: float, memory: int, limit: int, copies: int
) -> PlanOption:
    fits = memory <= limit
    note = "" if fits else f"needs {fmt_bytes(memory)} > {fmt_bytes(limit)}"
    return PlanOption(
        mesh,
        variant.micro_batches,
        variant.optimizer_shard,
        variant.recompute,
        step,
        memory,
        fits,
        note,
        copies,
    )


def _with(cfg: ParallelConfig, **changes: object) -> ParallelConfig:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    fields.update(changes)
    return ParallelConfig(**fields)


def _rank(
    trials: Sequence[_Trial],
) -> tuple[_Trial, list[_Trial], list[_Trial], bool]:
    """(the winner, the pool ranked, every option weighed, whether any fits)."""
    real = [t for t in trials if t.cfg is not None]
    if not real:
        raise ConfigError(
            "no mesh could be planned: " + "; ".join(t.option.note for t in trials[:4])
        )
    feasible = [t for t in real if t.option.feasible]
    pool = feasible or real
    key = (
        (lambda t: (t.option.step_time_s, t.option.memory_bytes))
        if feasible
        else (lambda t: (t.option.memory_bytes, t.option.step_time_s))
    )
    ranked = sorted(pool, key=key)
    return ranked[0], ranked, real, bool(feasible)


def _winner(
    best: _Trial,
    ranked: Sequence[_Trial],
    real: Sequence[_Trial],
    feasible: bool,
    limit: int,
    cfg: ParallelConfig,
) -> Plan:
    """The winner's plan, with the options weighed and why it won."""
    plan = best.plan
    assert plan is not None
    option = best.option
    others = sorted(
        (t.option for t in real if t is not best), key=lambda o: (not o.feasible, o.step_time_s)
    )
    options = (option, *others[: KEPT_OPTIONS - 1])
    runner_up = ranked[1].option if len(ranked) > 1 else None
    notes = [
        _why(option, runner_up, limit, feasible, len(real), len(ranked))
        + ("" if feasible else _advice(cfg))
    ]
    return dataclasses.replace(plan, options=options, notes=(*plan.notes, *notes))


def _advice(cfg: ParallelConfig) -> str:
    """What the user fixed that the escalation could not change, and offload, as ways out."""
    ways = []
    if cfg.optimizer_shard not in (None, 3):
        ways.append("optimizer_shard=3")
    if cfg.recompute not in ("none", "auto", "full"):
        ways.append("recompute='full'")
    if cfg.micro_batches > 1:
        ways.append(f"fewer micro-batches in flight than micro_batches={cfg.micro_batches}")
    if cfg.offload is None:
        ways.append("offload='optimizer' or 'activations' (host memory)")
    return f"; also possible: {', '.join(ways)}" if ways else ""


def _describe(o: PlanOption) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in o.mesh.items())
    if TPX in o.mesh:
        mesh += f" (model parallel over two axes: {TPX} across nodes, tp inside one)"
    zero = "off" if o.optimizer_shard is None else str(o.optimizer_shard)
    copies = f", {o.interleave_num} copies interleaved" if o.interleave_num > 1 else ""
    return (
        f"mesh {mesh}, micro-batches {o.micro_batches}, optimizer shard {zero}, "
        f"recompute {o.recompute}{copies}"
    )


def _why(
    best: PlanOption,
    runner_up: PlanOption | None,
    limit: int,
    feasible: bool,
    weighed: int,
    fit: int,
) -> str:
    head = (
        f"auto chose {_describe(best)}: predicted {fmt_seconds(best.step_time_s)} per step, "
        f"{fmt_bytes(best.memory_bytes)} per device (limit {fmt_bytes(limit)}), the fastest of "
        f"{fit} options that fit ({weighed} weighed)"
        if feasible
        else f"no option fits {fmt_bytes(limit)} per device; auto chose the smallest, {_describe(best)} "
        f"({fmt_bytes(best.memory_bytes)}): add devices, use a bigger memory_limit or a smaller batch"
    )
    if runner_up is None:
        return head
    gap = runner_up.step_time_s / best.step_time_s - 1 if best.step_time_s else 0.0
    return (
        head
        + f"; next best: {_describe(runner_up)}, {fmt_seconds(runner_up.step_time_s)} ({gap:+.0%})"
    )
