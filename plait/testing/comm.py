"""Recording the collectives a block of code issues, per kind and per mesh axis.

``CommDebugMode`` counts collectives by kind; tests here also need to know *which mesh axis*
each one ran on (a tensor-parallel all-reduce and a data-parallel one are different costs and
different bugs). :class:`CollectiveLog` is a dispatch mode that records every functional
collective with its process-group name, bytes, and the mesh axis that group belongs to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from plait._compat import HigherOrderOperator, TorchDispatchMode

__all__ = ["Collective", "CollectiveLog", "collective_kind"]

_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def collective_kind(op: object) -> str | None:
    """The kind ("all_reduce", "all_gather", ...) of a functional collective op or its name,
    as CommDebugMode's ``get_comm_counts()`` keys them; None for anything else."""
    name = getattr(op, "_opname", None) or getattr(op, "__name__", None) or str(op)
    return _KINDS.get(name.rpartition(".")[2])


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str
    axis: str
    bytes: int


@dataclass
class CollectiveLog(TorchDispatchMode):
    """Records collectives issued while active; ``counts()`` gives ``{(kind, axis): n}``."""

    device_mesh: DeviceMesh
    events: list[Collective] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        names = self.device_mesh.mesh_dim_names or ()
        # keyed by group name: a functional collective's last argument
        self._axis_of_group: dict[str, str] = {
            self.device_mesh.get_group(a).group_name: a for a in names
        }

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            # Let DTensor desugar into collectives first, then see those (as CommDebugMode does).
            return NotImplemented
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if func.namespace == "_c10d_functional":
            kind = _KINDS.get(func._opname)
            if kind is not None:
                group = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
                tensor = args[0]
                axis = self._axis_of_group.get(group, str(group))
                self.events.append(Collective(kind, axis, tensor.numel() * tensor.element_size()))
        return func(*args, **kwargs)

    def counts(self) -> dict[tuple[str, str], int]:
        return dict(Counter((e.kind, e.axis) for e in self.events))

    def total(self) -> int:
        return len(self.events)
