"""Layouts and strategies: MindSpore's notation on named meshes, with DTensor's placements.

Pure planning code: no process groups, no ``torch.distributed``.
"""

from plait.layout.layout import Layout, TensorLayout
from plait.layout.optimizer_shard import (
    optimizer_shard_dim,
    optimizer_shard_layout,
    shard_group_size,
    why_whole,
)
from plait.layout.placement import Partial, Placement, Replicate, Shard
from plait.layout.redistribute import (
    LOCAL_KINDS,
    CollectiveKind,
    Redistribution,
    RedistStep,
    plan_redistribution,
)
from plait.layout.strategy import (
    OpSignature,
    ResolvedStrategy,
    resolve_strategy,
    resolve_tensor_strategy,
)

__all__ = [
    "LOCAL_KINDS",
    "CollectiveKind",
    "Layout",
    "OpSignature",
    "Partial",
    "Placement",
    "RedistStep",
    "Redistribution",
    "Replicate",
    "ResolvedStrategy",
    "Shard",
    "TensorLayout",
    "optimizer_shard_dim",
    "optimizer_shard_layout",
    "plan_redistribution",
    "resolve_strategy",
    "resolve_tensor_strategy",
    "shard_group_size",
    "why_whole",
]
