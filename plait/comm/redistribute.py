"""Running a planned redistribution (:mod:`plait.layout.redistribute`) on a DTensor.

A :class:`~plait.layout.redistribute.Redistribution` is a list of single-axis steps, each one
collective (or a local op) over one mesh axis. :func:`run_redistribution` runs exactly those
steps, so the collectives a program issues are the ones its plan priced:

- ``all_gather``, ``all_reduce``, ``reduce_scatter`` and ``slice`` go through
  ``DTensor.redistribute`` between the step's two layouts, which differ on one mesh axis only;
  DTensor issues that one collective (or, for a slice, keeps each rank's chunk);
- ``all_to_all`` runs as one functional all-to-all on the local piece: DTensor gathers
  instead when either side is a strided shard (a dim split over axes against mesh order);
- ``partition`` (replicated -> pending sum) is local: DTensor refuses it, so the local piece
  is divided by the axis size for ``sum`` (kept for ``avg``/``max``/``min``), as DTensor does
  internally.

:func:`execute_redistribution` is the differentiable form used in forward passes: its
backward brings the incoming gradient, whatever its layout, to the source layout with pending
sums reduced (the layout a gradient of the source has), again with a planned redistribution.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from plait._compat import funcol
from plait.comm.dtensor import DeviceMesh, contiguous_stride, layout_of, to_dtensor_placements
from plait.errors import LayoutError
from plait.layout import TensorLayout
from plait.layout.redistribute import Redistribution, RedistStep, plan_redistribution

__all__ = [
    "execute_redistribution",
    "redistribute_to",
    "replicated_from_local",
    "run_redistribution",
    "run_step",
    "settled",
]


def settled(layout: TensorLayout) -> TensorLayout:
    """``layout`` with its pending sums reduced: the layout of a gradient flowing back to it."""
    return layout if not layout.partial else TensorLayout(layout.mesh, layout.dims)


def _rewrap(tensor: DTensor, local: torch.Tensor, layout: TensorLayout) -> DTensor:
    return DTensor.from_local(
        local,
        tensor.device_mesh,
        to_dtensor_placements(layout),
        run_check=False,
        shape=tensor.shape,
        stride=contiguous_stride(tensor.shape),
    )


def _all_to_all(tensor: DTensor, step: RedistStep) -> DTensor:
    """Innermost split of ``from_dim`` moves to innermost split of ``to_dim`` over the axis."""
    mesh = step.before.mesh
    n = step.group_size
    src, dst = step.from_dim, step.to_dim
    assert src is not None and dst is not None
    local = tensor.to_local()
    if local.shape[dst] % n:
        raise LayoutError(
            f"all_to_all@{step.axis}: local piece of shape {tuple(local.shape)} does not divide "
            f"dim {dst} into {n}; plans split dims evenly, so the tensor does not match its plan"
        )
    # chunk j goes to group rank j; the received chunks stack along the dim the axis leaves
    sent = torch.stack(local.chunk(n, dim=dst)).contiguous()
    got = funcol.all_to_all_single(
        sent, None, None, (tensor.device_mesh, mesh.axis_index(step.axis))
    )
    out = torch.cat(funcol.wait_tensor(got).unbind(0), dim=src)
    return _rewrap(tensor, out, step.after)


def run_step(tensor: DTensor, step: RedistStep) -> DTensor:
    """One step of a plan on ``tensor`` (laid out ``step.before``); not differentiable."""
    if step.kind == "all_to_all":
        return _all_to_all(tensor, step)
    if step.kind == "partition":
        scale = step.group_size if step.after.reduce_op == "sum" else 1
        local = tensor.to_local()
        return _rewrap(tensor, local / scale if scale != 1 else local, step.after)
    return tensor.redistribute(tensor.device_mesh, to_dtensor_placements(step.after))


def run_redistribution(tensor: DTensor, redistribution: Redistribution) -> DTensor:
    """Every step of ``redistribution`` in order on ``tensor``; not differentiable.

    Raises LayoutError when ``tensor`` is not laid out as the plan's source.
    """
    have = layout_of(tensor)
    if have != redistribution.src:
        raise LayoutError(
            f"redistribution {redistribution.src.describe()} -> {redistribution.dst.describe()} "
            f"was given a tensor laid out {have.describe()}; plan from the tensor's own layout"
        )
    for step in redistribution.steps:
        tensor = run_step(tensor, step)
    return tensor


def redistribute_to(tensor: DTensor, layout: TensorLayout) -> DTensor:
    """``tensor`` brought to ``layout`` with a planned redistribution; not differentiable."""
    have = layout_of(tensor)
    if have == layout:
        return tensor
    itemsize = tensor.element_size()
    return run_redistribution(
        tensor, plan_redistribution(have, layout, tuple(tensor.shape), itemsize)
    )


class _Redistribute(torch.autograd.Function):
    """Forward: the planned steps. Backward: the gradient to the settled source layout."""

    @staticmethod
    def forward(ctx: Any, tensor: DTensor, redistribution: Redistribution) -> DTensor:  # type: ignore[override]
        ctx.source = redistribution.src
        return run_redistribution(tensor, redistribution)

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple[DTensor | None, None]:  # type: ignore[override]
        if grad is None:
            return None, None
        return redistribute_to(grad, settled(ctx.source)), None


def execute_redistribution(tensor: DTensor, redistribution: Redistribution) -> DTensor:
    """Run ``redistribution`` on ``tensor``, differentiably.

    In backward the gradient (in whatever layout the consumers handed back) is brought to
    ``settled(redistribution.src)`` by a planned redistribution: pending sums are reduced by
    the cheapest collective and splits restored, as :mod:`plait.planning.assemble` prices an edge.
    """
    if redistribution.is_noop():
        return tensor
    if not tensor.requires_grad:
        return run_redistribution(tensor, redistribution)
    return _Redistribute.apply(tensor, redistribution)  # type: ignore[no-any-return]


def replicated_from_local(local: torch.Tensor, device_mesh: DeviceMesh) -> DTensor:
    """A whole value every rank computed alike, as a replicated DTensor (differentiable)."""
    return DTensor.from_local(local, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
