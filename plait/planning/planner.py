"""``plait.plan``: model + config (+ example batch) -> Plan, with no process group.

The one path of the design, up to the Plan:

    capture (OpGraph) -> rules (candidates per op) -> constraints (annotations, mode, batch)
    -> search -> Plan (layouts, every collective with its reason and cost, predictions)

Mode auto without a fixed mesh goes through the outer planner (:mod:`plait.planning.outer`),
which runs this search once per mesh. Costs are seconds and bytes on the config's hardware
profile (``plait.cost``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from plait import support
from plait.config import ParallelConfig
from plait.data import planned_piece, split_micro_batches
from plait.errors import ConfigError
from plait.graph import OpGraph, capture, in_mode
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.planning.assemble import assemble_plan
from plait.planning.copies import weigh_copies
from plait.planning.outer import auto_plan
from plait.planning.records import Plan
from plait.planning.servers import (
    check_servers,
    dense_config,
    distinct_rows,
    ids_per_micro_batch,
    mesh_of_auto,
    on_meta,
    ps_config_for,
    read_tables,
    replaced,
    servable_tables,
    server_plan,
    server_table_paths,
    server_tables,
    stand_in_tables,
    weigh_servers,
)
from plait.planning.setup import check_config, hardware_of, mesh_of, prepare
from plait.planning.timing import PlanTiming
from plait.search import get_searcher
from plait.support import Where

__all__ = ["LossFn", "PlanTiming", "plan", "plan_graph"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]

_log = logging.getLogger("plait.planning")


def plan(
    model: nn.Module,
    config: ParallelConfig,
    *legacy: Any,
    example_batch: Any = None,
    loss_fn: LossFn | None = None,
    hardware_file: str | None = None,
    timing: PlanTiming | None = None,
    servers: int | None = None,
) -> Plan:
    """Plan how to train ``model`` under ``config`` (no process group, no parameter memory).

    The arguments are ``parallelize``'s, in its order. ``example_batch`` is one optimizer
    step's global batch, as ``parallelize`` takes it (real, fake or meta tensors; only shapes
    are read); with ``grad_accumulation=k`` the plan is for its micro-batches of 1/k, and
    ``plan.batch`` records one micro-batch's shapes. ``loss_fn(model, batch)`` returns the
    scalar loss (None: the model's output is the loss). The older order
    ``plan(model, example_batch, config[, loss_fn])`` is still read. ``timing``, a
    :class:`~plait.planning.timing.PlanTiming`, receives where the time went (capture,
    candidates, search, estimate, assemble, and what the outer planner did with its meshes).
    ``servers`` (mode ``parameter_server`` only, where it is required): the server ranks the
    job runs beside ``devices`` workers (``plait run --server-num``); the plan places each
    table on them, counts each step's pulls and pushes and weighs the other placements
    (:mod:`plait.planning.servers`).

    Example:
        >>> cfg = ParallelConfig(mode="auto", devices=8)
        >>> plan = plait.plan(model, cfg, example_batch=batch, loss_fn=loss)  # doctest: +SKIP
        >>> print(plan.summary())  # doctest: +SKIP
    """
    start = time.perf_counter()
    timing = timing if timing is not None else PlanTiming()
    config, example_batch, loss_fn = _arguments(config, legacy, example_batch, loss_fn)
    if config.mode == "auto" and servers is not None:
        result = _auto_with_servers(
            model, config, example_batch, loss_fn, servers, hardware_file, timing
        )
        timing.total_s = time.perf_counter() - start
        return result
    if config.mode == "parameter_server" or servers is not None:
        result = _server_plan(
            model, config, example_batch, loss_fn, servers, hardware_file, timing
        )[0]
        timing.total_s = time.perf_counter() - start
        return result
    check_config(config)
    if config.mode != "auto":
        mesh_of(config)  # a bad mesh or device count fails before the capture
    # A plan is for training steps; with gradient accumulation each micro-step runs on 1/k of
    # the step's batch (and with interleave_num on one copy of that), so the graph is traced
    # on that piece (as parallelize does).

    def plan_one(cfg: ParallelConfig) -> tuple[Plan, None]:
        micro = planned_piece(example_batch, cfg)
        with timing.phase("capture"), in_mode(model, training=True):
            graph = capture(model, micro, loss_fn)
        return _plan_graph(graph, cfg, None, model, hardware_file, False, timing), None

    with _gc_paused():
        if config.interleave_num == "auto":  # one capture and search per copy count
            result = weigh_copies(config, plan_one)[0]
        else:
            result = plan_one(config)[0]
    if config.host_modules:
        note = (
            f"host_modules {', '.join(config.host_modules)}: kept and computed on the host when "
            "run; this plan still counts their parameters, gradients and optimizer states (and "
            "their ops' time) on the device"
        )
        result = dataclasses.replace(result, notes=(*result.notes, note))
    timing.total_s = time.perf_counter() - start
    _log.info("%s", timing.line())
    return result


def _server_plan(
    model: nn.Module,
    config: ParallelConfig,
    example_batch: Any,
    loss_fn: LossFn | None,
    servers: int | None,
    hardware_file: str | None,
    timing: PlanTiming,
    auto_config: ParallelConfig | None = None,
) -> tuple[Plan, Plan]:
    """A parameter-server job's plan (:mod:`plait.planning.servers`): the dense part planned
    data parallel with stand-ins for the tables, each table's traffic added to its step, and
    the placements a user could take instead weighed beside it; and mode auto's plan of the
    whole model (``auto_config``, default the job's config in mode auto), one of them."""
    check_servers(config, servers)
    assert servers is not None
    dense = dense_config(config)
    check_config(dense)
    support.check(config, Where(support.engine_of(config, config.mesh_dict)), planning=True)
    workers = mesh_of(dense).size
    tables = read_tables(model, server_table_paths(model, config), servers, config.ps_split)
    hardware = hardware_of(dense, hardware_file)
    k = config.grad_accumulation
    micro = split_micro_batches(example_batch, k)[0]
    with _gc_paused(), on_meta_after(model, tables, example_batch, loss_fn, workers, k) as counted:
        with timing.phase("capture"), in_mode(model, training=True):
            whole = capture(model, micro, loss_fn)
        planned = server_tables(
            tables, config, servers=servers, workers=workers,
            ids=ids_per_micro_batch(whole, tables), counted=counted, hardware=hardware,
        )  # fmt: skip
        with replaced(model, stand_in_tables(tables, planned, k)):
            with timing.phase("capture"), in_mode(model, training=True):
                graph = capture(model, micro, loss_fn)
            dense_plan = _plan_graph(graph, dense, None, model, hardware_file, False, timing)
        data_parallel = _plan_graph(whole, dense, None, model, hardware_file, False, timing)
        auto_cfg = auto_config or dataclasses.replace(dense, mode="auto")
        auto = _plan_graph(whole, auto_cfg, None, model, hardware_file, False, timing)
    plan = server_plan(
        dense_plan, config, servers=servers, tables=planned, counted=counted is not None,
        data_parallel=data_parallel, auto=auto, table_states=_table_states(data_parallel, tables),
        limit=int(config.memory_limit or hardware.memory_bytes),
    )  # fmt: skip
    return plan, auto


def _auto_with_servers(
    model: nn.Module,
    config: ParallelConfig,
    example_batch: Any,
    loss_fn: LossFn | None,
    servers: int,
    hardware_file: str | None,
    timing: PlanTiming,
) -> Plan:
    """Mode auto with ``servers`` parameter servers to weigh: the model's embedding tables on
    them (a parameter-server plan) against mode auto's plan of the whole model on the devices;
    the faster that fits wins, and its notes say what the other would take."""
    check_servers(config, servers)
    if config.interleave_num == "auto":
        raise ConfigError(
            f"ParallelConfig(interleave_num='auto') with servers={servers}: mode auto weighs "
            "parameter servers or the copy count, not both yet; give interleave_num a count "
            "(1 = off) or leave servers out"
        )
    check_config(config)
    tables, split = servable_tables(model, servers)
    ps_config = ps_config_for(config, mesh_of_auto(config), tables, split)
    ps_plan, auto = _server_plan(
        model, ps_config, example_batch, loss_fn, servers, hardware_file, timing,
        auto_config=config,
    )  # fmt: skip
    limit = int(config.memory_limit or hardware_of(config, hardware_file).memory_bytes)
    return weigh_servers(auto, ps_plan, servers, limit)


@contextmanager
def on_meta_after(
    model: nn.Module,
    tables: Sequence[Any],
    batch: Any,
    loss_fn: LossFn | None,
    workers: int,
    micro: int,
) -> Iterator[dict[str, tuple[int, int]] | None]:
    """The distinct rows the example batch reads (:func:`distinct_rows`, run on the model as
    given, in training mode), then the model on meta tensors for capturing it."""
    with in_mode(model, training=True):
        counted = distinct_rows(model, tables, batch, loss_fn, workers, micro)
    with on_meta(model):
        yield counted


def _table_states(plan: Plan, tables: Sequence[Any]) -> int:
    """Bytes the tables' parameters, gradients and optimizer states take on a device under a
    data-parallel plan (their share of the plan's model states)."""
    total = sum(math.prod(p.shape) for p in plan.parameters)
    share = sum(t.rows * t.dim for t in tables) / max(total, 1)
    kinds = plan.predicted.memory_by_kind
    return int(share * sum(kinds.get(k, 0) for k in ("parameters", "gradients", "optimizer")))


def _arguments(
    config: Any, legacy: tuple[Any, ...], example_batch: Any, loss_fn: LossFn | None
) -> tuple[ParallelConfig, Any, LossFn | None]:
    """``(config, example_batch, loss_fn)`` from either argument order; ConfigError if neither."""
    if legacy and not isinstance(config, ParallelConfig) and isinstance(legacy[0], ParallelConfig):
        # plan(model, example_batch, config[, loss_fn]): the order before parallelize's
        if len(legacy) > 2 or example_batch is not None or (len(legacy) == 2 and loss_fn):
            raise ConfigError("plait.plan(model, batch, config, loss_fn): too many arguments")
        example_batch, config = config, legacy[0]
        loss_fn = legacy[1] if len(legacy) == 2 else loss_fn
    elif legacy:
        raise ConfigError(
            f"plait.plan takes (model, config, *, example_batch=..., loss_fn=...); got "
            f"{2 + len(legacy)} positional arguments: pass example_batch= and loss_fn= by name"
        )
    if not isinstance(config, ParallelConfig):
        raise ConfigError(
            f"plait.plan expects a plait.ParallelConfig as its second argument, got "
            f"{type(config).__name__}; e.g. plait.plan(model, ParallelConfig(mode='auto', "
            "devices=8), example_batch=batch, loss_fn=loss)"
        )
    if example_batch is None:
        raise ConfigError(
            "plait.plan needs example_batch=: one step's global batch (real, fake or meta "
            "tensors; only shapes are read), to capture the program it plans"
        )
    return config, example_batch, loss_fn


def plan_graph(
    graph: OpGraph,
    cfg: ParallelConfig,
    *,
    mesh: MeshSpec | None = None,
    model: nn.Module | None = None,
    hardware_file: str | None = None,
    runnable_only: bool = False,
    timing: PlanTiming | None = None,
    fixed_parameters: Mapping[str, TensorLayout] | None = None,
) -> Plan:
    """Plan an already captured graph (annotations are read from ``model`` when given).

    ``runnable_only`` keeps mode auto to what the operator executor runs today: no pipeline
    stages, ZeRO or recompute. ``timing`` receives where the time went (as in :func:`plan`).
    ``fixed_parameters`` (needs ``mesh``): the layouts, by FQN, that those parameters keep (a
    running job planning again for a batch of a new shape).
    """
    start = time.perf_counter()
    timing = timing if timing is not None else PlanTiming()
    if fixed_parameters and mesh is None:
        raise ConfigError("plan_graph(fixed_parameters=...) needs the mesh they live on: mesh=")
    with _gc_paused():
        result = _plan_graph(
            graph, cfg, mesh, model, hardware_file, runnable_only, timing, fixed_parameters
        )
    timing.total_s += time.perf_counter() - start
    _log.info("%s", timing.line())
    return result


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning makes millions of short-lived objects, all freed by reference counting; the
    cyclic collector would walk torch's whole heap (hundreds of thousands of objects) over and
    over meanwhile, ~20% of a large plan. It runs again once the plan is made."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan_graph(
    graph: OpGraph,
    cfg: ParallelConfig,
    mesh: MeshSpec | None,
    model: nn.Module | None,
    hardware_file: str | None,
    runnable_only: bool,
    timing: PlanTiming,
    fixed_parameters: Mapping[str, TensorLayout] | None = None,
) -> Plan:
    check_config(cfg)
    if cfg.mode == "auto" and mesh is None:
        return auto_plan(
            graph,
            cfg,
            model=model,
            hardware_file=hardware_file,
            runnable_only=runnable_only,
            timing=timing,
        )
    with timing.phase("candidates"):
        setup = prepare(
            graph,
            cfg,
            mesh=mesh,
            model=model,
            hardware_file=hardware_file,
            fixed_parameters=fixed_parameters,
        )
    searcher = get_searcher(cfg.search or "sharding_propagation")
    with timing.phase("search"):
        decisions = searcher(setup.problem, setup.allowed, setup.configured)
    model_name = type(model).__name__ if model is not None else ""

    def assemble(c: ParallelConfig) -> Plan:
        with timing.phase("assemble"):
            timing.assembled += 1
            return assemble_plan(
                graph,
                c,
                setup.mesh,
                setup.problem,
                decisions,
                setup.topology,
                setup.hardware,
                model_name,
            )

    if cfg.recompute != "auto":
        return assemble(cfg)
    # recompute="auto": the cheapest policy whose predicted memory fits the limit
    limit = int(cfg.memory_limit or setup.hardware.memory_bytes)  # parsed to bytes by the config
    for recompute in ("none", "selective", "full"):
        plan = assemble(dataclasses.replace(cfg, recompute=recompute))
        if plan.predicted.memory_bytes <= limit:
            note = f"recompute='auto' chose {recompute!r}: the cheapest that fits {limit} bytes"
            return dataclasses.replace(plan, notes=(*plan.notes, note))
    note = f"recompute='auto': nothing fits {limit} bytes, even 'full'; see plan.summary()"
    return dataclasses.replace(plan, notes=(*plan.notes, note))
