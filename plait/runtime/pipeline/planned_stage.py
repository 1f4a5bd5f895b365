"""Pipeline stages that follow the plan: a pass over each stage's graphs that lays every planned
op's inputs out as the plan's strategy for that op says.

A stage is torch's export split of the model (one FX graph per module,
``torch.export.unflatten``'s interpreter modules named by the model's own module paths). Its
parameters are DTensors laid out as the plan says (:func:`plait.runtime.pipeline.job.distribute_stage`),
but from there DTensor's propagation picks each op's strategy, which can differ from the plan's
(an embedding split over its hidden dim hands a ``Shard(-1)`` activation to ``rms_norm``, which
DTensor then computes as a pending mean it cannot add ``eps`` to). This pass inserts, before
every op of the stage that the plan lists, a call of
:func:`plait.comm.pipeline.lay_out` for each tensor input: a
redistribution to the plan's input layout for that op (nothing at all where the value is
already laid out so, the usual case). The stage then computes what the plan computes, with the
collectives it lists, and the stage's per-rank program
(:mod:`plait.runtime.pipeline.stage_program`) traces those redistributions into explicit
collectives like any other.

A stage op is the plan's op with the same module path and aten target, counted in order within
that module (export names nodes by op, ``linear_default``, where the plan's capture numbers
them, ``linear_14``). A module whose ops of one target do not count the same in the stage and
in the plan, an op whose tensor inputs differ in number from the plan's, and a layout DTensor
can only express with a strided shard, are left to DTensor's propagation (counted in
:attr:`PlannedStage.skipped`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from plait.comm.pipeline import PlacementCode as Code
from plait.comm.pipeline import lay_out
from plait.layout import TensorLayout
from plait.mesh import MeshSpec

__all__ = ["PlannedStage", "follow_plan", "placement_code"]


@dataclass
class PlannedStage:
    """What :func:`follow_plan` did to one stage's graphs."""

    laid_out: int = 0
    """Planned ops whose inputs the stage now lays out as planned."""
    skipped: list[str] = field(default_factory=list)
    """Why each op (or group of ops) of the stage is left to DTensor's propagation."""


def follow_plan(module: nn.Module, ops: Sequence[Any], axes: Sequence[str]) -> PlannedStage:
    """Insert :func:`plait.comm.pipeline.lay_out` before each of ``module``'s ops that ``ops`` (the plan's ops of
    this stage, :class:`plait.planning.PlannedOp`) plans, for the mesh axes ``axes`` inside a
    stage; the plan's layouts are over its whole mesh and keep only those axes here."""
    done = PlannedStage()
    planned: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for op in ops:
        planned[(op.module_path, str(op.target))].append(op)
    graphs = [(path, sub) for path, sub in module.named_modules() if _graph(sub) is not None]
    nodes: dict[tuple[str, str], list[tuple[nn.Module, torch.fx.Node]]] = defaultdict(list)
    for path, sub in graphs:
        for node in _graph(sub).nodes:  # type: ignore[union-attr]
            if node.op == "call_function":
                nodes[(path, str(node.target))].append((sub, node))
    edited: set[int] = set()
    for key, found in nodes.items():
        plan_ops = planned.get(key, [])
        if len(plan_ops) != len(found):
            if plan_ops:
                done.skipped.append(
                    f"{key[1]} in {key[0] or 'the stage'}: {len(found)} in the stage, "
                    f"{len(plan_ops)} in the plan"
                )
            continue
        for (sub, node), op in zip(found, plan_ops, strict=True):
            why = _lay_out_inputs(node.graph, node, op, axes)
            if why:
                done.skipped.append(f"{op.name}: {why}")
                continue
            done.laid_out += 1
            edited.add(id(sub))
    for _, sub in graphs:
        if id(sub) in edited:
            _rebuild(sub)
    return done


def _lay_out_inputs(
    graph: torch.fx.Graph, node: torch.fx.Node, op: Any, axes: Sequence[str]
) -> str | None:
    """Lay ``node``'s tensor inputs out as ``op`` plans them; why not, if it does not."""
    tensors = [a for a in _node_args(node) if isinstance(a.meta.get("val"), torch.Tensor)]
    if len(tensors) != len(op.inputs):
        return f"{len(tensors)} tensor inputs in the stage, {len(op.inputs)} in the plan"
    codes = []
    for layout in op.inputs:
        code = placement_code(layout, axes)
        if code is None:
            return "a strided shard (axes out of mesh order)"
        codes.append(code)
    moved: dict[tuple[torch.fx.Node, Code], torch.fx.Node] = {}
    position = iter(codes)

    def replace(arg: torch.fx.Node) -> torch.fx.Node:
        if not isinstance(arg.meta.get("val"), torch.Tensor):
            return arg
        code = next(position)
        if (arg, code) not in moved:
            with graph.inserting_before(node):
                moved[(arg, code)] = graph.call_function(lay_out, (arg, code))
            moved[(arg, code)].meta["val"] = arg.meta["val"]
        return moved[(arg, code)]

    node.args = torch.fx.node.map_arg(node.args, replace)
    node.kwargs = torch.fx.node.map_arg(node.kwargs, replace)
    return None


def _node_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph nodes ``node`` reads, in order (args, then kwargs), lists entered."""
    found: list[torch.fx.Node] = []

    def keep(arg: torch.fx.Node) -> torch.fx.Node:
        found.append(arg)
        return arg

    torch.fx.node.map_arg((node.args, node.kwargs), keep)
    return found


def placement_code(layout: TensorLayout, axes: Sequence[str]) -> Code | None:
    """``layout`` on the stage's mesh (the axes in ``axes`` only), one code per axis; None
    where it would need a strided shard (a dim split over several axes out of mesh order)."""
    inside = [a for a in layout.mesh.axis_names if a in axes]
    sub = MeshSpec.from_dict({a: layout.mesh.axis_size(a) for a in inside})
    dims = tuple(tuple(a for a in d if a in axes) for d in layout.dims)
    restricted = TensorLayout(sub, dims)
    if not restricted.is_mesh_ordered():
        return None
    out = []
    for axis in inside:
        dim = next((i for i, d in enumerate(dims) if axis in d), None)
        out.append(f"{axis}=R" if dim is None else f"{axis}=S{dim}")
    return tuple(out)


def _rebuild(sub: nn.Module) -> None:
    """Regenerate an edited module's code: an export interpreter module rebuilds its own
    graph module; a plain graph module recompiles."""
    graph = _graph(sub)
    assert graph is not None
    graph.lint()
    finalize = getattr(sub, "finalize", None)
    if callable(finalize):
        finalize()
    elif isinstance(sub, torch.fx.GraphModule):
        sub.recompile()


def _graph(sub: nn.Module) -> torch.fx.Graph | None:
    """The FX graph a stage's module runs, if it runs one (export's interpreter modules and
    graph modules do; the root of a stage is a graph module)."""
    graph = getattr(sub, "graph", None)
    return graph if isinstance(graph, torch.fx.Graph) else None
