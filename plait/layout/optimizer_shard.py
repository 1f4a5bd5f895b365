"""Optimizer parallel (ZeRO): which dim of a parameter's piece is split over the data-parallel axis.

MindSpore's optimizer parallel splits each parameter along the device-matrix axes it is *not*
already split on (its data-parallel replicas): a weight split k ways by tensor parallel is
split again over dp. plait splits the parameter's local piece along one dim that no other mesh
axis splits and that divides evenly, so the result is an ordinary layout (that dim split over
dp), the same rule for the planner (what the plan predicts) and the runtime (what runs):

* dim 0 when it is free and divides, else the first free dim that divides;
* a piece smaller than the threshold (MindSpore's ``parallel_optimizer_threshold``, 64 KB by
  default) stays whole: its collectives would cost more in latency than its memory saves;
* a parameter already split over dp, or with no such dim, stays whole (and says why).

Pure planning code: no process groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from plait.layout.layout import TensorLayout

__all__ = ["optimizer_shard_dim", "optimizer_shard_layout", "why_whole"]


def optimizer_shard_dim(
    layout: TensorLayout,
    shape: Sequence[int],
    axis: str,
    *,
    itemsize: int,
    threshold: int,
) -> int | None:
    """The dim of the local piece optimizer parallel splits over ``axis``, or None (whole)."""
    return _choose(layout, shape, axis, itemsize=itemsize, threshold=threshold)[0]


def why_whole(
    layout: TensorLayout, shape: Sequence[int], axis: str, *, itemsize: int, threshold: int
) -> str:
    """Why a parameter stays whole under optimizer parallel ("" when it is split)."""
    return _choose(layout, shape, axis, itemsize=itemsize, threshold=threshold)[1]


def _choose(
    layout: TensorLayout, shape: Sequence[int], axis: str, *, itemsize: int, threshold: int
) -> tuple[int | None, str]:
    mesh = layout.mesh
    if axis not in mesh.axis_names or mesh.axis_size(axis) == 1:
        return None, f"no {axis!r} axis larger than 1 to shard over"
    if any(axis in axes for axes in layout.dims):
        return None, f"already split over {axis!r} by its layout"
    n = mesh.axis_size(axis)
    local = layout.local_shape(shape)
    nbytes = math.prod(local) * itemsize
    if nbytes < threshold:
        return None, f"its piece ({nbytes} bytes) is under optimizer_shard_threshold={threshold}"
    for d in range(len(local)):
        if not layout.dims[d] and local[d] % n == 0:
            return d, ""
    return None, (
        f"no dim of its piece {tuple(local)} that no other axis splits divides by {axis!r}={n}; "
        f"to split it, give it a dim divisible by {n} or use a {axis!r} size that divides one"
    )


def optimizer_shard_layout(layout: TensorLayout, dim: int, axis: str) -> TensorLayout:
    """``layout`` with its piece's dim ``dim`` split over ``axis`` (where ZeRO-3 keeps it)."""
    dims = list(layout.dims)
    dims[dim] = (axis,)
    return TensorLayout(layout.mesh, tuple(dims), layout.partial, layout.reduce_op)
