"""The :class:`~plait.runtime.engine.job.Job` of a plan: :func:`build_plan_job` builds it the way
``parallelize`` builds a semi_auto job, with the plan's executor
(:class:`~plait.runtime.engine.plan_exec.PlanExecutor`) as the job's loss function and its
step traced once into the per-rank program (:mod:`plait.runtime.program.compile`), over which
the passes run: gradient buckets, optimizer parallel (ZeRO 1/2/3, HSDP groups), recompute,
activation offload, mixed precision.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, cast

import torch
import torch.fx
from torch import nn

from plait._compat import greedy_redistribution_planning
from plait.comm.dispatch import PlaitDispatchMode
from plait.comm.dtensor import (
    DeviceMesh,
    build_device_mesh,
    implicit_replication,
    mesh_spec_of,
)
from plait.comm.world import current_world
from plait.config import CommFusion, ParallelConfig
from plait.errors import ConfigError, PlanError
from plait.graph import (
    ExecutableCapture,
)
from plait.planning import Plan
from plait.runtime.engine.job import LossFn, OptimizerFactory, ProgramJob
from plait.runtime.engine.placement import place_parameters, reshard_parameters
from plait.runtime.engine.plan_exec import (
    PlanExecutor,
)
from plait.runtime.engine.precision import autocast_for
from plait.runtime.program.compile import Program, compile_program
from plait.runtime.program.grad_sync import GradSync
from plait.runtime.program.local_optim import build_optimizer
from plait.runtime.program.zero import (
    ShardedParameter,
    ShardGroups,
    ZeroOptimizer,
    check_elementwise,
    reshard_to_groups,
    shard_groups,
    sharded_parameters,
    split_buckets,
)

__all__ = ["build_plan_job"]

logger = logging.getLogger(__name__)


def _grad_sync(
    model: nn.Module, plan: Plan, device_mesh: DeviceMesh, cfg: ParallelConfig
) -> GradSync | None:
    """Fused reduction of the gradients the plan reduces over the data-parallel axis."""
    dp = cfg.dp_axis
    if dp not in plan.mesh.axis_names or plan.mesh.axis_size(dp) == 1:
        return None
    reduced = {p.name for p in plan.parameters if dp in p.grad_reduce_axes}
    replicated = {p.name for p in plan.parameters if all(dp not in axes for axes in p.layout.dims)}
    params = [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and (name in reduced or name in replicated)
    ]
    if not params:
        return None
    return GradSync(params, device_mesh, dp, cfg.comm_fusion or CommFusion())


def build_plan_job(
    model: nn.Module,
    plan: Plan,
    cfg: ParallelConfig,
    loss_fn: LossFn,
    optimizer_factory: OptimizerFactory,
    example_batch: Any,
    *,
    strict: bool = False,
    captured: ExecutableCapture | None = None,
    device_mesh: DeviceMesh | None = None,
) -> ProgramJob:
    """A Job that trains ``model`` exactly as ``plan`` says (call inside a process group).

    ``captured`` is the model's :func:`~plait.graph.capture_program`, when the caller has it
    (plan from ``captured.graph`` with :func:`plait.planning.planner.plan_graph` to export only once);
    otherwise the model is exported here. Export before entering ``simulate``: some models
    (Hugging Face's) do not export while simulated ranks are active.

    Checks the plan against the model and the world before anything changes, exports the
    model and loss (on fake tensors), turns parameters into DTensors with the planned layouts
    and returns a Job whose loss function is the :class:`PlanExecutor`. The executor is
    ``job.loss_fn``; its ``mismatches`` list ops where DTensor's layout differed from the plan.

    Raises:
        ConfigError: no process group, or a plan the config cannot run.
        PlanError: the plan does not fit the model (parameters, shapes, ops) or the world.
    """
    world = current_world()
    if world is None:
        raise ConfigError(
            "running a plan needs a process group: call plait.init() first (under `plait run` "
            "or torchrun), or use plait.testing.simulate(world_size=N)"
        )
    plan.validate(model, world.world_size)
    _check_settings(plan, cfg)
    if plan.optimizer_shard is not None or cfg.offload == "optimizer":
        # refused before anything is traced or placed
        check_elementwise(optimizer_factory(list(model.parameters())), plan.optimizer_shard)
    if device_mesh is None or mesh_spec_of(device_mesh) != plan.mesh:
        device_mesh = build_device_mesh(plan.mesh, world.device_type)
    executor = PlanExecutor(
        model,
        plan,
        example_batch,
        loss_fn,
        device_mesh,
        dp_axis=cfg.dp_axis,
        dataset_strategy=cfg.dataset_strategy,
        strict=strict,
        captured=captured,
    )
    layouts = place_parameters(
        model, {p.name: p.layout for p in plan.parameters}, device_mesh, executor.buffer_layouts()
    )
    grad_sync = _grad_sync(model, plan, device_mesh, cfg)
    program = _compile(executor, model, cfg, device_mesh)
    level = plan.optimizer_shard
    _warn_whole(plan)
    sharded = {}
    groups = None
    if level is not None and grad_sync is not None:
        # HSDP's shard groups (the whole dp axis without): process groups, built once
        groups = shard_groups(device_mesh, cfg.dp_axis, plan.optimizer_weight_shard_size)
        sharded = sharded_parameters(
            plan.parameters, model, program.trained, device_mesh, cfg.dp_axis, groups
        )
    buckets = [] if grad_sync is None else [b.params for b in grad_sync.buckets]
    whole, split = split_buckets(buckets, sharded if level != 1 else {})
    if grad_sync is not None and level not in (None, 1):
        grad_sync.skip = set(sharded)
    passes = functools.partial(
        _program_passes,
        model=model,
        cfg=cfg,
        reduce=grad_sync is not None,
        whole=whole,
        split=split,
        gather=level == 3,
        groups=groups,
    )
    passes(program, executor.plan)
    if level == 3 and split and groups is not None and groups.replicate is not None:
        reshard_to_groups(model, split)  # HSDP: on the groups' mesh (the layouts stay the plan's)
    elif level == 3 and split:
        layouts = reshard_parameters(
            model, {m.name: m.placements for b in split for m in b}, device_mesh, layouts
        )
    logger.info(
        "running plan for %s on mesh %s (%d ops)",
        plan.model or type(model).__name__,
        plan.mesh.as_dict(),
        len(plan.ops),
    )
    return ProgramJob(
        model,
        _optimizer(
            model,
            optimizer_factory,
            level,
            sharded,
            device_mesh,
            cfg.dp_axis,
            buckets,
            host=cfg.offload == "optimizer",
            groups=groups,
        ),
        executor,
        cfg,
        mesh=plan.mesh,
        device_mesh=device_mesh,
        slice_inputs=world.simulated or cfg.dataset_strategy == "full_batch",
        layouts=layouts,
        grad_sync=grad_sync,
        program=program,
        program_for=lambda ex: passes(_compile(ex, model, cfg, device_mesh), ex.plan),
        evaluation_for=lambda ex, outputs: _evaluation_passes(
            _compile(ex, model, cfg, device_mesh, evaluation=True, outputs=outputs),
            split=split if level == 3 else [],
            axis=cfg.dp_axis,
            groups=groups,
        ),
    )


def _evaluation_passes(
    program: Program, *, split: list[list[ShardedParameter]], axis: str, groups: ShardGroups | None
) -> Program:
    """The passes an evaluation or prediction program takes: ZeRO-3's gathers (``split``),
    so it reads the parameters as the job holds them, their shards; the rest are the training
    step's."""
    if split:
        program.gather_parameters(split, axis, groups)
    return program


def _program_passes(
    program: Program,
    plan: Plan,
    *,
    model: nn.Module,
    cfg: ParallelConfig,
    reduce: bool,
    whole: list[list[nn.Parameter]],
    split: list[list[ShardedParameter]],
    gather: bool,
    groups: ShardGroups | None = None,
) -> Program:
    """The passes over a plan's freshly traced program, in order: collectives on the batch
    alone issued first (the global target count), the loss's pending mean reduced while
    backward computes, the data-parallel gradient buckets reduced
    inside it (``reduce``: the plan has them; with accumulation the Job
    reduces after the last micro-step instead), ZeRO's reduce-scatters and, at level 3
    (``gather``), parameter gathers, recompute, activation offload, torch.compile."""
    program.issue_batch_collectives_early()
    if cfg.grad_accumulation == 1:  # else the Job sums the micro-steps' losses, then reduces
        program.reduce_loss_early()
    if reduce and cfg.grad_accumulation == 1:
        _fuse_buckets(program, model, whole, cfg.dp_axis, into_buffers=not cfg.compile)
        if split:
            program.reduce_scatter_gradients(split, cfg.dp_axis, groups)
    if gather and split:
        program.gather_parameters(split, cfg.dp_axis, groups)
    if (gather and split) or plan.recompute_regions:
        program.rematerialize(plan.recompute_regions)
    if plan.offload == "activations":
        # torch.compile takes the program whole: plain copy ops there, not stream calls
        program.offload_activations(side_stream=not cfg.compile)
    if cfg.compile:
        program.compile()
    return program


def _warn_whole(plan: Plan) -> None:
    """Optimizer parallel keeps a parameter whole where no dim of its piece divides: say which
    (the plan's reason has the fix), so a large one is not missed."""
    if plan.optimizer_shard is None:
        return
    whole = [p for p in plan.parameters if "divisible by" in p.reason]
    for p in whole[:8]:
        logger.warning("optimizer_shard=%s: %s stays whole: %s", plan.optimizer_shard, p.name,
                       p.reason.rsplit("optimizer shard: whole (", 1)[-1].rstrip(")"))  # fmt: skip


def _optimizer(
    model: nn.Module,
    factory: OptimizerFactory,
    level: int | None,
    sharded: dict[int, ShardedParameter],
    device_mesh: DeviceMesh,
    axis: str,
    buckets: list[list[nn.Parameter]],
    *,
    host: bool = False,
    groups: ShardGroups | None = None,
) -> torch.optim.Optimizer:
    """The user's optimizer on local pieces; under optimizer parallel, on this rank's shards;
    with ``offload="optimizer"``, on host copies of them."""
    if level is None and not host:
        return build_optimizer(model, factory)
    zero = ZeroOptimizer(
        list(model.named_parameters()),
        list(sharded.values()),
        level=level,
        buckets=split_buckets(buckets, sharded)[1],
        device_mesh=device_mesh,
        axis=axis,
        host=host,
        groups=groups,
    )
    optimizer = factory(zero.shadows)
    optimizer._plait_shadows = zero  # type: ignore[attr-defined]
    return optimizer


def _fuse_buckets(
    program: Program,
    model: nn.Module,
    buckets: list[list[nn.Parameter]],
    dp_axis: str,
    *,
    into_buffers: bool,
) -> None:
    """The plan's gradient buckets, all-reduced inside the program (overlapping backward);
    ``into_buffers``: computed straight into the buckets (see
    :meth:`~plait.runtime.program.compile.Program.fuse_gradient_reduction`)."""
    position = {id(model.get_parameter(name)): i for i, name in enumerate(program.trained)}
    indices = [[position[id(p)] for p in bucket if id(p) in position] for bucket in buckets]
    placements = [
        tuple(cast(Any, model.get_parameter(name)).placements) for name in program.trained
    ]
    program.fuse_gradient_reduction(indices, placements, dp_axis, into_buffers=into_buffers)


def _compile(
    executor: PlanExecutor,
    model: nn.Module,
    cfg: ParallelConfig,
    device_mesh: DeviceMesh,
    *,
    evaluation: bool = False,
    outputs: bool = False,
) -> Program:
    """The per-rank program of the executor's plan (traced on zero batches of its shapes).
    ``evaluation``: the program ``job.evaluate`` runs, the forward of the model's eval-mode
    program alone (the model in eval mode while it is traced), no passes: the parameters go in
    as the job holds them (ZeRO-3's shards gathered inside it, as the plan's executor would)."""
    # every name of a tied parameter: the export names it once, by any of them
    trained = [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.requires_grad and not evaluation
    ]
    if evaluation and not outputs:
        executor = executor.evaluator(model)

    def contexts() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(greedy_redistribution_planning())
        stack.enter_context(implicit_replication())
        stack.enter_context(PlaitDispatchMode())  # as Job._loss: exact mean-reduced losses
        stack.enter_context(autocast_for(cfg.precision, device_mesh.device_type))
        return stack

    return compile_program(
        executor,
        model,
        executor.example_flat_inputs(model),
        trained=trained,
        contexts=contexts,
        outputs=outputs,
        copies=1 if evaluation else cfg.copies,
    )


def _check_settings(plan: Plan, cfg: ParallelConfig) -> None:
    """Plan features the executor does not run yet are refused by name, before any change."""
    unbuilt = [
        (plan.pipeline_stages != 1, f"pipeline_stages={plan.pipeline_stages}"),
        (plan.micro_batches != 1, f"micro_batches={plan.micro_batches}"),
    ]
    for refused, what in unbuilt:
        if refused:
            raise PlanError(
                f"plan has {what}: the operator executor does not run that yet; plan again "
                "without it"
            )
    if cfg.dp_axis not in plan.mesh.axis_names and cfg.dataset_strategy == "data_parallel":
        logger.info(
            "plan mesh %s has no %r axis: batch replicated", plan.mesh.as_dict(), cfg.dp_axis
        )
