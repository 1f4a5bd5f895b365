"""Conversion between plait layouts and DTensor placements, and DTensor helpers.

plait's :class:`~plait.layout.TensorLayout` lists, per tensor dim, the mesh axes that split it,
outermost first. DTensor lists one placement per mesh axis and, for a dim split over several
axes, applies them in mesh order (the first mesh axis picks the outer block). When a layout's
order differs from mesh order, the axes that are inner in the layout but earlier in the mesh
get DTensor's strided shard: ``_StridedShard(dim, split_factor=f)`` where ``f`` is the product
of the sizes of the axes that are outer in the layout but later in the mesh. Example, mesh
``(dp=2, tp=2)``, dim 0 laid out ``("tp", "dp")``: placements ``(S_strided(0, sf=2), S(0))``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.placement_types import Placement as TPlacement

from plait._compat import StridedShard, own_per_rank, simulated_ranks
from plait.errors import LayoutError
from plait.layout import Partial, Replicate, Shard, TensorLayout
from plait.layout.placement import Placement
from plait.mesh import MeshSpec

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

__all__ = [
    "DeviceMesh",
    "any_rank_true",
    "as_dtensor",
    "axis_names_of",
    "build_device_mesh",
    "coordinate_of",
    "distribute",
    "dtensor_from_local",
    "from_dtensor_placements",
    "from_local_piece",
    "full_value",
    "implicit_replication",
    "is_dtensor",
    "is_pending_sum_over",
    "layout_of",
    "local_piece",
    "mesh_spec_of",
    "pending_beside",
    "pin_grad_layout",
    "replicate_placement",
    "start_all_reduce",
    "sum_pending",
    "sync_grad",
    "to_dtensor_placements",
    "to_layout",
    "wait_for",
    "with_contiguous_local",
    "with_local",
]


def build_device_mesh(mesh: MeshSpec, device_type: str = "cpu") -> DeviceMesh:
    """A ``DeviceMesh`` over the current world with ``mesh``'s axis names and sizes."""
    return init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)


def coordinate_of(device_mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's coordinate on ``device_mesh`` (every plait mesh holds every rank)."""
    coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(
            f"this rank is not on the device mesh {device_mesh}; plait builds every mesh over "
            "the whole world, so this is a plait bug: please report it"
        )
    return tuple(coordinate)


def axis_names_of(device_mesh: DeviceMesh) -> tuple[str, ...]:
    """The axis names of ``device_mesh`` (plait names every axis it builds)."""
    names = device_mesh.mesh_dim_names
    if names is None:
        raise RuntimeError(
            f"the device mesh {device_mesh} has unnamed axes; plait names every axis of the "
            "meshes it builds, so this is a plait bug: please report it"
        )
    return tuple(names)


def mesh_spec_of(device_mesh: DeviceMesh) -> MeshSpec:
    names = device_mesh.mesh_dim_names
    assert names is not None, "plait meshes always carry axis names"
    return MeshSpec(tuple(names), tuple(device_mesh.shape))


def _strided_factor(layout: TensorLayout, dim: int, axis: str) -> int:
    """Product of sizes of axes outer than ``axis`` in the layout but later in the mesh."""
    mesh = layout.mesh
    order = layout.dims[dim]
    pos = order.index(axis)
    mine = mesh.axis_index(axis)
    return math.prod(mesh.axis_size(b) for b in order[:pos] if mesh.axis_index(b) > mine)


@functools.lru_cache(maxsize=4096)  # pure, and called for every op of every step
def to_dtensor_placements(layout: TensorLayout) -> tuple[TPlacement, ...]:
    """DTensor placements (one per mesh axis) for ``layout``; exact, including axis order."""
    out: list[TPlacement] = []
    for axis, p in zip(layout.mesh.axis_names, layout.placements(), strict=True):
        if isinstance(p, Shard):
            factor = _strided_factor(layout, p.dim, axis)
            out.append(StridedShard(p.dim, split_factor=factor) if factor > 1 else TShard(p.dim))
        elif isinstance(p, Partial):
            out.append(TPartial(p.reduce_op))
        else:
            out.append(TReplicate())
    return tuple(out)


def _plain(p: TPlacement, ndim: int) -> Placement:
    if isinstance(p, StridedShard | TShard):
        return Shard(p.dim % ndim)
    if isinstance(p, TPartial):
        return Partial(p.reduce_op)  # type: ignore[arg-type]
    if isinstance(p, TReplicate):
        return Replicate()
    raise LayoutError(f"DTensor placement {p!r} has no plait equivalent")


def replicate_placement() -> TPlacement:
    """DTensor's ``Replicate()``, for rooms that may not import ``torch.distributed``."""
    return TReplicate()


def from_dtensor_placements(
    mesh: MeshSpec, placements: Sequence[TPlacement], ndim: int
) -> TensorLayout:
    """Inverse of :func:`to_dtensor_placements`, decoding strided shards into axis order."""
    return _from_dtensor_placements(mesh, tuple(placements), ndim)


@functools.lru_cache(maxsize=4096)  # pure, and called for every op of every step
def _from_dtensor_placements(
    mesh: MeshSpec, placements: tuple[TPlacement, ...], ndim: int
) -> TensorLayout:
    plain = [_plain(p, ndim) for p in placements]
    base = TensorLayout.from_placements(mesh, plain, ndim)
    orders = []
    for dim, axes in enumerate(base.dims):
        if len(axes) < 2:
            continue
        order = _decode_order(mesh, placements, base, dim)
        if order != axes:
            orders.append((dim, order))
    return TensorLayout.from_placements(mesh, plain, ndim, orders)


def _decode_order(
    mesh: MeshSpec, placements: Sequence[TPlacement], base: TensorLayout, dim: int
) -> tuple[str, ...]:
    wanted = {
        axis: (p.split_factor if isinstance(p, StridedShard) else 1)
        for axis, p in zip(mesh.axis_names, placements, strict=True)
        if axis in base.dims[dim]
    }
    for order in itertools.permutations(base.dims[dim]):
        cand = TensorLayout(mesh, tuple(order if d == dim else a for d, a in enumerate(base.dims)))
        if all(_strided_factor(cand, dim, a) == f for a, f in wanted.items()):
            return tuple(order)
    raise LayoutError(f"strided placements {list(placements)} of dim {dim} match no axis order")


def distribute(tensor: torch.Tensor, device_mesh: DeviceMesh, layout: TensorLayout) -> DTensor:
    """Slice a full tensor, present on every rank, into a DTensor with ``layout``; no communication."""
    layout.check_shape(tuple(tensor.shape))
    placements = to_dtensor_placements(layout)
    out = distribute_tensor(tensor, device_mesh, placements, src_data_rank=None)
    ranks = simulated_ranks()
    if ranks is None:
        return out
    local = own_per_rank(out.to_local(), ranks)
    return DTensor.from_local(
        local, device_mesh, placements, run_check=False, shape=out.shape, stride=out.stride()
    )


def layout_of(tensor: DTensor) -> TensorLayout:
    mesh = tensor.device_mesh
    return _layout_of(mesh.mesh_dim_names, mesh.shape, tuple(tensor.placements), tensor.ndim)


@functools.lru_cache(maxsize=4096)  # pure; the plan executor asks several times per op and step
def _layout_of(
    names: tuple[str, ...] | None,
    shape: tuple[int, ...],
    placements: tuple[TPlacement, ...],
    ndim: int,
) -> TensorLayout:
    assert names is not None, "plait meshes always carry axis names"
    return _from_dtensor_placements(MeshSpec(tuple(names), tuple(shape)), placements, ndim)


def to_layout(tensor: DTensor, layout: TensorLayout) -> DTensor:
    """Redistribute ``tensor`` to ``layout`` (a no-op when it already has it)."""
    placements = to_dtensor_placements(layout)
    if tuple(tensor.placements) == placements:
        return tensor
    return tensor.redistribute(tensor.device_mesh, placements)


def is_dtensor(value: object) -> TypeIs[DTensor]:
    return isinstance(value, DTensor)


def as_dtensor(tensor: torch.Tensor, device_mesh: DeviceMesh, layout: TensorLayout) -> DTensor:
    """``tensor`` as a DTensor with ``layout``: redistributed if it is one, sliced if it is full."""
    if isinstance(tensor, DTensor):
        return to_layout(tensor, layout)
    return distribute(tensor, device_mesh, layout)


def from_local_piece(
    tensor: torch.Tensor, device_mesh: DeviceMesh, layout: TensorLayout
) -> DTensor:
    """A DTensor from this rank's own piece (each rank passes its slice; no communication)."""
    shape = torch.Size(s * n for s, n in zip(tensor.shape, layout.splits(), strict=True))
    return DTensor.from_local(
        tensor,
        device_mesh,
        to_dtensor_placements(layout),
        run_check=False,
        shape=shape,
        stride=contiguous_stride(shape),
    )


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def pin_grad_layout(tensor: DTensor) -> DTensor:
    """Identity in forward; in backward, the gradient is brought to ``tensor``'s own layout.

    An op that consumes a replicated activation with a split weight (a column-parallel
    Linear) produces a pending-sum gradient for it. MindSpore reduces it inside the op, which
    keeps every gradient that leaves an op in its activation's layout; DTensor would instead
    carry the pending sum on through earlier ops and into many parameter gradients. The
    round trip through the local tensor installs that reduction point.
    """
    return with_local(tensor, tensor.to_local())


def sync_grad(param: torch.Tensor) -> None:
    """Reduce a DTensor parameter's pending-sum gradient to the parameter's own layout."""
    grad = param.grad
    if (
        isinstance(param, DTensor)
        and isinstance(grad, DTensor)
        and grad.placements != param.placements
    ):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor as a plain tensor (collective for DTensors: every rank must call it)."""
    from plait._compat import same_on_every_rank

    if isinstance(tensor, DTensor):
        # Pending sums are reduced one mesh axis at a time, as the plan lists them (DTensor
        # would do the same, warning about it on every call).
        placements = list(tensor.placements)
        for i, p in enumerate(placements):
            if p.is_partial():
                placements[i] = TReplicate()
                tensor = tensor.redistribute(tensor.device_mesh, placements)
        value = tensor.full_tensor()
    else:
        value = tensor
    return same_on_every_rank(value.detach(), "full_value")


def sum_pending(tensor: DTensor) -> DTensor:
    """``tensor`` with every pending sum (``Partial``, a vocabulary-split embedding's masked
    one included) reduced, one mesh axis at a time; other placements kept (collective)."""
    placements = list(tensor.placements)
    for i, p in enumerate(placements):
        if p.is_partial():
            placements[i] = TReplicate()
            tensor = tensor.redistribute(tensor.device_mesh, placements)
    return tensor


def implicit_replication():  # type: ignore[no-untyped-def]
    """Treat plain tensors met in DTensor ops (e.g. masks built in forward) as replicated.

    Nests: inside an enclosing block it does nothing (torch's own context would clear the flag
    when the inner block ends, for the rest of the outer one: a backward run after a forward
    inside it would meet plain tensors again)."""
    from torch.distributed.tensor.experimental import implicit_replication as ctx

    from plait._compat import implicit_replication_active

    return contextlib.nullcontext() if implicit_replication_active() else ctx()


def start_all_reduce(flat: torch.Tensor, group_mesh: DeviceMesh) -> torch.Tensor:
    """Start a sum all-reduce of a 1-D local buffer over a 1-D (sub-)mesh; returns its result.

    The result is an async tensor: the collective runs while the caller goes on, and the first
    use of the result waits for it. Built on DTensor's redistribution (a partial sum made
    replicated), so it is exact under simulated ranks too.
    """
    pending = DTensor.from_local(
        flat, group_mesh, [TPartial("sum")], run_check=False, shape=flat.shape, stride=(1,)
    )
    return pending.redistribute(group_mesh, [TReplicate()], async_op=True).to_local()


def wait_for(result: torch.Tensor) -> torch.Tensor:
    """The finished value of a collective started by :func:`start_all_reduce`."""
    wait = getattr(result, "wait", None)
    return wait() if callable(wait) else result


def dtensor_from_local(
    local: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[TPlacement],
    shape: Sequence[int],
    stride: Sequence[int],
) -> DTensor:
    """A DTensor with ``placements``, global ``shape`` and ``stride``, whose local piece is
    ``local`` (no communication)."""
    return DTensor.from_local(
        local,
        device_mesh,
        tuple(placements),
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(stride),
    )


def with_local(param: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor laid out like ``param`` whose local piece is ``local``."""
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def with_contiguous_local(tensor: DTensor) -> DTensor:
    """``tensor`` with a contiguous local piece (and contiguous global strides).

    DTensor judges contiguity on the global strides; a local piece can be transposed while
    the global strides look contiguous (e.g. the backward of a transpose of a split tensor),
    and a later ``view`` then fails on the local piece.
    """
    local = tensor.to_local()
    if local.is_contiguous() and tensor.is_contiguous():
        return tensor
    return DTensor.from_local(
        local.contiguous(),
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=contiguous_stride(tensor.shape),
    )


def is_pending_sum_over(grad: torch.Tensor, param: torch.Tensor, axis_index: int) -> bool:
    """True when ``grad`` equals ``param``'s layout except for a pending sum on one mesh axis."""
    if not isinstance(grad, DTensor) or not isinstance(param, DTensor):
        return False
    expected = list(param.placements)
    expected[axis_index] = TPartial("sum")
    return tuple(grad.placements) == tuple(expected)


def pending_beside(
    have: Sequence[TPlacement], own: Sequence[TPlacement], index: int
) -> tuple[int, ...] | None:
    """The other mesh dims on which a gradient laid out ``have`` is also a pending sum, where
    its parameter (``own``) is replicated, when ``have`` is ``own`` but for pending sums on
    ``index`` and those dims (a sequence-parallel norm's weight: pending over dp and tp).
    None when it is not, or when it is pending over ``index`` alone."""
    if len(have) != len(own) or have[index] != TPartial("sum"):
        return None
    beside = []
    for k, (h, o) in enumerate(zip(have, own, strict=True)):
        if k == index or h == o:
            continue
        if h != TPartial("sum") or not isinstance(o, TReplicate):
            return None
        beside.append(k)
    return tuple(beside) or None


def any_rank_true(flag: bool, device_mesh: DeviceMesh | None) -> bool:
    """True if ``flag`` is true on any rank of ``device_mesh`` (one all-reduce per mesh axis)."""
    local = torch.tensor([1.0 if flag else 0.0])
    if device_mesh is None:
        return flag
    from plait._compat import simulated_ranks

    ranks = simulated_ranks()
    if ranks is not None:
        local = own_per_rank(local, ranks)
    pending = DTensor.from_local(
        local,
        device_mesh,
        [TPartial("max")] * device_mesh.ndim,
        run_check=False,
        shape=torch.Size([1]),
        stride=(1,),
    )
    return bool(full_value(pending).item() > 0)


def local_piece(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
