"""plait's own placement types, with DTensor's vocabulary.

``Shard(dim)``, ``Replicate()`` and ``Partial(reduce_op)`` say what one mesh axis does to a
tensor: split dim ``dim`` across the axis, hold a full copy on every device of the axis, or
hold a per-device contribution still to be reduced across the axis. They are plain frozen
values so that planning code never imports ``torch.distributed``; ``plait.comm`` converts them
to DTensor placements for execution. ``repr`` is exact (``Shard(dim=0)``), ``str`` is short
(``S(0)``, ``R``, ``P(sum)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Partial", "Placement", "ReduceOp", "Replicate", "Shard"]

ReduceOp = Literal["sum", "avg", "max", "min"]


@dataclass(frozen=True, slots=True)
class Shard:
    """Split tensor dim ``dim`` into equal pieces across the mesh axis."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device of the mesh axis holds the whole tensor (along this axis)."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Every device holds a contribution; the tensor is their reduction across the axis."""

    reduce_op: ReduceOp = "sum"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


Placement = Shard | Replicate | Partial
