"""Capture by ``torch.export``: model + example batch + loss -> :class:`~plait.graph.OpGraph`.

``torch.export.export(strict=False)`` traces the forward pass and the loss on fake tensors
(a model built on the meta device, or a real one: export reads only shapes, so no parameter
memory is allocated). The graph is kept at the level of torch's training IR (``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention``...): plait's op catalogue is
written against that level, so no decompositions run.

Repeated layers (:mod:`plait.graph.repeat`). With ``repeat=True`` capture traces only the
first two members of each long run of identical layers and synthesises the rest; the result
equals a full capture, op names included. When the shortened model does not trace or its
members do not chain, capture falls back to a full trace. It cannot see a forward that treats
later members differently from member 1 without showing it in the first two (``for b in
blocks[:k]`` with a ``k`` from elsewhere, per-layer inputs computed before the loop): pass
``repeat=False`` for such models.

What export leaves that is not a plain aten op (``torch.vmap``, ``torch.cond``, reentrant
activation checkpoints, tensor literals, writes into views) is rewritten before conversion;
other higher-order ops and value-dependent sizes or branches are refused with the module and
line (:mod:`plait.graph.higher_order`, :mod:`plait.graph.sites`; docs/models.md).

Names and dropped nodes: see :mod:`plait.graph.convert`. Frozen parameters: each parameter
input records the model's ``requires_grad`` (:attr:`GraphInput.requires_grad`), so planning
lists no gradient work for frozen ones.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait._compat import simulation_suspended
from plait.errors import CaptureError
from plait.graph.convert import Captured, batch_leaves, canonical_names, convert_program
from plait.graph.functional import fills_as_copies, functional_views, stride_free_views
from plait.graph.higher_order import (
    inline_higher_order,
    inlined_while_exporting,
    refuse_higher_order,
)
from plait.graph.literals import plain_literals
from plait.graph.opgraph import OpGraph
from plait.graph.repeat import (
    LayerRun,
    NotRepeatable,
    expand_run,
    find_repeated_layers,
    shortened,
    tag_layers,
    verified_groups,
)
from plait.graph.sites import is_value_dependent, site_of_exception, value_dependent_error

__all__ = [
    "AUTOCAST_META",
    "GRAD_ENABLED_META",
    "ExecutableCapture",
    "LossFn",
    "batch_leaves",
    "capture",
    "capture_program",
    "in_mode",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class _Traced(nn.Module):
    """The user's model and loss as one module, so one export covers forward and loss."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None) -> None:
        super().__init__()
        self.model = model  # named convert.WRAPPED: conversion strips it from FQNs
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Any:
        if self.loss_fn is not None:
            return self.loss_fn(self.model, batch)
        if isinstance(batch, dict):
            return self.model(**batch)
        if isinstance(batch, tuple | list):
            return self.model(*batch)
        return self.model(batch)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_tensors(fn, v) for v in obj]
    if isinstance(obj, tuple):
        items = [_map_tensors(fn, v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(fn, v)) for k, v in obj.items())
    return obj


def _device_of(model: nn.Module) -> torch.device | None:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return None if first is None else first.device


def _batch_for(model: nn.Module, batch: Any) -> Any:
    """The batch on the model's device without touching real memory.

    A meta model gets meta copies of the batch; a real model given a meta batch gets
    uninitialised tensors (export reads only their shapes, and untouched pages are never
    committed).
    """
    device = _device_of(model)

    def move(t: torch.Tensor) -> torch.Tensor:
        if device is None or t.device == device:
            return t
        if device.type == "meta":
            return t.to("meta")
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    return _map_tensors(move, batch)


GRAD_ENABLED_META = "plait_grad_enabled"
"""fx node meta key: False on ops that ran inside a ``torch.no_grad()`` region of the forward."""
AUTOCAST_META = "plait_autocast"
"""fx node meta key: ``(device_type, dtype, enabled, cache_enabled)`` of the ``torch.autocast``
region an op ran in."""

# export's region wrappers -> (meta key, how many leading arguments describe the region)
_REGIONS = {
    "wrap_with_set_grad_enabled": (GRAD_ENABLED_META, 1),
    "wrap_with_autocast": (AUTOCAST_META, 4),
}


def _inline_regions(gm: torch.fx.GraphModule) -> None:
    """Inline export's ``wrap_with_set_grad_enabled`` and ``wrap_with_autocast`` regions (a
    ``@torch.no_grad()`` forward, an ``autocast(enabled=False)`` block, as in Hugging Face's
    rotary embeddings) into the graph, in place, innermost first.

    The regions' ops become ordinary ops of the graph; each carries the region in its meta
    (:data:`GRAD_ENABLED_META`, :data:`AUTOCAST_META`; the innermost region wins), so that an
    executor runs it as the model did.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        region = _REGIONS.get(str(node.target)) if node.op == "call_function" else None
        if region is None:
            continue
        key, lead = region
        setting, holder, operands = node.args[:lead], node.args[lead], node.args[lead + 1 :]
        sub = getattr(gm, holder.target)
        _inline_regions(sub)
        plain = all(n.op in ("placeholder", "call_function", "output") for n in sub.graph.nodes)
        if not plain or any(u.target is not operator.getitem for u in node.users):
            continue  # nested modules or odd outputs: capture reports the region by name
        value = bool(setting[0]) if key == GRAD_ENABLED_META else tuple(setting)
        env: dict[torch.fx.Node, Any] = dict(
            zip([n for n in sub.graph.nodes if n.op == "placeholder"], operands, strict=True)
        )
        outputs: Any = ()
        with graph.inserting_before(node):
            for inner in sub.graph.nodes:
                if inner.op == "output":
                    outputs = inner.args[0]
                elif inner.op == "call_function":
                    copied = graph.node_copy(inner, env.__getitem__)
                    copied.meta.setdefault(key, value)
                    env[inner] = copied
        results = [env.get(o, o) if isinstance(o, torch.fx.Node) else o for o in outputs]
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not holder.users:
            graph.erase_node(holder)
            delattr(gm, holder.target)
    graph.lint()
    gm.recompile()


def _exported(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.export.ExportedProgram:
    """``loss_fn(model, batch)`` exported as plain aten ops: writes into views functionalized
    (:mod:`~plait.graph.functional`), no_grad/autocast regions, vmap and cond inlined
    (:mod:`~plait.graph.higher_order`), tensor literals made plain
    (:mod:`~plait.graph.literals`), views that relied on export's strides made reshapes and
    tensor fills copies (:mod:`~plait.graph.functional`);
    export's own errors pass through."""
    # outside a simulated world: some models do not export under LocalTensorMode
    with simulation_suspended(), inlined_while_exporting():
        program = torch.export.export(_Traced(model, loss_fn), (batch,), strict=False)
        program = functional_views(program)  # writes into views would miss their base
    _inline_regions(program.graph_module)
    inline_higher_order(program.graph_module)
    _inline_regions(program.graph_module)  # regions that were inside an inlined subgraph
    plain_literals(program)
    strides = stride_free_views(program.graph_module.graph)
    if fills_as_copies(program.graph_module.graph) or strides:
        program.graph_module.recompile()
    refuse_higher_order(program.graph_module, type(model).__name__)
    return program


def _export(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.export.ExportedProgram:
    try:
        return _exported(model, batch, loss_fn)
    except CaptureError:
        raise
    except Exception as e:
        name = type(model).__name__
        if is_value_dependent(e):
            culprit = site_of_exception(e, model) or "the forward or the loss"
            raise value_dependent_error(name, culprit, e) from e
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        site = site_of_exception(e, model)
        where = f" in {site}" if site else ""
        raise CaptureError(
            f"capture of {name} failed{where}: torch.export raised {type(e).__name__}: "
            f"{text[:500]}; check that loss_fn(model, batch) runs under `with "
            "torch.device('meta'):` on meta tensors and that the batch matches what the model "
            "expects"
        ) from e


def _finish(
    cap: Captured, runs: Sequence[LayerRun], names: dict[str, str] | None = None
) -> OpGraph:
    """The finished graph; ``names`` (if given) receives export's node name -> op name."""
    groups = verified_groups(cap, runs)
    rename = canonical_names(cap)
    if names is not None:
        names.update(rename)
    graph = OpGraph(tuple(cap.inputs), tuple(cap.ops), tuple(cap.outputs), tuple(groups))
    graph.validate()
    return graph


def _check_loss(graph: OpGraph, model: nn.Module, loss_fn: LossFn | None) -> None:
    if loss_fn is None or not graph.outputs:
        return
    meta = graph.meta(graph.outputs[0])
    if meta.ndim != 0:
        raise CaptureError(
            f"capture of {type(model).__name__}: loss_fn returned a tensor of shape "
            f"{meta.shape}, not a scalar; reduce it in loss_fn (e.g. .mean())"
        )


# --------------------------------------------------------------------------- entry point


@contextlib.contextmanager
def in_mode(model: nn.Module, *, training: bool) -> Iterator[nn.Module]:
    """Every module of ``model`` in training (or eval) mode inside the block, as
    ``model.train(training)`` sets it; each module's own mode is restored after.

    Plans are for training steps and the runtime's steps run under ``model.train()``: the
    programs planned and run are exported so, whatever mode the user's model was left in.
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train(training)
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


def capture(
    model: nn.Module,
    example_batch: Any,
    loss_fn: LossFn | None = None,
    *,
    repeat: bool = True,
) -> OpGraph:
    """Trace ``loss_fn(model, example_batch)`` (or ``model(*example_batch)``) into an OpGraph.

    ``model`` may live on the meta device or hold real weights: only shapes are read.
    ``example_batch`` is a tensor, a tuple/list or a dict of tensors; without ``loss_fn`` it
    is unpacked into the model's arguments. ``repeat=True`` traces only two members of long
    runs of identical layers and synthesises the rest (see the module doc); ``repeat=False``
    traces every layer. Both record the same layer groups and give equal graphs.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(
            f"capture: model is a {type(model).__name__}, not a torch.nn.Module; pass the module"
        )
    batch = _batch_for(model, example_batch)
    runs = find_repeated_layers(model)
    long_runs = [r for r in runs if len(r.keys) > 2]
    graph: OpGraph | None = None
    if repeat and long_runs:
        graph = _capture_shortened(model, batch, loss_fn, runs, long_runs)
    if graph is None:
        cap = convert_program(_export(model, batch, loss_fn), model, batch)
        tag_layers(cap, runs)
        graph = _finish(cap, runs)
    _check_loss(graph, model, loss_fn)
    return graph


def _capture_shortened(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    runs: Sequence[LayerRun],
    long_runs: Sequence[LayerRun],
) -> OpGraph | None:
    short = shortened(model, long_runs)
    try:
        program = _exported(short, batch, loss_fn)
    except Exception:
        return None  # e.g. the forward indexes members 2..N-1: the full trace reports errors
    cap = convert_program(program, model, batch)
    tag_layers(cap, runs)
    try:
        for run in long_runs:
            expand_run(cap, run)
    except NotRepeatable:
        return None
    graph = _finish(cap, runs)
    if not {r.members for r in long_runs} <= {g.members for g in graph.layers}:
        return None  # a synthesised group did not verify: trust only a full trace
    return graph


# --------------------------------------------------------------------------- for execution


@dataclass(frozen=True)
class ExecutableCapture:
    """A full trace kept for running: the exported program, its OpGraph, and how they match.

    ``op_of_node`` maps each fx node name of ``program.graph`` that became an op of ``graph``
    to that op's name (the names a Plan uses); nodes capture folds away (getitem, alias,
    assertions) are absent.
    """

    program: torch.export.ExportedProgram
    graph: OpGraph
    op_of_node: dict[str, str]


def capture_program(
    model: nn.Module, example_batch: Any, loss_fn: LossFn | None = None
) -> ExecutableCapture:
    """Trace every layer (no repeated-layer fast path) and keep the program for execution.

    The graph equals :func:`capture`'s (op names included); only shapes are read, so a model
    with real weights is not copied.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(
            f"capture: model is a {type(model).__name__}, not a torch.nn.Module; pass the module"
        )
    batch = _batch_for(model, example_batch)
    runs = find_repeated_layers(model)
    program = _export(model, batch, loss_fn)
    cap = convert_program(program, model, batch)
    tag_layers(cap, runs)
    names: dict[str, str] = {}
    graph = _finish(cap, runs, names)
    _check_loss(graph, model, loss_fn)
    return ExecutableCapture(program, graph, names)
