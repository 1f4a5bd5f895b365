"""plait: train one PyTorch model on many devices.

Users write a plain ``torch.nn.Module``; plait splits it the way MindSpore's parallel system
does (data parallel, semi-automatic operator-level parallel with strategies and layouts, ...)
and runs it on ``torch.distributed``. See README.md for a tour.
"""

from plait import checkpoint, data, ops, testing
from plait.annotate import on_host, pipeline_stage, recompute, shard
from plait.config import CommFusion, ParallelConfig
from plait.errors import (
    CaptureError,
    CheckpointError,
    ConfigError,
    CostError,
    LaunchError,
    LayoutError,
    MissingExtraError,
    NotBuiltError,
    PlaitError,
    PlanError,
    ShardingError,
    WorkerFailed,
)
from plait.graph import OpGraph, capture
from plait.launch import World, init
from plait.layout import Layout, Partial, Replicate, Shard, TensorLayout
from plait.mesh import MeshSpec
from plait.planning import Plan, plan
from plait.runtime.job import Job
from plait.runtime.parallelize import parallelize

__all__ = [
    "CaptureError",
    "CheckpointError",
    "CommFusion",
    "ConfigError",
    "CostError",
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
    "TensorLayout",
    "WorkerFailed",
    "World",
    "capture",
    "checkpoint",
    "data",
    "init",
    "on_host",
    "ops",
    "parallelize",
    "pipeline_stage",
    "plan",
    "recompute",
    "shard",
    "testing",
]
