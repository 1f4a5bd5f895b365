"""Applying layouts to a model: DTensor parameters and per-module redistribution.

For every ``nn.Linear`` and ``nn.Embedding`` plait installs a forward that follows its op rule
(:mod:`plait.rules`): the input is redistributed to the layout the rule needs, the op runs on
DTensors, and pending partial sums are reduced to the output layout. Unannotated ones get the
data-parallel default: the weight is replicated and the input keeps the split its producer
gave it. Other annotated modules get hooks that redistribute their inputs and outputs; the ops
inside follow DTensor's propagation from there (MindSpore's ``Cell.shard``).

All validation happens in :func:`collect_layouts`, before any parameter changes or any
collective runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.annotate import StrategyLike, get_shard_spec
from plait.comm.dtensor import (
    as_dtensor,
    distribute,
    is_dtensor,
    layout_of,
    pin_grad_layout,
    to_layout,
)
from plait.errors import ShardingError
from plait.layout import TensorLayout, resolve_tensor_strategy
from plait.mesh import MeshSpec
from plait.rules import EmbeddingRule, LinearRule
from plait.rules.common import to_mesh

__all__ = ["ModelLayouts", "apply_layouts", "collect_layouts"]


@dataclass(slots=True)
class ModelLayouts:
    """Every parameter's layout and every module's rule, validated, not yet applied."""

    params: dict[int, tuple[TensorLayout, str]] = field(default_factory=dict)
    rules: dict[str, LinearRule | EmbeddingRule] = field(default_factory=dict)
    hooks: dict[str, tuple[tuple[Any, ...] | None, tuple[Any, ...] | None]] = field(
        default_factory=dict
    )

    def layout_by_name(self, model: nn.Module) -> dict[str, TensorLayout]:
        return {
            name: self.params[id(p)][0]
            for name, p in model.named_parameters()
            if id(p) in self.params
        }


def _resolve_param(
    strategy: StrategyLike, p: torch.Tensor, mesh: MeshSpec, where: str
) -> TensorLayout:
    if isinstance(strategy, TensorLayout):
        layout = to_mesh(strategy, mesh, where)
        layout.check_shape(tuple(p.shape), where)
        return layout
    return resolve_tensor_strategy(strategy, mesh, where, tuple(p.shape))


def _record(layouts: ModelLayouts, p: torch.Tensor, layout: TensorLayout, where: str) -> None:
    prev = layouts.params.get(id(p))
    if prev is not None and prev[0] != layout:
        raise ShardingError(
            f"parameter {where} (also reached as {prev[1]}) is annotated {layout.describe()} here and "
            f"{prev[0].describe()} there; a shared parameter has one layout: make the two annotations agree"
        )
    if prev is None:
        layouts.params[id(p)] = (layout, where)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _first(strategies: tuple[Any, ...] | None, where: str, what: str) -> Any:
    if strategies is None:
        return None
    if len(strategies) != 1:
        raise ShardingError(
            f"{where}: {what} has {len(strategies)} strategies but the module takes one tensor"
        )
    return strategies[0]


def collect_layouts(model: nn.Module, mesh: MeshSpec, dp_axis: str) -> ModelLayouts:
    """Resolve and validate every annotation in ``model`` (no mutation, no communication)."""
    layouts = ModelLayouts()
    for path, module in model.named_modules():
        spec = get_shard_spec(module)
        for pname, strategy in (spec.parameter_strategy if spec else {}).items():
            where = _join(path, pname)
            p = module.get_parameter(pname)
            _record(layouts, p, _resolve_param(strategy, p, mesh, where), where)
    for path, module in model.named_modules():
        spec = get_shard_spec(module)
        where = path or type(module).__name__
        ins = spec.in_strategy if spec else None
        outs = spec.out_strategy if spec else None
        if isinstance(module, nn.Linear):
            w = _layout_or_replicated(layouts, module.weight, mesh)
            rule: LinearRule | EmbeddingRule = LinearRule(
                where,
                mesh,
                dp_axis,
                w,
                module.bias is not None,
                _first(ins, where, "in_strategy"),
                _first(outs, where, "out_strategy"),
            )
            _record(layouts, module.weight, w, _join(path, "weight"))
            if module.bias is not None:
                _record(layouts, module.bias, TensorLayout(mesh, (w.dims[0],)), _join(path, "bias"))
            layouts.rules[path] = rule
        elif isinstance(module, nn.Embedding):
            w = _layout_or_replicated(layouts, module.weight, mesh)
            layouts.rules[path] = EmbeddingRule(
                where,
                mesh,
                dp_axis,
                w,
                _first(ins, where, "in_strategy"),
                _first(outs, where, "out_strategy"),
            )
            _record(layouts, module.weight, w, _join(path, "weight"))
        elif ins is not None or outs is not None:
            layouts.hooks[path] = (ins, outs)
    for name, p in model.named_parameters():
        if id(p) not in layouts.params:
            layouts.params[id(p)] = (TensorLayout.replicated(mesh, p.ndim), name)
    return layouts


def _layout_or_replicated(layouts: ModelLayouts, p: torch.Tensor, mesh: MeshSpec) -> TensorLayout:
    found = layouts.params.get(id(p))
    return found[0] if found else TensorLayout.replicated(mesh, p.ndim)


def _input_layout(
    x: torch.Tensor, needed_last: tuple[str, ...] | None, weight: TensorLayout
) -> TensorLayout:
    """Default input layout: keep the producer's split, minus the weight's axes; fix the last dim."""
    mesh = weight.mesh
    if not is_dtensor(x):
        dims: list[tuple[str, ...]] = [()] * x.ndim
    else:
        used = {a for axes in weight.dims for a in axes}
        dims = [tuple(a for a in axes if a not in used) for axes in layout_of(x).dims]
    if needed_last is not None:
        dims[-1] = needed_last
    return TensorLayout(mesh, tuple(dims))


def _as_replicated_if_plain(x: torch.Tensor, device_mesh: Any, mesh: MeshSpec) -> torch.Tensor:
    """A plain tensor met inside forward (e.g. ``torch.arange`` positions) is the same on
    every rank: treat it as replicated."""
    return x if is_dtensor(x) else distribute(x, device_mesh, TensorLayout.replicated(mesh, x.ndim))


def _linear_forward(
    module: nn.Linear, rule: LinearRule, device_mesh: Any, x: torch.Tensor
) -> torch.Tensor:
    explicit = rule.in_strategy is not None or rule.out_strategy is not None
    lay = rule.layouts(x.ndim) if explicit else None
    x_layout = (
        lay.input
        if lay is not None and rule.in_strategy is not None
        else _input_layout(x, rule.weight.dims[1], rule.weight)
    )
    x = to_layout(_as_replicated_if_plain(x, device_mesh, rule.mesh), x_layout)
    if any(rule.weight.dims):
        # A split weight leaves the input's gradient a pending sum: reduce it here (see pin).
        x = pin_grad_layout(x)
    y = F.linear(x, module.weight)
    out = (
        lay.output
        if lay is not None and rule.out_strategy is not None
        else TensorLayout(rule.mesh, (*x_layout.dims[:-1], rule.weight.dims[0]))
    )
    y = to_layout(y, out)
    return y + module.bias if module.bias is not None else y


def _embedding_forward(
    module: nn.Embedding, rule: EmbeddingRule, device_mesh: Any, ids: torch.Tensor
) -> torch.Tensor:
    explicit = rule.in_strategy is not None or rule.out_strategy is not None
    lay = rule.layouts(ids.ndim) if explicit else None
    ids_layout = (
        lay.input
        if lay is not None and rule.in_strategy is not None
        else _input_layout(ids, None, rule.weight)
    )
    y = F.embedding(
        to_layout(_as_replicated_if_plain(ids, device_mesh, rule.mesh), ids_layout),
        module.weight,
        module.padding_idx,
        module.max_norm,
        module.norm_type,
        module.scale_grad_by_freq,
        module.sparse,
    )
    out = (
        lay.output
        if lay is not None and rule.out_strategy is not None
        else TensorLayout(rule.mesh, (*ids_layout.dims, rule.weight.dims[1]))
    )
    return to_layout(y, out)


def _tensor_layout(strategy: Any, x: torch.Tensor, mesh: MeshSpec, where: str) -> TensorLayout:
    if isinstance(strategy, TensorLayout):
        layout = to_mesh(strategy, mesh, where)
        layout.check_shape(tuple(x.shape), where)
        return layout
    return resolve_tensor_strategy(strategy, mesh, where, tuple(x.shape))


def _relayout_all(
    values: Any, strategies: tuple[Any, ...], mesh: MeshSpec, device_mesh: Any, where: str
) -> Any:
    single = isinstance(values, torch.Tensor)
    items = (values,) if single else tuple(values)
    tensors = [v for v in items if isinstance(v, torch.Tensor)]
    if len(strategies) != len(tensors):
        raise ShardingError(
            f"{where}: {len(strategies)} strategies for {len(tensors)} tensors; give one per tensor (None to leave one)"
        )
    it = iter(strategies)
    out = []
    for v in items:
        s = next(it) if isinstance(v, torch.Tensor) else None
        out.append(
            v if s is None else as_dtensor(v, device_mesh, _tensor_layout(s, v, mesh, where))
        )
    return out[0] if single else type(values)(out) if isinstance(values, tuple) else out


def _install_hooks(
    module: nn.Module, where: str, ins: Any, outs: Any, mesh: MeshSpec, device_mesh: Any
) -> None:
    if ins is not None:
        module.register_forward_pre_hook(
            lambda _m, args: _relayout_all(args, ins, mesh, device_mesh, f"{where} in_strategy")
        )
    if outs is not None:
        module.register_forward_hook(
            lambda _m, _a, out: _relayout_all(out, outs, mesh, device_mesh, f"{where} out_strategy")
        )


def apply_layouts(model: nn.Module, layouts: ModelLayouts, device_mesh: Any) -> None:
    """Turn parameters and buffers into DTensors and install the per-module forwards."""
    mesh = next(iter(layouts.params.values()))[0].mesh if layouts.params else None
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                layout = layouts.params[id(p)][0]
                done[id(p)] = nn.Parameter(
                    distribute(p.detach(), device_mesh, layout), p.requires_grad
                )
            module._parameters[name] = done[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and mesh is not None:
                module._buffers[name] = distribute(
                    b, device_mesh, TensorLayout.replicated(mesh, b.ndim)
                )
    modules = dict(model.named_modules())
    for path, rule in layouts.rules.items():
        module = modules[path]
        forward: Callable[..., torch.Tensor] = (
            _linear_forward if isinstance(rule, LinearRule) else _embedding_forward
        )  # type: ignore[assignment]
        module.forward = functools.partial(forward, module, rule, device_mesh)  # type: ignore[method-assign]
    for path, (ins, outs) in layouts.hooks.items():
        assert mesh is not None
        _install_hooks(
            modules[path], path or type(modules[path]).__name__, ins, outs, mesh, device_mesh
        )
