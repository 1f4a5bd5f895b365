"""``plait.parallelize``: lay a model out on the world and return a :class:`Job`.

Order of work: refuse features not built yet, check the world and the mesh, resolve and
validate every annotation (no mutation, no communication), then turn parameters into
DTensors and build the optimizer. Errors therefore come before any process waits on another.

Pure data parallelism (mode ``data_parallel`` on a mesh whose only axis larger than one is the
data-parallel one) skips DTensor: parameters stay plain tensors and gradients are summed in
hook-driven buckets (:mod:`plait.runtime.engine.data_parallel`), as DDP does.

A model built under ``with torch.device("meta"):`` (meta init) is never made whole: placement
gives each rank uninitialised pieces of its own (:mod:`plait.runtime.engine.placement`), ranks that
hold the whole model (stand-alone, plain data parallel) an uninitialised model on their device,
and ``job.load_pretrained`` or ``job.load`` fills them (:mod:`plait.runtime.engine.pretrained`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Literal, cast

import torch
from torch import nn

from plait import support
from plait._compat import tree_leaves, tree_map
from plait.annotate import host_marks, parameter_layouts, recompute_marks, server_marks
from plait.comm import ps as ps_comm
from plait.comm.dp import host_group_mesh
from plait.comm.dtensor import DeviceMesh, build_device_mesh, coordinate_of
from plait.comm.world import current_world
from plait.config import (
    CommFusion,
    ParallelConfig,
    Recompute,
    Schedule,
    Search,
    parameter_server_defaults,
)
from plait.data import planned_piece
from plait.errors import ConfigError, NotBuiltError, PlanError
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.planning import Plan
from plait.ps.worker import serve_tables
from plait.runtime.engine.data_parallel import PlainDataParallel, PlainGradSync, fresh_parameters
from plait.runtime.engine.generate import install_model_generate
from plait.runtime.engine.host import (
    host_module_paths,
    place_on_host,
    plan_host_placement,
)
from plait.runtime.engine.job import (
    DeferredJob,
    HybridJob,
    Job,
    LossFn,
    OptimizerFactory,
    PlainJob,
    StandAloneJob,
)
from plait.runtime.engine.meta_init import (
    capture_on_device,
    check_meta_buffers,
    materialize_meta,
    move_to_device,
)
from plait.runtime.engine.metrics import check_log_dir
from plait.runtime.engine.placement import place_parameters
from plait.runtime.program.grad_sync import GradSync
from plait.runtime.program.local_optim import build_optimizer
from plait.support import Where

__all__ = ["parallelize"]

logger = logging.getLogger(__name__)


def _with_model_marks(model: nn.Module, cfg: ParallelConfig) -> ParallelConfig:
    """The config with what the model's modules and parameters say: modules marked by
    ``plait.recompute`` (MindSpore's ``Cell.recompute()``) added to ``recompute_modules`` (the
    config's own entries win), and parameters with ``parallel_optimizer = False`` (MindSpore's
    flag) added to ``optimizer_shard_exclude``, and modules marked by ``plait.on_host`` added to
    ``host_modules``."""
    hosts = host_marks(model)
    if hosts:
        cfg = dataclasses.replace(cfg, host_modules=(*cfg.host_modules, *hosts))
    tables = server_marks(model)
    if tables and cfg.mode != "parameter_server":
        raise ConfigError(
            f"plait.on_server marks {tables[0]!r} of {type(model).__name__}, and mode="
            f"{cfg.mode!r} would do nothing with it: give ParallelConfig(mode="
            "'parameter_server') or undo the mark (plait.on_server(module, server=False))"
        )
    if tables:
        cfg = dataclasses.replace(cfg, server_modules=(*cfg.server_modules, *tables))
    marks = recompute_marks(model)
    if marks:
        cfg = dataclasses.replace(
            cfg, recompute_modules={**dict(marks), **dict(cfg.recompute_modules)}
        )
    excluded = tuple(
        n for n, p in model.named_parameters() if getattr(p, "parallel_optimizer", True) is False
    )
    if excluded:
        cfg = dataclasses.replace(
            cfg, optimizer_shard_exclude=(*cfg.optimizer_shard_exclude, *excluded)
        )
    return cfg


def _refuse_plan_overrides(plan: Plan, cfg: ParallelConfig, where: str) -> None:
    """``ParallelConfig(plan=...)`` runs the plan's mesh, mode, search, recompute, stages and
    schedule: a config field set to something else (a value other than its default) would be
    ignored, so it is refused by name."""
    defaults = ParallelConfig()
    pairs = [
        ("mesh", plan.mesh.as_dict(), cfg.mesh_dict if cfg.mesh is not None else None),
        ("devices", plan.mesh.size, cfg.devices),
        ("mode", plan.mode, cfg.mode if cfg.mode != defaults.mode else None),
        ("search", plan.search, cfg.search),
        ("recompute", plan.recompute, cfg.recompute if cfg.recompute != "none" else None),
        (
            "recompute_modules",
            tuple(tuple(r) for r in plan.recompute_regions),
            cfg.recompute_modules or None,
        ),
        ("micro_batches", plan.micro_batches, cfg.micro_batches if cfg.micro_batches > 1 else None),
        ("schedule", plan.schedule, cfg.schedule if cfg.schedule != defaults.schedule else None),
    ]
    for name, planned, given in pairs:
        if given is not None and given != planned:
            raise ConfigError(
                f"ParallelConfig(plan=..., {name}={given!r}): {where} was made with {name}="
                f"{planned!r}, and a plan runs as it was made, so {name} would be ignored; leave "
                f"{name} out (the plan's is used), or plan again with plait.plan(..., "
                f"ParallelConfig({name}={given!r}, ...))"
            )


def _pipeline_recompute(
    model: nn.Module, config: ParallelConfig, loss_fn: LossFn, batch: Any
) -> ParallelConfig:
    """``recompute="auto"`` in a pipeline: the planner's choice for this model, mesh, schedule
    and batch (the cheapest of none, selective and full whose predicted peak per device, the
    schedule's micro-batches in flight included, fits ``memory_limit``), logged."""
    if config.recompute != "auto":
        return config
    from plait.planning import plan as make_plan

    chosen = make_plan(model, config, example_batch=batch, loss_fn=loss_fn)
    logger.info(
        "pipeline recompute='auto' chose %r (%s)", chosen.recompute, "; ".join(chosen.notes[-1:])
    )
    recompute = cast(Literal["none", "full", "selective"], chosen.recompute)  # a plan's choice
    return dataclasses.replace(config, recompute=recompute)


def _job_mesh(cfg: ParallelConfig, world_size: int) -> MeshSpec:
    mesh = cfg.mesh_dict or {cfg.dp_axis: world_size}
    spec = MeshSpec.from_dict(mesh)
    if spec.size != world_size:
        raise ConfigError(
            f"ParallelConfig.mesh={mesh!r} covers {spec.size} devices but the world has "
            f"{world_size} ranks; make the product of the mesh sizes equal the number of "
            f"processes (or launch {spec.size} processes)"
        )
    if cfg.devices is not None and cfg.devices != world_size:
        raise ConfigError(
            f"ParallelConfig.devices={cfg.devices} but the world has {world_size} ranks; "
            "launch that many processes or change devices"
        )
    return spec


def _plan_and_config(
    given: ParallelConfig | Plan, world: Any
) -> tuple[Plan | None, ParallelConfig]:
    """The plan given (if one was) and the config to run, sized for the world (a mesh's
    ``dp=-1`` takes the rest of it)."""
    plan: Plan | None = None
    config: Any = given
    if isinstance(given, Plan):
        plan, config = given, _config_of(given)
    if not isinstance(config, ParallelConfig):
        raise ConfigError(
            f"parallelize expects a plait.ParallelConfig or a plait.Plan, got "
            f"{type(config).__name__}; build one with plait.ParallelConfig(...) or plait.plan(...)"
        )
    if world is not None:
        config = config.for_world(world.world_size)
    return plan, config


def parallelize(
    model: nn.Module,
    config: ParallelConfig | Plan,
    *,
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
    example_batch: Any = None,
) -> Job:
    """Split ``model`` across the current world as ``config`` says; returns a :class:`Job`.

    Args:
        model: the full model, built identically (same seed) on every rank.
        config: the parallel configuration, or a :class:`~plait.Plan` to run as it is
            (from ``plait.plan`` or ``Plan.load``; its mesh, precision and gradient
            accumulation are the job's; ``ParallelConfig(plan="file.json")`` is the same for a
            saved file).
        optimizer: called with the (now distributed) parameters, returns the optimizer.
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss of a batch.
        example_batch: a global batch (real, fake or meta tensors; only shapes are read), needed
            by mode "auto" (plait plans the model on it) and by ``ParallelConfig(plan=...)``.

    Raises:
        NotBuiltError: a config knob asks for a feature not built yet.
        ConfigError: the mesh does not match the world.
        ShardingError, LayoutError: an annotation does not fit the model or the mesh.
    """
    world = current_world()
    plan, config = _plan_and_config(config, world)
    support.check(config)  # what is refused on every engine (plait.support's table)
    check_log_dir(config)  # metrics that could not be written: before any collective
    config = _with_model_marks(model, config)
    check_meta_buffers(model)  # meta init: refused before planning, not after
    install_model_generate(model, config.dp_axis)  # HF's own generate on the job's DTensor parameters
    _servers_match(config, world)
    if config.mode == "parameter_server":
        return _parameter_server_job(model, config, optimizer, loss_fn, example_batch)
    planned = config.mode == "auto" or config.plan is not None or plan is not None
    if config.pipeline_stages > 1 and not planned:
        # its engine's rules need the axes inside the stages: check_pipeline_config reads them
        return _pipeline_job(model, config, optimizer, loss_fn, example_batch)
    _stages_need_processes(config, world)
    if config.mode == "stand_alone":
        support.check(config, Where("stand_alone"), engine_only=True)
        return _stand_alone_job(model, config, optimizer, loss_fn)
    if world is None:
        raise ConfigError(
            f"parallelize(mode={config.mode!r}) needs a process group: call plait.init() first "
            "(under `plait run` or torchrun), or use plait.testing.simulate(world_size=N) to run "
            "N ranks in this process"
        )
    mesh: MeshSpec | None = None
    if not planned:
        mesh = _job_mesh(config, world.world_size)
        if config.mode == "data_parallel":
            _refuse_annotations(model)
        # annotations are checked now, before anything waits for the first batch
        named = parameter_layouts(model, mesh)
        engine = support.engine_of(config, mesh.as_dict())
        support.check(config, Where(engine), engine_only=True)
        if engine == "plain":
            plain_mesh = build_device_mesh(mesh, world.device_type)
            return _plain_job(model, config, mesh, plain_mesh, named, optimizer, loss_fn)
        if engine == "hybrid":
            return _hybrid_job(model, config, mesh, named, optimizer, loss_fn)
    elif plan is None and config.plan is None and config.mesh is not None:
        mesh = _job_mesh(config, world.world_size)
    support.check(config, Where("program", planned=planned), engine_only=True)
    # Every other job runs a plan: semi_auto plans from the annotations (unannotated ops data
    # parallel), auto searches, a plan file or Plan runs as it is. Without an example batch
    # the plan is made at the first step, on its batch; the mesh, when the config fixes it, is
    # built now and shared with the planned job.
    device_mesh = None if mesh is None else build_device_mesh(mesh, world.device_type)
    build = functools.partial(
        _planned_job,
        model,
        config,
        optimizer,
        loss_fn,
        world_size=world.world_size,
        plan=plan,
        device_mesh=device_mesh,
    )
    if example_batch is None:
        return _deferred_job(model, config, build, plan, mesh, device_mesh, world.simulated)
    return build(example_batch)


def _servers_match(config: ParallelConfig, world: Any) -> None:
    """A parameter-server job has server ranks, and only it: refused by name otherwise."""
    servers = ps_comm.group()
    if config.mode != "parameter_server":
        if servers is not None:
            raise ConfigError(
                f"this job was launched with {servers.servers} parameter servers "
                f"(PLAIT_SERVER_NUM, plait run --server-num) and ParallelConfig(mode="
                f"{config.mode!r}) puts nothing on them; give mode='parameter_server' or "
                "launch without servers"
            )
        return
    if servers is None:
        simulated = world is not None and world.simulated
        raise ConfigError(
            "ParallelConfig(mode='parameter_server') needs server ranks beside the workers, "
            + (
                "and plait.testing.simulate has none (the servers are processes): "
                if simulated
                else "and this job has none: "
            )
            + "launch with plait run --worker-num W --server-num S train.py (or set "
            "PLAIT_SERVER_NUM=S under torchrun, mpirun or srun: the last S ranks serve)"
        )


def _parameter_server_job(
    model: nn.Module,
    config: ParallelConfig,
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
    example_batch: Any,
) -> Job:
    """A parameter-server job: the model's tables moved to the servers (:mod:`plait.ps`, each
    lookup one ``plait::ps_lookup`` op), the dense rest data parallel over the workers - on
    plain tensors, or as a plan's per-rank program where ZeRO asks for one; each step pushes
    the rows' gradients after its last backward."""
    world = current_world()
    servers = ps_comm.group()
    assert world is not None and servers is not None
    mesh = _job_mesh(config, world.world_size)
    engine = support.engine_of(config, mesh.as_dict())
    support.check(config, Where(engine), engine_only=True)
    client = serve_tables(model, config, servers, _device_of(world.device_type))
    device_mesh = build_device_mesh(mesh, world.device_type)

    def attach(job: Job) -> Job:
        job.before_update.append(client.flush)
        job.checkpoint_parts.append(client)
        job.parameter_server = client
        return job

    if engine == "plain":
        return attach(_plain_job(model, config, mesh, device_mesh, {}, optimizer, loss_fn))
    dense = dataclasses.replace(config, mode="data_parallel", **parameter_server_defaults())
    build = functools.partial(
        _planned_job, model, dense, optimizer, loss_fn, world_size=world.world_size,
        device_mesh=device_mesh,
    )  # fmt: skip
    if example_batch is not None:
        return attach(build(example_batch))
    deferred = _deferred_job(
        model, dense, lambda batch: attach(build(batch)), None, mesh, device_mesh, False
    )
    deferred.parameter_server = client  # readable before the first step (prefetch)
    return deferred


def _stages_need_processes(config: ParallelConfig, world: Any) -> None:
    """Pipeline stages send to each other point to point: no simulated world."""
    if config.pipeline_stages > 1 and (world is None or world.simulated):
        raise ConfigError(
            f"pipeline_stages={config.pipeline_stages} (mode {config.mode!r}) needs real "
            "processes (plait run, torchrun, or plait.testing.run_workers): its stages send "
            "activations to each other point to point, which a simulated world "
            "(plait.testing.simulate) cannot"
        )


def _planned_job(
    model: nn.Module,
    config: ParallelConfig,
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
    example_batch: Any,
    *,
    world_size: int,
    plan: Plan | None = None,
    device_mesh: DeviceMesh | None = None,
) -> Job:
    """The job of a plan: made now on ``example_batch`` (semi_auto from the annotations, auto by
    search), or a plan file or Plan checked against it; run as a compiled per-rank program."""
    from plait.planning import plan_graph
    from plait.runtime.engine.plan_job import build_plan_job

    if plan is not None:
        where = "the given plan"
    elif config.plan is not None:
        where = f"plan file {os.fspath(config.plan)!r}"
    else:
        where = f"mode {config.mode!r}"
    if plan is None and config.plan is not None:
        plan = Plan.load(config.plan)
        _refuse_plan_overrides(plan, config, where)
    if plan is not None:
        _check_plan_batch(plan, config, planned_piece(example_batch, config), where)
    planned_here = plan is None
    plan, config, micro, captured = _captured_plan(
        model, config, loss_fn, example_batch, world_size=world_size, plan=plan
    )
    logger.info("running plan on mesh %s (%s)", plan.mesh.as_dict(), plan.search)
    if plan.pipeline_stages > 1:
        try:
            return _pipeline_of_plan(model, config, plan, optimizer, loss_fn, example_batch)
        except (ConfigError, NotBuiltError) as e:
            if not planned_here or config.mesh is not None:
                raise  # a pipeline the user asked for: say why it cannot run
            # The same on every rank, before any collective: plan without stages instead.
            logger.warning(
                "the plan's %d pipeline stages cannot run (%s); planning without pipeline stages",
                plan.pipeline_stages,
                e,
            )
            plan = plan_graph(captured.graph, config, model=model, runnable_only=True)
    job = build_plan_job(
        model, plan, config, loss_fn, optimizer, micro, captured=captured, device_mesh=device_mesh
    )
    if planned_here and job.program_for is not None:
        job.replan = _replanner(model, config, loss_fn, plan, job.program_for)
    return job


def _captured_plan(
    model: nn.Module,
    config: ParallelConfig,
    loss_fn: LossFn,
    example_batch: Any,
    *,
    world_size: int,
    plan: Plan | None,
) -> tuple[Plan, ParallelConfig, Any, Any]:
    """(the plan, the config it runs with, the batch piece its program is traced on, that
    piece's capture on this rank's device). The piece: with gradient accumulation each
    micro-step runs the graph on 1/k of the batch, and with interleave_num each copy on
    1/copies of that; the plan is made for (and the model traced on) that piece. Without
    ``plan``, one is made on the capture (semi_auto from the annotations, auto by search;
    ``interleave_num="auto"``: a capture and a search per copy count, the faster kept and
    the config given its count)."""
    from plait.planning import plan_graph
    from plait.planning.copies import weigh_copies

    world = current_world()
    assert world is not None

    def capture_for(cfg: ParallelConfig) -> tuple[Any, Any]:
        """What Job.step runs; a meta model's on this rank's device (meta init)."""
        micro = planned_piece(example_batch, cfg)
        device = _device_of(world.device_type)
        return micro, capture_on_device(model, micro, loss_fn, training=True, device=device)

    if plan is not None:
        return (plan, config, *capture_for(config))
    if config.mesh is None and config.devices is None:
        config = dataclasses.replace(config, devices=world_size)

    def plan_one(cfg: ParallelConfig) -> tuple[Plan, tuple[Any, Any]]:
        made = capture_for(cfg)
        # pipeline stages send to each other point to point: real processes only
        return plan_graph(made[1].graph, cfg, model=model, runnable_only=world.simulated), made

    if config.interleave_num == "auto":
        made_plan, (micro, captured) = weigh_copies(config, plan_one)
        config = dataclasses.replace(config, interleave_num=made_plan.interleave_num)
    else:
        made_plan, (micro, captured) = plan_one(config)
    return made_plan, config, micro, captured


def _replanner(
    model: nn.Module, config: ParallelConfig, loss_fn: LossFn, plan: Plan, program_for: Any
) -> Any:
    """Plans the job again for a batch of a new shape (:mod:`plait.runtime.engine.replan`): same
    mode, mesh and searcher as ``plan``, the parameters pinned where they are."""
    from plait.planning import plan_graph
    from plait.runtime.engine.replan import Replanner

    # the outer planner's choice of searcher, when mode auto left it to plait
    again = config
    if config.mode == "auto":
        again = dataclasses.replace(config, search=cast(Search, plan.search))

    def plan_for(graph: Any, fixed: Any) -> Plan:
        return plan_graph(
            graph, again, mesh=plan.mesh, model=model, runnable_only=True, fixed_parameters=fixed
        )

    return Replanner(model, loss_fn, plan_for, program_for)


def _pipeline_of_plan(
    model: nn.Module,
    config: ParallelConfig,
    plan: Plan,
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
    example_batch: Any,
) -> Job:
    """A plan with pipeline stages (the outer planner's pp x dp x tp, or a plan file) run as
    pipeline parallel: its mesh, stage split, micro-batches, schedule, ZeRO level and
    recompute, and its parameters' layouts inside each stage (:mod:`plait.runtime.pipeline.job`)."""
    from plait.runtime.pipeline.job import (
        PipelineJob,
        check_pipeline_config,
        check_pipeline_optimizer,
    )

    world = current_world()
    if world is None or world.simulated:
        raise ConfigError(
            f"the plan has pipeline_stages={plan.pipeline_stages}, which needs real processes "
            "(plait run, torchrun, or plait.testing.run_workers): its stages send activations "
            "to each other point to point, which a simulated world cannot"
        )
    pipe = dataclasses.replace(
        config,
        mesh=plan.mesh.as_dict(),
        devices=None,
        pipeline_stages=plan.pipeline_stages,
        micro_batches=plan.micro_batches,
        schedule=cast(Schedule, plan.schedule),
        virtual_stages=plan.virtual_stages,
        optimizer_shard=cast(Any, plan.optimizer_shard),
        recompute=cast(Recompute, plan.recompute),
        plan=None,
    )
    # refusals before anything changes
    check_pipeline_config(pipe, plan.mesh, planned=True)
    check_pipeline_optimizer(model, pipe, optimizer)
    materialize_meta(model, _device_of(world.device_type))
    logger.info(
        "running the plan's %d pipeline stages (%s, %d micro-batches) on mesh %s",
        plan.pipeline_stages,
        plan.schedule,
        plan.micro_batches,
        plan.mesh.as_dict(),
    )
    return PipelineJob(
        model,
        pipe,
        mesh=plan.mesh,
        device_mesh=build_device_mesh(plan.mesh, world.device_type),
        optimizer=optimizer,
        loss_fn=loss_fn,
        example_batch=example_batch,
        plan=plan,
    )


def _stand_alone_job(
    model: nn.Module, config: ParallelConfig, optimizer: OptimizerFactory, loss_fn: LossFn
) -> Job:
    """The model as it is, on one process."""
    materialize_meta(model, "cpu")  # stand-alone runs where the model is: the CPU for meta
    return StandAloneJob(model, optimizer(model.parameters()), loss_fn, config)


def _pipeline_job(
    model: nn.Module,
    config: ParallelConfig,
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
    example_batch: Any,
) -> Job:
    """Pipeline parallel (``runtime/pipeline/job.py``): stages built now on ``example_batch``, or
    at the first step on its batch."""
    from plait.runtime.pipeline.job import (
        PipelineJob,
        check_pipeline_config,
        check_pipeline_optimizer,
    )

    world = current_world()
    if world is None or world.simulated:
        raise ConfigError(
            f"pipeline_stages={config.pipeline_stages} needs real processes (plait run, "
            "torchrun, or plait.testing.run_workers): its stages send activations to each other "
            "point to point, which a simulated world (plait.testing.simulate) cannot"
        )
    mesh = _job_mesh(config, world.world_size)
    if "pp" not in mesh.axis_names:
        raise ConfigError(
            f"pipeline_stages={config.pipeline_stages} needs a mesh with a 'pp' axis, e.g. "
            f"mesh={{'pp': {config.pipeline_stages}, 'dp': ...}}; got {dict(mesh.as_dict())}"
        )
    # before anything waits (the device mesh's groups, the first batch)
    check_pipeline_config(config, mesh)
    check_pipeline_optimizer(model, config, optimizer)
    materialize_meta(model, _device_of(world.device_type))
    device_mesh = build_device_mesh(mesh, world.device_type)

    def build(batch: Any) -> Job:
        return PipelineJob(
            model,
            _pipeline_recompute(model, config, loss_fn, batch),
            mesh=mesh,
            device_mesh=device_mesh,
            optimizer=optimizer,
            loss_fn=loss_fn,
            example_batch=batch,
        )

    if example_batch is not None:
        return build(example_batch)
    return DeferredJob(
        model,
        config,
        build,
        mesh=mesh,
        device_mesh=device_mesh,
        to_global=_global_batch(config, mesh),
        engine="pipeline",
    )


def _deferred_job(
    model: nn.Module,
    config: ParallelConfig,
    build: Any,
    plan: Plan | None,
    mesh: MeshSpec | None,
    device_mesh: DeviceMesh | None,
    simulated: bool,
) -> DeferredJob:
    """A job planned at its first step (no example batch given)."""
    if plan is not None or config.plan is not None:
        where = "the given plan" if plan is not None else f"plan file {config.plan!r}"
        raise ConfigError(
            f"parallelize with {where} needs example_batch=: a global batch (shapes only; "
            "meta tensors are fine) to check the plan against before anything runs"
        )
    if mesh is None and not simulated:
        raise ConfigError(
            f"parallelize(mode={config.mode!r}) without a mesh needs example_batch=: each "
            "process passes its own slice of the batch to step, and the slicing depends on "
            "the mesh the plan picks; give example_batch= (the global batch, meta tensors "
            "are fine) or ParallelConfig(mesh=...)"
        )
    to_global = None if simulated or mesh is None else _global_batch(config, mesh)
    return DeferredJob(
        model, config, build, mesh=mesh, device_mesh=device_mesh, to_global=to_global
    )


def _global_batch(config: ParallelConfig, mesh: MeshSpec) -> Any:
    """The global batch's shapes (meta tensors) from one process's own slice of it, as the
    dataset strategy cuts it (a real process steps on its slice; plans are for the whole)."""
    strategy = config.dataset_strategy
    if strategy == "full_batch":
        return None
    dp = mesh.axis_size(config.dp_axis) if config.dp_axis in mesh.axis_names else 1

    def whole(x: Any, splits: tuple[int, ...]) -> Any:
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return x
        shape = [s * (splits[d] if d < len(splits) else 1) for d, s in enumerate(x.shape)]
        return torch.empty(shape, dtype=x.dtype, device="meta")

    def to_global(batch: Any) -> Any:
        if isinstance(strategy, tuple) and isinstance(batch, tuple | list):
            cuts = [s.splits() if isinstance(s, TensorLayout) else tuple(s) for s in strategy]
            return type(batch)(whole(x, c) for x, c in zip(batch, cuts, strict=False))
        return tree_map(lambda x: whole(x, (dp,)), batch)

    return to_global


def _config_of(plan: Plan) -> ParallelConfig:
    """The job settings a plan fixes: mesh, precision, gradient accumulation, data-parallel
    axis, dataset strategy and gradient fusion, as it was made with."""
    return ParallelConfig(
        mode="auto",
        mesh=plan.mesh.as_dict(),
        optimizer_shard=plan.optimizer_shard,  # type: ignore[arg-type]
        offload=plan.offload,  # type: ignore[arg-type]
        recompute=plan.recompute,  # type: ignore[arg-type]
        recompute_modules=tuple((p, m) for p, m in plan.recompute_regions),
        precision=plan.precision,  # type: ignore[arg-type]
        grad_accumulation=plan.grad_accumulation,
        interleave_num=plan.interleave_num,
        dp_axis=plan.dp_axis,
        dataset_strategy=plan.dataset_strategy,  # type: ignore[arg-type]
        comm_fusion=plan.comm_fusion,
    )


def _check_plan_settings(plan: Plan, config: ParallelConfig, where: str) -> None:
    """A plan runs with the settings its collectives and batch layouts were planned for."""
    pairs = [
        ("precision", plan.precision, config.precision),
        ("dp_axis", plan.dp_axis, config.dp_axis),
        ("dataset_strategy", plan.dataset_strategy, config.dataset_strategy),
        ("comm_fusion", plan.comm_fusion, config.comm_fusion),
        ("optimizer_shard", plan.optimizer_shard, config.optimizer_shard),
        ("offload", plan.offload, config.offload),
    ]
    for name, planned, given in pairs:
        if planned != given:
            raise PlanError(
                f"{where} was made with {name}={planned!r} but the config has {name}="
                f"{given!r}; give the plan's value (or leave it out with "
                f"plait.parallelize(model, plan, ...)) or plan again with this one"
            )


def _check_plan_batch(plan: Plan, config: ParallelConfig, micro: Any, where: str) -> None:
    """A saved plan runs with the gradient accumulation and batch shapes it was made for."""
    _check_plan_settings(plan, config, where)
    for name in ("grad_accumulation", "interleave_num"):
        planned, given = getattr(plan, name), getattr(config, name)
        if planned != given:
            raise PlanError(
                f"{where} was made for {name}={planned} but the config has {name}={given}; "
                "use the plan's value or plan again with this one"
            )
    shapes = tuple(tuple(x.shape) for x in tree_leaves(micro) if isinstance(x, torch.Tensor))
    if plan.batch and shapes != plan.batch:
        per = " per micro-step" if config.grad_accumulation > 1 else ""
        per = " per copy" if config.interleave_num != 1 else per
        raise PlanError(
            f"{where} was made for batch shapes {list(plan.batch)}{per} but example_batch gives "
            f"{list(shapes)}{per}; train with the planned batch size or plan again for this one"
        )


def _plain_job(
    model: nn.Module,
    cfg: ParallelConfig,
    mesh: MeshSpec,
    device_mesh: DeviceMesh,
    layouts: dict[str, TensorLayout],
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
    example_batch: Any = None,
) -> Job:
    """The Job of pure data parallelism: plain parameters, bucketed gradient sums."""
    world = current_world()
    assert world is not None
    dp = cfg.dp_axis
    size = mesh.axis_size(dp)
    device = _device_of(world.device_type)
    # host modules are made (meta init) and kept in host memory: never put on the device
    paths = host_module_paths(model, cfg) if cfg.host_modules else ()
    host = plan_host_placement(model, paths) if paths else None
    materialize_meta(model, device, paths)  # meta init: each rank holds the whole model, empty
    if device.type != "cpu":
        move_to_device(model, device, keep=paths)
    if host is not None:
        place_on_host(model, host, device)
    fresh_parameters(model)  # drops old hooks; simulated ranks: one private copy each
    plain = PlainDataParallel(
        group_mesh=device_mesh[dp],
        axis=dp,
        size=size,
        rank=None if world.simulated else coordinate_of(device_mesh)[mesh.axis_index(dp)],
        slice_inputs=world.simulated or cfg.dataset_strategy == "full_batch",
        device=device,
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    grad_sync = None
    if size > 1 and trained:
        host_mesh = host_group_mesh(device_mesh[dp], device_mesh, dp) if host else None
        grad_sync = PlainGradSync(
            trained, device_mesh[dp], cfg.comm_fusion or CommFusion(), host_mesh=host_mesh
        )
    logger.info(
        "parallelized %s on mesh %s (pure data parallel, plain tensors%s)",
        type(model).__name__,
        mesh.as_dict(),
        f"; {host.describe()}" if host else "",
    )
    return PlainJob(
        model,
        optimizer(model.parameters()),
        loss_fn,
        cfg,
        mesh=mesh,
        device_mesh=device_mesh,
        layouts=layouts,
        plain=plain,
        grad_sync=grad_sync,
    )


def _device_of(device_type: str) -> torch.device:
    """This process's device: the current CUDA device for NCCL worlds, else the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _hybrid_job(
    model: nn.Module,
    cfg: ParallelConfig,
    mesh: MeshSpec,
    layouts: dict[str, TensorLayout],
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
) -> Job:
    """MindSpore's hybrid (manual) mode: the user's own layout-aware code.

    Parameters become DTensors in their annotated layouts (replicated otherwise) and the
    forward runs the user's code on them as written: ``plait.ops`` calls and DTensor's own
    propagation decide the collectives, nothing is planned. Gradients of parameters the user
    split over the data-parallel axis (MindSpore's ``layerwise_parallel``) are the user's and
    stay out of the data-parallel all-reduce; the others are reduced in fused buckets.
    """
    if cfg.compile:
        raise NotBuiltError(
            "ParallelConfig(mode='hybrid', compile=True): hybrid runs the user's own "
            "code eagerly on DTensors; compile=True compiles a plan's per-rank program "
            "(modes semi_auto, auto, data_parallel): leave compile False or plan"
        )
    world = current_world()
    assert world is not None
    device_mesh = build_device_mesh(mesh, world.device_type)
    place_parameters(model, layouts, device_mesh)
    dp = cfg.dp_axis
    grad_sync = None
    if dp in mesh.axis_names and mesh.axis_size(dp) > 1:
        reduced = [
            p
            for name, p in model.named_parameters()
            if p.requires_grad and all(dp not in axes for axes in layouts[name].dims)
        ]
        if reduced:
            grad_sync = GradSync(reduced, device_mesh, dp, cfg.comm_fusion or CommFusion())
    logger.info("parallelized %s on mesh %s (mode hybrid)", type(model).__name__, mesh.as_dict())
    return HybridJob(
        model,
        build_optimizer(model, optimizer),
        loss_fn,
        cfg,
        mesh=mesh,
        device_mesh=device_mesh,
        slice_inputs=world.simulated or cfg.dataset_strategy == "full_batch",
        layouts=layouts,
        grad_sync=grad_sync,
    )


def _refuse_annotations(model: nn.Module) -> None:
    from plait.annotate import get_shard_spec

    for path, module in model.named_modules():
        if get_shard_spec(module) is not None:
            raise ConfigError(
                f"module {path or type(module).__name__!r} carries a plait.shard annotation but "
                "mode is 'data_parallel', which ignores annotations; use mode='semi_auto'"
            )
