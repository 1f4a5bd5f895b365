"""Planning again for a batch of a new shape: a plan job's program, per batch shape.

A plan's per-rank program is exported and compiled for one batch shape: the first step's (or
``example_batch``'s). When a job that plait's planner made (modes ``semi_auto`` and ``auto``)
meets a batch of another shape (the shorter last batch of an epoch, another sequence length),
it plans again for that shape, as ``torch.compile`` recompiles for a new shape and MindSpore
compiles a new graph:

1. the training forward and loss are captured for the new shapes on meta stand-ins of the
   parameters (no rank builds the whole model; :func:`~plait.runtime.engine.predict.meta_stand_ins`);
2. the plan is made again with the job's mode, searcher and mesh, each parameter pinned to the
   layout the job's parameters have (``fixed_parameters`` of :func:`plait.planning.plan_graph`),
   so the parameters, the optimizer's states and the gradient buckets stay as they are; a plan
   that would reduce a gradient over other axes is refused by name;
3. the program is compiled with the same passes as the first (fused gradient buckets, ZeRO,
   recompute, offload, ``torch.compile``): :attr:`ProgramJob.program_for
   <plait.runtime.engine.job.ProgramJob.program_for>`.

The Job caches each shape's executor and program (by batch structure and shapes) and logs each
new plan. A job running a plan it was given (a Plan or plan file) runs the shapes it was made
for only: its executor refuses others by name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from plait._compat import tree_map
from plait.errors import PlanError
from plait.graph import OpGraph, batch_leaves
from plait.layout import TensorLayout
from plait.planning import Plan
from plait.runtime.engine.meta_init import capture_on_device
from plait.runtime.engine.plan_exec import PlanExecutor
from plait.runtime.engine.predict import meta_stand_ins
from plait.runtime.program.compile import Program

__all__ = ["Replanner"]

logger = logging.getLogger(__name__)

PlanFor = Callable[[OpGraph, Mapping[str, TensorLayout]], Plan]
"""``plan_for(graph, fixed)``: the job's planner on a new graph, parameters pinned to ``fixed``."""


class Replanner:
    """``Job.replan``: plans and compiles a job's program again for a new batch shape.

    Args:
        model: the job's model (its parameters are DTensors by now).
        loss_fn: the job's loss function, as ``parallelize`` took it.
        plan_for: plans a captured graph with the job's config and mesh, parameters pinned.
        program_for: the job's :attr:`~plait.runtime.engine.job.ProgramJob.program_for`.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Any,
        plan_for: PlanFor,
        program_for: Callable[[PlanExecutor], Program],
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.plan_for = plan_for
        self.program_for = program_for

    @torch.enable_grad()  # job.evaluate runs without gradients; the program has a backward
    def __call__(self, current: PlanExecutor, batch: Any) -> tuple[PlanExecutor, Program]:
        """The executor and program for ``batch`` (one micro-step's batch, laid out: global
        shapes), planned like ``current``'s plan with its parameter layouts."""
        started = time.perf_counter()
        shapes = [tuple(x.shape) for x in batch_leaves(batch) if isinstance(x, torch.Tensor)]
        logger.info(
            "batch shapes %s differ from the planned %s: planning again for them "
            "(parameters keep their layouts)",
            shapes,
            [tuple(s) for s in current._batch_shapes],
        )
        example = tree_map(_meta_like, batch)
        device = torch.device(current.device_mesh.device_type)
        fixed = {p.name: p.layout for p in current.plan.parameters}
        with meta_stand_ins(self.model):
            captured = capture_on_device(
                self.model, example, self.loss_fn, training=True, device=device
            )
            plan = self.plan_for(captured.graph, fixed)
            check_same_parameters(current.plan, plan, shapes)
            executor = PlanExecutor(
                self.model, plan, example, self.loss_fn, current.device_mesh,
                dp_axis=current._dp_axis, dataset_strategy=current._dataset_strategy,
                strict=current.strict, captured=captured,
            )  # fmt: skip
        # one record of layout differences and one cache of predict's programs per job
        executor.mismatches = current.mismatches
        executor._seen_mismatch = current._seen_mismatch
        executor.predictors = current.predictors
        program = self.program_for(executor)
        logger.info(
            "planned batch shapes %s in %.2f s (%d ops, %d collectives in the program)",
            shapes,
            time.perf_counter() - started,
            len(plan.ops),
            len(program.collectives()),
        )
        return executor, program


def check_same_parameters(first: Plan, again: Plan, shapes: list[tuple[int, ...]]) -> None:
    """The new plan keeps every parameter's layout and gradient reduction (the job's
    parameters, optimizer states and gradient buckets are built for them)."""
    kept = {p.name: p for p in first.parameters}
    for p in again.parameters:
        old = kept.get(p.name)
        if old is None:
            continue  # read only at the new shape: placed whole at the first plan, as planned
        if (p.layout, p.grad_reduce_axes) != (old.layout, old.grad_reduce_axes):
            raise PlanError(
                f"batch shapes {shapes}: planned again for them, parameter {p.name} would be "
                f"laid out {p.layout.describe()} with its gradient summed over "
                f"{list(p.grad_reduce_axes)}, but the job keeps it {old.layout.describe()} "
                f"summed over {list(old.grad_reduce_axes)} (its first plan's); train on "
                "batches of the first shape (pad or drop the last batch), or parallelize "
                "with example_batch= of the shape that should decide the layouts"
            )


def _meta_like(x: Any) -> Any:
    """A laid-out batch leaf as planning reads it: an empty meta tensor of its global shape."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
