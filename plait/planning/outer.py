"""The outer planner of ``mode="auto"``: mesh shape, ZeRO level, recompute, micro-batches.

For every mesh factorisation ``pp x dp x tp`` of the devices (tensor parallel within a node,
pipeline stages no more than the repeated layers), the inner searcher chooses op strategies
once; then, in order of rising cost, the settings are escalated until the plan fits the
memory limit (``memory_limit``, default the profile's device memory):

    ZeRO off -> 1 -> 2 -> 3, then recompute selective -> full (at ZeRO 3)

and the fastest feasible plan wins. With pipeline stages, the micro-batch count is the
largest of ``pp``, ``2 pp``, ``4 pp`` that divides the per-replica batch (a smaller bubble).
What the user fixes stays fixed: ``mesh`` (only strategies inside it are searched),
``pipeline_stages`` other than 1, ``micro_batches`` other than 1, ``optimizer_shard``, and
``recompute`` other than "none". The plan keeps every option it weighed (``Plan.options``) and
notes why the winner won. Only options that run are weighed: with a zero-bubble schedule the
pipeline's stages hold no optimizer parallel, and tensor parallel only where they run as
compiled stage programs (``stage_programs`` on: docs/pipeline.md), so the
other meshes and levels are left out.

What it costs (docs/benchmarks.md, "Planning at scale"): each mesh is searched once; its
options are predicted (step time and memory) from the mesh's shared work by
:class:`~plait.planning.estimate.MeshEstimate`, and only the winner is assembled, with the same
predictor (its prediction is the plan's). A mesh whose lower bound (:func:`_lower_bound`)
is slower than the runner-up found so far is not searched (a note names it). Where the time
went: :class:`~plait.planning.timing.PlanTiming`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from torch import nn

from plait import support
from plait.config import ParallelConfig
from plait.errors import ConfigError, PlaitError
from plait.graph import OpGraph
from plait.planning.assemble import assemble_plan
from plait.planning.estimate import (
    PP_AXIS,
    GraphFacts,
    MeshEstimate,
    micro_batch_seconds,
    schedule_bubble,
)
from plait.planning.records import Plan, PlanOption
from plait.planning.report import fmt_bytes, fmt_seconds
from plait.planning.setup import SearchSetup, compute_model, hardware_of, mesh_of, prepare
from plait.planning.timeline import SPLIT_BACKWARD
from plait.planning.timing import PlanTiming
from plait.search import Decision, get_searcher
from plait.search.problem import OpCompute
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


def _powers_of_two_up_to(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def mesh_candidates(
    devices: int, cfg: ParallelConfig, graph: OpGraph, devices_per_node: int
) -> list[dict[str, int]]:
    """Mesh factorisations ``{pp, dp, tp}`` worth trying (axes of size 1 left out)."""
    batch = _global_batch(graph)
    layers = max((len(g.members) for g in graph.layers), default=1)
    stages = (
        [cfg.pipeline_stages]
        if cfg.pipeline_stages != 1
        else [p for p in range(1, layers + 1) if devices % p == 0 and (p & (p - 1) == 0)]
    )
    found: list[dict[str, int]] = []
    for pp in stages:
        for tp in _powers_of_two_up_to(min(MAX_TP, devices_per_node)):
            if devices % (pp * tp):
                continue
            if pp > 1 and _refused_stages(cfg, pp, tp):
                continue  # stages the runtime would refuse (plait.support's table)
            dp = devices // (pp * tp)
            if batch % dp:
                continue
            if dp % (cfg.optimizer_weight_shard_size or 1):
                continue  # HSDP's shard groups must cut the dp axis evenly
            mesh = {"pp": pp, cfg.dp_axis: dp, "tp": tp}
            found.append({k: v for k, v in mesh.items() if v > 1 or k == cfg.dp_axis})
    if not found:
        raise ConfigError(
            f"no mesh of {devices} devices fits: the global batch {batch} must divide over the "
            "data-parallel axis; use a batch that is a multiple of the devices, or give mesh={...}"
        )
    return found


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


def _variants(cfg: ParallelConfig, pp: int, replica_batch: int) -> Iterator[_Variant]:
    """Settings in order of rising cost (escalation order), those that run on a mesh of
    ``pp`` stages."""
    if pp == 1:
        m = 1  # micro-batches run only between stages (parallelize refuses them without)
    elif cfg.micro_batches != 1:
        m = cfg.micro_batches
    else:
        m = max((k * pp for k in (1, 2, 4) if replica_batch % (k * pp) == 0), default=1)
    if cfg.optimizer_shard is not None:
        levels: tuple[int | None, ...] = (cfg.optimizer_shard,)
    else:  # optimizer parallel in zero-bubble stages does not run
        levels = (None,) if _splits_backward(cfg, pp) else LEVELS
    recomputes = RECOMPUTES if cfg.recompute in ("none", "auto") else (cfg.recompute,)
    for recompute in recomputes:
        for level in levels if recompute == "none" else levels[-1:]:
            yield _Variant(level, recompute, m)


@dataclass
class _Trial:
    """One option weighed: its record, the config it was weighed under, its mesh's search."""

    option: PlanOption
    cfg: ParallelConfig | None = None  # None: the mesh was skipped (no search)
    search: int = -1  # index into the searched meshes
    plan: Plan | None = None  # when assembled


@dataclass
class _Searched:
    """One mesh's search, and its settings in escalation order."""

    mesh: dict[str, int]
    setup: SearchSetup
    decisions: dict[str, Decision]
    variants: list[tuple[_Variant, ParallelConfig]]
    estimate: MeshEstimate | None = None


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
    choice, slower; for tests and benchmarks). ``prune``: a mesh whose lower bound
    (:func:`_lower_bound`) is slower than the runner-up found so far is not searched; the
    winner and the runner-up stay the same, ``Plan.options`` lists only meshes searched and a
    note names the others.
    """
    timing = timing if timing is not None else PlanTiming()
    searcher = get_searcher(cfg.search or "sharding_propagation")
    hardware = hardware_of(cfg, hardware_file)
    # ParallelConfig parsed a memory_limit given as text ("80GiB") to bytes
    limit = cast("int | None", cfg.memory_limit) or hardware.memory_bytes
    meshes = _meshes(cfg, graph, hardware.devices_per_node, runnable_only)
    model_name = type(model).__name__ if model is not None else ""
    facts = GraphFacts(graph)
    op_compute = compute_model(hardware, cfg.precision)
    searched: list[_Searched] = []
    trials: list[_Trial] = []
    errors: list[PlaitError] = []
    pruned: list[tuple[dict[str, int], float, float]] = []  # mesh, its bound, the runner-up
    fits: list[float] = []  # step times of the options that fit, fastest first
    timing.meshes += len(meshes)
    for mesh in meshes:
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
        if prune and len(fits) >= 2:
            bound = _lower_bound(graph, variants[0][1], op_compute)
            if bound > fits[1] * (1 + 1e-9):
                pruned.append((mesh, bound, fits[1]))
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
            found = _escalate(len(searched) - 1, searched, limit, timing, graph, model_name)
        else:
            done = searched[-1]
            with timing.phase("estimate"):
                # at the options' micro-batch count: it weighs in the stage partition
                at_m = _with(base, micro_batches=variants[0][1].micro_batches)
                done.estimate = MeshEstimate(
                    facts, at_m, setup.mesh, setup.problem, setup.topology, setup.hardware,
                    decisions,
                )  # fmt: skip
                found = _escalate(len(searched) - 1, searched, limit, timing)
        trials += found
        fits = sorted(fits + [t.option.step_time_s for t in found if t.option.feasible])
    if len(errors) == len(meshes):
        raise errors[0]  # no mesh works: the first mesh's error says why
    best, ranked, real, feasible = _rank(trials)
    if best.plan is None:
        assert best.cfg is not None
        with timing.phase("assemble"):
            best.plan = _assemble(graph, best.cfg, searched[best.search], model_name)
        timing.assembled += 1
    plan = _winner(best, ranked, real, feasible, limit, cfg)
    if pruned:  # before the note on why the winner won, which stays last
        notes = (*plan.notes[:-1], _pruned_note(pruned), plan.notes[-1])
        plan = dataclasses.replace(plan, notes=notes)
    return plan


def _lower_bound(graph: OpGraph, cfg: ParallelConfig, op_compute: OpCompute) -> float:
    """No option of ``cfg``'s mesh (at its micro-batch count) predicts a faster step.

    Its busiest stage computes at least ``1 / pp`` of every op, each op at best cut over all
    the stage's devices (an op's roofline time only falls as its pieces grow), plus ``1 / pp``
    of the fixed costs micro-batches pay again, each op at worst whole (what an op pays again
    only grows as its pieces do: :func:`~plait.planning.estimate.micro_batch_seconds`);
    communication adds to that; and with 1F1B or GPipe the bubble grows with the stage's
    time, so it is at least the bubble of that much compute alone (:func:`schedule_bubble`).
    Other schedules get no bubble in the bound.
    """
    pp = cfg.pipeline_stages
    pieces = math.prod(n for a, n in cfg.mesh_dict.items() if a != PP_AXIS)
    total = sum(op_compute(op, pieces) for op in graph.ops) * cfg.grad_accumulation
    whole = {op.name: 1 for op in graph.ops}
    one_stage = dict.fromkeys(whole, 0)
    again = micro_batch_seconds(graph, one_stage, whole, op_compute, cfg, 1)[0]
    compute = (total + again) / pp
    if pp > 1 and cfg.schedule in ("1f1b", "gpipe"):
        return compute + schedule_bubble(cfg, compute, 0.0, 0.0)
    return compute


def _pruned_note(pruned: Sequence[tuple[dict[str, int], float, float]]) -> str:
    meshes = ", ".join(" x ".join(f"{k}={v}" for k, v in m.items()) for m, _, _ in pruned)
    least = min(b for _, b, _ in pruned)
    return (
        f"{len(pruned)} mesh{'es' if len(pruned) > 1 else ''} not searched ({meshes}): no "
        f"option of {'theirs' if len(pruned) > 1 else 'its'} could be faster "
        f"than {fmt_seconds(least)} (the busiest stage's compute with every op cut over all "
        "its devices, and the pipeline bubble of that), slower than the runner-up found "
        f"before {'them' if len(pruned) > 1 else 'it'}"
    )


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
    return meshes


def _escalate(
    k: int,
    searched: Sequence[_Searched],
    limit: int,
    timing: PlanTiming,
    graph: OpGraph | None = None,
    model_name: str = "",
) -> list[_Trial]:
    """Mesh ``k``'s settings in escalation order, up to the first that fits.

    With ``graph`` every option is assembled in full; without, predicted by the mesh's
    :class:`MeshEstimate`.
    """
    done = searched[k]
    out: list[_Trial] = []
    for variant, vcfg in done.variants:
        plan = None
        if graph is not None:
            with timing.phase("assemble"):
                plan = _assemble(graph, vcfg, done, model_name)
            timing.assembled += 1
            step, memory = plan.predicted.step_time_s, plan.predicted.memory_bytes
        else:
            assert done.estimate is not None
            found = done.estimate.predict(vcfg)
            timing.reused += 1
            step, memory = found.step_time_s, found.memory_bytes
        timing.options += 1
        out.append(_Trial(_option(done.mesh, variant, step, memory, limit), vcfg, k, plan))
        if out[-1].option.feasible:
            break
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
    mesh: dict[str, int], variant: _Variant, step: float, memory: int, limit: int
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
        _why(option, runner_up, limit, feasible, len(real)) + ("" if feasible else _advice(cfg))
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
    zero = "off" if o.optimizer_shard is None else str(o.optimizer_shard)
    return f"mesh {mesh}, micro-batches {o.micro_batches}, optimizer shard {zero}, recompute {o.recompute}"


def _why(
    best: PlanOption, runner_up: PlanOption | None, limit: int, feasible: bool, weighed: int
) -> str:
    head = (
        f"auto chose {_describe(best)}: predicted {fmt_seconds(best.step_time_s)} per step, "
        f"{fmt_bytes(best.memory_bytes)} per device (limit {fmt_bytes(limit)}), the fastest of "
        f"{weighed} options that fit"
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
