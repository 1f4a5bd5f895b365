"""Creation family: ops that make a tensor from nothing (``arange``, ``zeros``, ``full``, ...).

They have no tensor input, so no layout to follow: every device makes the whole tensor
(replicated output, no communication). Sharded outputs would be honest only if the executor
made each device's piece itself; plait's executor runs the op as written, so none are offered.
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.rules.einsum import Einsum, EinsumRule, saved_nothing

__all__ = ["creation_rules"]


def creation_rule(op: OpNode) -> Einsum | None:
    """Replicated only (the rule returns no einsum)."""
    return None


def creation_rules() -> tuple[EinsumRule, ...]:
    targets = (
        "aten.arange.default",
        "aten.arange.start",
        "aten.arange.start_step",
        "aten.zeros.default",
        "aten.ones.default",
        "aten.full.default",
        "aten.empty.memory_format",
        "aten.empty.default",
        "aten.scalar_tensor.default",
        "aten.rand.default",
        "aten.randn.default",
        "aten.randint.default",
        "aten.linspace.default",
        "aten.eye.default",
        "aten.tensor.default",
        "aten._tensor_constant.default",
    )
    return (EinsumRule("creation", targets, creation_rule, saved=saved_nothing),)
