"""What a Plan is made of: its records (ops, parameters, collectives, the prediction, the
options weighed) and its fields, checked at construction (:class:`PlanContents`).

:class:`plait.planning.records.Plan` adds what is done with a plan (files, reports, the
timeline, checks against a model); the reports (:mod:`plait.planning.report`,
:mod:`plait.planning.timeline`) read these contents, so they sit below the Plan that calls
them. See :mod:`plait.planning.records` for the file format and conventions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, get_args

from plait.config import CommFusion, DatasetStrategy, Mode, Precision, Schedule
from plait.cost.hardware import UNCALIBRATED
from plait.errors import PlanError
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.planning import codec
from plait.planning.checks import (
    COLLECTIVE_KINDS,
    MEMORY_KINDS,
    PHASES,
    Strategy,
    check_bool,
    check_choice,
    check_int,
    check_layout,
    check_names,
    check_on_mesh,
    check_recompute,
    check_seconds,
    check_shape,
    check_str,
    check_strategy,
    check_unique,
    close_matches,
    fail,
)

__all__ = [
    "Alternative",
    "PlanContents",
    "PlanOption",
    "PlannedCollective",
    "PlannedOp",
    "PlannedParameter",
    "PlannedServerTable",
    "Prediction",
]

FILE_FORMAT = "plait.plan"  # the file's "format" key: what kind of JSON this is
DatasetStrategyValue = str | tuple[tuple[int, ...] | TensorLayout, ...]


@dataclass(frozen=True, slots=True)
class Alternative:
    """Another strategy the search weighed for an op, with its cost in seconds."""

    label: str
    strategy: Strategy
    cost_s: float
    note: str = ""

    def __post_init__(self) -> None:
        check_str("Alternative.label", self.label)
        object.__setattr__(self, "strategy", check_strategy("Alternative.strategy", self.strategy))
        object.__setattr__(self, "cost_s", check_seconds("Alternative.cost_s", self.cost_s))
        check_str("Alternative.note", self.note)


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """The strategy chosen for one op of the graph, and why.

    ``strategy`` is MindSpore's strategy tuple (pieces per dim of each input) and must agree
    with ``inputs``; ``outputs`` may hold pending partial sums, inputs may not.
    """

    name: str
    target: str
    module_path: str = field(metadata={codec.KEY: "module"})
    strategy: Strategy
    inputs: tuple[TensorLayout, ...]
    outputs: tuple[TensorLayout, ...]
    label: str
    covered: bool
    reason: str
    layer: str | None = None
    alternatives: tuple[Alternative, ...] = ()
    pending_grad: tuple[str, ...] = ()
    """Mesh axes over which the gradient of this op's output comes back as a pending sum and
    stays pending into the gradients of the op's parameters, which the data-parallel buckets
    reduce (a position table added to a batch-split activation: no collective of its own)."""
    compute_s: float = 0.0
    """Predicted seconds of the op's forward and backward on one device, for one piece of the
    step (one micro-step, and with ``interleave_num`` one copy); what the copies' timeline
    places (:func:`plait.planning.timeline.copies_timeline`). 0 in files written before it."""
    # Names first and the long lists last: the order people read an op in the file.
    file_order: ClassVar[tuple[str, ...]] = (
        "name", "target", "module_path", "layer", "label", "covered", "compute_s", "strategy",
        "inputs", "outputs", "pending_grad", "reason", "alternatives",
    )  # fmt: skip

    def __post_init__(self) -> None:
        where = f"PlannedOp {self.name!r}"
        check_str("PlannedOp.name", self.name, empty=False)
        for attr in ("target", "module_path", "label", "reason"):
            check_str(f"{where}.{attr}", getattr(self, attr))
        check_bool(f"{where}.covered", self.covered)
        if self.layer is not None:
            check_str(f"{where}.layer", self.layer, empty=False)
        object.__setattr__(self, "strategy", check_strategy(f"{where}.strategy", self.strategy))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "alternatives", tuple(self.alternatives))
        pending = check_names(f"{where}.pending_grad", self.pending_grad)
        object.__setattr__(self, "pending_grad", pending)
        object.__setattr__(self, "compute_s", check_seconds(f"{where}.compute_s", self.compute_s))
        self._check_inputs(where)

    def _check_inputs(self, where: str) -> None:
        if len(self.strategy) != len(self.inputs):
            raise PlanError(
                f"{where}: strategy {self.strategy!r} has {len(self.strategy)} entries for "
                f"{len(self.inputs)} inputs; give one tuple of cuts per input"
            )
        for i, (cuts, layout) in enumerate(zip(self.strategy, self.inputs, strict=True)):
            check_layout(f"{where}.inputs[{i}]", layout)
            if layout.partial:
                raise PlanError(
                    f"{where}.inputs[{i}] {layout.describe()} holds a partial sum over "
                    f"{layout.partial!r}; inputs are reduced before an op reads them: drop partial"
                )
            if cuts != layout.splits():
                raise PlanError(
                    f"{where}: strategy entry {i} {cuts!r} disagrees with input layout "
                    f"{layout.describe()} (cuts {layout.splits()!r}); make them the same"
                )
        for i, alt in enumerate(self.alternatives):
            if not isinstance(alt, Alternative):
                raise fail(f"{where}.alternatives[{i}]", alt, "must be an Alternative", "wrap it")

    def layouts(self) -> tuple[TensorLayout, ...]:
        return (*self.inputs, *self.outputs)


@dataclass(frozen=True, slots=True)
class PlannedParameter:
    """The layout of one parameter (by FQN), and the axes its gradient is summed over."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: TensorLayout
    grad_reduce_axes: tuple[str, ...]
    op: str
    reason: str
    optimizer_shard_dim: int | None = None
    """The dim of this parameter's local piece optimizer parallel splits over the data-parallel
    axis (``optimizer_shard``; :func:`plait.layout.optimizer_shard_dim`), None = whole."""

    def __post_init__(self) -> None:
        where = f"PlannedParameter {self.name!r}"
        check_str("PlannedParameter.name", self.name, empty=False)
        object.__setattr__(self, "shape", check_shape(f"{where}.shape", self.shape))
        check_str(f"{where}.dtype", self.dtype, empty=False)
        check_str(f"{where}.op", self.op)
        check_str(f"{where}.reason", self.reason)
        axes = check_names(f"{where}.grad_reduce_axes", self.grad_reduce_axes)
        object.__setattr__(self, "grad_reduce_axes", axes)
        check_layout(f"{where}.layout", self.layout)
        if self.layout.ndim != len(self.shape):
            raise PlanError(
                f"{where}: layout {self.layout.describe()} has {self.layout.ndim} dims but the "
                f"shape {self.shape!r} has {len(self.shape)}; give one entry per dim"
            )
        d = self.optimizer_shard_dim
        if d is not None and (
            not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < len(self.shape)
        ):
            raise PlanError(
                f"{where}.optimizer_shard_dim={d!r} is not a dim of shape {self.shape!r}; give "
                "a dim index or null"
            )
        split = {a for dim in self.layout.dims for a in dim}
        if split & set(axes):
            raise PlanError(
                f"{where}: gradient reduced over {sorted(split & set(axes))!r}, axes that split "
                "the parameter itself; a split axis holds different pieces, never sums them"
            )


@dataclass(frozen=True, slots=True)
class PlannedCollective:
    """One collective of the step (``nbytes``/``seconds`` per occurrence, ``count`` per step)."""

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    seconds: float
    count: int
    phase: str
    op: str
    reason: str
    group_size: int | None = None
    """Ranks in one of its groups when smaller than the group its ``axes`` span: optimizer
    parallel's shard groups (``optimizer_weight_shard_size``, HSDP) and the groups across
    them; None: the whole axes."""
    value: str = ""
    """The graph value a forward redistribution moves (the ref ``op`` reads), so that moves
    of one value over the same axes can be told apart from moves of others (a pipeline stage,
    holding the data-parallel dim whole, moves a value needed in two layouts that differ only
    there once); empty for every other collective."""
    file_order: ClassVar[tuple[str, ...]] = (
        "kind", "axes", "phase", "op", "value", "nbytes", "seconds", "count", "group_size",
        "reason",
    )  # fmt: skip

    def __post_init__(self) -> None:
        where = f"PlannedCollective({self.kind!r} at {self.op!r})"
        check_choice(f"{where}.kind", self.kind, COLLECTIVE_KINDS)
        check_choice(f"{where}.phase", self.phase, PHASES)
        object.__setattr__(self, "axes", check_names(f"{where}.axes", self.axes))
        check_int(f"{where}.nbytes", self.nbytes)
        object.__setattr__(self, "seconds", check_seconds(f"{where}.seconds", self.seconds))
        check_int(f"{where}.count", self.count, 1)
        check_str(f"{where}.op", self.op)
        check_str(f"{where}.reason", self.reason)
        check_str(f"{where}.value", self.value)
        if self.group_size is not None:
            check_int(f"{where}.group_size", self.group_size, 1)

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.count

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.count


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted step time (and its split), peak memory per device (and by kind), FLOPs."""

    step_time_s: float
    compute_s: float
    communication_s: float
    bubble_s: float
    memory_bytes: int
    memory_by_kind: dict[str, int] = field(hash=False)
    flops_per_step: int
    optimizer_s: float = 0.0
    """The optimizer step's seconds on the busiest stage (AdamW over this device's pieces;
    ``plait.cost.compute.optimizer_seconds``), part of ``step_time_s``."""
    overlapped_s: float = 0.0
    """Seconds of ``communication_s`` that run beside compute (data-parallel reductions in
    backward, ZeRO-3's prefetched gathers: :mod:`plait.planning.overlap`), taken off
    ``step_time_s``."""

    def __post_init__(self) -> None:
        for attr in (
            "step_time_s", "compute_s", "communication_s", "bubble_s", "optimizer_s",
            "overlapped_s",
        ):  # fmt: skip
            object.__setattr__(self, attr, check_seconds(f"Prediction.{attr}", getattr(self, attr)))
        check_int("Prediction.memory_bytes", self.memory_bytes)
        check_int("Prediction.flops_per_step", self.flops_per_step)
        if not isinstance(self.memory_by_kind, Mapping):
            raise fail("Prediction.memory_by_kind", self.memory_by_kind, "must be a dict", "fix")
        given = {
            check_str("Prediction.memory_by_kind key", k, empty=False): check_int(
                f"Prediction.memory_by_kind[{k!r}]", v
            )
            for k, v in self.memory_by_kind.items()
        }
        # A private copy in a fixed order: the caller's dict can change, the plan cannot.
        order = [k for k in MEMORY_KINDS if k in given] + sorted(set(given) - set(MEMORY_KINDS))
        object.__setattr__(self, "memory_by_kind", {k: given[k] for k in order})


@dataclass(frozen=True, slots=True)
class PlanOption:
    """One configuration the outer planner weighed (mesh, micro-batches, ZeRO, recompute)."""

    mesh: dict[str, int] = field(hash=False)
    micro_batches: int
    optimizer_shard: int | None
    recompute: str
    step_time_s: float
    memory_bytes: int
    feasible: bool
    note: str = ""
    interleave_num: int = 1
    """Copies of each micro-batch (multi-copy parallel; ``interleave_num="auto"`` weighs 1 and 2)."""

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mapping) or not self.mesh:
            raise fail("PlanOption.mesh", self.mesh, "must be a non-empty dict", "e.g. {'dp': 4}")
        mesh = MeshSpec.from_dict(dict(self.mesh))  # validates names and sizes
        object.__setattr__(self, "mesh", mesh.as_dict())
        check_int("PlanOption.micro_batches", self.micro_batches, 1)
        check_choice("PlanOption.optimizer_shard", self.optimizer_shard, (None, 1, 2, 3))
        object.__setattr__(self, "recompute", check_recompute("PlanOption", self.recompute))
        object.__setattr__(
            self, "step_time_s", check_seconds("PlanOption.step_time_s", self.step_time_s)
        )
        check_int("PlanOption.memory_bytes", self.memory_bytes)
        check_bool("PlanOption.feasible", self.feasible)
        check_str("PlanOption.note", self.note)
        check_int("PlanOption.interleave_num", self.interleave_num, 1)


@dataclass(frozen=True, slots=True)
class PlannedServerTable:
    """One table of a parameter-server plan: where its rows live and what a worker's step moves.

    Bytes and rows are per worker and optimizer step (with ``grad_accumulation=k`` a worker
    pulls once per micro-batch and pushes once a step)."""

    name: str
    """The table module's path in the model."""
    rows: int
    dim: int
    split: str
    """``ParallelConfig.ps_split``: "range" or "hash"."""
    rows_per_server: tuple[int, ...]
    """Rows each server holds."""
    server_bytes: int
    """Bytes the busiest server holds for the table: its rows and their optimizer states."""
    ids_per_step: int
    """Ids a worker looks up in the table a step."""
    pulled_rows: int
    """Distinct rows a worker pulls a step (summed over its micro-batches)."""
    pushed_rows: int
    """Rows whose gradients a worker pushes a step (distinct over the step)."""
    measured: bool
    """Distinct rows counted on the example batch's ids (False: every id taken as distinct)."""
    pull_bytes: int
    """Bytes a worker's pulls move a step (ids out, rows back)."""
    push_bytes: int
    """Bytes a worker's push moves a step (ids and row gradients)."""
    seconds: float
    """What the table adds to a step: pulls, the push and the servers' update."""

    def __post_init__(self) -> None:
        check_str("PlannedServerTable.name", self.name, empty=False)
        for attr in ("rows", "dim", "ids_per_step", "pulled_rows", "pushed_rows",
                     "server_bytes", "pull_bytes", "push_bytes"):  # fmt: skip
            check_int(f"PlannedServerTable.{attr}", getattr(self, attr))
        check_choice("PlannedServerTable.split", self.split, ("range", "hash"))
        object.__setattr__(self, "rows_per_server", tuple(self.rows_per_server))
        for n in self.rows_per_server:
            check_int("PlannedServerTable.rows_per_server", n)
        check_bool("PlannedServerTable.measured", self.measured)
        object.__setattr__(
            self, "seconds", check_seconds("PlannedServerTable.seconds", self.seconds)
        )


@dataclass(frozen=True)
class PlanContents:
    """The fields of a :class:`~plait.planning.records.Plan` (what each means: its docstring)
    and the structure checked at construction: unique names, layouts on the plan's mesh,
    strategies matching layouts, references to known ops."""

    mesh: MeshSpec
    mode: str
    search: str
    hardware: str
    precision: str
    micro_batches: int
    pipeline_stages: int
    optimizer_shard: int | None
    recompute: str
    ops: tuple[PlannedOp, ...]
    parameters: tuple[PlannedParameter, ...] = field(metadata={codec.KEYED_BY: "name"})
    collectives: tuple[PlannedCollective, ...]
    predicted: Prediction
    stages: tuple[tuple[str, ...], ...] = ()
    options: tuple[PlanOption, ...] = ()
    model: str = ""
    batch: tuple[tuple[int, ...], ...] = ()
    notes: tuple[str, ...] = ()
    memory_limit: int | None = None
    # Fields added after schema_version 1 was first written keep a default: the codec fills
    # it in for files written before them (a field without a default is required in a file).
    grad_accumulation: int = 1
    """Micro-steps per optimizer step (``ParallelConfig.grad_accumulation``): ``batch`` is one
    micro-step's batch; activation collectives repeat per micro-step (their ``count``), the
    gradient reductions happen once."""
    interleave_num: int = 1
    """Copies each micro-step is cut into (``ParallelConfig.interleave_num``, multi-copy
    parallel): ``batch`` is one copy's batch; the ops' collectives repeat per copy, and each
    copy's tensor-parallel collectives run while another copy computes."""
    dp_axis: str = "dp"
    """The data-parallel mesh axis the plan was made with (``ParallelConfig.dp_axis``)."""
    dataset_strategy: DatasetStrategyValue = "data_parallel"
    """How the batch enters a step (``ParallelConfig.dataset_strategy``): "data_parallel",
    "full_batch", or one strategy per input (a tuple of splits or a TensorLayout)."""
    comm_fusion: CommFusion | None = None
    """The gradient fusion the plan's bucketed reductions assume (None: plait's default)."""
    offload: str | None = None
    """What lives in host memory between uses (``ParallelConfig.offload``): "optimizer" keeps
    the optimizer's states and its step on the host (not in ``predicted.memory_by_kind``)."""
    recompute_regions: tuple[tuple[str, ...], ...] = ()
    """(module path, "full" | "selective") of each region whose forward backward recomputes:
    every repeated layer under ``recompute``, and the modules ``plait.recompute`` marks."""
    schedule: str = "1f1b"
    """The pipeline schedule planned for (``ParallelConfig.schedule``): the predicted bubble and
    the activations in flight depend on it (files without it: "1f1b")."""
    virtual_stages: int = 1
    """Model chunks a pipeline rank runs (``ParallelConfig.virtual_stages``): 1 for ``gpipe``
    and ``1f1b``, 2 or more interleaved, exactly 2 for ``zero_bubble_v``."""
    stage_compute_s: tuple[float, ...] = ()
    """Predicted compute seconds of each pipeline stage per step (forward and backward of every
    micro-batch): what :meth:`timeline` draws. Empty without pipeline stages."""
    optimizer_weight_shard_size: int | None = None
    """Ranks of ``dp_axis`` one parameter's shards spread over under ``optimizer_shard``
    (``ParallelConfig.optimizer_weight_shard_size``, HSDP): shard groups of this many
    consecutive ranks, each holding a whole copy; None: the whole axis."""
    hardware_uncalibrated: bool = False
    """The prediction was made on the uncalibrated ``local`` defaults (no ``plait calibrate``
    file: :attr:`plait.cost.HardwareProfile.uncalibrated`); every report of it says so
    (:attr:`hardware_label`). Files written before the field: False."""
    servers: int = 0
    """Parameter servers the plan is for (mode ``parameter_server``; 0 otherwise)."""
    server_tables: tuple[PlannedServerTable, ...] = ()
    """Mode ``parameter_server``: each server table's placement and traffic (the dense part's
    ops and parameters are the rest of the plan)."""
    schema_version: ClassVar[int] = 1
    # The file reads top-down: what was planned (model, batch, mesh, settings), what it costs,
    # then the long per-op and per-parameter lists.
    file_order: ClassVar[tuple[str, ...]] = (
        "model", "batch", "mesh", "mode", "search", "hardware", "hardware_uncalibrated",
        "precision", "micro_batches",
        "pipeline_stages", "schedule", "virtual_stages", "optimizer_shard",
        "optimizer_weight_shard_size", "recompute",
        "memory_limit", "grad_accumulation", "interleave_num", "dp_axis", "dataset_strategy", "comm_fusion",
        "offload", "recompute_regions", "predicted", "stages", "stage_compute_s", "ops",
        "parameters", "collectives", "servers", "server_tables", "options", "notes",
    )  # fmt: skip
    _ops: dict[str, PlannedOp] = field(init=False, repr=False, compare=False, hash=False)
    _params: dict[str, PlannedParameter] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, MeshSpec):
            raise fail("Plan.mesh", self.mesh, "must be a MeshSpec", "use MeshSpec.from_dict")
        self._check_settings()
        for attr in ("ops", "parameters", "collectives", "options", "notes", "server_tables"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))
        object.__setattr__(
            self, "stages", tuple(check_names("Plan.stages", s) for s in self.stages)
        )
        object.__setattr__(self, "batch", tuple(check_shape("Plan.batch", s) for s in self.batch))
        check_names("Plan.notes", self.notes)
        self._check_items()
        object.__setattr__(self, "_ops", {op.name: op for op in self.ops})
        object.__setattr__(self, "_params", {p.name: p for p in self.parameters})
        self._check_references()

    def _check_settings(self) -> None:
        check_choice("Plan.mode", self.mode, get_args(Mode))
        check_str("Plan.search", self.search)
        check_str("Plan.hardware", self.hardware, empty=False)
        check_bool("Plan.hardware_uncalibrated", self.hardware_uncalibrated)
        check_choice("Plan.precision", self.precision, get_args(Precision))
        check_int("Plan.micro_batches", self.micro_batches, 1)
        check_int("Plan.grad_accumulation", self.grad_accumulation, 1)
        check_int("Plan.interleave_num", self.interleave_num, 1)
        check_str("Plan.dp_axis", self.dp_axis, empty=False)
        object.__setattr__(self, "dataset_strategy", _check_dataset_strategy(self.dataset_strategy))
        if self.comm_fusion is not None and not isinstance(self.comm_fusion, CommFusion):
            raise fail("Plan.comm_fusion", self.comm_fusion, "must be a CommFusion or None",
                        "give plait.config.CommFusion(...)")  # fmt: skip
        check_int("Plan.pipeline_stages", self.pipeline_stages, 1)
        self._check_schedule()
        check_choice("Plan.optimizer_shard", self.optimizer_shard, (None, 1, 2, 3))
        self._check_weight_shard_size()
        object.__setattr__(self, "recompute", check_recompute("Plan", self.recompute))
        check_choice("Plan.offload", self.offload, (None, "optimizer", "parameters", "activations"))
        regions = tuple(tuple(r) for r in self.recompute_regions)
        for r in regions:
            if len(r) != 2 or r[1] not in ("full", "selective"):
                raise fail("Plan.recompute_regions", r, "must be [module path, 'full' | "
                           "'selective']", "give pairs such as ['blocks.0', 'full']")  # fmt: skip
        object.__setattr__(self, "recompute_regions", regions)
        check_str("Plan.model", self.model)
        if self.memory_limit is not None:
            check_int("Plan.memory_limit", self.memory_limit, 1)

    @property
    def hardware_label(self) -> str:
        """``hardware`` as every report of a predicted time or memory prints it: the name, and
        on the uncalibrated ``local`` defaults a warning that says how to calibrate."""
        if self.hardware_uncalibrated:
            return f"{self.hardware} ({UNCALIBRATED})"
        return self.hardware

    def _check_weight_shard_size(self) -> None:
        size = self.optimizer_weight_shard_size
        if size is None:
            return
        check_int("Plan.optimizer_weight_shard_size", size, 1)
        if self.optimizer_shard is None:
            raise fail("Plan.optimizer_weight_shard_size", size, "needs optimizer_shard",
                       "give optimizer_shard 1, 2 or 3, or null")  # fmt: skip
        axes = dict(zip(self.mesh.axis_names, self.mesh.shape, strict=True))
        dp = axes.get(self.dp_axis, 1)
        if dp % size:
            raise fail("Plan.optimizer_weight_shard_size", size,
                       f"must divide the {self.dp_axis!r} axis ({dp})",
                       "give a divisor of it, or null")  # fmt: skip

    def _check_schedule(self) -> None:
        check_choice("Plan.schedule", self.schedule, get_args(Schedule))
        check_int("Plan.virtual_stages", self.virtual_stages, 1)
        v, looped = self.virtual_stages, self.schedule in ("gpipe", "1f1b")
        if (looped and v != 1) or (self.schedule == "zero_bubble_v" and v != 2):
            raise PlanError(
                f"Plan.virtual_stages={v} with schedule {self.schedule!r}, which runs "
                f"{1 if looped else 2} chunk{'' if looped else 's'} a rank; fix virtual_stages"
            )
        computes = tuple(
            check_seconds(f"Plan.stage_compute_s[{i}]", t)
            for i, t in enumerate(self.stage_compute_s)
        )
        object.__setattr__(self, "stage_compute_s", computes)
        if computes and len(computes) != self.pipeline_stages:
            raise PlanError(
                f"Plan.stage_compute_s lists {len(computes)} stages but pipeline_stages="
                f"{self.pipeline_stages}; give one entry per stage (or none)"
            )

    def _check_items(self) -> None:
        kinds: list[tuple[str, type, tuple[object, ...]]] = [
            ("ops", PlannedOp, self.ops),
            ("parameters", PlannedParameter, self.parameters),
            ("collectives", PlannedCollective, self.collectives),
            ("options", PlanOption, self.options),
            ("server_tables", PlannedServerTable, self.server_tables),
        ]
        for attr, kind, items in kinds:
            for i, item in enumerate(items):
                if not isinstance(item, kind):
                    raise fail(f"Plan.{attr}[{i}]", item, f"must be a {kind.__name__}", "fix it")
        if not isinstance(self.predicted, Prediction):
            raise fail("Plan.predicted", self.predicted, "must be a Prediction", "fix it")
        check_unique("Plan.ops", (op.name for op in self.ops))
        check_unique("Plan.parameters", (p.name for p in self.parameters))
        check_unique("Plan.server_tables", (t.name for t in self.server_tables))
        check_int("Plan.servers", self.servers)
        if bool(self.servers) != bool(self.server_tables) or (
            self.server_tables and self.mode != "parameter_server"
        ):
            raise fail(
                "Plan.server_tables", len(self.server_tables),
                f"needs servers > 0 (servers={self.servers}) and mode 'parameter_server' "
                f"(mode={self.mode!r}), and servers need tables", "plan again with plait.plan",
            )  # fmt: skip
        if self.stages and len(self.stages) != self.pipeline_stages:
            raise PlanError(
                f"Plan.stages lists {len(self.stages)} stages but pipeline_stages="
                f"{self.pipeline_stages}; give one entry per stage (or none)"
            )

    def _check_references(self) -> None:
        for op in self.ops:
            for i, layout in enumerate(op.inputs):
                check_on_mesh(f"op {op.name!r} input {i}", layout, self.mesh)
            for i, layout in enumerate(op.outputs):
                check_on_mesh(f"op {op.name!r} output {i}", layout, self.mesh)
        for p in self.parameters:
            check_on_mesh(f"parameter {p.name!r}", p.layout, self.mesh)
            for axis in p.grad_reduce_axes:
                self._axis(f"parameter {p.name!r} grad_reduce_axes", axis)
            if p.op and p.op not in self._ops:
                raise PlanError(
                    f"parameter {p.name!r} is read first by op {p.op!r}, which is not in the "
                    f"plan{close_matches(p.op, self._ops)}; name a planned op or '' for an unused one"
                )
        for c in self.collectives:
            for axis in c.axes:
                self._axis(f"collective {c.kind!r} at {c.op!r}", axis)
            if c.op and c.op not in self._ops and c.op not in self._params:
                raise PlanError(
                    f"collective {c.kind!r} is placed at {c.op!r}, which is neither an op nor a "
                    f"parameter of the plan{close_matches(c.op, [*self._ops, *self._params])}; fix the name"
                )

    def _axis(self, where: str, axis: str) -> None:
        if axis not in self.mesh.axis_names:
            raise PlanError(
                f"{where}: axis {axis!r} is not in the mesh {self.mesh.as_dict()!r}; "
                f"use one of {list(self.mesh.axis_names)!r}"
            )

    # ----------------------------------------------------------------------- lookups

    def op(self, name: str) -> PlannedOp:
        """The planned op called ``name``; PlanError with close matches if there is none."""
        if name not in self._ops:
            raise PlanError(f"op {name!r} is not in the plan{close_matches(name, self._ops)}")
        return self._ops[name]

    def parameter(self, name: str) -> PlannedParameter:
        """The planned parameter with FQN ``name``; PlanError with close matches if none."""
        if name not in self._params:
            raise PlanError(
                f"parameter {name!r} is not in the plan{close_matches(name, self._params)}"
            )
        return self._params[name]


def _check_dataset_strategy(value: object) -> DatasetStrategyValue:
    """``value`` with per-input split counts as tuples; an error naming the field if bad."""
    if isinstance(value, str) and value in get_args(DatasetStrategy):
        return value
    if not isinstance(value, tuple | list) or not all(
        isinstance(e, TensorLayout)
        or (
            isinstance(e, tuple | list)
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in e)
        )
        for e in value
    ):
        raise fail(
            "Plan.dataset_strategy",
            value,
            "must be 'data_parallel', 'full_batch' or a tuple of per-input strategies",
            "give ParallelConfig.dataset_strategy's value",
        )
    return tuple(e if isinstance(e, TensorLayout) else tuple(e) for e in value)
