"""plait: train one PyTorch model on many devices.

Users write a plain ``torch.nn.Module``; plait splits it the way MindSpore's parallel system
does (data parallel, semi-automatic operator-level parallel with strategies and layouts, ...)
and runs it on ``torch.distributed``. See README.md for a tour.

The names below load on first use (PEP 562): ``import plait`` costs what ``import torch``
does, and a task pays only for the rooms it touches (``plait plan`` never loads the runtime,
a launcher never loads the planner or DTensor's op registrations).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plait.errors import (
    CaptureError,
    CheckpointError,
    ConfigError,
    CostError,
    DamagedCheckpointError,
    LaunchError,
    LayoutError,
    MissingExtraError,
    NotBuiltError,
    PlaitError,
    PlanError,
    ShardingError,
    WorkerFailed,
)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and readers
    from plait import checkpoint, data, ops, ps, testing
    from plait.annotate import on_host, on_server, pipeline_stage, recompute, shard
    from plait.config import CommFusion, ParallelConfig, SparseOptimizer
    from plait.graph import OpGraph, capture
    from plait.launch import World, init
    from plait.layout import Layout, Partial, Replicate, Shard, TensorLayout
    from plait.mesh import MeshSpec
    from plait.planning import Plan, plan
    from plait.runtime.engine.job import Job
    from plait.runtime.parallelize import parallelize

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "on_host": "plait.annotate",
    "on_server": "plait.annotate",
    "pipeline_stage": "plait.annotate",
    "recompute": "plait.annotate",
    "shard": "plait.annotate",
    "CommFusion": "plait.config",
    "ParallelConfig": "plait.config",
    "SparseOptimizer": "plait.config",
    "OpGraph": "plait.graph",
    "capture": "plait.graph",
    "World": "plait.launch",
    "init": "plait.launch",
    "Layout": "plait.layout",
    "Partial": "plait.layout",
    "Replicate": "plait.layout",
    "Shard": "plait.layout",
    "TensorLayout": "plait.layout",
    "MeshSpec": "plait.mesh",
    "Plan": "plait.planning",
    "plan": "plait.planning",
    "Job": "plait.runtime.engine.job",
    "parallelize": "plait.runtime.parallelize",
}
"""Each public name and the module it is defined in (loaded on first use)."""

_SUBMODULES = ("checkpoint", "data", "ops", "ps", "testing")
"""Rooms users reach as attributes (``plait.testing.simulate``), loaded on first use."""


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"plait.{name}")
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CaptureError",
    "CheckpointError",
    "CommFusion",
    "ConfigError",
    "CostError",
    "DamagedCheckpointError",
    "Job",
    "LaunchError",
    "Layout",
    "LayoutError",
    "MeshSpec",
    "MissingExtraError",
    "NotBuiltError",
    "OpGraph",
    "ParallelConfig",
    "Partial",
    "PlaitError",
    "Plan",
    "PlanError",
    "Replicate",
    "Shard",
    "ShardingError",
    "SparseOptimizer",
    "TensorLayout",
    "WorkerFailed",
    "World",
    "__version__",
    "capture",
    "checkpoint",
    "data",
    "init",
    "on_host",
    "on_server",
    "ops",
    "parallelize",
    "pipeline_stage",
    "plan",
    "ps",
    "recompute",
    "shard",
    "testing",
]
