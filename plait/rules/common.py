"""Pieces shared by the rules: the data-parallel default for activations and output strategies."""

from __future__ import annotations

from collections.abc import Sequence

from plait.errors import ShardingError
from plait.layout import TensorLayout
from plait.mesh import MeshSpec

__all__ = ["batch_axes", "resolve_output", "to_mesh"]


def batch_axes(mesh: MeshSpec, dp_axis: str, used: Sequence[str]) -> tuple[str, ...]:
    """Axes the batch dim of an activation takes by default: the data-parallel axis, if free."""
    if dp_axis in mesh.axis_names and dp_axis not in used and mesh.axis_size(dp_axis) > 1:
        return (dp_axis,)
    return ()


def to_mesh(layout: TensorLayout, mesh: MeshSpec, where: str) -> TensorLayout:
    """Re-home a user's Layout onto the job's mesh, matching axes by name and size."""
    if layout.mesh == mesh:
        return layout
    for axis, size in zip(layout.mesh.axis_names, layout.mesh.shape, strict=True):
        if axis not in mesh.axis_names or mesh.axis_size(axis) != size:
            raise ShardingError(
                f"{where}: layout axis {axis!r} of size {size} is not in the job's mesh "
                f"{mesh.as_dict()!r}; name the Layout's axes after the mesh axes "
                f"({list(mesh.axis_names)!r}) with the same sizes"
            )
    return TensorLayout(mesh, layout.dims, layout.partial, layout.reduce_op)


def resolve_output(
    natural: TensorLayout, requested: Sequence[int] | TensorLayout | None, where: str
) -> TensorLayout:
    """The layout an op's output takes, given the op's natural output (maybe partial).

    No request: partial sums are reduced to a full copy (all-reduce). A request may keep each
    dim's natural split or, on one dim, add the summed axes to it (MindSpore's
    ``((A * B, C),)`` for matmul), which turns the all-reduce into a reduce-scatter.
    """
    mesh = natural.mesh
    plain = TensorLayout(mesh, natural.dims)
    if requested is None:
        return plain
    if isinstance(requested, TensorLayout):
        out = to_mesh(requested, mesh, where)
        if out.ndim != natural.ndim:
            raise ShardingError(
                f"{where}: out layout {out.describe()} has {out.ndim} dims, the output has {natural.ndim}"
            )
        return out
    if len(requested) != natural.ndim:
        raise ShardingError(
            f"{where}: out_strategy {tuple(requested)!r} has {len(requested)} entries but the "
            f"output has {natural.ndim} dims; give one split per output dim"
        )
    dims = list(natural.dims)
    summed = natural.partial
    summed_size = 1
    for a in summed:
        summed_size *= mesh.axis_size(a)
    for d, want in enumerate(requested):
        have = plain.splits()[d]
        if want == have:
            continue
        if summed and want == have * summed_size:
            dims[d] = dims[d] + summed
            summed = ()
            continue
        options = f"{have}" + (f" or {have * summed_size}" if natural.partial else "")
        raise ShardingError(
            f"{where}: out_strategy {tuple(requested)!r} splits output dim {d} into {want}, "
            f"but this op's output dim {d} can be split {options}; change the out_strategy"
        )
    return TensorLayout(mesh, tuple(dims))
