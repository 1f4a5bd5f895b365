"""plait: train one PyTorch model on many devices.

Users write a plain ``torch.nn.Module``; plait splits it the way MindSpore's parallel system
does (data parallel, semi-automatic operator-level parallel with strategies and layouts, ...)
and runs it on ``torch.distributed``. See README.md for a tour.
"""

from plait import data, ops, testing
from plait.annotate import shard
from plait.capture import capture
from plait.config import CommFusion, ParallelConfig
from plait.errors import (
    ConfigError,
    LayoutError,
    NotBuiltError,
    PlaitError,
    PlanError,
    ShardingError,
)
from plait.graph import OpGraph
from plait.launch import World, init
from plait.layout import Layout, Partial, Replicate, Shard, TensorLayout
from plait.mesh import MeshSpec

# The module plait.plan (the Plan type) is imported before the function plait.plan is bound,
# so that the name plait.plan stays the function: `from plait.plan import Plan` still works.
from plait.plan import Plan  # isort: skip
from plait.planner import plan  # isort: skip
from plait.runtime.job import Job
from plait.runtime.parallelize import parallelize

__all__ = [
    "CommFusion",
    "ConfigError",
    "Job",
    "Layout",
    "LayoutError",
    "MeshSpec",
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
    "World",
    "capture",
    "data",
    "init",
    "ops",
    "parallelize",
    "plan",
    "shard",
    "testing",
]
