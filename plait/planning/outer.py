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
notes why the winner won.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from plait.config import ParallelConfig
from plait.errors import ConfigError, PlaitError
from plait.graph import OpGraph
from plait.planning.assemble import assemble_plan
from plait.planning.records import Plan, PlanOption
from plait.planning.report import fmt_bytes, fmt_seconds
from plait.planning.setup import hardware_of, mesh_of, prepare
from plait.search import get_searcher

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
            dp = devices // (pp * tp)
            if batch % dp:
                continue
            mesh = {"pp": pp, cfg.dp_axis: dp, "tp": tp}
            found.append({k: v for k, v in mesh.items() if v > 1 or k == cfg.dp_axis})
    if not found:
        raise ConfigError(
            f"no mesh of {devices} devices fits: the global batch {batch} must divide over the "
            "data-parallel axis; use a batch that is a multiple of the devices, or give mesh={...}"
        )
    return found


def _global_batch(graph: OpGraph) -> int:
    for g in graph.inputs:
        if g.kind == "input" and g.meta.ndim:
            return g.meta.shape[0]
    return 1


def _variants(cfg: ParallelConfig, pp: int, replica_batch: int) -> Iterator[_Variant]:
    """Settings in order of rising cost (escalation order)."""
    if cfg.micro_batches != 1 or pp == 1:
        m = cfg.micro_batches
    else:
        m = max((k * pp for k in (1, 2, 4) if replica_batch % (k * pp) == 0), default=1)
    levels = LEVELS if cfg.optimizer_shard is None else (cfg.optimizer_shard,)
    recomputes = RECOMPUTES if cfg.recompute in ("none", "auto") else (cfg.recompute,)
    for recompute in recomputes:
        for level in levels if recompute == "none" else levels[-1:]:
            yield _Variant(level, recompute, m)


def auto_plan(
    graph: OpGraph,
    cfg: ParallelConfig,
    *,
    model: nn.Module | None = None,
    hardware_file: str | None = None,
    runnable_only: bool = False,
) -> Plan:
    """The fastest plan that fits, over meshes and settings (module doc).

    ``runnable_only``: no pipeline stages (what ``parallelize`` runs today).
    """
    searcher = get_searcher(cfg.search or "sharding_propagation")
    hardware = hardware_of(cfg, hardware_file)
    limit = cfg.memory_limit or hardware.memory_bytes
    if cfg.mesh is not None:
        meshes = [mesh_of(cfg).as_dict()]
    else:
        if cfg.devices is None:
            mesh_of(cfg)  # raises the clear "needs the number of devices" error
        meshes = mesh_candidates(cfg.devices, cfg, graph, hardware.devices_per_node)
        if runnable_only:
            meshes = [m for m in meshes if m.get("pp", 1) == 1]
    model_name = type(model).__name__ if model is not None else ""
    trials: list[tuple[Plan | None, PlanOption]] = []
    errors: list[PlaitError] = []
    for mesh in meshes:
        pp = mesh.get("pp", 1)
        base = _with(cfg, mesh=mesh, pipeline_stages=pp, devices=None)
        try:
            setup = prepare(graph, base, model=model, hardware_file=hardware_file)
        except PlaitError as e:  # e.g. an annotation that does not fit this mesh
            errors.append(e)
            trials.append((None, PlanOption(mesh, 1, None, "none", 0.0, 0, False, f"skipped: {e}")))
            continue
        decisions = searcher(setup.problem, setup.allowed, setup.configured)
        replica_batch = _global_batch(graph) // mesh.get(cfg.dp_axis, 1)
        variants = list(_variants(cfg, pp, replica_batch))
        for variant in variants:
            vcfg = _with(
                base,
                optimizer_shard=variant.optimizer_shard,
                recompute=variant.recompute,
                micro_batches=variant.micro_batches,
            )
            plan = assemble_plan(
                graph,
                vcfg,
                setup.mesh,
                setup.problem,
                decisions,
                setup.topology,
                setup.hardware,
                model_name,
            )
            fits = plan.predicted.memory_bytes <= limit
            note = (
                ""
                if fits
                else f"needs {fmt_bytes(plan.predicted.memory_bytes)} > {fmt_bytes(limit)}"
            )
            option = PlanOption(
                mesh,
                variant.micro_batches,
                variant.optimizer_shard,
                variant.recompute,
                plan.predicted.step_time_s,
                plan.predicted.memory_bytes,
                fits,
                note,
            )
            trials.append((plan, option))
            if fits:
                break
    if len(errors) == len(meshes):
        raise errors[0]  # no mesh works: the first mesh's error says why
    return _winner(trials, limit, cfg)


def _with(cfg: ParallelConfig, **changes: object) -> ParallelConfig:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    fields.update(changes)
    return ParallelConfig(**fields)


def _winner(
    trials: Sequence[tuple[Plan | None, PlanOption]], limit: int, cfg: ParallelConfig
) -> Plan:
    real = [(p, o) for p, o in trials if p is not None]
    if not real:
        raise ConfigError("no mesh could be planned: " + "; ".join(o.note for _, o in trials[:4]))
    feasible = [(p, o) for p, o in real if o.feasible]
    pool = feasible or real
    key = (
        (lambda t: (t[1].step_time_s, t[1].memory_bytes))
        if feasible
        else (lambda t: (t[1].memory_bytes, t[1].step_time_s))
    )
    ranked = sorted(pool, key=key)
    best_plan, best = ranked[0]
    others = sorted(
        (o for _, o in real if o is not best), key=lambda o: (not o.feasible, o.step_time_s)
    )
    options = (best, *others[: KEPT_OPTIONS - 1])
    notes = [
        _why(best, ranked[1][1] if len(ranked) > 1 else None, limit, bool(feasible), len(real))
        + ("" if feasible else _advice(cfg))
    ]
    return dataclasses.replace(best_plan, options=options, notes=(*best_plan.notes, *notes))


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
