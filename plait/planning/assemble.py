"""From the searcher's choices to a :class:`~plait.planning.Plan`: collectives, stages, predictions.

Given one strategy per op, this module writes down what a training step does and costs:

- every redistribution on every edge (forward), and of every gradient going back (backward);
- each trainable parameter's gradient reduction over the axes that split its op's work but
  not the parameter (MindSpore's mirror operators), as reduce-scatter plus parameter
  all-gathers when ``optimizer_shard`` shards over the data-parallel axis (ZeRO levels 1 to 3).
  Over the data-parallel axis (no ZeRO, or level 1) the all-reduces are fused into the buckets
  the runtime forms (``ParallelConfig.comm_fusion``, :func:`plait.fusion.plan_buckets`): one
  all-reduce per bucket. Frozen parameters (``requires_grad=False``) have no gradient: no
  reduction, no backward redistribution, no gradient or optimizer memory;
- with ``pipeline_stages > 1``, contiguous stages balanced by compute (cut at repeated-layer
  boundaries when the model has them) and the activations and gradients sent between stages
  once per micro-batch;
- the predicted step: the busiest stage's compute and communication, plus the pipeline bubble
  of the schedule (:func:`~plait.planning.timeline.bubble_seconds`: ``(stages - 1) /
  micro_batches`` of it for GPipe and 1F1B, divided by the virtual stages when interleaved,
  less the weight-gradient passes that fill it under zero bubble); the peak memory per device
  (the stage with the highest), from a walk through one step of what the per-rank program
  holds (plait.cost.memory.StepTrace, docs/memory.md), with the model states it holds after
  the step by kind and the rest alive at the peak as activations.

Communication overlaps compute where the runtime lets it: data-parallel gradient reductions
beside backward, ZeRO-3 gathers prefetched (:mod:`plait.planning.overlap`, at the hardware's
``comm_overlap``); ``Prediction.overlapped_s`` is what hides, the rest adds to the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from plait.config import CommFusion, ParallelConfig
from plait.cost.comm import Topology
from plait.cost.compute import optimizer_seconds
from plait.cost.memory import (
    GradBucket,
    PeakMemory,
    StageActivations,
    StageBuffers,
    StateBytes,
    StepTrace,
    stage_states,
    step_peak,
)
from plait.fusion import plan_buckets
from plait.graph import GraphInput, OpGraph, OpNode
from plait.layout import TensorLayout, optimizer_shard_dim, shard_group_size, why_whole
from plait.layout.redistribute import LOCAL_KINDS, plan_redistribution
from plait.mesh import MeshSpec
from plait.planning.overlap import (
    GATHER_BACKWARD,
    GATHER_FORWARD,
    P2P,
    REDUCE,
    Overlappable,
    StageClock,
)
from plait.planning.records import (
    Alternative,
    Plan,
    PlannedCollective,
    PlannedOp,
    PlannedParameter,
    Prediction,
)
from plait.planning.timeline import BACKWARD_FLOPS_FACTOR, bubble_seconds, in_flight_micro_batches
from plait.rules import default_catalogue
from plait.rules.loss import divides_by_target_count
from plait.rules.registry import OpStrategy, grad_reduce_axes
from plait.search.problem import (
    OpCompute,
    SearchProblem,
    gradient_layout,
    kept_gradient,
    settled,
)
from plait.search.propagation import Decision
from plait.search.stages import StageMemory, assign_stages, op_memory, stage_memory_figures

__all__ = ["BACKWARD_FLOPS_FACTOR", "assemble_plan"]

PP_AXIS = "pp"
LOW_PRECISION_ACTIVATIONS = {"bf16": 0.5, "fp16": 0.5, "fp32": 1.0}


@dataclass
class _Step:
    """The collectives of one step, each attributed to the pipeline stage that issues it."""

    topology: Topology
    repeat: int = 1  # micro-steps (gradient accumulation) the collectives being added repeat in
    items: list[PlannedCollective] = field(default_factory=list)
    stage: list[int] = field(default_factory=list)
    moved: set[tuple[str, TensorLayout]] = field(default_factory=set)  # forward fan-out
    reduced: set[tuple[str, TensorLayout]] = field(default_factory=set)  # backward fan-out
    overlappable: list[tuple[int, Overlappable]] = field(default_factory=list)
    """(stage, item) of the collectives that may run beside compute (plait.planning.overlap)."""

    def redistribute(
        self,
        src: TensorLayout,
        dst: TensorLayout,
        shape: Sequence[int],
        itemsize: int,
        where: tuple[str, str, int],
        reason: str,
    ) -> None:
        if src == dst:
            return
        for step in plan_redistribution(src, dst, tuple(shape), itemsize).steps:
            if step.kind not in LOCAL_KINDS:
                self.add(step.kind, (step.axis,), step.nbytes, where, reason)

    def add(
        self,
        kind: str,
        axes: tuple[str, ...],
        nbytes: int,
        where: tuple[str, str, int],
        reason: str,
        count: int = 1,
        *,
        group: tuple[int, int] | None = None,
        overlap: tuple[str, tuple[str, ...]] | None = None,
    ) -> None:
        """``group``: (size, stride) of a group smaller than the one ``axes`` spans (HSDP's
        shard groups and the groups across them: :meth:`Topology.subgroup_seconds`).
        ``overlap``: (role, bucket members) of a collective that may run beside compute."""
        phase, op, stage = where
        if group is None:
            seconds = sum(self.topology.axis_seconds(kind, a, nbytes) for a in axes)
        else:
            size, stride = group
            seconds = sum(
                self.topology.subgroup_seconds(kind, a, nbytes, size=size, stride=stride)
                for a in axes
            )
        count *= self.repeat
        if self.repeat > 1:
            reason += f" (each of {self.repeat} micro-steps)"
        self.items.append(
            PlannedCollective(
                kind, axes, nbytes, seconds, count, phase, op, reason,
                None if group is None else group[0],
            )
        )  # fmt: skip
        self.stage.append(stage)
        if overlap is not None:
            role, members = overlap
            self.overlappable.append((stage, Overlappable(role, members, seconds * count)))

    def seconds_of_stage(self, stage: int, phase: str | None = None) -> float:
        """Seconds of the collectives ``stage`` issues per step (of one ``phase``, or all)."""
        return sum(
            c.seconds * c.count
            for c, s in zip(self.items, self.stage, strict=True)
            if s == stage and phase in (None, c.phase)
        )


@dataclass(frozen=True)
class _Context:
    graph: OpGraph
    cfg: ParallelConfig
    mesh: MeshSpec
    problem: SearchProblem
    chosen: Mapping[str, OpStrategy]
    stage_of: Mapping[str, int]
    kept: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Op -> axes its output's gradient stays pending over into its parameters (reduced with
    them: :func:`plait.search.problem.pending_values`); filled by :func:`_op_collectives`."""


def assemble_plan(
    graph: OpGraph,
    cfg: ParallelConfig,
    mesh: MeshSpec,
    problem: SearchProblem,
    decisions: Mapping[str, Decision],
    topology: Topology,
    hardware: Any,
    model_name: str = "",
) -> Plan:
    """The Plan of ``decisions`` (one candidate index per op) under ``cfg`` on ``mesh``."""
    chosen = {op.name: problem.candidates[op.name][decisions[op.name].index] for op in graph.ops}
    op_time = {op.name: _op_compute(problem, mesh, op, chosen[op.name]) for op in graph.ops}
    stages = cfg.pipeline_stages
    stage_list = [0] * len(graph.ops)
    if stages > 1:
        memory = partition_memory(StepTrace(graph), [chosen[op.name] for op in graph.ops],
                                  lambda t: math.prod(t.splits()), cfg, hardware)  # fmt: skip
        stage_list = assign_stages(graph, op_time, stages, memory)
    stage_of = {op.name: s for op, s in zip(graph.ops, stage_list, strict=True)}
    ctx = _Context(graph, cfg, mesh, problem, chosen, stage_of)
    # With gradient accumulation the graph is one micro-step's: its activation collectives
    # repeat per micro-step; the gradient reductions (after the last) and the reported loss's
    # reduction (of the micro-steps' sum) happen once.
    step = _Step(topology, repeat=cfg.grad_accumulation)
    param_layouts: dict[str, tuple[TensorLayout, str, OpStrategy, int]] = {}
    for op in graph.ops:
        _op_collectives(ctx, op, step, param_layouts)
    step.repeat = 1
    parameters = _parameters(ctx, param_layouts, step)
    _loss_collective(ctx, step)
    if stages > 1:
        _pipeline_transfers(ctx, step)
    predicted, stage_compute = _predict(ctx, op_time, step, param_layouts, hardware)
    return Plan(
        mesh=mesh,
        mode=cfg.mode,
        search=cfg.search or "sharding_propagation",
        hardware=hardware.name,
        precision=cfg.precision,
        micro_batches=cfg.micro_batches,
        pipeline_stages=stages,
        schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages or 1,
        stage_compute_s=tuple(stage_compute) if stages > 1 else (),
        optimizer_shard=cfg.optimizer_shard,
        optimizer_weight_shard_size=_weight_shard_size(cfg, mesh),
        recompute=cfg.recompute,
        recompute_regions=recompute_regions(graph, cfg),
        offload=cfg.offload,
        ops=tuple(_planned_op(ctx, op, decisions[op.name], ctx.kept) for op in graph.ops),
        parameters=parameters,
        collectives=tuple(step.items),
        predicted=predicted,
        stages=_stage_names(graph, stage_list, stages),
        model=model_name,
        batch=tuple(g.meta.shape for g in graph.inputs if g.kind == "input"),
        memory_limit=cast("int | None", cfg.memory_limit),  # ParallelConfig parsed text to bytes
        grad_accumulation=cfg.grad_accumulation,
        dp_axis=cfg.dp_axis,
        dataset_strategy=cfg.dataset_strategy,
        comm_fusion=cfg.comm_fusion,
    )


def partition_memory(
    trace: StepTrace,
    chosen: Sequence[OpStrategy],
    pieces: Callable[[TensorLayout], int],
    cfg: ParallelConfig,
    hardware: Any,
) -> StageMemory:
    """The stage partitioner's memory figures (:func:`plait.search.stages.op_memory`) under
    ``cfg``'s schedule, against the memory limit the outer planner holds plans to (the
    profile's device memory when ``memory_limit`` is unset). Shared by
    :mod:`plait.planning.estimate`, so both cut the same stages."""
    figures = op_memory(
        trace, chosen, pieces, cfg.precision, LOW_PRECISION_ACTIVATIONS[cfg.precision]
    )
    limit = cast("int | None", cfg.memory_limit) or getattr(hardware, "memory_bytes", None)
    return stage_memory_figures(figures, cfg, limit)


def _op_compute(problem: SearchProblem, mesh: MeshSpec, op: OpNode, strategy: OpStrategy) -> float:
    return problem.cost.op_compute(op, work_pieces(mesh, strategy))


def work_pieces(mesh: MeshSpec, strategy: OpStrategy) -> int:
    """Pieces ``strategy`` cuts its op's work into: the sizes of the mesh axes it uses."""
    return math.prod(mesh.axis_size(a) for a in strategy.used_axes())


def micro_batch_seconds(
    graph: OpGraph,
    stage_of: Mapping[str, int],
    pieces: Mapping[str, int],
    op_compute: OpCompute,
    cfg: ParallelConfig,
    stages: int,
) -> list[float]:
    """Per stage, what running the batch as ``cfg.micro_batches`` micro-batches one after
    another adds to its compute: each op runs once per micro-batch on a ``1 / m`` share, paying
    its fixed costs (the kernel floor, the host's per-op cost) ``m`` times; its FLOP- or
    byte-bound time is unchanged. ``m x op_compute(op, pieces x m) - op_compute(op, pieces)``
    per op (the search's price of its forward and backward), per micro-step. One function for
    the plan, the outer planner's estimate and its lower bound."""
    extra = [0.0] * stages
    m = cfg.micro_batches
    if m == 1:
        return extra
    for op in graph.ops:
        p = pieces[op.name]
        again = m * op_compute(op, p * m) - op_compute(op, p)
        extra[stage_of[op.name]] += max(0.0, again) * cfg.grad_accumulation
    return extra


def _stage_names(
    graph: OpGraph, stage_list: Sequence[int], stages: int
) -> tuple[tuple[str, ...], ...]:
    if stages == 1:
        return ()
    names: list[list[str]] = [[] for _ in range(stages)]
    for op, s in zip(graph.ops, stage_list, strict=True):
        names[s].append(op.name)
    return tuple(tuple(n) for n in names)


def _planned_op(
    ctx: _Context, op: OpNode, decision: Decision, kept: Mapping[str, tuple[str, ...]]
) -> PlannedOp:
    strategy = ctx.chosen[op.name]
    covered = default_catalogue().covers(op)
    candidates = ctx.problem.candidates[op.name]
    return PlannedOp(
        name=op.name,
        target=op.target,
        module_path=op.module_path,
        strategy=strategy.cuts(),
        inputs=strategy.inputs,
        outputs=strategy.outputs,
        label=strategy.label,
        covered=covered,
        reason=decision.reason if covered else "no rule in the catalogue: replicated",
        layer=op.layer,
        pending_grad=kept.get(op.name, ()),
        alternatives=tuple(
            Alternative(candidates[i].label, candidates[i].cuts(), c)
            for i, c in decision.alternatives
        ),
    )


def _op_collectives(
    ctx: _Context,
    op: OpNode,
    step: _Step,
    param_layouts: dict[str, tuple[TensorLayout, str, OpStrategy, int]],
) -> None:
    """Redistributions feeding ``op`` (forward) and its input gradients (backward)."""
    graph, strategy, stage = ctx.graph, ctx.chosen[op.name], ctx.stage_of[op.name]
    for i, ref in enumerate(op.inputs):
        source = graph.graph_input(ref)
        need = strategy.inputs[i]
        meta = op.input_metas[i]
        if source is not None and source.kind == "parameter":
            if ref not in param_layouts:
                param_layouts[ref] = (need, op.name, strategy, i)
                # The Job reduces the parameter's gradient once (_parameters); a later reader
                # (a tied head) handing back the same pending sum is summed into it first.
                step.reduced.add((ref, gradient_layout(strategy, i)))
                continue
            have = param_layouts[ref][0]
            what = f"parameter {source.target} (laid out {have.describe()} for {param_layouts[ref][1]})"
        elif source is not None and source.kind == "input":
            have = ctx.problem.input_layouts[ref]
            what = f"batch tensor {source.target}"
        elif source is not None:
            continue  # buffers and constants are replicated and read locally
        else:
            node, k = graph.producer(ref)
            assert isinstance(node, OpNode)
            have = ctx.chosen[node.name].outputs[k]
            what = f"output of {node.name}"
        # A value several ops need in one layout is moved once and shared (forward fan-out).
        if (ref, need) not in step.moved:
            step.moved.add((ref, need))
            reason = f"{op.name} needs {what} as {need.describe()}; it is {have.describe()}"
            where = ("forward", op.name, stage)
            step.redistribute(have, need, meta.shape, meta.itemsize, where, reason)
        if ctx.problem.needs_grad(ref):
            grad, back = gradient_layout(strategy, i), settled(have)
            keep = ctx.problem.keeps_pending(ref)
            kept = kept_gradient(grad, have, keep)
            if keep is not None and kept is not None:
                # reduced with the producer's parameter gradients, in the fused buckets
                ctx.kept[graph.producer(ref)[0].name] = (keep,)  # type: ignore[union-attr]
                grad = kept
            # Readers handing back the same pending sum are summed by autograd, then reduced
            # once (q, k and v reading one layer norm: one all-reduce, not three).
            if (ref, grad) in step.reduced:
                continue
            step.reduced.add((ref, grad))
            step.redistribute(
                grad,
                back,
                meta.shape,
                meta.itemsize,
                ("backward", op.name, stage),
                f"gradient of {what} for {op.name}: {grad.describe()} -> {back.describe()}",
            )
    if divides_by_target_count(op.target, strategy.outputs[0]):
        # The mean divides by the global count of targets not ignored, which differs between
        # ranks: one float64 scalar all-reduce per axis splitting the batch (the executor's
        # _run_mean_class_loss).
        for axis in sorted({a for d in strategy.inputs[0].dims for a in d}):
            step.add(
                "all_reduce",
                (axis,),
                8,
                ("forward", op.name, stage),
                f"{op.name}: count of the targets the mean divides by, over a batch split on "
                f"{axis!r}",
            )


def _parameters(
    ctx: _Context,
    param_layouts: Mapping[str, tuple[TensorLayout, str, OpStrategy, int]],
    step: _Step,
) -> tuple[PlannedParameter, ...]:
    """Every parameter's layout, and its gradient reduction (fused, ZeRO-aware over dp)."""
    planned: list[PlannedParameter] = []
    fused = _fused_dp(ctx)
    for g in ctx.graph.inputs:
        if g.kind != "parameter":
            continue
        if g.name not in param_layouts:  # read by no op: stays whole, has no gradient
            layout = TensorLayout.replicated(ctx.mesh, g.meta.ndim)
            planned.append(
                PlannedParameter(
                    g.target,
                    g.meta.shape,
                    g.meta.dtype,
                    layout,
                    (),
                    "",
                    "not read by the forward pass: replicated",
                )
            )
            continue
        layout, op, strategy, i = param_layouts[g.name]
        why = f"layout of input {i} of {op} ({strategy.label or 'strategy'} {strategy.cuts()!r})"
        if not g.requires_grad:
            planned.append(
                PlannedParameter(
                    g.target,
                    g.meta.shape,
                    g.meta.dtype,
                    layout,
                    (),
                    op,
                    f"{why}; frozen (requires_grad=False): no gradient to reduce",
                )
            )
            continue
        axes = _grad_axes(ctx, op, strategy, i)
        kept = [a for a in axes if a not in grad_reduce_axes(strategy, i)]
        if kept:  # its reader's output gradient came back pending: so does its own
            why += f"; its gradient stays pending over {', '.join(kept)} from {op}'s output"
        nbytes = _local_bytes(g, layout)
        stage = ctx.stage_of[op]
        for axis in axes:
            if fused and axes == (ctx.cfg.dp_axis,):
                continue  # in a bucket (_fused_reductions)
            # GradSync reduces a gradient pending over dp and another axis by itself
            several = fused and ctx.cfg.dp_axis in axes and len(axes) > 1
            alone = " (reduced alone: pending over several axes)" if several else ""
            _gradient_reduction(step, g.target, op, axis, nbytes, stage, note=alone)
        zero_dim, whole = _optimizer_shard(ctx, g, layout, axes)
        planned.append(
            PlannedParameter(
                g.target, g.meta.shape, g.meta.dtype, layout, axes, op, why + whole, zero_dim
            )
        )
    if fused:
        _fused_reductions(ctx, step, planned)
    return tuple(planned)


def recompute_regions(graph: OpGraph, cfg: ParallelConfig) -> tuple[tuple[str, str], ...]:
    """The modules whose forward backward recomputes, with the policy of each.

    ``cfg.recompute`` covers every repeated layer the capture found (``OpNode.layer``: the
    transformer blocks); a model without repeated layers has its top-level modules instead.
    ``cfg.recompute_modules`` (``plait.recompute``) adds or overrides single modules.
    """
    out: dict[str, str] = {}
    if cfg.recompute in ("full", "selective"):
        layers = [op.layer for op in graph.ops if op.layer]
        if not layers:  # no repeated layers: each top-level module is a region
            layers = [op.module_path.split(".")[0] for op in graph.ops if op.module_path]
        for path in layers:
            out.setdefault(path, cfg.recompute)
    # ParallelConfig holds a mapping given to it as sorted (path, mode) pairs
    for path, mode in cast("tuple[tuple[str, str], ...]", cfg.recompute_modules):
        out[path] = mode
    return tuple(out.items())


def _local_bytes(g: GraphInput, layout: TensorLayout) -> int:
    """Bytes of one device's piece of parameter ``g`` laid out as ``layout``."""
    return g.meta.nbytes // math.prod(layout.splits())


def _fused_dp(ctx: _Context) -> bool:
    """Are dp gradient reductions fused into buckets (the runtime's GradSync/PlainGradSync,
    and optimizer parallel's bucketed reduce-scatters and all-gathers)?

    They are when the mesh has a data-parallel axis of size > 1.
    """
    dp = ctx.cfg.dp_axis
    return dp in ctx.mesh.axis_names and ctx.mesh.axis_size(dp) > 1


def _optimizer_shard(
    ctx: _Context, g: GraphInput, layout: TensorLayout, axes: tuple[str, ...]
) -> tuple[int | None, str]:
    """(the dim optimizer parallel splits, or None; why it stays whole, for the reason)."""
    cfg = ctx.cfg
    if cfg.optimizer_shard is None:
        return None, ""
    if g.target in cfg.optimizer_shard_exclude:
        return None, "; optimizer shard: whole (excluded: optimizer_shard_exclude)"
    if axes != (cfg.dp_axis,):
        return (
            None,
            f"; optimizer shard: whole (its gradient is not a sum over {cfg.dp_axis!r} alone)",
        )
    k = _weight_shard_size(cfg, ctx.mesh)
    kw: dict[str, Any] = {
        "itemsize": g.meta.itemsize,
        "threshold": int(cfg.optimizer_shard_threshold),
        "shard_size": k,
    }
    dim = optimizer_shard_dim(layout, g.meta.shape, cfg.dp_axis, **kw)
    if dim is None:
        return (
            None,
            f"; optimizer shard: whole ({why_whole(layout, g.meta.shape, cfg.dp_axis, **kw)})",
        )
    where = f"groups of {k} ranks of {cfg.dp_axis!r}" if k else repr(cfg.dp_axis)
    return dim, f"; optimizer shard: dim {dim} of its piece split over {where}"


def _weight_shard_size(cfg: ParallelConfig, mesh: MeshSpec) -> int | None:
    """HSDP's shard group size on ``mesh`` (None: the whole dp axis, as without it).

    Raises LayoutError when it does not divide the dp axis (a mesh the outer planner chose)."""
    k, dp = cfg.optimizer_weight_shard_size, cfg.dp_axis
    if k is None or cfg.optimizer_shard is None:
        return None
    n = mesh.axis_size(dp) if dp in mesh.axis_names else 1
    return None if shard_group_size(dp, n, k) == n else k


def _fused_reductions(
    ctx: _Context,
    step: _Step,
    planned: Sequence[PlannedParameter],
) -> None:
    """One all-reduce over dp per gradient bucket, formed as the runtime forms them.

    The runtime (plan_exec's ``_grad_sync``: GradSync; PlainGradSync for pure data
    parallelism) hands :func:`~plait.fusion.plan_buckets` the trainable parameters not split
    over dp, in model order (the graph's order, tied parameters once), sized by their local
    pieces. A bucket's all-reduce carries its parameters whose gradient is pending over dp
    alone; one also pending over another axis is reduced by itself (listed per parameter by
    :func:`_parameters`); one with no pending sum over dp (or no gradient) adds nothing. With
    pipeline stages each stage buckets its own parameters.
    """
    dp = ctx.cfg.dp_axis
    fusion = ctx.cfg.comm_fusion or CommFusion()
    by_name = {g.target: g for g in ctx.graph.inputs if g.kind == "parameter"}
    per_stage: dict[int, list[tuple[PlannedParameter, int]]] = {}
    for p in planned:
        g = by_name[p.name]
        if not g.requires_grad or any(dp in axes for axes in p.layout.dims):
            continue
        stage = ctx.stage_of[p.op] if p.op else 0
        per_stage.setdefault(stage, []).append((p, _local_bytes(g, p.layout)))
    level = ctx.cfg.optimizer_shard
    n = ctx.mesh.axis_size(dp)
    group = _weight_shard_size(ctx.cfg, ctx.mesh) or n
    # HSDP: shard groups of k consecutive dp ranks, and the n // k groups across them
    inside, across = ((group, 1), (n // group, group)) if group != n else (None, None)
    read_again = _read_by_backward(ctx.graph, ctx.cfg) if level == 3 else set()
    for stage, entries in sorted(per_stage.items()):
        buckets = plan_buckets([size for _, size in entries], fusion)
        for k, bucket in enumerate(buckets):
            members = [
                entries[i] for i in sorted(bucket) if entries[i][0].grad_reduce_axes == (dp,)
            ]
            where = f"bucket {k + 1} of {len(buckets)}, {_fusion_text(fusion)}"
            sharded = [m for m in members if m[0].optimizer_shard_dim is not None]
            summed = members if level == 1 else [m for m in members if m not in sharded]
            if summed:
                step.add(
                    "all_reduce",
                    (dp,),
                    sum(size for _, size in summed),
                    ("backward", summed[0][0].name, stage),
                    f"gradients of {_names(summed)} summed over {dp!r} in one fused all-reduce "
                    f"({where})",
                    overlap=(REDUCE, _values(by_name, summed)),
                )
            if not sharded:
                continue
            full = sum(size for _, size in sharded)
            first = sharded[0][0].name
            values = _values(by_name, sharded)
            if level != 1:
                over = f"groups of {group} ranks of {dp!r}" if inside else repr(dp)
                step.add(
                    "reduce_scatter",
                    (dp,),
                    full,
                    ("backward", first, stage),
                    f"gradients of {_names(sharded)} summed over {over} and split, each rank "
                    f"keeping its shard (optimizer_shard={level}; {where})",
                    group=inside,
                    overlap=(REDUCE, values),
                )
            if level != 1 and across:
                step.add(
                    "all_reduce",
                    (dp,),
                    full // group,
                    ("backward", first, stage),
                    f"gradient shards of {_names(sharded)} summed across the {n // group} shard "
                    f"groups of {dp!r} (optimizer_weight_shard_size={group}; {where})",
                    group=across,
                    overlap=(REDUCE, values),
                )
            phases: tuple[str, ...] = ("optimizer",)
            if level == 3:
                # the runtime gathers a bucket again only for the backward that reads it
                read = any(by_name[p.name].name in read_again for p, _ in sharded)
                phases = ("forward", "backward") if read else ("forward",)
            for phase in phases:
                what = "before use" if level == 3 else "after the update"
                over = f"groups of {group} ranks of {dp!r}" if inside else repr(dp)
                step.add(
                    "all_gather",
                    (dp,),
                    full // group,
                    (phase, first, stage),
                    f"shards of {_names(sharded)} gathered over {over} {what} in {phase} "
                    f"(optimizer_shard={level}; {where})",
                    group=inside,
                    overlap=(role, values) if (role := _GATHER_ROLES.get(phase)) else None,
                )


_GATHER_ROLES = {"forward": GATHER_FORWARD, "backward": GATHER_BACKWARD}
"""A ZeRO gather's overlap role by phase: prefetched before forward and backward (level 3),
not after the update (levels 1 and 2: the next forward needs every parameter at once)."""


def _values(
    by_name: Mapping[str, GraphInput], members: Sequence[tuple[PlannedParameter, int]]
) -> tuple[str, ...]:
    """The graph values of a bucket's parameters (what ops read)."""
    return tuple(by_name[p.name].name for p, _ in members)


# (op, tensor input position) whose backward never reads that input's value: an embedding's
# table (its gradient needs the indices), a bias (its gradient is a sum of the output's)
_UNREAD_BY_BACKWARD = frozenset(
    {
        ("aten.embedding.default", 0),
        ("aten.linear.default", 2),
        ("aten.conv1d.default", 2),
        ("aten.conv2d.default", 2),
        ("aten.conv3d.default", 2),
        ("aten.convolution.default", 2),
        ("aten.add.Tensor", 0),
        ("aten.add.Tensor", 1),
    }
)


def _read_by_backward(graph: OpGraph, cfg: ParallelConfig) -> set[str]:
    """The values the backward pass reads (ZeRO-3 gathers such a parameter again then).

    An op's backward reads an input unless ``_UNREAD_BY_BACKWARD`` says otherwise, and reads
    every input when the op is in a region whose forward backward recomputes in full.
    """
    again = [r for r, mode in recompute_regions(graph, cfg) if mode == "full"]
    return {
        ref
        for op in graph.ops
        for k, ref in enumerate(op.inputs)
        if (op.target, k) not in _UNREAD_BY_BACKWARD or _inside(op.module_path, again)
    }


def _inside(path: str, regions: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r + ".") or r == "" for r in regions)


def _names(members: Sequence[tuple[PlannedParameter, int]]) -> str:
    names = [p.name for p, _ in members]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{len(names)} parameter{'s' if len(names) > 1 else ''} ({shown})"


def _fusion_text(fusion: CommFusion) -> str:
    if fusion.mode == "index":
        return f"comm_fusion cut at parameters {list(fusion.boundaries)}"
    return f"comm_fusion buckets of {fusion.bucket_mb:g} MB"


def _gradient_reduction(
    step: _Step,
    name: str,
    op: str,
    axis: str,
    nbytes: int,
    stage: int,
    *,
    note: str = "",
) -> None:
    """One parameter's gradient all-reduce over ``axis`` (one not in a dp bucket)."""
    why = f"gradient of {name}: {op} splits its work over {axis!r} but not the parameter{note}"
    step.add("all_reduce", (axis,), nbytes, ("backward", name, stage), why)


def _loss_collective(ctx: _Context, step: _Step) -> None:
    """The loss value Job.step reports is reduced once when it is a pending sum."""
    if not ctx.graph.outputs:
        return
    node, k = ctx.graph.producer(ctx.graph.outputs[0])
    if not isinstance(node, OpNode):
        return
    layout = ctx.chosen[node.name].outputs[k]
    for axis in layout.partial:
        step.add(
            "all_reduce",
            (axis,),
            node.outputs[k].nbytes,
            ("forward", node.name, ctx.stage_of[node.name]),
            "loss value reported by Job.step",
        )


def _pipeline_transfers(ctx: _Context, step: _Step) -> None:
    """Values crossing a stage boundary: sent once per micro-batch, gradients sent back."""
    m = ctx.cfg.micro_batches
    sent: set[tuple[str, int]] = set()
    for op in ctx.graph.ops:
        for ref in op.inputs:
            node, k = ctx.graph.producer(ref)
            if not isinstance(node, OpNode):
                continue
            src, dst = ctx.stage_of[node.name], ctx.stage_of[op.name]
            if src == dst or (ref, dst) in sent:
                continue
            sent.add((ref, dst))
            layout = settled(ctx.chosen[node.name].outputs[k])
            local = node.outputs[k].nbytes // math.prod(layout.splits()) // m
            why = f"{ref} from stage {src} to stage {dst} ({op.name}), once per micro-batch"
            step.add(
                "send_recv", (PP_AXIS,), local, ("forward", op.name, dst), why, count=m,
                overlap=(P2P, ()),
            )  # fmt: skip
            if ctx.problem.needs_grad(ref):
                step.add(
                    "send_recv",
                    (PP_AXIS,),
                    local,
                    ("backward", node.name, src),
                    "gradient of " + why,
                    count=m,
                    overlap=(P2P, ()),
                )


def _predict(
    ctx: _Context,
    op_time: Mapping[str, float],
    step: _Step,
    param_layouts: Mapping[str, tuple[TensorLayout, str, OpStrategy, int]],
    hardware: Any,
) -> tuple[Prediction, list[float]]:
    """The step's prediction, and each pipeline stage's compute seconds per step."""
    stages = ctx.cfg.pipeline_stages
    compute = [0.0] * stages
    ga = ctx.cfg.grad_accumulation
    for op in ctx.graph.ops:  # one micro-step's graph, run grad_accumulation times
        compute[ctx.stage_of[op.name]] += op_time[op.name] * ga
    trace = StepTrace(ctx.graph, recompute_regions(ctx.graph, ctx.cfg))
    recomputed = trace.recomputed()
    again = recomputed_seconds(trace, op_time, ctx.stage_of, stages, ga, recomputed)
    compute = [c + a for c, a in zip(compute, again, strict=True)]
    pieces = {op.name: work_pieces(ctx.mesh, ctx.chosen[op.name]) for op in ctx.graph.ops}
    split = micro_batch_seconds(
        ctx.graph, ctx.stage_of, pieces, ctx.problem.cost.op_compute, ctx.cfg, stages
    )
    compute = [c + e for c, e in zip(compute, split, strict=True)]
    memories, updated = _memory(ctx, param_layouts, trace)
    update = [optimizer_seconds(n, e, hardware) for n, e in updated]
    clock = StageClock(ctx.graph, ctx.stage_of, op_time, recomputed, stages, ctx.cfg.micro_batches)
    hidden = [
        clock.hidden(s, [i for t, i in step.overlappable if t == s], hardware.comm_overlap)
        for s in range(stages)
    ]
    comm = [step.seconds_of_stage(s) for s in range(stages)]
    busiest = max(range(stages), key=lambda s: compute[s] + comm[s] - hidden[s] + update[s])
    compute_s, comm_s = compute[busiest], comm[busiest]
    bubble_s = _bubble(ctx.cfg, compute_s, step.seconds_of_stage(busiest, "forward"), comm_s)
    peak = max(memories, key=lambda mem: mem.peak)
    prediction = Prediction(
        step_time_s=compute_s + comm_s - hidden[busiest] + bubble_s + update[busiest],
        optimizer_s=update[busiest],
        compute_s=compute_s,
        communication_s=comm_s,
        overlapped_s=hidden[busiest],
        bubble_s=bubble_s,
        memory_bytes=peak.peak,
        memory_by_kind={
            "parameters": peak.parameters,
            "gradients": peak.gradients,
            "optimizer": peak.optimizer,
            "activations": peak.activations,
        },
        flops_per_step=int(
            ctx.graph.flops * (1 + BACKWARD_FLOPS_FACTOR) * ctx.cfg.grad_accumulation
        ),
    )
    return prediction, compute


def recomputed_seconds(
    trace: StepTrace,
    op_time: Mapping[str, float],
    stage_of: Mapping[str, int],
    stages: int,
    grad_accumulation: int,
    recomputed: Sequence[bool] | None = None,
) -> list[float]:
    """Per stage, the seconds backward spends running forwards again: a third of each
    recomputed op's time (its forward), per micro-step. One function for the plan and the
    outer planner's estimate, so both sum the same floats. ``recomputed``: the trace's
    ``recomputed()``, when the caller has it already."""
    again = [0.0] * stages
    flags = trace.recomputed() if recomputed is None else recomputed
    for op, recomputed_op in zip(trace.graph.ops, flags, strict=True):
        if recomputed_op:
            forward = op_time[op.name] * (1 / (1 + BACKWARD_FLOPS_FACTOR))
            again[stage_of[op.name]] += forward * grad_accumulation
    return again


def with_kept_axes(mesh: MeshSpec, axes: tuple[str, ...], kept: Iterable[str]) -> tuple[str, ...]:
    """A parameter's gradient axes with those its reader's output kept pending into it
    (``PlannedOp.pending_grad``), in mesh order."""
    extra = set(kept)
    return tuple(a for a in mesh.axis_names if a in axes or a in extra)


def _bubble(cfg: ParallelConfig, compute_s: float, forward_comm_s: float, comm_s: float) -> float:
    """The schedule's bubble (timeline.bubble_seconds) on the busiest stage's times per
    micro-batch: compute split into forward, input- and weight-gradient passes of about one
    forward each (BACKWARD_FLOPS_FACTOR), communication counted in the pass of its phase and
    never overlapped (so GPipe and 1F1B idle ``(stages - 1) / micro_batches`` of the stage)."""
    m = cfg.micro_batches
    forward = compute_s / (1 + BACKWARD_FLOPS_FACTOR)
    weight = forward * BACKWARD_FLOPS_FACTOR / 2
    return bubble_seconds(
        cfg.schedule,
        cfg.pipeline_stages,
        (forward + forward_comm_s) / m,
        (compute_s - forward + comm_s - forward_comm_s) / m,
        weight / m,
        cfg.virtual_stages or 1,
    )


def _memory(
    ctx: _Context,
    param_layouts: Mapping[str, tuple[TensorLayout, str, OpStrategy, int]],
    trace: StepTrace,
) -> tuple[list[PeakMemory], list[tuple[int, float]]]:
    """Each pipeline stage's peak (docs/memory.md, "How the plan predicts memory"): the
    model states by ZeRO level, and a walk through one step of what the program holds; and
    what each stage's optimizer updates (tensors, elements: a ZeRO shard's share)."""
    graph, mesh, cfg = ctx.graph, ctx.mesh, ctx.cfg
    stages = cfg.pipeline_stages
    # frozen parameters: no gradient, no optimizer state; whole ones: not split by ZeRO
    sharded, whole, frozen = [0] * stages, [0] * stages, [0] * stages
    param_numel: dict[str, int] = {}
    dp = mesh.axis_size(cfg.dp_axis) if cfg.dp_axis in mesh.axis_names else 1
    shards = _weight_shard_size(cfg, mesh) or dp
    updated: list[tuple[int, float]] = [(0, 0.0)] * stages
    for g in graph.inputs:
        if g.kind != "parameter":
            continue
        layout, op, strategy, i = param_layouts.get(
            g.name, (TensorLayout.replicated(mesh, g.meta.ndim), "", None, 0)
        )
        stage = ctx.stage_of.get(op, 0)
        numel = g.meta.numel // math.prod(layout.splits())
        split = False
        if not g.requires_grad:
            frozen[stage] += numel
        elif (
            strategy is not None
            and _optimizer_shard(ctx, g, layout, _grad_axes(ctx, op, strategy, i))[0] is not None
        ):
            sharded[stage] += numel
            split = True
        else:
            whole[stage] += numel
        if g.requires_grad and strategy is not None:
            param_numel[g.name] = numel
            tensors, elements = updated[stage]
            updated[stage] = (tensors + 1, elements + (numel / shards if split else numel))
    stage_list = [ctx.stage_of[op.name] for op in graph.ops]
    chosen = [ctx.chosen[op.name] for op in graph.ops]
    held = activation_buffers(trace, cfg, chosen, stage_list, lambda t: math.prod(t.splits()))
    buckets = _memory_buckets(ctx, param_layouts)
    sb = StateBytes.for_precision(cfg.precision)
    walked = [h.with_gradients(param_numel, buckets[s], sb) for s, h in enumerate(held)]
    memories = [
        stage_memory(cfg, s, walked[s], sharded[s], whole[s], frozen[s], dp) for s in range(stages)
    ]
    return memories, updated


def _grad_axes(ctx: _Context, op: str, strategy: OpStrategy, i: int) -> tuple[str, ...]:
    """The axes the gradient of input ``i`` of ``op`` (a parameter) is summed over: those
    the strategy splits the work over but not the parameter, and those the op's output
    gradient kept pending into it (``ctx.kept``), in mesh order."""
    axes = grad_reduce_axes(strategy, i)
    kept = ctx.kept.get(op, ())
    return with_kept_axes(ctx.mesh, axes, kept) if kept else axes


def _memory_buckets(
    ctx: _Context,
    param_layouts: Mapping[str, tuple[TensorLayout, str, OpStrategy, int]],
) -> list[list[GradBucket]]:
    """Per stage, the data-parallel gradient buckets as :func:`_fused_reductions` forms them:
    their members (gradients pending over dp alone) and which ZeRO splits."""
    out: list[list[GradBucket]] = [[] for _ in range(ctx.cfg.pipeline_stages)]
    if not _fused_dp(ctx):
        return out
    dp = ctx.cfg.dp_axis
    per_stage: dict[int, list[tuple[str, bool, bool, int]]] = {}
    for g in ctx.graph.inputs:
        if g.kind != "parameter" or not g.requires_grad:
            continue
        placed = param_layouts.get(g.name)
        if placed is None:  # read by no op: whole, no gradient, stage 0 (in _parameters)
            layout = TensorLayout.replicated(ctx.mesh, g.meta.ndim)
            if not any(dp in axes for axes in layout.dims):
                per_stage.setdefault(0, []).append((g.name, False, False, _local_bytes(g, layout)))
            continue
        layout, op, strategy, i = placed
        if any(dp in axes for axes in layout.dims):
            continue
        axes = _grad_axes(ctx, op, strategy, i)
        split = _optimizer_shard(ctx, g, layout, axes)[0] is not None
        entry = (g.name, axes == (dp,), split, _local_bytes(g, layout))
        per_stage.setdefault(ctx.stage_of[op], []).append(entry)
    fusion = ctx.cfg.comm_fusion or CommFusion()
    for stage, entries in sorted(per_stage.items()):
        for bucket in plan_buckets([size for *_, size in entries], fusion):
            members = [entries[i] for i in sorted(bucket) if entries[i][1]]
            if members:
                names = tuple(m[0] for m in members)
                out[stage].append(GradBucket(names, tuple(m[2] for m in members)))
    return out


def activation_buffers(
    trace: StepTrace,
    cfg: ParallelConfig,
    chosen: Sequence[OpStrategy],
    stage_list: Sequence[int],
    pieces: Callable[[TensorLayout], int],
) -> tuple[StageBuffers, ...]:
    """:meth:`StepTrace.hold` with the plan's layouts: each value's local piece as its
    producer lays it out (``chosen``: each op's strategy, graph order) or as an op reads it;
    float32 activations take the bytes of the compute precision (autocast), buffers and the
    batch their own. Shared by :mod:`plait.planning.estimate`, which passes its cached
    ``pieces``; :meth:`StageBuffers.with_gradients` then adds the parameters' gradients."""
    graph = trace.graph
    scale = LOW_PRECISION_ACTIVATIONS[cfg.precision]

    def value_bytes(ref: str) -> int:
        i, k = trace.out_slot[ref]
        meta = graph.ops[i].outputs[k]
        nbytes = meta.nbytes // pieces(chosen[i].outputs[k])
        return int(nbytes * scale) if meta.dtype == "float32" else nbytes

    def read_bytes(i: int, j: int) -> int:
        meta = graph.ops[i].input_metas[j]
        nbytes = meta.nbytes // pieces(chosen[i].inputs[j])
        if meta.dtype != "float32" or graph.ops[i].inputs[j] in trace.inputs:
            return nbytes
        return int(nbytes * scale)

    def moved(i: int, j: int) -> bool:
        producer = trace.out_slot.get(graph.ops[i].inputs[j])
        if producer is None:  # a graph input
            return False
        p, k = producer
        return communicates(chosen[p].outputs[k], chosen[i].inputs[j])

    return trace.hold(
        value_bytes=value_bytes,
        read_bytes=read_bytes,
        stage_of=stage_list,
        stages=cfg.pipeline_stages,
        # offload moves values of at least 1 MiB each (one micro-batch's)
        offload_min=(1 << 20) * cfg.micro_batches if cfg.offload == "activations" else None,
        moved=moved,
    )


def communicates(src: TensorLayout, dst: TensorLayout) -> bool:
    """Whether moving a value laid out as ``src`` to ``dst`` takes a collective: a pending
    sum to reduce, or a dim ``dst`` splits over fewer axes than ``src`` (a gather, an
    all-to-all); splitting further is a local slice."""
    if src == dst:
        return False
    if src.partial:
        return True
    return any(not set(a) <= set(b) for a, b in zip(src.dims, dst.dims, strict=True))


def stage_memory(
    cfg: ParallelConfig,
    stage: int,
    walked: StageActivations,
    sharded: int,
    whole: int,
    frozen: int,
    dp: int,
) -> PeakMemory:
    """One stage's peak: its model states (``sharded``, ``whole`` and ``frozen`` parameter
    elements) and its walk, with the micro-batches its schedule keeps in flight (all ``m``
    without pipeline stages; the stages still ahead under 1F1B: timeline.in_flight_micro_batches).
    Shared by :mod:`plait.planning.estimate`."""
    m = cfg.micro_batches
    # optimizer parallel splits over HSDP's shard groups when they are set
    dp = _weight_shard_size(cfg, MeshSpec((cfg.dp_axis,), (dp,))) or dp
    in_flight = (
        in_flight_micro_batches(
            cfg.schedule, stage, cfg.pipeline_stages, m, cfg.virtual_stages or 1
        )
        if cfg.pipeline_stages > 1
        else m
    )
    # offload="optimizer": the optimizer's states (and its step) live on the host
    on_device = cfg.offload != "optimizer"
    states = stage_states(
        sharded_numel=sharded,
        whole_numel=whole,
        frozen_numel=frozen,
        shard_group=dp,
        optimizer_shard=cfg.optimizer_shard,
        precision=cfg.precision,
        optimizer_on_device=on_device,
    )
    return step_peak(
        walked,
        states,
        optimizer_shard=cfg.optimizer_shard,
        shard_group=dp,
        in_flight=in_flight,
        micro_batches=m,
        # a pipeline's micro-batches add into .grad; the program's micro-steps sum after each
        accumulation="summed" if cfg.grad_accumulation > 1 else "in_place" if m > 1 else "none",
        optimizer_on_device=on_device,
    )
