"""Abstract device meshes: named axes and their sizes, with no process group behind them.

A :class:`MeshSpec` is what planning code sees of the devices. Axes are listed outermost
first, as in MindSpore's device matrix and in ``torch.distributed.DeviceMesh``: rank ``r`` has
the row-major coordinate of ``r`` in the shape. For a ``{"dp": 2, "tp": 2}`` mesh:

    rank  coordinate (dp, tp)
    0     (0, 0)
    1     (0, 1)
    2     (1, 0)
    3     (1, 1)

so ``tp`` groups are {0, 1} and {2, 3}, ``dp`` groups are {0, 2} and {1, 3}.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from plait.errors import LayoutError

__all__ = ["MeshSpec"]


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """Named mesh axes, outermost first.

    Example:
        >>> mesh = MeshSpec.from_dict({"dp": 2, "tp": 4})
        >>> mesh.size, mesh.axis_size("tp"), mesh.coordinate(5)
        (8, 4, (1, 1))
    """

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.shape):
            raise LayoutError(
                f"mesh axis names {self.axis_names!r} and sizes {self.shape!r} differ in length; "
                "give one size per axis name"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise LayoutError(
                f"mesh axis names {self.axis_names!r} repeat a name; make them unique"
            )
        for name, size in zip(self.axis_names, self.shape, strict=True):
            if not isinstance(name, str) or not name or name == "None":
                raise LayoutError(f"mesh axis name {name!r} is not allowed; use a non-empty string")
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"mesh axis {name!r} has size {size!r}; sizes are integers >= 1")

    @classmethod
    def from_dict(cls, axes: Mapping[str, int]) -> MeshSpec:
        """Build a mesh from ``{axis_name: size}``, outermost axis first."""
        return cls(tuple(axes), tuple(axes.values()))

    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape, strict=True))

    def axis_index(self, name: str) -> int:
        """Position of axis ``name`` (0 = outermost); a clear error if it is not in the mesh."""
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise LayoutError(
                f"mesh axis {name!r} is not in the mesh {self.as_dict()!r}; "
                f"use one of {list(self.axis_names)!r}"
            ) from None

    def axis_size(self, name: str) -> int:
        return self.shape[self.axis_index(name)]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinate of ``rank`` in the mesh."""
        coord = []
        for size in reversed(self.shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))
