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

With shard groups (HSDP, MindSpore's ``optimizer_weight_shard_size``) the piece is split over
a group of ``shard_size`` consecutive ranks of the axis instead of all of it, and the dim must
divide by that size (:func:`shard_group_size` says which size is in effect).

Pure planning code: no process groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from plait.errors import LayoutError
from plait.layout.layout import TensorLayout

__all__ = ["optimizer_shard_dim", "optimizer_shard_layout", "shard_group_size", "why_whole"]


def optimizer_shard_dim(
    layout: TensorLayout,
    shape: Sequence[int],
    axis: str,
    *,
    itemsize: int,
    threshold: int,
    shard_size: int | None = None,
) -> int | None:
    """The dim of the local piece optimizer parallel splits over ``axis`` (over groups of
    ``shard_size`` of its ranks when given), or None (whole)."""
    return _choose(
        layout, shape, axis, itemsize=itemsize, threshold=threshold, shard_size=shard_size
    )[0]


def why_whole(
    layout: TensorLayout,
    shape: Sequence[int],
    axis: str,
    *,
    itemsize: int,
    threshold: int,
    shard_size: int | None = None,
) -> str:
    """Why a parameter stays whole under optimizer parallel ("" when it is split)."""
    return _choose(
        layout, shape, axis, itemsize=itemsize, threshold=threshold, shard_size=shard_size
    )[1]


def shard_group_size(axis: str, axis_size: int, shard_size: int | None) -> int:
    """Ranks one parameter's shards spread over: ``shard_size`` (HSDP's group of consecutive
    ranks of ``axis``), or the whole axis when None. One rule for planner and runtime, so a
    size that does not divide the axis (a mesh the outer planner chose) fails the same way."""
    if shard_size is None or shard_size == axis_size:
        return axis_size
    if axis_size % shard_size:
        divisors = [d for d in range(1, axis_size + 1) if axis_size % d == 0]
        raise LayoutError(
            f"optimizer_weight_shard_size={shard_size} does not divide the {axis!r} axis "
            f"({axis_size} ranks): give one of {divisors}, or a mesh whose {axis!r} size is a "
            f"multiple of {shard_size}"
        )
    return shard_size


def _choose(
    layout: TensorLayout,
    shape: Sequence[int],
    axis: str,
    *,
    itemsize: int,
    threshold: int,
    shard_size: int | None,
) -> tuple[int | None, str]:
    mesh = layout.mesh
    if axis not in mesh.axis_names or mesh.axis_size(axis) == 1:
        return None, f"no {axis!r} axis larger than 1 to shard over"
    if any(axis in axes for axes in layout.dims):
        return None, f"already split over {axis!r} by its layout"
    n = shard_group_size(axis, mesh.axis_size(axis), shard_size)
    if n == 1:
        return None, "optimizer_weight_shard_size=1: a shard group of one rank holds it whole"
    local = layout.local_shape(shape)
    nbytes = math.prod(local) * itemsize
    if nbytes < threshold:
        return None, f"its piece ({nbytes} bytes) is under optimizer_shard_threshold={threshold}"
    for d in range(len(local)):
        if not layout.dims[d] and local[d] % n == 0:
            return d, ""
    if n != mesh.axis_size(axis):
        return None, (
            f"no dim of its piece {tuple(local)} that no other axis splits divides by the shard "
            f"group size optimizer_weight_shard_size={n}; to split it, give it a dim divisible "
            f"by {n} or use an optimizer_weight_shard_size that divides one"
        )
    return None, (
        f"no dim of its piece {tuple(local)} that no other axis splits divides by {axis!r}={n}; "
        f"to split it, give it a dim divisible by {n} or use a {axis!r} size that divides one"
    )


def optimizer_shard_layout(layout: TensorLayout, dim: int, axis: str) -> TensorLayout:
    """``layout`` with its piece's dim ``dim`` split over ``axis`` (where ZeRO-3 keeps it)."""
    dims = list(layout.dims)
    dims[dim] = (axis,)
    return TensorLayout(layout.mesh, tuple(dims), layout.partial, layout.reduce_op)
