"""Before any strategy is chosen: the plan's mesh, and a search's candidates, costs, constraints.

:func:`mesh_of` turns a config into the plan's mesh; :func:`prepare` gathers what a searcher
and :func:`~plait.planning.assemble.assemble_plan` need for one graph on one mesh (a
:class:`SearchSetup`). Both the inner planner and mode auto's outer planner start here.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from plait import support
from plait.config import ParallelConfig
from plait.cost import HardwareProfile, get_profile
from plait.cost.comm import Topology
from plait.cost.compute import elementwise_seconds, is_matmul, matmul_share, op_seconds
from plait.errors import ConfigError
from plait.graph import OpGraph, OpNode
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.planning.estimate import LOW_PRECISION_ACTIVATIONS, PP_AXIS
from plait.planning.timeline import BACKWARD_FLOPS_FACTOR
from plait.rules import default_catalogue
from plait.rules.registry import OpStrategy
from plait.search.constraints import (
    allowed_indices,
    batch_layouts,
    collect_constraints,
    with_orders,
)
from plait.search.problem import CostModel, SearchProblem
from plait.support import Where

__all__ = [
    "PLANNABLE_MODES",
    "SearchSetup",
    "check_config",
    "compute_model",
    "cost_model",
    "hardware_of",
    "mesh_of",
    "prepare",
]

PLANNABLE_MODES = ("stand_alone", "data_parallel", "semi_auto", "auto")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_config(cfg: ParallelConfig) -> None:
    """ConfigError unless ``cfg.mode`` is one plait plans (hybrid and PS are by hand);
    NotBuiltError for host modules where ``parallelize`` would refuse them too."""
    if cfg.mode not in PLANNABLE_MODES:
        raise ConfigError(
            f"ParallelConfig.mode={cfg.mode!r}: plait.plan plans modes {', '.join(PLANNABLE_MODES)}; "
            "hybrid runs are written by hand, not planned; parameter_server is planned by "
            "plait.plan(..., servers=S) (plait plan --server-num S)"
        )
    if cfg.mesh is not None and cfg.pipeline_stages == 1 and cfg.micro_batches != 1:
        raise ConfigError(
            f"ParallelConfig(micro_batches={cfg.micro_batches}, mesh={cfg.mesh_dict}): "
            "micro-batches run only between pipeline stages, and this mesh has none (parallelize "
            "refuses the config, so plait.plan does too); for gradient accumulation use "
            f"grad_accumulation={cfg.micro_batches} and micro_batches=1, or give the mesh a "
            "'pp' axis"
        )
    # what parallelize refuses on the engine this config runs on (plait.support's table)
    support.check(cfg, Where(support.engine_of(cfg, cfg.mesh_dict)), planning=True)


def mesh_of(cfg: ParallelConfig) -> MeshSpec:
    """The plan's mesh: ``cfg.mesh``, or ``{pp: stages, dp: rest}`` from ``cfg.devices``."""
    mesh = cfg.mesh_dict if cfg.mesh is not None else {}
    if mesh.get(cfg.dp_axis) == -1:
        raise ConfigError(
            f"ParallelConfig.mesh={mesh!r}: {cfg.dp_axis}=-1 takes the rest of the world, and"
            " plait.plan never looks at a live world: give devices=N (e.g. devices=8) to size it"
        )
    stages = cfg.pipeline_stages
    if not mesh:
        if cfg.mode == "stand_alone":
            return MeshSpec.from_dict({cfg.dp_axis: 1})
        if cfg.devices is None:
            raise ConfigError(
                "plait.plan needs the number of devices: ParallelConfig(devices=N) or mesh={...} "
                "(planning never looks at a live world); e.g. ParallelConfig(mode='auto', devices=8)"
            )
        if cfg.devices % stages:
            raise ConfigError(
                f"ParallelConfig.devices={cfg.devices} does not divide into "
                f"pipeline_stages={stages}; use a multiple of {stages} devices"
            )
        mesh = (
            {PP_AXIS: stages, cfg.dp_axis: cfg.devices // stages}
            if stages > 1
            else {cfg.dp_axis: cfg.devices}
        )
    if cfg.mode == "stand_alone" and math.prod(mesh.values()) != 1:
        raise ConfigError(f"mode 'stand_alone' runs on one device but mesh={mesh!r}")
    if mesh.get(PP_AXIS, 1) != stages:
        raise ConfigError(
            f"ParallelConfig.mesh={mesh!r} has {PP_AXIS}={mesh.get(PP_AXIS, 1)} but "
            f"pipeline_stages={stages}; the '{PP_AXIS}' axis holds the stages: make them equal"
        )
    return MeshSpec.from_dict(mesh)


def hardware_of(cfg: ParallelConfig, hardware_file: str | None = None) -> HardwareProfile:
    """The config's hardware profile (from ``hardware_file`` when given)."""
    return get_profile(cfg.hardware, hardware_file) if hardware_file else get_profile(cfg.hardware)


@dataclass(frozen=True)
class SearchSetup:
    """Everything a searcher and the plan builder need, before any strategy is chosen."""

    graph: OpGraph
    mesh: MeshSpec
    problem: SearchProblem
    allowed: Mapping[str, Sequence[int]]
    configured: Mapping[str, str]
    topology: Topology
    hardware: HardwareProfile
    dtype: str


def prepare(
    graph: OpGraph,
    cfg: ParallelConfig,
    *,
    mesh: MeshSpec | None = None,
    model: nn.Module | None = None,
    hardware_file: str | None = None,
    hardware: HardwareProfile | None = None,
    fixed_parameters: Mapping[str, TensorLayout] | None = None,
) -> SearchSetup:
    """Candidates, costs and constraints for ``graph`` under ``cfg`` (annotations from ``model``).

    ``hardware``: the profile, when the caller has it already (else read from ``cfg``).
    ``fixed_parameters``: layouts (by FQN) the plan must keep for those parameters (a running
    job planning again for a new batch shape).
    """
    mesh = mesh or mesh_of(cfg)
    hardware = hardware or hardware_of(cfg, hardware_file)
    dtype = _DTYPES[cfg.precision]
    topology = Topology(mesh, hardware)
    cost = cost_model(mesh, hardware, cfg.precision)
    constraints = collect_constraints(
        model or nn.Module(), graph, mesh, cfg.mode, fixed_parameters, dp_axis=cfg.dp_axis
    )
    candidates = with_orders(_shared_candidates(graph, mesh), constraints.orders)
    inputs = batch_layouts(graph, mesh, cfg.dp_axis, cfg.dataset_strategy)
    fused = cfg.dp_axis if cfg.optimizer_shard in (None, 1) else None
    problem = SearchProblem(
        graph, mesh, candidates, inputs, cost, fused_axis=fused, dp_axis=cfg.dp_axis
    )
    allowed, configured = allowed_indices(graph, candidates, constraints, cfg.dp_axis)
    return SearchSetup(graph, mesh, problem, allowed, configured, topology, hardware, dtype)


_COST_MODELS_KEPT = 16  # a free-mesh plan weighs up to ~30 meshes; a replan reuses one
_COST_MODELS: OrderedDict[tuple[MeshSpec, HardwareProfile, str], CostModel] = OrderedDict()


def cost_model(mesh: MeshSpec, hardware: HardwareProfile, precision: str) -> CostModel:
    """The search's prices on ``mesh`` (placed on ``hardware``) at ``precision``.

    One :class:`CostModel` per (mesh, profile, precision), by value, shared by every
    ``prepare`` that asks (the last ``_COST_MODELS_KEPT``): its cached redistribution and
    edge seconds, and the price tables searchers keep on it, carry over from one problem to
    the next (a replan, a second search of the same graph). Collective seconds depend on the
    mesh and the profile, compute seconds on the profile and the precision: nothing else
    enters a price, so another mesh, profile or precision never shares an entry.
    """
    key = (mesh, hardware, precision)
    found = _COST_MODELS.get(key)
    if found is not None:
        _COST_MODELS.move_to_end(key)
        return found
    topology = Topology(mesh, hardware)
    collectives: dict[tuple[str, str, int], float] = {}

    def axis_seconds(kind: str, axis: str, nbytes: int) -> float:
        key = (kind, axis, nbytes)
        found = collectives.get(key)
        if found is None:
            found = collectives[key] = topology.axis_seconds(kind, axis, nbytes)
        return found

    found = _COST_MODELS[key] = CostModel(axis_seconds, compute_model(hardware, precision))
    while len(_COST_MODELS) > _COST_MODELS_KEPT:
        _COST_MODELS.popitem(last=False)
    return found


def compute_model(hardware: HardwareProfile, precision: str) -> Callable[[OpNode, int], float]:
    """Seconds of an op's forward and backward when its work is cut into ``pieces`` (the
    roofline of ``hardware`` at ``precision``): the ``op_compute`` of every search's costs.

    The graph is captured in fp32; under bf16 or fp16 the activations an op reads and writes
    are half as many bytes (as the memory model counts them), so a memory-bound op is twice
    as fast. A matmul reaches the share of the peak its shape does (``matmul_share``); an op
    whose element rate the profile measured (gelu, softmax, ...) takes at least as long as
    that rate says (``elementwise_seconds``)."""
    dtype = _DTYPES[precision]
    seconds = _compute_memo(hardware, dtype)
    scale = LOW_PRECISION_ACTIVATIONS[precision]
    by_shape = bool(hardware.matmul_efficiency)
    by_rate = bool(hardware.elementwise_rates)
    gemm_latency = hardware.matmul_latency > 0
    passes = 1 + BACKWARD_FLOPS_FACTOR

    def op_compute(op: OpNode, pieces: int) -> float:
        share = (
            matmul_share(op.target, op.input_metas, op.outputs, hardware)
            if by_shape and op.flops
            else 1.0
        )
        work = elementwise_seconds(op.target, op.input_metas, hardware) if by_rate else 0.0
        key = (op.target, op.flops, op.bytes, pieces, share, work)
        found = seconds.get(key)
        if found is None:
            gemm = (
                gemm_latency and op.flops > 0 and is_matmul(op.target, op.input_metas, op.outputs)
            )
            # the measured rate is of forward and backward together: a forward's share of it;
            # each pass is a GEMM of its own (forward, dX, dW), each paying the GEMM latency
            forward = op_seconds(
                op.flops / pieces,
                op.bytes * scale / pieces,
                dtype,
                hardware,
                share,
                work_s=work / (pieces * passes),
                matmul=gemm,
            )
            found = seconds[key] = forward * passes
        return found

    return op_compute


_COMPUTE: list[
    tuple[HardwareProfile, str, dict[tuple[str, float, float, int, float, float], float]]
] = []


def _compute_memo(
    hardware: HardwareProfile, dtype: str
) -> dict[tuple[str, float, float, int, float, float], float]:
    """Seconds of an op's compute by (FLOPs, bytes, pieces), shared by every mesh planned on
    the same profile and dtype (the last ones asked about)."""
    last = _COMPUTE[0] if _COMPUTE else None  # one read: another thread may replace it
    if last is None or last[0] is not hardware or last[1] != dtype:
        last = (hardware, dtype, {})
        _COMPUTE[:] = [last]
    return last[2]


_CANDIDATES_KEPT = 16  # meshes whose candidates are kept, for the last graph asked about
_CANDIDATES: list[tuple[OpGraph, dict[MeshSpec, dict[str, list[OpStrategy]]]]] = []


def _shared_candidates(graph: OpGraph, mesh: MeshSpec) -> dict[str, list[OpStrategy]]:
    """:func:`_candidates`, kept per mesh (by value) for the last graph (by identity, held)
    asked about: ``prepare`` of the same graph on the same mesh gets the same lists (the
    catalogue is read-only), so prices searchers keep per candidate list carry over. A copy
    of the op -> list map is returned; the lists are shared and never changed."""
    last = _CANDIDATES[0] if _CANDIDATES else None  # one read: another thread may replace it
    if last is None or last[0] is not graph:
        last = (graph, {})
        _CANDIDATES[:] = [last]
    per_mesh = last[1]
    found = per_mesh.get(mesh)
    if found is None:
        if len(per_mesh) >= _CANDIDATES_KEPT:
            per_mesh.clear()
        found = per_mesh[mesh] = _candidates(graph, mesh)
    return dict(found)


def _op_key(op: OpNode) -> tuple[object, ...]:
    return (op.target, op.input_metas, op.outputs, op.args, op.kwargs)


def _candidates(graph: OpGraph, mesh: MeshSpec) -> dict[str, list[OpStrategy]]:
    """Every op's candidate strategies; ops with equal signatures share one list.

    The pipeline axis holds stages: no op splits over it. On a mesh with one, the catalogue
    lists the strategies of the mesh without it (the same strategies in the same order as
    those of the whole mesh that leave it unused, in a fraction of the time: each axis
    multiplies the choices) and their layouts are placed on the whole mesh. Equal layouts are
    one object (searches and predictions cache prices by identity).
    """
    catalogue = default_catalogue()
    staged = PP_AXIS in mesh.axis_names and mesh.axis_size(PP_AXIS) > 1
    inner = (
        MeshSpec.from_dict({a: n for a, n in mesh.as_dict().items() if a != PP_AXIS})
        if staged
        else mesh
    )
    layouts: dict[tuple[object, ...], TensorLayout] = {}

    def one(layout: TensorLayout) -> TensorLayout:
        key = (layout.dims, layout.partial, layout.reduce_op)
        found = layouts.get(key)
        if found is None:
            found = layouts[key] = layout if layout.mesh == mesh else TensorLayout(mesh, *key)
        return found

    memo: dict[tuple[object, ...], list[OpStrategy]] = {}
    out: dict[str, list[OpStrategy]] = {}
    for op in graph.ops:
        key = _op_key(op)
        try:
            found = memo.get(key)
        except TypeError:  # unhashable args: no sharing
            key, found = (op.name,), None
        if found is None:
            listed = catalogue.strategies(op, inner)
            if not staged:
                listed = [c for c in listed if PP_AXIS not in c.used_axes()]
            found = [
                OpStrategy(tuple(map(one, c.inputs)), tuple(map(one, c.outputs)), c.label)
                for c in listed
            ]
            memo[key] = found
        out[op.name] = found
    return out
