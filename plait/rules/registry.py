"""The op catalogue's contract: what a rule says about one op on one mesh.

A rule follows MindSpore's ``OperatorInfo`` (reference section 5.7): for an op of an
:class:`~plait.graph.OpGraph` and a mesh it lists the valid strategies. Each
:class:`OpStrategy` gives the layout every tensor input must have and the layout of every
output; an output's ``partial`` axes are the op's forward communication (a pending sum that a
consumer or the redistribution planner reduces). Gradient communication for parameters and
memory per device follow from the layouts (:func:`grad_reduce_axes`, ``TensorLayout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from plait.graph import OpNode
from plait.layout import TensorLayout
from plait.mesh import MeshSpec

__all__ = ["OpRule", "OpStrategy", "grad_reduce_axes", "replicated_strategy"]


@dataclass(frozen=True, slots=True)
class OpStrategy:
    """One way to run an op: the layout of each tensor input and of each output."""

    inputs: tuple[TensorLayout, ...]  # one per OpNode.inputs entry, no partial axes
    outputs: tuple[TensorLayout, ...]  # one per OpNode.outputs entry; may carry partial axes
    label: str = ""  # short human name: "replicate", "batch", "column", "row", "heads", ...

    def cuts(self) -> tuple[tuple[int, ...], ...]:
        """The MindSpore strategy tuple: pieces per dim of each input."""
        return tuple(layout.splits() for layout in self.inputs)

    def used_axes(self) -> frozenset[str]:
        """Mesh axes that divide the op's work (split a dim or hold a partial sum)."""
        return _used_axes(self)


class OpRule(Protocol):
    """A rule for one family of ops (``plait/rules/<family>.py``).

    ``family`` and ``targets`` are read-only here: the rules are frozen dataclasses.
    """

    @property
    def family(self) -> str:
        """The family's name: "matmul", "pointwise", ..."""
        ...

    @property
    def targets(self) -> tuple[str, ...]:
        """The aten targets it covers, e.g. ("aten.linear.default",)."""
        ...

    def strategies(self, op: OpNode, mesh: MeshSpec) -> list[OpStrategy]:
        """Every valid strategy of ``op`` on ``mesh``, fully replicated first."""
        ...


@lru_cache(maxsize=1 << 16)
def _used_axes(strategy: OpStrategy) -> frozenset[str]:
    axes: set[str] = set()
    for layout in (*strategy.inputs, *strategy.outputs):
        for dim in layout.dims:
            axes.update(dim)
        axes.update(layout.partial)
    return frozenset(axes)


def replicated_strategy(op: OpNode, mesh: MeshSpec) -> OpStrategy:
    """Every device runs the whole op: the fallback for ops without a rule."""
    return OpStrategy(
        tuple(TensorLayout.replicated(mesh, m.ndim) for m in op.input_metas),
        tuple(TensorLayout.replicated(mesh, m.ndim) for m in op.outputs),
        "replicate",
    )


def grad_reduce_axes(strategy: OpStrategy, input_index: int) -> tuple[str, ...]:
    """Mesh axes over which the gradient of input ``input_index`` is a partial sum.

    MindSpore's mirror operator, for parameters: an axis that divides the op's work but not
    this input leaves each device with a partial gradient (a batch split makes every weight's
    gradient partial over ``dp``; a column-parallel linear makes its input's gradient partial
    over ``tp``). Two kinds of axes need no reduction: those that divide nothing (every device
    repeats the same computation) and the output's own partial axes, which split a summed dim:
    inputs carrying that dim own the axis, and an input without it is added after the sum (a
    bias), so its gradient comes from the output's gradient, which is whole on those axes.
    Returned in mesh order.
    """
    layout = strategy.inputs[input_index]
    own = {a for dim in layout.dims for a in dim}
    summed = {a for out in strategy.outputs for a in out.partial}
    used = strategy.used_axes()
    return tuple(
        a for a in layout.mesh.axis_names if a in used and a not in own and a not in summed
    )
