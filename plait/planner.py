"""``plait.plan``: model + example batch + config -> Plan, with no process group.

The one path of the design, up to the Plan:

    capture (OpGraph) -> rules (candidates per op) -> constraints (annotations, mode, batch)
    -> search -> Plan (layouts, every collective with its reason and cost, predictions)

Costs are seconds and bytes on the config's hardware profile (``plait.cost``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.capture import capture
from plait.config import ParallelConfig
from plait.cost import get_profile
from plait.cost.comm import Topology
from plait.cost.compute import op_seconds
from plait.cost.memory import training_memory
from plait.errors import ConfigError, NotBuiltError
from plait.graph import OpGraph, OpNode, TensorMeta
from plait.layout import TensorLayout
from plait.layout.redistribute import LOCAL_KINDS, plan_redistribution
from plait.mesh import MeshSpec
from plait.plan import (
    Alternative,
    Plan,
    PlannedCollective,
    PlannedOp,
    PlannedParameter,
    Prediction,
)
from plait.rules import default_catalogue
from plait.rules.registry import OpStrategy, grad_reduce_axes
from plait.search import get_searcher
from plait.search.constraints import allowed_indices, batch_layouts, collect_constraints
from plait.search.problem import (
    CostModel,
    SearchProblem,
    gradient_layout,
    settled,
)
from plait.search.propagation import Decision

__all__ = ["SearchSetup", "plan", "plan_graph", "prepare"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
PLANNABLE_MODES = ("stand_alone", "data_parallel", "semi_auto", "auto")
BACKWARD_FLOPS_FACTOR = 2  # backward costs about twice the forward (dX and dW)


def _mesh_of(cfg: ParallelConfig) -> MeshSpec:
    mesh = cfg.mesh_dict
    if not mesh:
        if cfg.mode == "stand_alone":
            return MeshSpec.from_dict({cfg.dp_axis: 1})
        raise ConfigError(
            "plait.plan needs the number of devices: ParallelConfig(devices=N) or mesh={...} "
            "(planning never looks at a live world); e.g. ParallelConfig(mode='auto', devices=8)"
        )
    if cfg.mode == "stand_alone" and math.prod(mesh.values()) != 1:
        raise ConfigError(f"mode 'stand_alone' runs on one device but mesh={mesh!r}")
    return MeshSpec.from_dict(mesh)


def _check_config(cfg: ParallelConfig) -> None:
    if cfg.mode not in PLANNABLE_MODES:
        raise ConfigError(
            f"ParallelConfig.mode={cfg.mode!r}: plait.plan plans modes {', '.join(PLANNABLE_MODES)}; "
            "hybrid and parameter_server runs are written by hand, not planned"
        )
    if cfg.pipeline_stages != 1:
        raise NotBuiltError(
            f"ParallelConfig.pipeline_stages={cfg.pipeline_stages}: planning pipeline stages is not "
            "built yet; plan with pipeline_stages=1"
        )


def plan(
    model: nn.Module,
    example_batch: Any,
    cfg: ParallelConfig,
    loss_fn: LossFn | None = None,
    *,
    hardware_file: str | None = None,
) -> Plan:
    """Plan how to train ``model`` under ``cfg`` (no process group, no parameter memory).

    Example:
        >>> plan = plait.plan(model, batch, ParallelConfig(mode="auto", devices=8), loss_fn=loss)
        >>> print(plan.summary())
    """
    _check_config(cfg)
    mesh = _mesh_of(cfg)
    graph = capture(model, example_batch, loss_fn)
    return plan_graph(graph, cfg, mesh=mesh, model=model, hardware_file=hardware_file)


@dataclass(frozen=True)
class SearchSetup:
    """Everything a searcher and the plan builder need, before any strategy is chosen."""

    graph: OpGraph
    mesh: MeshSpec
    problem: SearchProblem
    allowed: Mapping[str, Sequence[int]]
    configured: Mapping[str, str]
    topology: Topology
    hardware: Any  # plait.cost.HardwareProfile
    dtype: str


def prepare(
    graph: OpGraph,
    cfg: ParallelConfig,
    *,
    mesh: MeshSpec | None = None,
    model: nn.Module | None = None,
    hardware_file: str | None = None,
) -> SearchSetup:
    """Candidates, costs and constraints for ``graph`` under ``cfg`` (annotations from ``model``)."""
    mesh = mesh or _mesh_of(cfg)
    hardware = (
        get_profile(cfg.hardware, hardware_file) if hardware_file else get_profile(cfg.hardware)
    )
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[cfg.precision]
    topology = Topology(mesh, hardware)

    def op_compute(op: OpNode, pieces: int) -> float:
        forward = op_seconds(op.flops / pieces, op.bytes / pieces, dtype, hardware)
        return forward * (1 + BACKWARD_FLOPS_FACTOR)

    cost = CostModel(topology.axis_seconds, op_compute)
    candidates = _candidates(graph, mesh)
    inputs = batch_layouts(graph, mesh, cfg.dp_axis, cfg.dataset_strategy)
    problem = SearchProblem(graph, mesh, candidates, inputs, cost)
    constraints = collect_constraints(model or nn.Module(), graph, mesh, cfg.mode)
    allowed, configured = allowed_indices(graph, candidates, constraints, cfg.dp_axis)
    return SearchSetup(graph, mesh, problem, allowed, configured, topology, hardware, dtype)


def plan_graph(
    graph: OpGraph,
    cfg: ParallelConfig,
    *,
    mesh: MeshSpec | None = None,
    model: nn.Module | None = None,
    hardware_file: str | None = None,
) -> Plan:
    """Plan an already captured graph (annotations are read from ``model`` when given)."""
    _check_config(cfg)
    setup = prepare(graph, cfg, mesh=mesh, model=model, hardware_file=hardware_file)
    searcher = get_searcher(cfg.search or "sharding_propagation")
    decisions = searcher(setup.problem, setup.allowed, setup.configured)
    return _build_plan(
        graph,
        cfg,
        setup.mesh,
        setup.problem,
        decisions,
        setup.topology,
        setup.hardware,
        setup.dtype,
        model,
    )


def _op_key(op: OpNode) -> tuple[object, ...]:
    return (op.target, op.input_metas, op.outputs, op.args, op.kwargs)


def _candidates(graph: OpGraph, mesh: MeshSpec) -> dict[str, list[OpStrategy]]:
    """Every op's candidate strategies; ops with equal signatures share one list."""
    catalogue = default_catalogue()
    memo: dict[tuple[object, ...], list[OpStrategy]] = {}
    out: dict[str, list[OpStrategy]] = {}
    for op in graph.ops:
        key = _op_key(op)
        try:
            found = memo.get(key)
        except TypeError:  # unhashable args: no sharing
            key, found = (op.name,), None
        if found is None:
            found = list(catalogue.strategies(op, mesh))
            memo[key] = found
        out[op.name] = found
    return out


@dataclass
class _Collectives:
    """Every collective of one step, in the order the step issues them."""

    topology: Topology
    items: list[PlannedCollective]

    def add_redistribution(
        self,
        src: TensorLayout,
        dst: TensorLayout,
        meta: TensorMeta,
        phase: str,
        op: str,
        reason: str,
    ) -> None:
        if src == dst:
            return
        for step in plan_redistribution(src, dst, meta.shape, meta.itemsize).steps:
            if step.kind in LOCAL_KINDS:
                continue
            self.add(step.kind, (step.axis,), step.nbytes, phase, op, reason)

    def add(
        self, kind: str, axes: tuple[str, ...], nbytes: int, phase: str, op: str, reason: str
    ) -> None:
        seconds = sum(self.topology.axis_seconds(kind, a, nbytes) for a in axes)
        self.items.append(PlannedCollective(kind, axes, nbytes, seconds, 1, phase, op, reason))


def _value_name(graph: OpGraph, ref: str) -> str:
    source = graph.graph_input(ref)
    return source.target if source is not None else ref


def _build_plan(
    graph: OpGraph,
    cfg: ParallelConfig,
    mesh: MeshSpec,
    problem: SearchProblem,
    decisions: Mapping[str, Decision],
    topology: Topology,
    hardware: Any,
    dtype: str,
    model: nn.Module | None,
) -> Plan:
    catalogue = default_catalogue()
    chosen = {op.name: problem.candidates[op.name][decisions[op.name].index] for op in graph.ops}
    collectives = _Collectives(topology, [])
    param_layouts: dict[str, tuple[TensorLayout, str, OpStrategy, int]] = {}
    planned_ops: list[PlannedOp] = []
    compute_s = 0.0
    for op in graph.ops:
        strategy = chosen[op.name]
        pieces = math.prod(mesh.axis_size(a) for a in strategy.used_axes())
        compute_s += problem.cost.op_compute(op, pieces)
        covered = catalogue.covers(op)
        decision = decisions[op.name]
        reason = decision.reason if covered else "no rule in the catalogue: replicated"
        alternatives = tuple(
            Alternative(
                problem.candidates[op.name][i].label,
                problem.candidates[op.name][i].cuts(),
                c,
            )
            for i, c in decision.alternatives
        )
        planned_ops.append(
            PlannedOp(
                name=op.name,
                target=op.target,
                module_path=op.module_path,
                strategy=strategy.cuts(),
                inputs=strategy.inputs,
                outputs=strategy.outputs,
                label=strategy.label,
                covered=covered,
                reason=reason,
                layer=op.layer,
                alternatives=alternatives,
            )
        )
        _op_collectives(graph, op, strategy, chosen, problem, collectives, param_layouts)
    parameters = _parameters(graph, param_layouts, collectives, cfg, mesh)
    _loss_collective(graph, chosen, collectives)
    communication_s = sum(c.seconds * c.count for c in collectives.items)
    memory = _memory(graph, chosen, param_layouts, cfg, mesh)
    flops = graph.flops * (1 + BACKWARD_FLOPS_FACTOR)
    predicted = Prediction(
        step_time_s=compute_s + communication_s,
        compute_s=compute_s,
        communication_s=communication_s,
        bubble_s=0.0,
        memory_bytes=memory.total,
        memory_by_kind={
            "parameters": memory.parameters,
            "gradients": memory.gradients,
            "optimizer": memory.optimizer,
            "activations": memory.activations,
        },
        flops_per_step=flops,
    )
    return Plan(
        mesh=mesh,
        mode=cfg.mode,
        search=cfg.search or "sharding_propagation",
        hardware=hardware.name,
        precision=cfg.precision,
        micro_batches=cfg.micro_batches,
        pipeline_stages=cfg.pipeline_stages,
        optimizer_shard=cfg.optimizer_shard,
        recompute=cfg.recompute,
        ops=tuple(planned_ops),
        parameters=parameters,
        collectives=tuple(collectives.items),
        predicted=predicted,
        model=type(model).__name__ if model is not None else "",
        batch=tuple(g.meta.shape for g in graph.inputs if g.kind == "input"),
    )


def _op_collectives(
    graph: OpGraph,
    op: OpNode,
    strategy: OpStrategy,
    chosen: Mapping[str, OpStrategy],
    problem: SearchProblem,
    collectives: _Collectives,
    param_layouts: dict[str, tuple[TensorLayout, str, OpStrategy, int]],
) -> None:
    """Redistributions feeding ``op`` (forward) and its input gradients (backward)."""
    for i, ref in enumerate(op.inputs):
        source = graph.graph_input(ref)
        need = strategy.inputs[i]
        meta = op.input_metas[i]
        if source is not None and source.kind == "parameter":
            if ref not in param_layouts:
                param_layouts[ref] = (need, op.name, strategy, i)
                continue
            have = param_layouts[ref][0]
            what = f"parameter {source.target} (laid out {have.describe()} for {param_layouts[ref][1]})"
        elif source is not None and source.kind == "input":
            have = problem.input_layouts[ref]
            what = f"batch tensor {source.target}"
        elif source is not None:
            continue  # buffers and constants are replicated and read locally
        else:
            node, k = graph.producer(ref)
            assert isinstance(node, OpNode)
            have = chosen[node.name].outputs[k]
            what = f"output of {node.name}"
        reason = f"{op.name} needs {what} as {need.describe()}; it is {have.describe()}"
        collectives.add_redistribution(have, need, meta, "forward", op.name, reason)
        if problem.needs_grad(ref):
            grad = gradient_layout(strategy, i)
            back = settled(have)
            collectives.add_redistribution(
                grad,
                back,
                meta,
                "backward",
                op.name,
                f"gradient of {what} for {op.name}: {grad.describe()} -> {back.describe()}",
            )


def _parameters(
    graph: OpGraph,
    param_layouts: Mapping[str, tuple[TensorLayout, str, OpStrategy, int]],
    collectives: _Collectives,
    cfg: ParallelConfig,
    mesh: MeshSpec,
) -> tuple[PlannedParameter, ...]:
    planned = []
    for g in graph.inputs:
        if g.kind != "parameter":
            continue
        if g.name not in param_layouts:  # read by no op: stays whole, no gradient
            layout = TensorLayout.replicated(mesh, g.meta.ndim)
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
        axes = grad_reduce_axes(strategy, i)
        nbytes = g.meta.nbytes // math.prod(layout.splits())
        for axis in axes:
            collectives.add(
                "all_reduce",
                (axis,),
                nbytes,
                "backward",
                g.target,
                f"gradient of {g.target}: {op} splits its work over {axis!r} but not the parameter",
            )
        why = f"layout of input {i} of {op} ({strategy.label or 'strategy'} {strategy.cuts()!r})"
        planned.append(
            PlannedParameter(g.target, g.meta.shape, g.meta.dtype, layout, axes, op, why)
        )
    return tuple(planned)


def _loss_collective(
    graph: OpGraph, chosen: Mapping[str, OpStrategy], collectives: _Collectives
) -> None:
    """The loss value Job.step reports is reduced once when it is a pending sum."""
    if not graph.outputs:
        return
    ref = graph.outputs[0]
    node, k = graph.producer(ref)
    if not isinstance(node, OpNode):
        return
    layout = chosen[node.name].outputs[k]
    meta = node.outputs[k]
    for axis in layout.partial:
        collectives.add(
            "all_reduce",
            (axis,),
            meta.nbytes,
            "forward",
            node.name,
            "loss value reported by Job.step",
        )


def _memory(
    graph: OpGraph,
    chosen: Mapping[str, OpStrategy],
    param_layouts: Mapping[str, tuple[TensorLayout, str, OpStrategy, int]],
    cfg: ParallelConfig,
    mesh: MeshSpec,
):
    param_numel = 0
    for g in graph.inputs:
        if g.kind != "parameter":
            continue
        layout = param_layouts.get(g.name, (TensorLayout.replicated(mesh, g.meta.ndim),))[0]
        param_numel += g.meta.numel // math.prod(layout.splits())
    activations = 0
    for op in graph.ops:
        for layout, meta in zip(chosen[op.name].outputs, op.outputs, strict=True):
            activations += meta.nbytes // math.prod(layout.splits())
    dp = mesh.axis_size(cfg.dp_axis) if cfg.dp_axis in mesh.axis_names else 1
    return training_memory(
        param_numel=param_numel,
        shard_group=dp,
        optimizer_shard=cfg.optimizer_shard,
        precision=cfg.precision,
        activation_bytes=activations,
    )
