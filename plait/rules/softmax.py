"""Softmax family: ``softmax``, ``log_softmax`` and their underscore forms.

The softmax dim is reduced inside the op (max and sum), so it is never split (MindSpore's
Softmax constraint, reference 5.6); every other dim may be.
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.rules.args import arg, ref_index, wrap_dim
from plait.rules.einsum import (
    FIXED,
    Einsum,
    EinsumRule,
    dim_letters,
    dim_names,
    einsum_for,
    saved_outputs,
)

__all__ = ["softmax_rules"]


def softmax_rule(op: OpNode) -> Einsum | None:
    """``softmax(x, dim)``: split every dim but ``dim``."""
    x = ref_index(op, 0, "self")
    if x is None or len(op.inputs) != 1:
        return None
    nd = op.input_metas[x].ndim
    dim = wrap_dim(arg(op, 1, "dim"), nd)
    if dim is None:
        return None
    letters = tuple(FIXED if d == dim else x for d, x in enumerate(dim_letters(nd)))
    return einsum_for(op, [letters], [letters], names=dim_names(nd))


def softmax_rules() -> tuple[EinsumRule, ...]:
    targets = (
        "aten.softmax.int",
        "aten._softmax.default",
        "aten.log_softmax.int",
        "aten._log_softmax.default",
        "aten.special_softmax.default",
    )
    return (EinsumRule("softmax", targets, softmax_rule, saved=saved_outputs),)
