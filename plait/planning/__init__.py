"""Planning: model + example batch + config -> :class:`Plan`, with no process group.

The rooms, each importing only the ones below it:

- ``planner``  ``plait.plan`` and ``plan_graph``: capture, then the inner or the outer planner
- ``outer``    mode auto's outer planner: mesh shape, ZeRO level, recompute, micro-batches
- ``setup``    the plan's mesh, candidates, costs and constraints of one search
- ``assemble`` the searcher's choices -> collectives, stages, predictions: a Plan
- ``records``  the Plan and its records (ops, parameters, collectives, prediction, options)
- ``report``   summary and explain, human units; ``codec`` the plan file, from the fields
- ``timeline`` a pipeline schedule's passes in time: bubble, picture (PNG), Chrome trace
- ``checks``   value checks and vocabulary

Planning never imports ``plait.runtime``, ``plait.comm`` or ``torch.distributed`` (an
import-linter contract in pyproject.toml says so).
"""

from plait.planning.planner import plan, plan_graph
from plait.planning.records import (
    Alternative,
    Plan,
    PlannedCollective,
    PlannedOp,
    PlannedParameter,
    PlanOption,
    Prediction,
)
from plait.planning.report import fmt_bytes, fmt_flops, fmt_seconds

__all__ = [
    "Alternative",
    "Plan",
    "PlanOption",
    "PlannedCollective",
    "PlannedOp",
    "PlannedParameter",
    "Prediction",
    "fmt_bytes",
    "fmt_flops",
    "fmt_seconds",
    "plan",
    "plan_graph",
]
