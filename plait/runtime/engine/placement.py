"""Turning a model's parameters and buffers into DTensors in given layouts (in place).

Meta init (:mod:`plait.runtime.engine.meta_init`): parameters and buffers on the meta device become
uninitialised pieces, each rank allocating only its own, and the model is marked
uninitialised until a load fills them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from plait._compat import own_per_rank, simulated_ranks
from plait.comm.dtensor import (
    DeviceMesh,
    distribute,
    from_local_piece,
    is_dtensor,
    layout_of,
    mesh_spec_of,
)
from plait.layout import TensorLayout
from plait.runtime.engine.meta_init import check_meta_buffers, mark_uninitialised

if TYPE_CHECKING:
    from plait.comm.dtensor import DTensor

__all__ = ["place_parameters", "reshard_parameters"]


def place_parameters(
    model: nn.Module,
    layouts: dict[str, TensorLayout],
    device_mesh: DeviceMesh,
    buffers: dict[str, TensorLayout] | None = None,
) -> dict[str, TensorLayout]:
    """Parameters -> DTensors in ``layouts`` (by name; a tied parameter once, under any of its
    names); buffers in ``buffers``' layouts, replicated when not named. Returns every
    parameter name's layout.

    Parameters and persistent buffers on the meta device become uninitialised pieces (see the
    module docstring); a non-persistent buffer on it is refused before anything changes.
    """
    check_meta_buffers(model)
    mesh = mesh_spec_of(device_mesh)
    buffers = buffers or {}
    buffer_names = {id(b): n for n, b in model.named_buffers()}
    done: dict[int, nn.Parameter] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    meta = False
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                meta = meta or p.is_meta
                value = _placed(p.detach(), device_mesh, layouts[names[id(p)]])
                done[id(p)] = nn.Parameter(value, p.requires_grad)
            module._parameters[name] = done[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and not is_dtensor(b):
                layout = buffers.get(buffer_names.get(id(b), ""))
                layout = layout or TensorLayout.replicated(mesh, b.ndim)
                meta = meta or b.is_meta
                module._buffers[name] = _placed(b, device_mesh, layout)
    if meta:
        mark_uninitialised(model)
    return {n: layouts[n] for n, _ in model.named_parameters()}


def _placed(tensor: torch.Tensor, device_mesh: DeviceMesh, layout: TensorLayout) -> torch.Tensor:
    """``tensor`` as a DTensor in ``layout``: sliced when it is whole on every rank; for a meta
    tensor, uninitialised, each rank allocating its own piece only (simulated ranks one private
    piece each)."""
    if not tensor.is_meta:
        return distribute(tensor, device_mesh, layout)
    layout.check_shape(tuple(tensor.shape))
    shape = [s // n for s, n in zip(tensor.shape, layout.splits(), strict=True)]
    local = torch.empty(shape, dtype=tensor.dtype, device=device_mesh.device_type)
    ranks = simulated_ranks()
    if ranks is not None:
        local = own_per_rank(local, ranks)
    return from_local_piece(local, device_mesh, layout)


def reshard_parameters(
    model: nn.Module,
    placements: dict[str, tuple[Any, ...]],
    device_mesh: DeviceMesh,
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
                whole = cast("DTensor", p.detach())  # the parameters named are DTensors
                moved = whole.redistribute(device_mesh, placements[names[id(p)]])
                done[id(p)] = nn.Parameter(moved, p.requires_grad)
            module._parameters[name] = done[id(p)]
    out = dict(layouts)
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in {id(q) for q in done.values()}:
            out[n] = layout_of(cast("DTensor", p))
    return out
