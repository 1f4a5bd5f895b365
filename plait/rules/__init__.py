"""plait's op catalogue: per-op sharding rules, pure functions of shapes and layouts.

Each rule says, for the layouts of an op's parameters (or a full strategy), which layouts its
inputs need and which layout its output has, including pending partial sums that the op must
reduce (MindSpore's forward communication). Rules never touch ``torch.distributed``.

The catalogue (:func:`default_catalogue`) lists, for each op of a captured
:class:`~plait.graph.OpGraph`, every valid :class:`OpStrategy` on a mesh; one module per op
family (matmul, pointwise, norm, softmax, embedding, attention, view, reduction, conv,
pooling, loss, creation).
"""

from plait.rules.catalogue import (
    Catalogue,
    OpMemory,
    default_catalogue,
    op_memory,
    strategy_from_cuts,
)
from plait.rules.einsum import Einsum, EinsumRule, einsum_for, enumerate_strategies
from plait.rules.registry import OpRule, OpStrategy, grad_reduce_axes, replicated_strategy
from plait.rules.signatures import linear_signature, matmul_signature

__all__ = [
    "Catalogue",
    "Einsum",
    "EinsumRule",
    "OpMemory",
    "OpRule",
    "OpStrategy",
    "default_catalogue",
    "einsum_for",
    "enumerate_strategies",
    "grad_reduce_axes",
    "linear_signature",
    "matmul_signature",
    "op_memory",
    "replicated_strategy",
    "strategy_from_cuts",
]
