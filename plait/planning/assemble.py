"""From the searcher's choices to a :class:`~plait.planning.Plan`: collectives, stages, predictions.

Given one strategy per op, this module writes down what a training step does, each
collective as a record with its reason and cost:

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
- the predicted step time and memory per device, and each stage's compute: the one
  predictor's (:meth:`plait.planning.estimate.MeshEstimate.predict`, which the outer planner
  weighs its options with), for the search's choices under ``cfg``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from plait.config import CommFusion, ParallelConfig
from plait.cost.comm import Topology
from plait.fusion import in_bucket, plan_buckets
from plait.graph import GraphInput, OpGraph, OpNode
from plait.layout import TensorLayout, optimizer_shard_dim, why_whole
from plait.layout.redistribute import LOCAL_KINDS, plan_redistribution
from plait.mesh import MeshSpec
from plait.planning.estimate import (
    PP_AXIS,
    GraphFacts,
    MeshEstimate,
    read_by_backward,
    recompute_regions,
    weight_shard_size,
    with_kept_axes,
)
from plait.planning.records import (
    Alternative,
    Plan,
    PlannedCollective,
    PlannedOp,
    PlannedParameter,
)
from plait.rules import default_catalogue
from plait.rules.loss import divides_by_target_count
from plait.rules.registry import OpStrategy, grad_reduce_axes
from plait.search.problem import SearchProblem, gradient_layout, kept_gradient, settled
from plait.search.propagation import Decision

__all__ = ["assemble_plan"]


def _pieces(repeat: int, copies: int) -> str:
    """What a repeated collective repeats in, in words."""
    if copies == 1:
        return f"{repeat} micro-steps"
    if repeat == copies:
        return f"{copies} copies, interleaved"
    return f"{repeat // copies} micro-steps x {copies} copies, interleaved"


@dataclass
class _Step:
    """The collectives of one step as the plan lists them."""

    topology: Topology
    repeat: int = 1  # pieces (micro-steps x copies) the collectives being added repeat in
    copies: int = 1  # of them, copies of one micro-step (multi-copy parallel)
    items: list[PlannedCollective] = field(default_factory=list)
    moved: set[tuple[str, TensorLayout]] = field(default_factory=set)  # forward fan-out
    reduced: set[tuple[str, TensorLayout]] = field(default_factory=set)  # backward fan-out

    def redistribute(
        self,
        src: TensorLayout,
        dst: TensorLayout,
        shape: Sequence[int],
        itemsize: int,
        where: tuple[str, str],
        reason: str,
        value: str = "",
    ) -> None:
        """The collectives moving ``src`` to ``dst``; ``value``: the ref a forward move
        moves (:attr:`PlannedCollective.value`)."""
        if src == dst:
            return
        for step in plan_redistribution(src, dst, tuple(shape), itemsize).steps:
            if step.kind not in LOCAL_KINDS:
                self.add(step.kind, (step.axis,), step.nbytes, where, reason, value=value)

    def add(
        self,
        kind: str,
        axes: tuple[str, ...],
        nbytes: int,
        where: tuple[str, str],
        reason: str,
        count: int = 1,
        *,
        group: tuple[int, int] | None = None,
        value: str = "",
    ) -> None:
        """``where``: (phase, op). ``group``: (size, stride) of a group smaller than the one
        ``axes`` spans (HSDP's shard groups and the groups across them:
        :meth:`Topology.subgroup_seconds`)."""
        phase, op = where
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
            reason += f" (each of {_pieces(self.repeat, self.copies)})"
        self.items.append(
            PlannedCollective(
                kind, axes, nbytes, seconds, count, phase, op, reason,
                None if group is None else group[0], value,
            )
        )  # fmt: skip


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
    *,
    estimate: MeshEstimate | None = None,
) -> Plan:
    """The Plan of ``decisions`` (one candidate index per op) under ``cfg`` on ``mesh``.

    ``estimate``: the predictor of this search (the outer planner's, which has predicted its
    options with it already); one is made when not given. Its stages and prediction are the
    plan's."""
    if estimate is None:
        estimate = MeshEstimate(GraphFacts(graph), cfg, mesh, problem, topology, hardware,
                                decisions)  # fmt: skip
    estimate = estimate.for_stages_of(cfg)
    chosen, stage_of = estimate.chosen, estimate.stage_of
    stages = cfg.pipeline_stages
    ctx = _Context(graph, cfg, mesh, problem, chosen, stage_of)
    # With gradient accumulation the graph is one micro-step's (with interleave_num, one
    # copy's): its activation collectives repeat per micro-step and copy; the gradient
    # reductions (after the last) and the reported loss's reduction (of the sum) happen once.
    step = _Step(topology, repeat=cfg.planned_pieces, copies=cfg.copies)
    param_layouts: dict[str, tuple[TensorLayout, str, OpStrategy, int]] = {}
    for op in graph.ops:
        _op_collectives(ctx, op, step, param_layouts)
    step.repeat = 1
    parameters = _parameters(ctx, param_layouts, step)
    _loss_collective(ctx, step)
    if stages > 1:
        _pipeline_transfers(ctx, step)
    found = estimate.predict(cfg)
    return Plan(
        mesh=mesh,
        mode=cfg.mode,
        search=cfg.search or "sharding_propagation",
        hardware=hardware.name,
        hardware_uncalibrated=hardware.uncalibrated,
        precision=cfg.precision,
        micro_batches=cfg.micro_batches,
        pipeline_stages=stages,
        schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages or 1,
        stage_compute_s=found.stage_compute_s,
        optimizer_shard=cfg.optimizer_shard,
        optimizer_weight_shard_size=weight_shard_size(cfg, mesh),
        recompute=cfg.recompute,
        recompute_regions=recompute_regions(graph, cfg),
        offload=cfg.offload,
        ops=tuple(
            _planned_op(ctx, op, decisions[op.name], ctx.kept, estimate.op_seconds(op.name))
            for op in graph.ops
        ),
        parameters=parameters,
        collectives=tuple(step.items),
        predicted=found.predicted,
        stages=_stage_names(graph, estimate.stage_list, stages),
        model=model_name,
        batch=tuple(g.meta.shape for g in graph.inputs if g.kind == "input"),
        memory_limit=cast("int | None", cfg.memory_limit),  # ParallelConfig parsed text to bytes
        grad_accumulation=cfg.grad_accumulation,
        interleave_num=cfg.copies,
        dp_axis=cfg.dp_axis,
        dataset_strategy=cfg.dataset_strategy,
        comm_fusion=cfg.comm_fusion,
        notes=_high_dimensional(parameters),
    )


def _high_dimensional(parameters: Sequence[PlannedParameter]) -> tuple[str, ...]:
    """A note naming the parameters split on two dims or more (MindSpore's high-dimensional
    tensor parallel), none without."""
    split = [p for p in parameters if sum(1 for axes in p.layout.dims if axes) >= 2]
    if not split:
        return ()
    shown = ", ".join(f"{p.name} {p.layout.describe()}" for p in split[:4])
    more = f" and {len(split) - 4} more" if len(split) > 4 else ""
    return (
        f"high-dimensional tensor parallel: {len(split)} parameter(s) split on two dims or "
        f"more, one set of axes each ({shown}{more}): a matmul with such a weight gathers its "
        "input over the axes of the weight's input dim only and reduces its partial sums over "
        "those alone, where a split on one dim over the same axes gathers or reduces over all "
        "of them",
    )


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
    ctx: _Context,
    op: OpNode,
    decision: Decision,
    kept: Mapping[str, tuple[str, ...]],
    compute_s: float,
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
        compute_s=compute_s,
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
    graph, strategy = ctx.graph, ctx.chosen[op.name]
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
            where = ("forward", op.name)
            step.redistribute(have, need, meta.shape, meta.itemsize, where, reason, ref)
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
                ("backward", op.name),
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
                ("forward", op.name),
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
        for axis in axes:
            if _bucketed(ctx, axes):
                continue  # in a bucket (_fused_reductions)
            # a pipeline stage reduces a gradient pending over dp and another axis by itself
            several = fused and ctx.cfg.dp_axis in axes and len(axes) > 1
            alone = " (reduced alone: pending over several axes)" if several else ""
            _gradient_reduction(step, g.target, op, axis, nbytes, note=alone)
        zero_dim, whole = _optimizer_shard(ctx, g, layout, axes)
        planned.append(
            PlannedParameter(
                g.target, g.meta.shape, g.meta.dtype, layout, axes, op, why + whole, zero_dim
            )
        )
    if fused:
        _fused_reductions(ctx, step, planned)
    return tuple(planned)


def _bucketed(ctx: _Context, axes: tuple[str, ...]) -> bool:
    """Is a gradient pending over ``axes`` reduced in a dp bucket (:func:`_fused_reductions`,
    :func:`plait.fusion.in_bucket`)?"""
    staged = max(ctx.stage_of.values(), default=0) > 0
    return in_bucket(axes, ctx.cfg.dp_axis, fused=_fused_dp(ctx), staged=staged)


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
    k = weight_shard_size(cfg, ctx.mesh)
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
    group = weight_shard_size(ctx.cfg, ctx.mesh) or n
    # HSDP: shard groups of k consecutive dp ranks, and the n // k groups across them
    inside, across = ((group, 1), (n // group, group)) if group != n else (None, None)
    read_again = read_by_backward(ctx.graph, ctx.cfg) if level == 3 else set()
    for _, entries in sorted(per_stage.items()):  # stage by stage, as the runtime's buckets
        buckets = plan_buckets([size for _, size in entries], fusion)
        for k, bucket in enumerate(buckets):
            in_bucket = [entries[i] for i in sorted(bucket)]
            members = [m for m in in_bucket if m[0].grad_reduce_axes == (dp,)]
            where = f"bucket {k + 1} of {len(buckets)}, {_fusion_text(fusion)}"
            members += _summed_first(ctx, step, in_bucket, where)
            sharded = [m for m in members if m[0].optimizer_shard_dim is not None]
            summed = members if level == 1 else [m for m in members if m not in sharded]
            if summed:
                _fused_all_reduce(step, dp, summed, f"({where})")
            if not sharded:
                continue
            full = sum(size for _, size in sharded)
            first = sharded[0][0].name
            if level != 1:
                over = f"groups of {group} ranks of {dp!r}" if inside else repr(dp)
                step.add(
                    "reduce_scatter",
                    (dp,),
                    full,
                    ("backward", first),
                    f"gradients of {_names(sharded)} summed over {over} and split, each rank "
                    f"keeping its shard (optimizer_shard={level}; {where})",
                    group=inside,
                )
            if level != 1 and across:
                step.add(
                    "all_reduce",
                    (dp,),
                    full // group,
                    ("backward", first),
                    f"gradient shards of {_names(sharded)} summed across the {n // group} shard "
                    f"groups of {dp!r} (optimizer_weight_shard_size={group}; {where})",
                    group=across,
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
                    (phase, first),
                    f"shards of {_names(sharded)} gathered over {over} {what} in {phase} "
                    f"(optimizer_shard={level}; {where})",
                    group=inside,
                )


def _names(members: Sequence[tuple[PlannedParameter, int]]) -> str:
    names = [p.name for p, _ in members]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{len(names)} parameter{'s' if len(names) > 1 else ''} ({shown})"


def _fusion_text(fusion: CommFusion) -> str:
    if fusion.mode == "index":
        return f"comm_fusion cut at parameters {list(fusion.boundaries)}"
    return f"comm_fusion buckets of {fusion.bucket_mb:g} MB"


def _summed_first(
    ctx: _Context,
    step: _Step,
    in_bucket: Sequence[tuple[PlannedParameter, int]],
    where: str,
) -> list[tuple[PlannedParameter, int]]:
    """A bucket's gradients pending over dp and other axes too (:func:`_bucketed`): per set of
    other axes, one all-reduce a axis of them all, before they join the bucket's sum over dp
    (the runtime's order: plait.runtime.program.grad_sync). Returns them, runs in turn."""
    dp = ctx.cfg.dp_axis
    runs: dict[tuple[str, ...], list[tuple[PlannedParameter, int]]] = {}
    for m in in_bucket:
        axes = m[0].grad_reduce_axes
        if len(axes) > 1 and _bucketed(ctx, axes):
            beside = tuple(a for a in ctx.mesh.axis_names if a in axes and a != dp)
            runs.setdefault(beside, []).append(m)
    for beside, run in runs.items():
        for axis in beside:
            detail = (
                f"(pending there too: their readers split the work over {axis!r}), before "
                f"their sum over {dp!r} ({where})"
            )
            _fused_all_reduce(step, axis, run, detail)
    return [m for run in runs.values() for m in run]


def _fused_all_reduce(
    step: _Step, axis: str, members: Sequence[tuple[PlannedParameter, int]], detail: str
) -> None:
    """One all-reduce over ``axis`` of ``members``' gradients in one flat buffer, listed at
    the first of them."""
    step.add(
        "all_reduce",
        (axis,),
        sum(size for _, size in members),
        ("backward", members[0][0].name),
        f"gradients of {_names(members)} summed over {axis!r} in one fused all-reduce {detail}",
    )


def _gradient_reduction(
    step: _Step,
    name: str,
    op: str,
    axis: str,
    nbytes: int,
    *,
    note: str = "",
) -> None:
    """One parameter's gradient all-reduce over ``axis`` (one not in a dp bucket)."""
    why = f"gradient of {name}: {op} splits its work over {axis!r} but not the parameter{note}"
    step.add("all_reduce", (axis,), nbytes, ("backward", name), why)


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
            ("forward", node.name),
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
            step.add("send_recv", (PP_AXIS,), local, ("forward", op.name), why, count=m)
            if ctx.problem.needs_grad(ref):
                step.add(
                    "send_recv",
                    (PP_AXIS,),
                    local,
                    ("backward", node.name),
                    "gradient of " + why,
                    count=m,
                )


def _grad_axes(ctx: _Context, op: str, strategy: OpStrategy, i: int) -> tuple[str, ...]:
    """The axes the gradient of input ``i`` of ``op`` (a parameter) is summed over: those
    the strategy splits the work over but not the parameter, and those the op's output
    gradient kept pending into it (``ctx.kept``), in mesh order."""
    axes = grad_reduce_axes(strategy, i)
    kept = ctx.kept.get(op, ())
    return with_kept_axes(ctx.mesh, axes, kept) if kept else axes
