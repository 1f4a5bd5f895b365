"""Turning a model's parameters and buffers into DTensors in given layouts (in place)."""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.comm.dtensor import distribute, is_dtensor, layout_of, mesh_spec_of
from plait.layout import TensorLayout

__all__ = ["place_parameters", "reshard_parameters"]


def place_parameters(
    model: nn.Module,
    layouts: dict[str, TensorLayout],
    device_mesh: Any,
    buffers: dict[str, TensorLayout] | None = None,
) -> dict[str, TensorLayout]:
    """Parameters -> DTensors in ``layouts`` (by name; a tied parameter once, under any of its
    names); buffers in ``buffers``' layouts, replicated when not named. Returns every
    parameter name's layout."""
    mesh = mesh_spec_of(device_mesh)
    buffers = buffers or {}
    buffer_names = {id(b): n for n, b in model.named_buffers()}
    done: dict[int, nn.Parameter] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                layout = layouts[names[id(p)]]
                done[id(p)] = nn.Parameter(
                    distribute(p.detach(), device_mesh, layout), p.requires_grad
                )
            module._parameters[name] = done[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and not is_dtensor(b):
                layout = buffers.get(buffer_names.get(id(b), ""))
                layout = layout or TensorLayout.replicated(mesh, b.ndim)
                module._buffers[name] = distribute(b, device_mesh, layout)
    return {n: layouts[n] for n, _ in model.named_parameters()}


def reshard_parameters(
    model: nn.Module,
    placements: dict[str, tuple[Any, ...]],
    device_mesh: Any,
    layouts: dict[str, TensorLayout],
) -> dict[str, TensorLayout]:
    """DTensor parameters named in ``placements`` -> new parameters laid out so (in place;
    a tied parameter once). Returns ``layouts`` with theirs updated."""
    names = {id(p): n for n, p in model.named_parameters()}
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or names.get(id(p)) not in placements:
                continue
            if id(p) not in done:
                moved = p.detach().redistribute(device_mesh, placements[names[id(p)]])
                done[id(p)] = nn.Parameter(moved, p.requires_grad)
            module._parameters[name] = done[id(p)]
    out = dict(layouts)
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in {id(q) for q in done.values()}:
            out[n] = layout_of(p)
    return out
