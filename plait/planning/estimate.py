"""The one predictor: a plan's step time and memory per device, from the searcher's choices.

:class:`MeshEstimate` predicts, for one mesh's search result, what a training step costs
under any setting the outer planner (:mod:`plait.planning.outer`) varies: ZeRO level,
recompute policy, micro-batches, pipeline schedule. Both the outer planner (weighing every
option without building its Plan) and :func:`~plait.planning.assemble.assemble_plan` (the
``predicted`` of the Plan it builds, and each stage's compute) call :meth:`MeshEstimate.predict`,
so the option the outer planner chose is the plan it gets, with no second computation to keep
in step. It shares what the settings do not change:

- per mesh, once: the chosen strategies, compute per op, pipeline stages, every
  redistribution on every edge (forward and backward), the gradient all-reduces outside the
  data-parallel buckets, the loss reduction, each stage's walk through one step per recompute
  policy (:meth:`~plait.cost.step_memory.StepTrace.hold`; its gradients once with ZeRO and once
  without);
- per ZeRO level (and, at level 3, per recompute policy): the bucketed data-parallel
  reductions and which parameters' optimizer states are split;
- per micro-batch count: the pipeline transfers.

An option then costs a few additions per pipeline stage. Values no recompute policy changes
(which outputs are kept for backward) are read once per graph (:class:`GraphFacts`).

The step (docs/planner.md, "What a step costs"): the busiest stage's compute (forward and
backward, what recompute runs again, the fixed costs micro-batches pay again) and
communication, less what of it runs beside compute (:mod:`plait.planning.overlap`), plus the
schedule's bubble (:func:`schedule_bubble`) and the optimizer step. Memory: the highest
stage's peak of a walk through one step (:func:`stage_memory`; docs/memory.md).

``assemble_plan`` lists the same collectives as records with their reasons;
``tests/unit/test_plan_speed.py`` checks that the listing sums to the predicted
communication, and that one predictor reused across options predicts what a fresh one does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from plait.config import CommFusion, ParallelConfig
from plait.cost.comm import Topology
from plait.cost.compute import optimizer_seconds
from plait.cost.memory import MemoryBreakdown, Schedule, StateBytes, in_flight_micro_batches
from plait.cost.step_memory import (
    GradBucket,
    PeakMemory,
    StageActivations,
    StageBuffers,
    StepTrace,
    stage_states,
    step_peak,
)
from plait.fusion import in_bucket, plan_buckets
from plait.graph import GraphInput, OpGraph, OpNode, TensorMeta
from plait.layout import TensorLayout, optimizer_shard_dim, shard_group_size
from plait.layout.redistribute import LOCAL_KINDS, plan_redistribution
from plait.mesh import MeshSpec
from plait.planning.entries import Prediction
from plait.planning.overlap import (
    GATHER_BACKWARD,
    GATHER_FORWARD,
    P2P,
    REDUCE,
    Overlappable,
    StageClock,
)
from plait.planning.timeline import BACKWARD_FLOPS_FACTOR, bubble_seconds
from plait.rules.loss import divides_by_target_count
from plait.rules.registry import OpStrategy, grad_reduce_axes
from plait.search.problem import OpCompute, SearchProblem, gradient_layout, kept_gradient, settled
from plait.search.propagation import Decision
from plait.search.stages import StageMemory, assign_stages, op_memory, stage_memory_figures

__all__ = [
    "LOW_PRECISION_ACTIVATIONS",
    "PP_AXIS",
    "Estimate",
    "GraphFacts",
    "MeshEstimate",
    "micro_batch_seconds",
    "read_by_backward",
    "recompute_regions",
    "schedule_bubble",
    "weight_shard_size",
    "with_kept_axes",
]

PP_AXIS = "pp"
LOW_PRECISION_ACTIVATIONS = {"bf16": 0.5, "fp16": 0.5, "fp32": 1.0}


def partition_memory(
    trace: StepTrace,
    chosen: Sequence[OpStrategy],
    pieces: Callable[[TensorLayout], int],
    cfg: ParallelConfig,
    hardware: Any,
    figures: tuple[Sequence[float], Sequence[float]] | None = None,
) -> StageMemory:
    """The stage partitioner's memory figures (:func:`plait.search.stages.op_memory`) under
    ``cfg``'s schedule, against the memory limit the outer planner holds plans to (the
    profile's device memory when ``memory_limit`` is unset). ``figures``: ``op_memory``'s,
    when already computed (they do not depend on the schedule or the micro-batches)."""
    if figures is None:
        figures = op_memory(
            trace, chosen, pieces, cfg.precision, LOW_PRECISION_ACTIVATIONS[cfg.precision]
        )
    limit = cast("int | None", cfg.memory_limit) or getattr(hardware, "memory_bytes", None)
    return stage_memory_figures(figures, cfg, limit)


def work_pieces(mesh: MeshSpec, strategy: OpStrategy) -> int:
    """Pieces ``strategy`` cuts its op's work into: the sizes of the mesh axes it uses."""
    return math.prod(mesh.axis_size(a) for a in strategy.used_axes())


def micro_batch_seconds(
    graph: OpGraph,
    stage_of: Mapping[str, int],
    pieces: Mapping[str, int],
    op_compute: OpCompute,
    cfg: ParallelConfig,
    stages: int,
) -> list[float]:
    """Per stage, what running the batch as ``cfg.micro_batches`` micro-batches one after
    another adds to its compute: each op runs once per micro-batch on a ``1 / m`` share, paying
    its fixed costs (the kernel floor, the host's per-op cost) ``m`` times; its FLOP- or
    byte-bound time is unchanged. ``m x op_compute(op, pieces x m) - op_compute(op, pieces)``
    per op (the search's price of its forward and backward), per micro-step. One function for
    the prediction and the outer planner's lower bound."""
    extra = [0.0] * stages
    m = cfg.micro_batches
    if m == 1:
        return extra
    for op in graph.ops:
        p = pieces[op.name]
        again = m * op_compute(op, p * m) - op_compute(op, p)
        extra[stage_of[op.name]] += max(0.0, again) * cfg.planned_pieces
    return extra


def interleaved_seconds(
    op_comm_s: float, compute_s: float, hidden_s: float, copies: int, overlap: float
) -> float:
    """What of the ops' collectives multi-copy parallel hides (``interleave_num``): each
    copy's collectives run while the other copies compute, so up to ``(copies - 1) / copies``
    of the step's compute can cover them, less the compute that already covers other
    collectives (``hidden_s``: the gradient buckets behind backward), at the hardware's
    ``overlap`` efficiency."""
    room = max(0.0, compute_s * (copies - 1) / copies - hidden_s)
    return overlap * min(op_comm_s, room)


def recompute_regions(graph: OpGraph, cfg: ParallelConfig) -> tuple[tuple[str, str], ...]:
    """The modules whose forward backward recomputes, with the policy of each.

    ``cfg.recompute`` covers every repeated layer the capture found (``OpNode.layer``: the
    transformer blocks); a model without repeated layers has its top-level modules instead.
    ``cfg.recompute_modules`` (``plait.recompute``) adds or overrides single modules.
    """
    out: dict[str, str] = {}
    if cfg.recompute in ("full", "selective"):
        layers = [op.layer for op in graph.ops if op.layer]
        if not layers:  # no repeated layers: each top-level module is a region
            layers = [op.module_path.split(".")[0] for op in graph.ops if op.module_path]
        for path in layers:
            out.setdefault(path, cfg.recompute)
    # ParallelConfig holds a mapping given to it as sorted (path, mode) pairs
    for path, mode in cast("tuple[tuple[str, str], ...]", cfg.recompute_modules):
        out[path] = mode
    return tuple(out.items())


def weight_shard_size(cfg: ParallelConfig, mesh: MeshSpec) -> int | None:
    """HSDP's shard group size on ``mesh`` (None: the whole dp axis, as without it).

    Raises LayoutError when it does not divide the dp axis (a mesh the outer planner chose)."""
    k, dp = cfg.optimizer_weight_shard_size, cfg.dp_axis
    if k is None or cfg.optimizer_shard is None:
        return None
    n = mesh.axis_size(dp) if dp in mesh.axis_names else 1
    return None if shard_group_size(dp, n, k) == n else k


# (op, tensor input position) whose backward never reads that input's value: an embedding's
# table (its gradient needs the indices), a bias (its gradient is a sum of the output's)
_UNREAD_BY_BACKWARD = frozenset(
    {
        ("aten.embedding.default", 0),
        ("aten.linear.default", 2),
        ("aten.conv1d.default", 2),
        ("aten.conv2d.default", 2),
        ("aten.conv3d.default", 2),
        ("aten.convolution.default", 2),
        ("aten.add.Tensor", 0),
        ("aten.add.Tensor", 1),
    }
)


def read_by_backward(graph: OpGraph, cfg: ParallelConfig) -> set[str]:
    """The values the backward pass reads (ZeRO-3 gathers such a parameter again then).

    An op's backward reads an input unless ``_UNREAD_BY_BACKWARD`` says otherwise, and reads
    every input when the op is in a region whose forward backward recomputes in full.
    """
    again = [r for r, mode in recompute_regions(graph, cfg) if mode == "full"]
    return {
        ref
        for op in graph.ops
        for k, ref in enumerate(op.inputs)
        if (op.target, k) not in _UNREAD_BY_BACKWARD or _inside(op.module_path, again)
    }


def _inside(path: str, regions: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r + ".") or r == "" for r in regions)


def recomputed_seconds(
    trace: StepTrace,
    op_time: Mapping[str, float],
    stage_of: Mapping[str, int],
    stages: int,
    grad_accumulation: int,
) -> list[float]:
    """Per stage, the seconds backward spends running forwards again: a third of each
    recomputed op's time (its forward), per micro-step. ``recomputed``: the trace's
    ``recomputed()``, when the caller has it already."""
    again = [0.0] * stages
    for op, recomputed_op in zip(trace.graph.ops, trace.recomputed(), strict=True):
        if recomputed_op:
            forward = op_time[op.name] * (1 / (1 + BACKWARD_FLOPS_FACTOR))
            again[stage_of[op.name]] += forward * grad_accumulation
    return again


def with_kept_axes(mesh: MeshSpec, axes: tuple[str, ...], kept: Iterable[str]) -> tuple[str, ...]:
    """A parameter's gradient axes with those its reader's output kept pending into it
    (``PlannedOp.pending_grad``), in mesh order."""
    extra = set(kept)
    return tuple(a for a in mesh.axis_names if a in axes or a in extra)


def schedule_bubble(
    cfg: ParallelConfig, compute_s: float, forward_comm_s: float, comm_s: float
) -> float:
    """The schedule's bubble (timeline.bubble_seconds) on the busiest stage's times per
    micro-batch: compute split into forward, input- and weight-gradient passes of about one
    forward each (BACKWARD_FLOPS_FACTOR), communication counted in the pass of its phase and
    never overlapped (so GPipe and 1F1B idle ``(stages - 1) / micro_batches`` of the stage)."""
    m = cfg.micro_batches
    forward = compute_s / (1 + BACKWARD_FLOPS_FACTOR)
    weight = forward * BACKWARD_FLOPS_FACTOR / 2
    return bubble_seconds(
        cfg.schedule,
        cfg.pipeline_stages,
        (forward + forward_comm_s) / m,
        (compute_s - forward + comm_s - forward_comm_s) / m,
        weight / m,
        cfg.virtual_stages or 1,
    )


def activation_buffers(
    trace: StepTrace,
    cfg: ParallelConfig,
    chosen: Sequence[OpStrategy],
    stage_list: Sequence[int],
    pieces: Callable[[TensorLayout], int],
) -> tuple[StageBuffers, ...]:
    """:meth:`StepTrace.hold` with the plan's layouts: each value's local piece as its
    producer lays it out (``chosen``: each op's strategy, graph order) or as an op reads it;
    float32 activations take the bytes of the compute precision (autocast), buffers and the
    batch their own (``pieces``: the predictor's cached pieces of a layout);
    :meth:`StageBuffers.with_gradients` then adds the parameters' gradients."""
    graph = trace.graph
    scale = LOW_PRECISION_ACTIVATIONS[cfg.precision]

    def value_bytes(ref: str) -> int:
        i, k = trace.out_slot[ref]
        meta = graph.ops[i].outputs[k]
        nbytes = meta.nbytes // pieces(chosen[i].outputs[k])
        return int(nbytes * scale) if meta.dtype == "float32" else nbytes

    def read_bytes(i: int, j: int) -> int:
        meta = graph.ops[i].input_metas[j]
        nbytes = meta.nbytes // pieces(chosen[i].inputs[j])
        if meta.dtype != "float32" or graph.ops[i].inputs[j] in trace.inputs:
            return nbytes
        return int(nbytes * scale)

    def moved(i: int, j: int) -> bool:
        producer = trace.out_slot.get(graph.ops[i].inputs[j])
        if producer is None:  # a graph input
            return False
        p, k = producer
        return communicates(chosen[p].outputs[k], chosen[i].inputs[j])

    return trace.hold(
        value_bytes=value_bytes,
        read_bytes=read_bytes,
        stage_of=stage_list,
        stages=cfg.pipeline_stages,
        # offload moves values of at least 1 MiB each (one micro-batch's)
        offload_min=(1 << 20) * cfg.micro_batches if cfg.offload == "activations" else None,
        moved=moved,
    )


def communicates(src: TensorLayout, dst: TensorLayout) -> bool:
    """Whether moving a value laid out as ``src`` to ``dst`` takes a collective: a pending
    sum to reduce, or a dim ``dst`` splits over fewer axes than ``src`` (a gather, an
    all-to-all); splitting further is a local slice."""
    if src == dst:
        return False
    if src.partial:
        return True
    return any(not set(a) <= set(b) for a, b in zip(src.dims, dst.dims, strict=True))


def stage_model_states(
    cfg: ParallelConfig, sharded: int, whole: int, frozen: int, dp: int
) -> tuple[MemoryBreakdown, int]:
    """One stage's model states after the step (``sharded``, ``whole`` and ``frozen``
    parameter elements: :func:`stage_memory`), and the group optimizer parallel splits over."""
    # optimizer parallel splits over HSDP's shard groups when they are set
    group = weight_shard_size(cfg, MeshSpec((cfg.dp_axis,), (dp,))) or dp
    states = stage_states(
        sharded_numel=sharded,
        whole_numel=whole,
        frozen_numel=frozen,
        shard_group=group,
        optimizer_shard=cfg.optimizer_shard,
        precision=cfg.precision,
        # offload="optimizer": the optimizer's states (and its step) live on the host
        optimizer_on_device=cfg.offload != "optimizer",
    )
    return states, group


def stage_memory(
    cfg: ParallelConfig,
    stage: int,
    walked: StageActivations,
    sharded: int,
    whole: int,
    frozen: int,
    dp: int,
) -> PeakMemory:
    """One stage's peak: its model states (``sharded``, ``whole`` and ``frozen`` parameter
    elements) and its walk, with the micro-batches its schedule keeps in flight (all ``m``
    without pipeline stages; the stages still ahead under 1F1B: :func:`plait.cost.memory.in_flight_micro_batches`)."""
    m = cfg.micro_batches
    states, dp = stage_model_states(cfg, sharded, whole, frozen, dp)
    in_flight = (
        in_flight_micro_batches(
            stage, cfg.pipeline_stages, m, cast(Schedule, cfg.schedule), cfg.virtual_stages or 1
        )
        if cfg.pipeline_stages > 1
        else m * cfg.copies  # multi-copy: every copy's forward before any backward
    )
    on_device = cfg.offload != "optimizer"
    return step_peak(
        walked,
        states,
        optimizer_shard=cfg.optimizer_shard,
        shard_group=dp,
        in_flight=in_flight,
        micro_batches=m,
        # a pipeline's micro-batches add into .grad; the program's micro-steps sum after each
        accumulation="summed" if cfg.grad_accumulation > 1 else "in_place" if m > 1 else "none",
        optimizer_on_device=on_device,
    )


def _sends(pipe: list[list[_Item]] | None, stage: int) -> list[Overlappable]:
    """A stage's pipeline transfers as the overlap model takes them: role P2P, no bucket
    members."""
    return [] if pipe is None else [Overlappable(P2P, (), seconds) for seconds, _ in pipe[stage]]


_Item = tuple[float, bool]  # a collective's seconds x count per step; is it in forward?


@dataclass(frozen=True, slots=True)
class Estimate:
    """A plan's prediction (the Plan's ``predicted``) and each pipeline stage's compute
    seconds per step (``Plan.stage_compute_s``, what ``plan.timeline()`` draws)."""

    predicted: Prediction
    stage_compute_s: tuple[float, ...]

    @property
    def step_time_s(self) -> float:
        """Predicted seconds per step (what the outer planner compares)."""
        return self.predicted.step_time_s

    @property
    def memory_bytes(self) -> int:
        """Predicted peak bytes per device (what the outer planner holds to the limit)."""
        return self.predicted.memory_bytes


class GraphFacts:
    """What every mesh of one graph shares: parameters, layers, values kept for backward."""

    def __init__(self, graph: OpGraph) -> None:
        self.graph = graph
        self.parameters: tuple[GraphInput, ...] = tuple(
            g for g in graph.inputs if g.kind == "parameter"
        )
        self.by_target = {g.target: g for g in self.parameters}
        self._traces: dict[tuple[object, ...], StepTrace] = {}
        self._by_setting: dict[tuple[object, ...], StepTrace] = {}
        self._read_again: dict[tuple[object, ...], frozenset[str]] = {}
        self._read_sets: dict[frozenset[str], frozenset[str]] = {}

    def plain_trace(self) -> StepTrace:
        """The step's values without recompute (the stage partitioner's memory figures)."""
        found = self._traces.get(())
        if found is None:
            found = self._traces[()] = StepTrace(self.graph, ())
        return found

    def trace(self, cfg: ParallelConfig) -> StepTrace:
        """The step's values under ``cfg``'s recompute regions (the memory model's
        :class:`~plait.cost.step_memory.StepTrace`), one per set of regions."""
        key = (cfg.recompute, cfg.recompute_modules)
        found = self._by_setting.get(key)
        if found is None:  # the regions are a walk over the graph: once per setting
            regions = recompute_regions(self.graph, cfg)
            found = self._traces.get(regions)
            if found is None:
                found = self._traces[regions] = StepTrace(self.graph, regions)
            self._by_setting[key] = found
        return found

    def read_again(self, cfg: ParallelConfig) -> frozenset[str]:
        """Values the backward reads (ZeRO-3 gathers such a parameter again); equal sets are
        one object, so options that agree on it share their ZeRO-3 collectives."""
        key = (cfg.recompute, cfg.recompute_modules)
        found = self._read_again.get(key)
        if found is None:
            found = frozenset(read_by_backward(self.graph, cfg))
            found = self._read_again[key] = self._read_sets.setdefault(found, found)
        return found


@dataclass
class _Param:
    """One parameter as placed: the layout its first reader needs, that reader's strategy,
    gradient axes, stage."""

    g: GraphInput
    layout: TensorLayout
    strategy: OpStrategy | None
    axes: tuple[str, ...]  # gradient reduction axes (empty: frozen or not read)
    stage: int
    numel: int  # elements of this device's piece
    nbytes: int  # bytes of this device's piece


@dataclass(frozen=True, slots=True)
class _Bucket:
    """One dp gradient bucket: its members (pending over dp alone), those ZeRO keeps whole,
    the bytes of each kind, and the names of those it splits (at levels 1 to 3)."""

    stage: int
    members: int
    all_bytes: int
    whole: int
    whole_bytes: int
    split_bytes: int
    split_names: frozenset[str]
    names: tuple[str, ...] = ()  # every member's value name, in model order
    first: tuple[tuple[tuple[str, ...], int], ...] = ()
    """Members also pending over other axes: per set of axes, their bytes, summed over each of
    those axes (one all-reduce an axis) before the bucket's sum over dp."""


@dataclass
class _Level:
    """What one ZeRO level decides: bucketed reductions and split optimizer states per stage."""

    items: list[list[_Item]]  # per stage: each collective's seconds x count, in plan order
    sharded_numel: list[int] = field(default_factory=list)
    whole_numel: list[int] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    """Per stage, the optimizer step's seconds (over this device's pieces and ZeRO shards)."""
    overlappable: list[list[Overlappable]] = field(default_factory=list)
    """Per stage, the bucket collectives that may run beside compute (plait.planning.overlap)."""


@dataclass(frozen=True, slots=True)
class _Timed:
    """One option's step time and its parts on the busiest stage (:meth:`MeshEstimate.predict`)."""

    step_time_s: float
    compute: list[float]  # per stage
    compute_s: float
    comm_s: float
    hidden_s: float
    bubble_s: float
    update_s: float
    level: _Level


class MeshEstimate:
    """Predictions for one mesh's search result under any setting the outer planner varies.

    ``base`` is the config the search ran under (its mesh, pipeline stages, dp axis, gradient
    accumulation, fusion, precision, offload); :meth:`predict` takes a config that differs
    from it only in ``optimizer_shard``, ``recompute``, ``micro_batches``, ``schedule`` and
    ``virtual_stages``. ``mesh``, ``problem``, ``topology`` and ``hardware`` are the search's
    (:class:`~plait.planning.setup.SearchSetup`); ``decisions`` its choice per op.
    """

    def __init__(
        self,
        facts: GraphFacts,
        base: ParallelConfig,
        mesh: MeshSpec,
        problem: SearchProblem,
        topology: Topology,
        hardware: Any,
        decisions: Mapping[str, Decision],
        figures: tuple[Sequence[float], Sequence[float]] | None = None,
    ) -> None:
        self.facts = facts
        self.graph = graph = facts.graph
        self.base = base
        self.mesh = mesh
        self.problem = problem
        self.topology = topology
        self.hardware = hardware
        self.stages = stages = base.pipeline_stages
        candidates = problem.candidates
        self.chosen = {op.name: candidates[op.name][decisions[op.name].index] for op in graph.ops}
        # per object (kept alive here, so ids stay unique): pieces of a strategy's work or of
        # a layout's tensor, a layout's number among equal layouts, its settled form
        self._work: dict[int, tuple[object, int]] = {}
        self._pieces_of: dict[int, tuple[object, int]] = {}
        self._canon_of: dict[int, tuple[object, int]] = {}
        self._numbers: dict[TensorLayout, int] = {}
        self._settled: dict[int, tuple[object, TensorLayout]] = {}
        self._grads: dict[tuple[int, int], tuple[object, TensorLayout]] = {}
        self._axes: dict[tuple[int, int], tuple[object, tuple[str, ...]]] = {}
        self._secs: dict[tuple[str, str, int], float] = {}
        op_compute = problem.cost.op_compute
        op_time = {
            op.name: op_compute(op, self._work_pieces(self.chosen[op.name])) for op in graph.ops
        }
        self._decisions, self._op_time = decisions, op_time
        self._others: dict[tuple[object, ...], MeshEstimate] = {}
        self.chosen_list = [self.chosen[op.name] for op in graph.ops]
        self._figures = figures
        stage_list = self._partition(base)
        self.stage_of = dict(zip((op.name for op in graph.ops), stage_list, strict=True))
        self.stage_list = stage_list
        ga = base.planned_pieces  # the graph is one piece's: micro-steps x copies of it
        self.compute = [0.0] * stages
        for op, s in zip(graph.ops, stage_list, strict=True):
            self.compute[s] += op_time[op.name] * ga
        self.dp = base.dp_axis
        self.dp_size = mesh.axis_size(self.dp) if self.dp in mesh.axis_names else 1
        self.fused = self.dp in mesh.axis_names and mesh.axis_size(self.dp) > 1
        # HSDP's shard group size (weight_shard_size; every option has the same)
        self.shard_size = shard_group_size(self.dp, self.dp_size, base.optimizer_weight_shard_size)
        self._redistributions: dict[tuple[object, ...], tuple[float, ...]] = {}
        # the step's collectives in the order the plan lists them: ops' redistributions
        # (repeated per micro-step), parameters' own reductions, the buckets (per level), the
        # loss, the pipeline transfers (per micro-batch count)
        self.op_sums = self._op_collectives(ga)
        self.param_items = self._parameters()
        self.loss_items = self._loss()
        self._levels: dict[tuple[object, ...], _Level] = {}
        self._frozen: list[int] | None = None
        self._stage_peaks: dict[tuple[object, ...], PeakMemory] = {}
        self._walks: dict[tuple[object, ...], tuple[StageActivations, ...]] = {}
        self._again: dict[int, list[float]] = {}
        self._clocks: dict[tuple[int, int], StageClock] = {}
        self._split: dict[tuple[object, ...], list[float]] = {}
        self._held: dict[tuple[object, ...], tuple[StageBuffers, ...]] = {}
        self._dims: list[int | None] | None = None
        self._buckets: list[_Bucket] | None = None
        self._pipes: dict[int, list[list[_Item]]] = {}
        self._timeds: dict[tuple[object, ...], _Timed] = {}
        self._floors: dict[tuple[object, ...], int] = {}

    def _partition(self, cfg: ParallelConfig) -> list[int]:
        """Each op's pipeline stage under ``cfg``'s schedule and micro-batches (they weigh
        in the partitioner's memory figures): contiguous stages balanced by compute, cut at
        repeated-layer boundaries when the model has them (:func:`assign_stages`)."""
        graph = self.graph
        if self.stages == 1:
            return [0] * len(graph.ops)
        if self._figures is None:  # per mesh search: shared by the estimates of other cuts
            self._figures = op_memory(
                self.facts.plain_trace(), self.chosen_list, self._pieces, cfg.precision,
                LOW_PRECISION_ACTIVATIONS[cfg.precision],
            )  # fmt: skip
        memory = partition_memory(
            self.facts.plain_trace(), self.chosen_list, self._pieces, cfg, self.hardware,
            self._figures,
        )  # fmt: skip
        return assign_stages(graph, self._op_time, self.stages, memory)

    def op_seconds(self, name: str) -> float:
        """Op ``name``'s forward and backward seconds on one device, for one piece of the step
        (the graph's batch: one micro-step, one copy), under the chosen strategy."""
        return self._op_time[name]

    def for_stages_of(self, cfg: ParallelConfig) -> MeshEstimate:
        """The predictor whose stages are ``cfg``'s: this one, or (another schedule or
        micro-batch count moving a cut) one built for them, kept."""
        key = (cfg.schedule, cfg.micro_batches, cfg.virtual_stages)
        if self.stages == 1 or key == (self.base.schedule, self.base.micro_batches,
                                       self.base.virtual_stages):  # fmt: skip
            return self
        found = self._others.get(key)
        if found is None:
            found = self
            if self._partition(cfg) != self.stage_list:
                base = replace(self.base, schedule=cfg.schedule, micro_batches=cfg.micro_batches,
                               virtual_stages=cfg.virtual_stages)  # fmt: skip
                found = MeshEstimate(
                    self.facts, base, self.mesh, self.problem, self.topology, self.hardware,
                    self._decisions, self._figures,
                )  # fmt: skip
            self._others[key] = found
        return found

    # ------------------------------------------------------------------ shared per mesh

    def _seconds(self, kind: str, axis: str, nbytes: int) -> float:
        key = (kind, axis, nbytes)
        found = self._secs.get(key)
        if found is None:
            found = self._secs[key] = float(self.topology.axis_seconds(kind, axis, nbytes))
        return found

    def _work_pieces(self, strategy: OpStrategy) -> int:
        """Pieces ``strategy`` cuts its op's work into (:func:`work_pieces`), by identity."""
        found = self._work.get(id(strategy))
        if found is None:
            found = self._work[id(strategy)] = (strategy, work_pieces(self.mesh, strategy))
        return found[1]

    def _pieces(self, layout: TensorLayout) -> int:
        """Pieces a tensor laid out as ``layout`` is cut into (the product of its splits)."""
        found = self._pieces_of.get(id(layout))
        if found is None:
            found = self._pieces_of[id(layout)] = (layout, math.prod(layout.splits()))
        return found[1]

    def _canon(self, layout: TensorLayout) -> int:
        """The same number for equal layouts (cheaper to hash than the layout)."""
        found = self._canon_of.get(id(layout))
        if found is None:
            number = self._numbers.setdefault(layout, len(self._numbers))
            found = self._canon_of[id(layout)] = (layout, number)
        return found[1]

    def _gradient(self, strategy: OpStrategy, i: int) -> TensorLayout:
        """The gradient ``strategy`` hands back for input ``i`` (by the strategy's identity:
        hashing a strategy hashes all its layouts)."""
        found = self._grads.get((id(strategy), i))
        if found is None:
            found = self._grads[(id(strategy), i)] = (strategy, gradient_layout(strategy, i))
        return found[1]

    def _reduce_axes(self, strategy: OpStrategy, i: int) -> tuple[str, ...]:
        """Axes the gradient of a parameter read as input ``i`` of ``strategy`` is summed over."""
        found = self._axes.get((id(strategy), i))
        if found is None:
            found = self._axes[(id(strategy), i)] = (strategy, grad_reduce_axes(strategy, i))
        return found[1]

    def _settle(self, layout: TensorLayout) -> TensorLayout:
        found = self._settled.get(id(layout))
        if found is None:
            found = self._settled[id(layout)] = (layout, settled(layout))
        return found[1]

    def _redistribute(
        self, src: TensorLayout, dst: TensorLayout, meta: TensorMeta
    ) -> tuple[float, ...]:
        """Seconds of each collective moving ``src`` to ``dst`` (the plan's steps, local ones
        dropped)."""
        a, b = self._canon(src), self._canon(dst)
        if a == b:
            return ()
        key = (a, b, meta.shape, meta.itemsize)
        found = self._redistributions.get(key)
        if found is None:
            steps = plan_redistribution(src, dst, tuple(meta.shape), meta.itemsize).steps
            found = tuple(
                self._seconds(s.kind, s.axis, s.nbytes) for s in steps if s.kind not in LOCAL_KINDS
            )
            self._redistributions[key] = found
        return found

    def _op_collectives(self, repeat: int) -> list[tuple[float, float]]:
        """Per stage, the sums (all, forward only) of the ops' redistributions, in order."""
        graph, chosen = self.graph, self.chosen
        sums = [(0.0, 0.0)] * self.stages
        self.param_layouts: dict[str, tuple[TensorLayout, str, OpStrategy, int]] = {}
        self.kept: dict[str, str] = {}  # op -> the axis its output's gradient stays pending over
        moved: set[tuple[str, int]] = set()
        reduced: set[tuple[str, int]] = set()
        for op in graph.ops:
            strategy, stage = chosen[op.name], self.stage_of[op.name]
            acc, forward = sums[stage]
            for i, ref in enumerate(op.inputs):
                have = self._have(op, i, ref, strategy, reduced)
                if have is None:
                    continue
                meta, need = op.input_metas[i], strategy.inputs[i]
                if (ref, self._canon(need)) not in moved:
                    moved.add((ref, self._canon(need)))
                    for seconds in self._redistribute(have, need, meta):
                        acc += seconds * repeat
                        forward += seconds * repeat
                if self.problem.needs_grad(ref):
                    grad = self._gradient(strategy, i)
                    keep = self.problem.keeps_pending(ref)
                    kept = kept_gradient(grad, have, keep)
                    if keep is not None and kept is not None:  # into the buckets
                        self.kept[self.graph.producer(ref)[0].name] = keep  # type: ignore[union-attr]
                        grad = kept
                    if (ref, self._canon(grad)) in reduced:
                        continue
                    reduced.add((ref, self._canon(grad)))
                    for seconds in self._redistribute(grad, self._settle(have), meta):
                        acc += seconds * repeat
            if divides_by_target_count(op.target, strategy.outputs[0]):
                for axis in sorted({a for d in strategy.inputs[0].dims for a in d}):
                    seconds = self._seconds("all_reduce", axis, 8) * repeat
                    acc += seconds
                    forward += seconds
            sums[stage] = (acc, forward)
        return sums

    def _have(
        self,
        op: OpNode,
        i: int,
        ref: str,
        strategy: OpStrategy,
        reduced: set[tuple[str, int]],
    ) -> TensorLayout | None:
        """The layout value ``ref`` has when ``op`` reads it as input ``i`` (None: nothing
        to move: a buffer, or a parameter's first reader, which lays it out)."""
        source = self.graph.graph_input(ref)
        if source is None:
            node, k = self.graph.producer(ref)
            return self.chosen[node.name].outputs[k]
        if source.kind == "input":
            return self.problem.input_layouts[ref]
        if source.kind != "parameter":
            return None
        placed = self.param_layouts.get(ref)
        if placed is None:
            self.param_layouts[ref] = (strategy.inputs[i], op.name, strategy, i)
            reduced.add((ref, self._canon(self._gradient(strategy, i))))
            return None
        return placed[0]

    def _parameters(self) -> list[list[_Item]]:
        """Parameters as placed, and the gradient all-reduces outside the dp buckets."""
        items: list[list[_Item]] = [[] for _ in range(self.stages)]
        self.params: list[_Param] = []
        for g in self.facts.parameters:
            placed = self.param_layouts.get(g.name)
            if placed is None:  # read by no op: whole, no gradient, stage 0
                layout = TensorLayout.replicated(self.mesh, g.meta.ndim)
                pieces = math.prod(layout.splits())
                numel, nbytes = g.meta.numel // pieces, g.meta.nbytes // pieces
                self.params.append(_Param(g, layout, None, (), 0, numel, nbytes))
                continue
            layout, op, strategy, i = placed
            stage = self.stage_of[op]
            pieces = self._pieces(layout)
            numel, nbytes = g.meta.numel // pieces, g.meta.nbytes // pieces
            axes = self._reduce_axes(strategy, i) if g.requires_grad else ()
            kept = self.kept.get(op)
            if g.requires_grad and kept is not None and kept not in axes:
                axes = with_kept_axes(self.mesh, axes, (kept,))
            self.params.append(_Param(g, layout, strategy, axes, stage, numel, nbytes))
            for axis in axes:
                if self._bucketed(axes):
                    continue  # in a bucket
                items[stage].append((self._seconds("all_reduce", axis, nbytes), False))
        return items

    def _bucketed(self, axes: tuple[str, ...]) -> bool:
        """Is a gradient pending over ``axes`` reduced in a dp bucket
        (:func:`plait.fusion.in_bucket`, as the plan lists it)?"""
        return in_bucket(axes, self.dp, fused=self.fused, staged=self.stages > 1)

    def _loss(self) -> list[list[_Item]]:
        items: list[list[_Item]] = [[] for _ in range(self.stages)]
        graph = self.graph
        if not graph.outputs:
            return items
        node, k = graph.producer(graph.outputs[0])
        if not isinstance(node, OpNode):
            return items
        for axis in self.chosen[node.name].outputs[k].partial:
            seconds = self._seconds("all_reduce", axis, node.outputs[k].nbytes)
            items[self.stage_of[node.name]].append((seconds, True))
        return items

    def _group_seconds(self, kind: str, nbytes: int, size: int, stride: int) -> float:
        """One collective over a group of ``size`` dp ranks ``stride`` apart (the whole dp
        axis when that is the group)."""
        if size == self.dp_size:
            return self._seconds(kind, self.dp, nbytes)
        return float(
            self.topology.subgroup_seconds(kind, self.dp, nbytes, size=size, stride=stride)
        )

    # ------------------------------------------------------------------ per setting

    def _shard_dims(self, cfg: ParallelConfig) -> list[int | None]:
        """Per parameter, the dim of its piece optimizer parallel splits under any ZeRO level
        (None: kept whole; assemble's ``_optimizer_shard`` writes why for the plan's record).
        The same for levels 1 to 3."""
        if self._dims is None:
            threshold = int(cfg.optimizer_shard_threshold)
            self._dims = [
                None
                if p.strategy is None
                or not p.g.requires_grad
                or p.g.target in cfg.optimizer_shard_exclude
                or p.axes != (self.dp,)
                else optimizer_shard_dim(
                    p.layout,
                    p.g.meta.shape,
                    self.dp,
                    itemsize=p.g.meta.itemsize,
                    threshold=threshold,
                    shard_size=self.shard_size,
                )
                for p in self.params
            ]
        return self._dims

    def _level(self, cfg: ParallelConfig) -> _Level:
        level = cfg.optimizer_shard
        key: tuple[object, ...] = (level,)
        if level == 3 and self.fused:
            key = (level, id(self.facts.read_again(cfg)))
        found = self._levels.get(key)
        if found is None:
            found = self._levels[key] = self._build_level(cfg)
        return found

    def _build_level(self, cfg: ParallelConfig) -> _Level:
        stages, level = self.stages, cfg.optimizer_shard
        dims = self._shard_dims(cfg) if level is not None else [None] * len(self.params)
        sharded, whole = [0] * stages, [0] * stages
        tensors, elements = [0] * stages, [0.0] * stages
        for p, dim in zip(self.params, dims, strict=True):
            if p.g.requires_grad:
                if dim is not None:
                    sharded[p.stage] += p.numel
                else:
                    whole[p.stage] += p.numel
                if p.strategy is not None:  # read by an op: it has a gradient to apply
                    tensors[p.stage] += 1
                    elements[p.stage] += p.numel / self.shard_size if dim is not None else p.numel
        hardware = self.hardware
        update = [optimizer_seconds(n, e, hardware) for n, e in zip(tensors, elements, strict=True)]
        items: list[list[_Item]] = [[] for _ in range(stages)]
        overlappable: list[list[Overlappable]] = [[] for _ in range(stages)]
        if self.fused:
            read_again = self.facts.read_again(cfg) if level == 3 else frozenset()
            for bucket in self._bucket_list(cfg):
                self._bucket(
                    level, bucket, read_again, items[bucket.stage], overlappable[bucket.stage]
                )
        return _Level(items, sharded, whole, update, overlappable)

    def _bucket_list(self, cfg: ParallelConfig) -> list[_Bucket]:
        """Every dp bucket in plan order, as the runtime forms them (:func:`plan_buckets`): the
        trainable parameters not split over dp, bucketed per stage by their local bytes; its members
        are those whose gradient is pending over dp alone, split by ZeRO (at levels 1 to 3,
        :meth:`_shard_dims`) or whole."""
        if self._buckets is None:
            dp = self.dp
            fusion = cfg.comm_fusion or CommFusion()
            dims = self._shard_dims(cfg)
            per_stage: dict[int, list[int]] = {}
            for n, p in enumerate(self.params):
                if p.g.requires_grad and not any(dp in axes for axes in p.layout.dims):
                    per_stage.setdefault(p.stage, []).append(n)
            self._buckets = []
            for stage, entries in sorted(per_stage.items()):
                sizes = [self.params[n].nbytes for n in entries]
                for bucket in plan_buckets(sizes, fusion):
                    members = [entries[i] for i in sorted(bucket)]
                    runs: dict[tuple[str, ...], int] = {}  # summed over other axes first
                    for n in members:
                        axes = self.params[n].axes
                        if len(axes) > 1 and self._bucketed(axes):
                            beside = tuple(a for a in self.mesh.axis_names if a in axes and a != dp)
                            runs[beside] = runs.get(beside, 0) + self.params[n].nbytes
                    members = [n for n in members if self._bucketed(self.params[n].axes)]
                    whole = [n for n in members if dims[n] is None]
                    split = [n for n in members if dims[n] is not None]
                    self._buckets.append(
                        _Bucket(
                            stage,
                            len(members),
                            sum(self.params[n].nbytes for n in members),
                            len(whole),
                            sum(self.params[n].nbytes for n in whole),
                            sum(self.params[n].nbytes for n in split),
                            frozenset(self.params[n].g.name for n in split),
                            tuple(self.params[n].g.name for n in members),
                            tuple(runs.items()),
                        )
                    )
        return self._buckets

    def _bucket(
        self,
        level: int | None,
        bucket: _Bucket,
        read_again: frozenset[str],
        out: list[_Item],
        overlappable: list[Overlappable],
    ) -> None:
        """One bucket's collectives: an all-reduce of its whole members (all of them without
        ZeRO and at level 1); the split members reduce-scattered (levels 2, 3) and gathered
        after the update (levels 1, 2) or before forward, and before backward when backward
        reads them (3). Those that may run beside compute go to ``overlappable`` too."""
        dp = self.dp

        def add(seconds: float, in_forward: bool, role: str, members: tuple[str, ...]) -> None:
            out.append((seconds, in_forward))
            if role:
                overlappable.append(Overlappable(role, members, seconds))

        split = tuple(n for n in bucket.names if n in bucket.split_names)
        for beside, nbytes in bucket.first:
            for axis in beside:
                add(self._seconds("all_reduce", axis, nbytes), False, REDUCE, bucket.names)
        if level in (None, 1) and bucket.members:  # no member is split without ZeRO
            add(self._seconds("all_reduce", dp, bucket.all_bytes), False, REDUCE, bucket.names)
        elif level in (2, 3) and bucket.whole:
            whole = tuple(n for n in bucket.names if n not in bucket.split_names)
            add(self._seconds("all_reduce", dp, bucket.whole_bytes), False, REDUCE, whole)
        if level is None or not bucket.split_names:
            return
        full, k = bucket.split_bytes, self.shard_size
        if level != 1:
            add(self._group_seconds("reduce_scatter", full, k, 1), False, REDUCE, split)
            if k != self.dp_size:  # HSDP: the shards summed across the shard groups
                seconds = self._group_seconds("all_reduce", full // k, self.dp_size // k, k)
                add(seconds, False, REDUCE, split)
        gather = self._group_seconds("all_gather", full // k, k, 1)
        if level != 3:
            add(gather, False, "", split)  # after the update (the optimizer phase)
            return
        add(gather, True, GATHER_FORWARD, split)  # before forward
        if not bucket.split_names.isdisjoint(read_again):
            add(gather, False, GATHER_BACKWARD, split)  # and again before backward

    def _pipeline(self, m: int) -> list[list[_Item]]:
        """Values crossing a stage boundary, once per micro-batch each way."""
        found = self._pipes.get(m)
        if found is not None:
            return found
        items: list[list[_Item]] = [[] for _ in range(self.stages)]
        if self.stages > 1:
            graph, stage_of = self.graph, self.stage_of
            sent: set[tuple[str, int]] = set()
            for op in graph.ops:
                dst = stage_of[op.name]
                for ref in op.inputs:
                    node, k = graph.producer(ref)
                    if not isinstance(node, OpNode):
                        continue
                    src = stage_of[node.name]
                    if src == dst or (ref, dst) in sent:
                        continue
                    sent.add((ref, dst))
                    # the value sent is settled (pending sums reduced): its splits are the same
                    local = (
                        node.outputs[k].nbytes
                        // self._pieces(self.chosen[node.name].outputs[k])
                        // m
                    )
                    seconds = self._seconds("send_recv", PP_AXIS, local) * m
                    items[dst].append((seconds, True))
                    if self.problem.needs_grad(ref):
                        items[src].append((seconds, False))
        self._pipes[m] = items
        return items

    def _walk(self, cfg: ParallelConfig) -> tuple[StageActivations, ...]:
        """Each stage's walk through one step: the activations' buffers
        once per recompute regions (and, with activation offload, micro-batch count: what
        moves depends on one micro-batch's sizes), the gradients once more per ZeRO on or
        off (which bucket members it splits)."""
        trace = self.facts.trace(cfg)
        moved = cfg.micro_batches if cfg.offload == "activations" else 0
        zero = cfg.optimizer_shard is not None
        key = (id(trace), moved, zero)
        found = self._walks.get(key)
        if found is None:
            held = self._held.get(key[:2])
            if held is None:
                held = self._held[key[:2]] = activation_buffers(
                    trace, cfg, self.chosen_list, self.stage_list, self._pieces
                )
            buckets: list[list[GradBucket]] = [[] for _ in range(self.stages)]
            if self.fused:
                for bucket in self._bucket_list(cfg):
                    if bucket.members:
                        split = tuple(zero and n in bucket.split_names for n in bucket.names)
                        buckets[bucket.stage].append(GradBucket(bucket.names, split))
            if zero and not any(any(b.split) for stage in buckets for b in stage):
                # ZeRO splits no bucket member: the walk without it
                found = self._walks[key] = self._walk(replace(cfg, optimizer_shard=None))
                return found
            numel = {
                p.g.name: p.numel
                for p in self.params
                if p.g.requires_grad and p.strategy is not None
            }
            sb = StateBytes.for_precision(cfg.precision)
            found = self._walks[key] = tuple(
                h.with_gradients(numel, buckets[s], sb) for s, h in enumerate(held)
            )
        return found

    def _frozen_numel(self) -> list[int]:
        if self._frozen is None:
            self._frozen = [0] * self.stages
            for p in self.params:
                if not p.g.requires_grad:
                    self._frozen[p.stage] += p.numel
        return self._frozen

    def predict(self, cfg: ParallelConfig) -> Estimate:
        """The prediction of the plan of this search under ``cfg``: the busiest stage's
        compute and communication, less what hides behind compute, plus the schedule's
        bubble and the optimizer step; the highest stage's peak memory."""
        other = self.for_stages_of(cfg)
        if other is not self:
            return other.predict(cfg)
        t = self._timed(cfg)
        peak = self._memory(cfg, t.level)
        predicted = Prediction(
            step_time_s=t.step_time_s,
            optimizer_s=t.update_s,
            compute_s=t.compute_s,
            communication_s=t.comm_s,
            overlapped_s=t.hidden_s,
            bubble_s=t.bubble_s,
            memory_bytes=peak.peak,
            memory_by_kind={
                "parameters": peak.parameters,
                "gradients": peak.gradients,
                "optimizer": peak.optimizer,
                "activations": peak.activations,
            },
            flops_per_step=int(
                self.graph.flops * (1 + BACKWARD_FLOPS_FACTOR) * cfg.planned_pieces
            ),
        )
        return Estimate(predicted, tuple(t.compute) if self.stages > 1 else ())

    def memory_floor(self, cfg: ParallelConfig) -> int:
        """A lower bound on :meth:`predict`'s memory, without the memory walk: the most model
        states (parameters, gradients, optimizer states by ZeRO level) any stage holds after
        the step. Every stage's peak counts them at its optimizer step
        (:func:`~plait.cost.step_memory.step_peak`), and the prediction is the highest stage's."""
        other = self.for_stages_of(cfg)
        if other is not self:
            return other.memory_floor(cfg)
        level = self._level(cfg)
        key = (id(level), cfg.optimizer_shard)  # the rest of what it reads is the mesh's
        found = self._floors.get(key)
        if found is None:
            frozen = self._frozen_numel()
            # a stage's states only grow with its elements: each distinct stage priced once
            held = set(zip(level.sharded_numel, level.whole_numel, frozen, strict=True))
            found = self._floors[key] = max(
                stage_model_states(cfg, *numel, self.dp_size)[0].total for numel in held
            )
        return found

    def step_time_s(self, cfg: ParallelConfig) -> float:
        """:meth:`predict`'s step time alone (the same float), without the memory walk: the
        outer planner ranks options by it and walks memory only for those that could win."""
        other = self.for_stages_of(cfg)
        if other is not self:
            return other.step_time_s(cfg)
        return self._timed(cfg).step_time_s

    def _timed(self, cfg: ParallelConfig) -> _Timed:
        """The step's parts under ``cfg``, once per setting (ranking, then predicting)."""
        key = (cfg.optimizer_shard, cfg.recompute, cfg.recompute_modules, cfg.micro_batches,
               cfg.schedule, cfg.virtual_stages)  # fmt: skip
        found = self._timeds.get(key)
        if found is None:
            found = self._timeds[key] = self._time(cfg)
        return found

    def _time(self, cfg: ParallelConfig) -> _Timed:
        stages = self.stages
        level = self._level(cfg)
        pipe = self._pipeline(cfg.micro_batches) if stages > 1 else None
        comm, forward = self._communication(level, pipe)
        again, update = self._recomputed_s(cfg), level.update_s
        compute = [c + a for c, a in zip(self.compute, again, strict=True)]
        compute = [c + e for c, e in zip(compute, self._micro_batched_s(cfg), strict=True)]
        clock, overlap = self._clock(cfg), self.hardware.comm_overlap
        hidden = [
            clock.hidden(s, level.overlappable[s] + _sends(pipe, s), overlap) for s in range(stages)
        ]
        copies = self.base.copies
        if copies > 1:
            hidden = [
                h + interleaved_seconds(self.op_sums[s][0], compute[s], h, copies, overlap)
                for s, h in enumerate(hidden)
            ]
        busiest = max(range(stages), key=lambda s: compute[s] + comm[s] - hidden[s] + update[s])
        compute_s, comm_s = compute[busiest], comm[busiest]
        bubble_s = schedule_bubble(cfg, compute_s, forward[busiest], comm_s)
        return _Timed(
            step_time_s=compute_s + comm_s - hidden[busiest] + bubble_s + update[busiest],
            compute=compute,
            compute_s=compute_s,
            comm_s=comm_s,
            hidden_s=hidden[busiest],
            bubble_s=bubble_s,
            update_s=update[busiest],
            level=level,
        )

    def _communication(
        self, level: _Level, pipe: list[list[_Item]] | None
    ) -> tuple[list[float], list[float]]:
        """Per stage, the seconds of every collective it issues per step, and of those in
        forward (the bubble counts them in the forward pass), summed in plan order."""
        comm, forward = [], []
        for s in range(self.stages):
            acc, fwd = self.op_sums[s]
            parts = [self.param_items[s], level.items[s], self.loss_items[s]]
            if pipe is not None:
                parts.append(pipe[s])
            for part in parts:
                for seconds, in_forward in part:
                    acc += seconds
                    if in_forward:
                        fwd += seconds
            comm.append(acc)
            forward.append(fwd)
        return comm, forward

    def _micro_batched_s(self, cfg: ParallelConfig) -> list[float]:
        """Per stage, the fixed op costs micro-batches pay again (:func:`micro_batch_seconds`)."""
        key = (cfg.micro_batches, cfg.planned_pieces)
        found = self._split.get(key)
        if found is None:
            pieces = {op.name: self._work_pieces(self.chosen[op.name]) for op in self.graph.ops}
            found = self._split[key] = micro_batch_seconds(
                self.graph, self.stage_of, pieces, self.problem.cost.op_compute, cfg, self.stages
            )
        return found

    def _clock(self, cfg: ParallelConfig) -> StageClock:
        """When each op runs inside a micro-step under ``cfg``'s recompute, for what hides
        behind compute."""
        trace = self.facts.trace(cfg)
        key = (id(trace), cfg.micro_batches)
        found = self._clocks.get(key)
        if found is None:
            first = self._clocks.get((id(trace), 0))  # the op walk, shared by every count
            if first is None:
                first = self._clocks[(id(trace), 0)] = StageClock(
                    self.graph, self.stage_of, self._op_time, trace.recomputed(), self.stages,
                    cfg.micro_batches,
                )  # fmt: skip
            found = self._clocks[key] = first.with_micro_batches(cfg.micro_batches)
        return found

    def _recomputed_s(self, cfg: ParallelConfig) -> list[float]:
        """Per stage, the forward seconds backward runs again under ``cfg``'s recompute
        (:func:`recomputed_seconds`: a third of each recomputed op's time, per micro-step)."""
        trace = self.facts.trace(cfg)
        found = self._again.get(id(trace))
        if found is None:
            found = self._again[id(trace)] = recomputed_seconds(
                trace, self._op_time, self.stage_of, self.stages, self.base.planned_pieces
            )
        return found

    def _memory(self, cfg: ParallelConfig, level: _Level) -> PeakMemory:
        """The peak of the stage with the highest (the first of equals): its model states by
        ZeRO level and its walk through one step (:func:`stage_memory`)."""
        walked = self._walk(cfg)
        frozen_numel = self._frozen_numel()
        highest: PeakMemory | None = None
        for s in range(self.stages):
            key = (
                id(walked[s]),
                s,
                level.sharded_numel[s],
                level.whole_numel[s],
                frozen_numel[s],
                cfg.micro_batches,
                cfg.optimizer_shard,
                cfg.schedule,
                cfg.virtual_stages,
            )
            found = self._stage_peaks.get(key)
            if found is None:
                found = self._stage_peaks[key] = stage_memory(
                    cfg,
                    s,
                    walked[s],
                    level.sharded_numel[s],
                    level.whole_numel[s],
                    frozen_numel[s],
                    self.dp_size,
                )
            if highest is None or found.peak > highest.peak:
                highest = found
        assert highest is not None  # a plan has at least one stage
        return highest
