"""Tensor layouts: MindSpore's device matrix + tensor map, on named mesh axes.

A :class:`Layout` names the axes of a device matrix, ``Layout((2, 2, 2), ("dp", "sp", "mp"))``.
Calling it with one entry per tensor dim gives a :class:`TensorLayout`:

* an alias (``"mp"``): the dim is split across that axis;
* a tuple of aliases (``("sp", "dp")``): the dim is split across several axes, the first
  alias outermost (``sp`` picks the big block, ``dp`` the piece inside it);
* ``"None"``: the dim is not split.

MindSpore numbers device-matrix axes from the right (the last axis is 0) in its tensor map;
:meth:`TensorLayout.tensor_map` reproduces that numbering, ``-1`` for an unsplit dim. A
TensorLayout can also carry pending partial sums over axes (``partial``), the state DTensor
calls ``Partial`` and MindSpore keeps inside its operators.

Worked example (MindSpore's docs), ``Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp"))``
on a ``[4, 8]`` tensor: dim 0 is split over ``mp``; dim 1 over ``sp`` (outer) then ``dp``.

    rank  (dp, sp, mp)  dim-0 block  dim-1 block (= 2 * sp + dp)
    0     (0, 0, 0)     0            0
    1     (0, 0, 1)     1            0
    2     (0, 1, 0)     0            2
    4     (1, 0, 0)     0            1
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from plait.errors import LayoutError
from plait.layout.placement import Partial, Placement, ReduceOp, Replicate, Shard
from plait.mesh import MeshSpec

__all__ = ["Layout", "TensorLayout"]

DimSpec = str | tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """A device matrix with a name per axis; call it to lay out a tensor.

    Args:
        device_matrix: axis sizes, outermost first; their product is the device count.
        alias_name: one unique name per axis (``"None"`` is reserved).

    Example:
        >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
        >>> layout("dp", "mp").tensor_map()
        (2, 0)
    """

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_matrix", tuple(self.device_matrix))
        object.__setattr__(self, "alias_name", tuple(self.alias_name))
        self.mesh  # noqa: B018 -- builds and so validates the axes

    @property
    def mesh(self) -> MeshSpec:
        return MeshSpec(self.alias_name, self.device_matrix)

    def __call__(self, *dims: DimSpec) -> TensorLayout:
        return TensorLayout.build(self.mesh, dims)


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where each dim of one tensor lives on a named mesh.

    ``dims[d]`` lists the mesh axes dim ``d`` is split across, outermost first; ``partial``
    lists axes over which the tensor is a pending reduction of kind ``reduce_op``.
    """

    mesh: MeshSpec
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    reduce_op: ReduceOp = "sum"
    _axis_dim: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)
    _hash: int = field(init=False, repr=False, compare=False, hash=False)

    def __hash__(self) -> int:
        # computed once: searches key their price caches on layouts, millions of lookups
        return self._hash

    def __reduce__(self) -> tuple[object, ...]:
        # rebuilt from its fields: the cached hash is not carried to another process (string
        # hashes differ between processes)
        return (TensorLayout, (self.mesh, self.dims, self.partial, self.reduce_op))

    def __post_init__(self) -> None:
        seen: dict[str, int] = {}
        for d, axes in enumerate(self.dims):
            for axis in axes:
                self.mesh.axis_index(axis)
                if axis in seen:
                    raise LayoutError(
                        f"mesh axis {axis!r} is used by tensor dims {seen[axis]} and {d}; "
                        "an axis may split at most one dim of a tensor"
                    )
                seen[axis] = d
        for axis in self.partial:
            self.mesh.axis_index(axis)
            if axis in seen:
                raise LayoutError(
                    f"mesh axis {axis!r} both splits dim {seen[axis]} and holds a partial sum; "
                    "an axis does one of the two"
                )
        object.__setattr__(self, "_axis_dim", seen)
        key = (self.mesh, self.dims, self.partial, self.reduce_op)
        object.__setattr__(self, "_hash", hash(key))

    @classmethod
    def build(cls, mesh: MeshSpec, dims: Sequence[DimSpec]) -> TensorLayout:
        """Normalise per-dim aliases (``"mp"``, ``("sp", "dp")``, ``"None"``)."""
        norm: list[tuple[str, ...]] = []
        for d, spec in enumerate(dims):
            if spec == "None" or spec is None:
                norm.append(())
            elif isinstance(spec, str):
                norm.append((spec,))
            elif isinstance(spec, tuple) and spec and all(isinstance(a, str) for a in spec):
                if "None" in spec:
                    raise LayoutError(f"dim {d}: {spec!r} mixes 'None' with axis names")
                norm.append(spec)
            else:
                raise LayoutError(
                    f"dim {d}: {spec!r} is not an alias, a tuple of aliases or 'None'; "
                    f"aliases of this layout are {list(mesh.axis_names)!r}"
                )
        return cls(mesh, tuple(norm))

    @classmethod
    def replicated(cls, mesh: MeshSpec, ndim: int) -> TensorLayout:
        return cls(mesh, ((),) * ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def splits(self) -> tuple[int, ...]:
        """Number of pieces per dim (a strategy tuple)."""
        return tuple(math.prod(self.mesh.axis_size(a) for a in axes) for axes in self.dims)

    def tensor_map(self) -> tuple[int | tuple[int, ...], ...]:
        """MindSpore's tensor map: axis numbers counted from the right, ``-1`` if unsplit."""
        last = self.mesh.ndim - 1

        def number(axes: tuple[str, ...]) -> int | tuple[int, ...]:
            if not axes:
                return -1
            idx = tuple(last - self.mesh.axis_index(a) for a in axes)
            return idx[0] if len(idx) == 1 else idx

        return tuple(number(axes) for axes in self.dims)

    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis, in mesh order (DTensor's convention)."""
        out: list[Placement] = []
        for axis in self.mesh.axis_names:
            if axis in self._axis_dim:
                out.append(Shard(self._axis_dim[axis]))
            elif axis in self.partial:
                out.append(Partial(self.reduce_op))
            else:
                out.append(Replicate())
        return tuple(out)

    def is_mesh_ordered(self) -> bool:
        """True when every multi-axis dim lists its axes in mesh order (outer to inner).

        DTensor's plain ``Shard`` placements express exactly those; other orders need
        DTensor's strided shards.
        """
        for axes in self.dims:
            idx = [self.mesh.axis_index(a) for a in axes]
            if idx != sorted(idx):
                return False
        return True

    def shard_index(self, rank: int, dim: int) -> int:
        """Which of the ``splits()[dim]`` pieces of ``dim`` rank ``rank`` holds."""
        coord = self.mesh.coordinate(rank)
        index = 0
        for axis in self.dims[dim]:
            i = self.mesh.axis_index(axis)
            index = index * self.mesh.shape[i] + coord[i]
        return index

    def local_shape(self, shape: Sequence[int], where: str = "tensor") -> tuple[int, ...]:
        """Shape of one device's piece; refuses dims that do not divide evenly."""
        self.check_shape(shape, where)
        return tuple(s // n for s, n in zip(shape, self.splits(), strict=True))

    def check_shape(self, shape: Sequence[int], where: str = "tensor") -> None:
        """Raise a clear error if ``shape`` does not fit this layout."""
        if len(shape) != self.ndim:
            raise LayoutError(
                f"{where}: layout has {self.ndim} dims {self.describe()} but the tensor has "
                f"{len(shape)} (shape {tuple(shape)!r}); give one entry per tensor dim"
            )
        for d, (size, n) in enumerate(zip(shape, self.splits(), strict=True)):
            if size % n:
                raise LayoutError(
                    f"{where}: dim {d} has size {size}, which does not divide into {n} pieces "
                    f"(axes {self.dims[d]!r}); uneven splits are not supported: change the "
                    f"split of dim {d} to a divisor of {size}, or resize the tensor"
                )

    def with_partial(self, axes: Sequence[str], reduce_op: ReduceOp = "sum") -> TensorLayout:
        return TensorLayout(self.mesh, self.dims, tuple(axes), reduce_op)

    def describe(self) -> str:
        """Short text form, e.g. ``[dp, (sp, mp)] P(sum)@tp``."""
        parts = []
        for axes in self.dims:
            parts.append(
                "None" if not axes else axes[0] if len(axes) == 1 else f"({', '.join(axes)})"
            )
        text = "[" + ", ".join(parts) + "]"
        if self.partial:
            text += f" P({self.reduce_op})@{','.join(self.partial)}"
        return text

    @classmethod
    def from_placements(
        cls,
        mesh: MeshSpec,
        placements: Sequence[Placement],
        ndim: int,
        shard_order: Sequence[tuple[int, tuple[str, ...]]] = (),
    ) -> TensorLayout:
        """Inverse of :meth:`placements`.

        ``shard_order`` gives, for dims split over several axes in an order other than mesh
        order, ``(dim, axes outermost first)``.
        """
        if len(placements) != mesh.ndim:
            raise LayoutError(
                f"{len(placements)} placements {list(map(str, placements))} for a mesh with "
                f"{mesh.ndim} axes {list(mesh.axis_names)!r}; give one placement per mesh axis"
            )
        dims: list[list[str]] = [[] for _ in range(ndim)]
        partial: list[str] = []
        reduce_ops: set[str] = set()
        for axis, p in zip(mesh.axis_names, placements, strict=True):
            if isinstance(p, Shard):
                if not -ndim <= p.dim < ndim:
                    raise LayoutError(f"{p!r} on axis {axis!r} is out of range for {ndim} dims")
                dims[p.dim % ndim].append(axis)
            elif isinstance(p, Partial):
                partial.append(axis)
                reduce_ops.add(p.reduce_op)
        if len(reduce_ops) > 1:
            raise LayoutError(f"partial placements mix reduce ops {sorted(reduce_ops)}")
        for dim, order in shard_order:
            if sorted(order) != sorted(dims[dim]):
                raise LayoutError(
                    f"shard order {order!r} for dim {dim} names other axes than {dims[dim]!r}"
                )
            dims[dim] = list(order)
        op: ReduceOp = reduce_ops.pop() if reduce_ops else "sum"  # type: ignore[assignment]
        return cls(mesh, tuple(tuple(d) for d in dims), tuple(partial), op)
