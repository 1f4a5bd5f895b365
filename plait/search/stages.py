"""The pipeline stage partitioner: contiguous stages balanced by compute.

Ops keep graph order; stage ``s`` gets the ops between two cut points. When the graph has
repeated layers, cuts fall only at layer boundaries (a stage holds whole layers, as in
Megatron and MindSpore's ``pipeline_stage`` per cell); otherwise any op boundary may be cut.
Each cut is the allowed boundary whose cumulative compute is nearest to ``s / stages`` of the
total (ties to the earlier one), kept strictly increasing so every stage has at least one op.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

from plait.errors import ConfigError
from plait.graph import OpGraph

__all__ = ["assign_stages"]


def _allowed_cuts(graph: OpGraph) -> list[int]:
    """Op indices a stage may start at (index 0 excluded)."""
    if not graph.layers:
        return list(range(1, len(graph.ops)))
    cuts = []
    previous = graph.ops[0].layer
    for n, op in enumerate(graph.ops[1:], start=1):
        if op.layer != previous and op.layer is not None:
            cuts.append(n)  # the first op of a layer member
        previous = op.layer
    return cuts


def assign_stages(graph: OpGraph, op_seconds: Mapping[str, float], stages: int) -> list[int]:
    """Stage index of every op, in graph order."""
    cuts = _allowed_cuts(graph)
    if len(cuts) < stages - 1:
        raise ConfigError(
            f"pipeline_stages={stages} but the graph offers only {len(cuts) + 1} places to cut "
            f"({(len(graph.layers) and 'at repeated-layer boundaries') or 'between ops'}); "
            f"use at most {len(cuts) + 1} stages"
        )
    prefix = [0.0]
    for op in graph.ops:
        prefix.append(prefix[-1] + op_seconds[op.name])
    total = prefix[-1]
    chosen: list[int] = []
    for s in range(1, stages):
        target = total * s / stages
        lo = chosen[-1] if chosen else 0
        options = [c for c in cuts if c > lo]
        # leave enough cut points for the stages still to place
        options = options[: len(options) - (stages - 1 - s)]
        at = bisect.bisect_left([prefix[c] for c in options], target)
        near = [options[j] for j in (at - 1, at) if 0 <= j < len(options)]
        chosen.append(min(near, key=lambda c: (abs(prefix[c] - target), c)))
    stage_of = []
    s = 0
    for n in range(len(graph.ops)):
        while s < len(chosen) and n >= chosen[s]:
            s += 1
        stage_of.append(s)
    return stage_of
