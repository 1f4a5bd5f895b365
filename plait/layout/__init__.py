"""Layouts and strategies: MindSpore's notation on named meshes, with DTensor's placements.

Pure planning code: no process groups, no ``torch.distributed``.
"""

from plait.layout.layout import Layout, TensorLayout
from plait.layout.placement import Partial, Placement, Replicate, Shard
from plait.layout.strategy import (
    OpSignature,
    ResolvedStrategy,
    resolve_strategy,
    resolve_tensor_strategy,
)

__all__ = [
    "Layout",
    "OpSignature",
    "Partial",
    "Placement",
    "Replicate",
    "ResolvedStrategy",
    "Shard",
    "TensorLayout",
    "resolve_strategy",
    "resolve_tensor_strategy",
]
