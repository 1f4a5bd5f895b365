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

from plait.assemble import BACKWARD_FLOPS_FACTOR, PP_AXIS, assemble_plan
from plait.capture import capture, in_mode
from plait.config import ParallelConfig
from plait.cost import get_profile
from plait.cost.comm import Topology
from plait.cost.compute import op_seconds
from plait.data import split_micro_batches
from plait.errors import ConfigError
from plait.graph import OpGraph, OpNode
from plait.mesh import MeshSpec
from plait.plan import (
    Plan,
)
from plait.rules import default_catalogue
from plait.rules.registry import OpStrategy
from plait.search import get_searcher
from plait.search.constraints import allowed_indices, batch_layouts, collect_constraints
from plait.search.problem import (
    CostModel,
    SearchProblem,
)

__all__ = ["SearchSetup", "mesh_of", "plan", "plan_graph", "prepare"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
PLANNABLE_MODES = ("stand_alone", "data_parallel", "semi_auto", "auto")


def mesh_of(cfg: ParallelConfig) -> MeshSpec:
    """The plan's mesh: ``cfg.mesh``, or ``{pp: stages, dp: rest}`` from ``cfg.devices``."""
    mesh = cfg.mesh_dict if cfg.mesh is not None else {}
    stages = cfg.pipeline_stages
    if not mesh:
        if cfg.mode == "stand_alone":
            return MeshSpec.from_dict({cfg.dp_axis: 1})
        if cfg.devices is None:
            raise ConfigError(
                "plait.plan needs the number of devices: ParallelConfig(devices=N) or mesh={...} "
                "(planning never looks at a live world); e.g. ParallelConfig(mode='auto', devices=8)"
            )
        if cfg.devices % stages:
            raise ConfigError(
                f"ParallelConfig.devices={cfg.devices} does not divide into "
                f"pipeline_stages={stages}; use a multiple of {stages} devices"
            )
        mesh = (
            {PP_AXIS: stages, cfg.dp_axis: cfg.devices // stages}
            if stages > 1
            else {cfg.dp_axis: cfg.devices}
        )
    if cfg.mode == "stand_alone" and math.prod(mesh.values()) != 1:
        raise ConfigError(f"mode 'stand_alone' runs on one device but mesh={mesh!r}")
    if mesh.get(PP_AXIS, 1) != stages:
        raise ConfigError(
            f"ParallelConfig.mesh={mesh!r} has {PP_AXIS}={mesh.get(PP_AXIS, 1)} but "
            f"pipeline_stages={stages}; the '{PP_AXIS}' axis holds the stages: make them equal"
        )
    return MeshSpec.from_dict(mesh)


def _check_config(cfg: ParallelConfig) -> None:
    if cfg.mode not in PLANNABLE_MODES:
        raise ConfigError(
            f"ParallelConfig.mode={cfg.mode!r}: plait.plan plans modes {', '.join(PLANNABLE_MODES)}; "
            "hybrid and parameter_server runs are written by hand, not planned"
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

    ``example_batch`` is one optimizer step's global batch, as ``parallelize`` takes it (real,
    fake or meta tensors); with ``grad_accumulation=k`` the plan is for its micro-batches of
    1/k, and ``plan.batch`` records one micro-batch's shapes.

    Example:
        >>> plan = plait.plan(model, batch, ParallelConfig(mode="auto", devices=8), loss_fn=loss)
        >>> print(plan.summary())
    """
    _check_config(cfg)
    if cfg.mode != "auto":
        mesh_of(cfg)  # a bad mesh or device count fails before the capture
    # A plan is for training steps; with gradient accumulation each micro-step runs on 1/k of
    # the step's batch, so the graph is traced on one micro-batch (as parallelize does).
    micro = split_micro_batches(example_batch, cfg.grad_accumulation)[0]
    with in_mode(model, training=True):
        graph = capture(model, micro, loss_fn)
    return plan_graph(graph, cfg, model=model, hardware_file=hardware_file)


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
    mesh = mesh or mesh_of(cfg)
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
    fused = cfg.dp_axis if cfg.optimizer_shard in (None, 1) else None
    problem = SearchProblem(graph, mesh, candidates, inputs, cost, fused_axis=fused)
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
    runnable_only: bool = False,
) -> Plan:
    """Plan an already captured graph (annotations are read from ``model`` when given).

    ``runnable_only`` keeps mode auto to what the operator executor runs today: no pipeline
    stages, ZeRO or recompute.
    """
    _check_config(cfg)
    if cfg.mode == "auto" and mesh is None:
        from plait.search.outer import auto_plan

        return auto_plan(
            graph, cfg, model=model, hardware_file=hardware_file, runnable_only=runnable_only
        )
    setup = prepare(graph, cfg, mesh=mesh, model=model, hardware_file=hardware_file)
    searcher = get_searcher(cfg.search or "sharding_propagation")
    decisions = searcher(setup.problem, setup.allowed, setup.configured)
    model_name = type(model).__name__ if model is not None else ""
    return assemble_plan(
        graph, cfg, setup.mesh, setup.problem, decisions, setup.topology, setup.hardware, model_name
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
            # the pipeline axis holds stages: no op splits over it
            found = [c for c in catalogue.strategies(op, mesh) if PP_AXIS not in c.used_axes()]
            memo[key] = found
        out[op.name] = found
    return out
