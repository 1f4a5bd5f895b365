"""The Plan: what planning decided, as one value that running reads (DESIGN.md decision 2).

A :class:`Plan` holds the mesh, the strategy and layouts chosen for every op of the captured
graph, the layout of every parameter, the collectives those layouts cause, the pipeline stages
and the predicted step time and memory. It is pure data: building, saving and reading one
needs no process group, no devices and no model weights.

Plan files are MindSpore's strategy checkpoint files (reference section 25.2) made readable:
versioned JSON (``schema_version``), one entry per op and per parameter, layouts written as
``{"dims": [["dp"], []], "partial": [], "reduce_op": "sum", "tensor_map": [1, -1]}`` (the
mesh is the plan's; ``tensor_map`` is MindSpore's numbering, written for readers who know it
and checked on load). The same plan always gives the same bytes: keys in a fixed order, floats
as Python's ``repr``, no timestamps.

Conventions: a :class:`PlannedCollective`'s ``nbytes`` and ``seconds`` are those of *one*
occurrence (``nbytes`` per device, the local piece before the collective, as in
:mod:`plait.cost`), and ``count`` is how many times it runs per training step.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_args

from plait.config import CommFusion, DatasetStrategy, Mode, Precision, Recompute
from plait.errors import PlaitError, PlanError
from plait.layout import TensorLayout
from plait.layout.placement import ReduceOp
from plait.mesh import MeshSpec

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
]

Strategy = tuple[tuple[int, ...], ...]

COLLECTIVE_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "broadcast",
)
PHASES = ("forward", "backward", "optimizer")
# Memory kinds in the order people read them; other kinds follow, sorted by name.
MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations")
_FORMAT = "plait.plan"


# --------------------------------------------------------------------------- value checks


def _fail(where: str, value: object, rule: str, fix: str) -> PlanError:
    return PlanError(f"{where}={value!r}: {rule}; {fix}")


def _str(where: str, value: object, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        rule = "must be a string" if empty else "must be a non-empty string"
        raise _fail(where, value, rule, "give a name")
    return value


def _int(where: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _fail(where, value, f"must be an integer >= {minimum}", "give a whole number")
    return value


def _seconds(where: str, value: object) -> float:
    """Non-negative finite number, stored as float so the file always writes it the same way."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:  # type: ignore[arg-type]
        raise _fail(where, value, "must be a finite number >= 0", "give seconds as a float")
    return float(value)  # type: ignore[arg-type]


def _choice(where: str, value: object, allowed: Iterable[object]) -> Any:
    allowed = tuple(allowed)
    if value not in allowed or isinstance(value, bool):
        raise _fail(where, value, "is not allowed", f"use one of {', '.join(map(repr, allowed))}")
    return value


def _names(where: str, value: Iterable[object]) -> tuple[str, ...]:
    return tuple(_str(f"{where}[{i}]", v, empty=False) for i, v in enumerate(value))


def _shape(where: str, value: Iterable[object]) -> tuple[int, ...]:
    return tuple(_int(f"{where}[{i}]", v) for i, v in enumerate(value))


def _strategy(where: str, value: Iterable[Iterable[object]]) -> Strategy:
    return tuple(
        tuple(_int(f"{where}[{i}][{j}]", c, 1) for j, c in enumerate(cuts))
        for i, cuts in enumerate(value)
    )


def _on_mesh(where: str, layout: object, mesh: MeshSpec) -> None:
    if not isinstance(layout, TensorLayout):
        raise _fail(where, layout, "must be a TensorLayout", "build it with plait.Layout(...)")
    if layout.mesh != mesh:
        raise PlanError(
            f"{where} is laid out on mesh {layout.mesh.as_dict()!r} but the plan's mesh is "
            f"{mesh.as_dict()!r}; build every layout on the plan's mesh"
        )


def _unique(where: str, names: Iterable[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise PlanError(f"{where} names {name!r} twice; every name in a plan is unique")
        seen.add(name)


# --------------------------------------------------------------------------- the value types


@dataclass(frozen=True, slots=True)
class Alternative:
    """Another strategy the search weighed for an op, with its cost in seconds."""

    label: str
    strategy: Strategy
    cost_s: float
    note: str = ""

    def __post_init__(self) -> None:
        _str("Alternative.label", self.label)
        object.__setattr__(self, "strategy", _strategy("Alternative.strategy", self.strategy))
        object.__setattr__(self, "cost_s", _seconds("Alternative.cost_s", self.cost_s))
        _str("Alternative.note", self.note)


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """The strategy chosen for one op of the graph, and why.

    ``strategy`` is MindSpore's strategy tuple (pieces per dim of each input) and must agree
    with ``inputs``; ``outputs`` may hold pending partial sums, inputs may not.
    """

    name: str
    target: str
    module_path: str
    strategy: Strategy
    inputs: tuple[TensorLayout, ...]
    outputs: tuple[TensorLayout, ...]
    label: str
    covered: bool
    reason: str
    layer: str | None = None
    alternatives: tuple[Alternative, ...] = ()

    def __post_init__(self) -> None:
        where = f"PlannedOp {self.name!r}"
        _str("PlannedOp.name", self.name, empty=False)
        for attr in ("target", "module_path", "label", "reason"):
            _str(f"{where}.{attr}", getattr(self, attr))
        if not isinstance(self.covered, bool):
            raise _fail(f"{where}.covered", self.covered, "must be True or False", "give a bool")
        if self.layer is not None:
            _str(f"{where}.layer", self.layer, empty=False)
        object.__setattr__(self, "strategy", _strategy(f"{where}.strategy", self.strategy))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "alternatives", tuple(self.alternatives))
        self._check_inputs(where)

    def _check_inputs(self, where: str) -> None:
        if len(self.strategy) != len(self.inputs):
            raise PlanError(
                f"{where}: strategy {self.strategy!r} has {len(self.strategy)} entries for "
                f"{len(self.inputs)} inputs; give one tuple of cuts per input"
            )
        for i, (cuts, layout) in enumerate(zip(self.strategy, self.inputs, strict=True)):
            if not isinstance(layout, TensorLayout):
                raise _fail(f"{where}.inputs[{i}]", layout, "must be a TensorLayout", "fix it")
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
                raise _fail(f"{where}.alternatives[{i}]", alt, "must be an Alternative", "wrap it")

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

    def __post_init__(self) -> None:
        where = f"PlannedParameter {self.name!r}"
        _str("PlannedParameter.name", self.name, empty=False)
        object.__setattr__(self, "shape", _shape(f"{where}.shape", self.shape))
        _str(f"{where}.dtype", self.dtype, empty=False)
        _str(f"{where}.op", self.op)
        _str(f"{where}.reason", self.reason)
        axes = _names(f"{where}.grad_reduce_axes", self.grad_reduce_axes)
        object.__setattr__(self, "grad_reduce_axes", axes)
        if not isinstance(self.layout, TensorLayout):
            raise _fail(f"{where}.layout", self.layout, "must be a TensorLayout", "fix it")
        if self.layout.ndim != len(self.shape):
            raise PlanError(
                f"{where}: layout {self.layout.describe()} has {self.layout.ndim} dims but the "
                f"shape {self.shape!r} has {len(self.shape)}; give one entry per dim"
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

    def __post_init__(self) -> None:
        where = f"PlannedCollective({self.kind!r} at {self.op!r})"
        _choice(f"{where}.kind", self.kind, COLLECTIVE_KINDS)
        _choice(f"{where}.phase", self.phase, PHASES)
        object.__setattr__(self, "axes", _names(f"{where}.axes", self.axes))
        _int(f"{where}.nbytes", self.nbytes)
        object.__setattr__(self, "seconds", _seconds(f"{where}.seconds", self.seconds))
        _int(f"{where}.count", self.count, 1)
        _str(f"{where}.op", self.op)
        _str(f"{where}.reason", self.reason)

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

    def __post_init__(self) -> None:
        for attr in ("step_time_s", "compute_s", "communication_s", "bubble_s"):
            object.__setattr__(self, attr, _seconds(f"Prediction.{attr}", getattr(self, attr)))
        _int("Prediction.memory_bytes", self.memory_bytes)
        _int("Prediction.flops_per_step", self.flops_per_step)
        if not isinstance(self.memory_by_kind, Mapping):
            raise _fail("Prediction.memory_by_kind", self.memory_by_kind, "must be a dict", "fix")
        given = {
            _str("Prediction.memory_by_kind key", k, empty=False): _int(
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

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mapping) or not self.mesh:
            raise _fail("PlanOption.mesh", self.mesh, "must be a non-empty dict", "e.g. {'dp': 4}")
        mesh = MeshSpec.from_dict(dict(self.mesh))  # validates names and sizes
        object.__setattr__(self, "mesh", mesh.as_dict())
        _int("PlanOption.micro_batches", self.micro_batches, 1)
        _choice("PlanOption.optimizer_shard", self.optimizer_shard, (None, 1, 2, 3))
        object.__setattr__(self, "recompute", _recompute("PlanOption", self.recompute))
        object.__setattr__(
            self, "step_time_s", _seconds("PlanOption.step_time_s", self.step_time_s)
        )
        _int("PlanOption.memory_bytes", self.memory_bytes)
        if not isinstance(self.feasible, bool):
            raise _fail("PlanOption.feasible", self.feasible, "must be True or False", "fix")
        _str("PlanOption.note", self.note)


def _recompute(where: str, value: object) -> str:
    """ParallelConfig's recompute values; MindSpore's bool form is accepted and normalised."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    return _choice(f"{where}.recompute", value, get_args(Recompute))


@dataclass(frozen=True)
class Plan:
    """The contract between planning and running: see the module docstring.

    ``mode``, ``precision``, ``optimizer_shard`` and ``recompute`` take
    :class:`~plait.config.ParallelConfig`'s values (``recompute`` also accepts MindSpore's
    bool: True -> "full", False/None -> "none"); ``hardware`` names the cost profile;
    ``stages[s]`` lists the op names or module paths of pipeline stage ``s``; ``options`` are
    the configurations the outer planner weighed; ``memory_limit`` (bytes, optional) is the
    per-device cap the summary compares the prediction with. Construction checks structure
    (unique names, layouts on the plan's mesh, strategies matching layouts, references to
    known ops); :meth:`validate` checks the plan against a model and a world.

    Example:
        >>> plan.save("gpt.plan.json")                       # doctest: +SKIP
        >>> Plan.load("gpt.plan.json") == plan               # doctest: +SKIP
        True
        >>> print(plan.summary()); print(plan.explain("blocks.0.attn.q.weight"))  # doctest: +SKIP
    """

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
    parameters: tuple[PlannedParameter, ...]
    collectives: tuple[PlannedCollective, ...]
    predicted: Prediction
    stages: tuple[tuple[str, ...], ...] = ()
    options: tuple[PlanOption, ...] = ()
    model: str = ""
    batch: tuple[tuple[int, ...], ...] = ()
    notes: tuple[str, ...] = ()
    memory_limit: int | None = None
    grad_accumulation: int = 1
    """Micro-steps per optimizer step (``ParallelConfig.grad_accumulation``): ``batch`` is one
    micro-step's batch; activation collectives repeat per micro-step (their ``count``), the
    gradient reductions happen once."""
    dp_axis: str = "dp"
    """The data-parallel mesh axis the plan was made with (``ParallelConfig.dp_axis``)."""
    dataset_strategy: str | tuple[Any, ...] = "data_parallel"
    """How the batch enters a step (``ParallelConfig.dataset_strategy``): "data_parallel",
    "full_batch", or one strategy per input (a tuple of splits or a TensorLayout)."""
    comm_fusion: CommFusion | None = None
    """The gradient fusion the plan's bucketed reductions assume (None: plait's default)."""
    schema_version: ClassVar[int] = 1
    _ops: dict[str, PlannedOp] = field(init=False, repr=False, compare=False, hash=False)
    _params: dict[str, PlannedParameter] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, MeshSpec):
            raise _fail("Plan.mesh", self.mesh, "must be a MeshSpec", "use MeshSpec.from_dict")
        self._check_settings()
        for attr in ("ops", "parameters", "collectives", "options", "notes"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))
        object.__setattr__(self, "stages", tuple(_names("Plan.stages", s) for s in self.stages))
        object.__setattr__(self, "batch", tuple(_shape("Plan.batch", s) for s in self.batch))
        _names("Plan.notes", self.notes)
        self._check_items()
        object.__setattr__(self, "_ops", {op.name: op for op in self.ops})
        object.__setattr__(self, "_params", {p.name: p for p in self.parameters})
        self._check_references()

    def _check_settings(self) -> None:
        _choice("Plan.mode", self.mode, get_args(Mode))
        _str("Plan.search", self.search)
        _str("Plan.hardware", self.hardware, empty=False)
        _choice("Plan.precision", self.precision, get_args(Precision))
        _int("Plan.micro_batches", self.micro_batches, 1)
        _int("Plan.grad_accumulation", self.grad_accumulation, 1)
        _str("Plan.dp_axis", self.dp_axis, empty=False)
        object.__setattr__(self, "dataset_strategy", _check_dataset_strategy(self.dataset_strategy))
        if self.comm_fusion is not None and not isinstance(self.comm_fusion, CommFusion):
            raise _fail("Plan.comm_fusion", self.comm_fusion, "must be a CommFusion or None",
                        "give plait.config.CommFusion(...)")  # fmt: skip
        _int("Plan.pipeline_stages", self.pipeline_stages, 1)
        _choice("Plan.optimizer_shard", self.optimizer_shard, (None, 1, 2, 3))
        object.__setattr__(self, "recompute", _recompute("Plan", self.recompute))
        _str("Plan.model", self.model)
        if self.memory_limit is not None:
            _int("Plan.memory_limit", self.memory_limit, 1)

    def _check_items(self) -> None:
        kinds: list[tuple[str, type, tuple[object, ...]]] = [
            ("ops", PlannedOp, self.ops),
            ("parameters", PlannedParameter, self.parameters),
            ("collectives", PlannedCollective, self.collectives),
            ("options", PlanOption, self.options),
        ]
        for attr, kind, items in kinds:
            for i, item in enumerate(items):
                if not isinstance(item, kind):
                    raise _fail(f"Plan.{attr}[{i}]", item, f"must be a {kind.__name__}", "fix it")
        if not isinstance(self.predicted, Prediction):
            raise _fail("Plan.predicted", self.predicted, "must be a Prediction", "fix it")
        _unique("Plan.ops", (op.name for op in self.ops))
        _unique("Plan.parameters", (p.name for p in self.parameters))
        if self.stages and len(self.stages) != self.pipeline_stages:
            raise PlanError(
                f"Plan.stages lists {len(self.stages)} stages but pipeline_stages="
                f"{self.pipeline_stages}; give one entry per stage (or none)"
            )

    def _check_references(self) -> None:
        for op in self.ops:
            for i, layout in enumerate(op.inputs):
                _on_mesh(f"op {op.name!r} input {i}", layout, self.mesh)
            for i, layout in enumerate(op.outputs):
                _on_mesh(f"op {op.name!r} output {i}", layout, self.mesh)
        for p in self.parameters:
            _on_mesh(f"parameter {p.name!r}", p.layout, self.mesh)
            for axis in p.grad_reduce_axes:
                self._axis(f"parameter {p.name!r} grad_reduce_axes", axis)
            if p.op and p.op not in self._ops:
                raise PlanError(
                    f"parameter {p.name!r} is read first by op {p.op!r}, which is not in the "
                    f"plan{_close(p.op, self._ops)}; name a planned op or '' for an unused one"
                )
        for c in self.collectives:
            for axis in c.axes:
                self._axis(f"collective {c.kind!r} at {c.op!r}", axis)
            if c.op and c.op not in self._ops and c.op not in self._params:
                raise PlanError(
                    f"collective {c.kind!r} is placed at {c.op!r}, which is neither an op nor a "
                    f"parameter of the plan{_close(c.op, [*self._ops, *self._params])}; fix the name"
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
            raise PlanError(f"op {name!r} is not in the plan{_close(name, self._ops)}")
        return self._ops[name]

    def parameter(self, name: str) -> PlannedParameter:
        """The planned parameter with FQN ``name``; PlanError with close matches if none."""
        if name not in self._params:
            raise PlanError(f"parameter {name!r} is not in the plan{_close(name, self._params)}")
        return self._params[name]

    # ----------------------------------------------------------------------- files

    def to_json(self) -> str:
        """The plan file's text: same plan, same bytes."""
        return _dump(_plan_to_data(self)) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan file's text; PlanError naming the field for anything malformed."""
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"plan file is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                "re-create it with plait.plan(...).save(path)"
            ) from None
        return _plan_from_data(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan file (UTF-8 JSON) to ``path``."""
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan file written by :meth:`save`."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise PlanError(f"cannot read plan file {os.fspath(path)!r}: {e.strerror}") from None
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"{os.fspath(path)}: {e}") from None

    # ----------------------------------------------------------------------- for people

    def summary(self) -> str:
        """A readable report: settings, prediction, ops (repeated layers grouped), collectives."""
        return "\n".join(_summary_lines(self)) + "\n"

    def explain(self, name: str) -> str:
        """Why an op, a parameter (FQN) or a module path is laid out as it is, and what it costs.

        ``explain("mesh")`` shows the options the outer planner weighed and why the winner won.
        """
        if name in self._ops:
            return "\n".join(_explain_op(self, self._ops[name])) + "\n"
        if name in self._params:
            return "\n".join(_explain_param(self, self._params[name])) + "\n"
        if name and name in _module_paths(self):
            return "\n".join(_explain_module(self, name)) + "\n"
        if name in ("mesh", "options") and (self.options or self.notes):
            return "\n".join(_explain_options(self)) + "\n"
        known = [*self._ops, *self._params, *_module_paths(self), "mesh"]
        raise PlanError(
            f"explain({name!r}): no op, parameter or module of that name in the plan"
            f"{_close(name, known)}; give an op name, a parameter FQN or a module path"
        )

    # ----------------------------------------------------------------------- checks

    def validate(self, model_or_params: object, world_size: int | None = None) -> None:
        """Check the plan against a model (or ``{name: shape}``) and, if given, a world size.

        Raises PlanError listing the first problems: a world size other than the mesh's,
        parameters without a planned layout or planned but absent, shapes that differ, layouts
        that do not divide their shape, stages naming unknown ops.
        """
        shapes = _model_shapes(model_or_params)
        problems: list[str] = []
        if world_size is not None and world_size != self.mesh.size:
            problems.append(
                f"the mesh {self.mesh.as_dict()!r} has {self.mesh.size} devices but the world "
                f"has {world_size}: plan again for {world_size} devices or launch {self.mesh.size}"
            )
        problems += self._parameter_problems(shapes)
        problems += self._stage_problems()
        if problems:
            shown = "\n  - ".join(problems[:8])
            more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
            raise PlanError(
                f"plan for {self.model or 'the model'} does not fit ({len(problems)} problem"
                f"{'s' if len(problems) > 1 else ''}):\n  - {shown}{more}"
            )

    def _parameter_problems(self, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
        missing = [n for n in shapes if n not in self._params]
        extra = [n for n in self._params if n not in shapes]
        problems: list[str] = []
        if missing:
            problems.append(
                f"model parameters without a planned layout: {_few(missing)}; plan again for "
                "this model (did the model change since the plan was made?)"
            )
        if extra:
            problems.append(
                f"planned parameters the model does not have: {_few(extra)}; plan again for "
                "this model, or check that parameter names match (wrappers add prefixes)"
            )
        for p in self.parameters:
            if p.name in shapes and tuple(shapes[p.name]) != p.shape:
                problems.append(
                    f"parameter {p.name!r} has shape {tuple(shapes[p.name])!r} in the model but "
                    f"{p.shape!r} in the plan; plan again for this model"
                )
                continue
            try:
                p.layout.check_shape(p.shape, f"parameter {p.name!r}")
            except PlaitError as e:
                problems.append(str(e))
        return problems

    def _stage_problems(self) -> list[str]:
        modules = set(_module_paths(self))
        problems = []
        for s, stage in enumerate(self.stages):
            for ref in stage:
                if ref not in self._ops and ref not in modules:
                    problems.append(
                        f"stage {s} names {ref!r}, which is neither an op nor a module path of "
                        f"the plan{_close(ref, [*self._ops, *modules])}; fix the stage list"
                    )
        return problems


# --------------------------------------------------------------------------- small helpers


def _close(name: str, known: Iterable[str]) -> str:
    matches = difflib.get_close_matches(name, list(known), n=5, cutoff=0.6)
    return f" (close matches: {', '.join(map(repr, matches))})" if matches else ""


def _few(names: Sequence[str], n: int = 6) -> str:
    text = ", ".join(map(repr, names[:n]))
    return text + (f" and {len(names) - n} more" if len(names) > n else "")


def _module_paths(plan: Plan) -> list[str]:
    """Every module path of the plan's ops and parameters, with all their prefixes, in order."""
    seen: dict[str, None] = {}
    paths = [op.module_path for op in plan.ops] + [
        p.name.rpartition(".")[0] for p in plan.parameters
    ]
    for path in paths:
        parts = path.split(".") if path else []
        for i in range(1, len(parts) + 1):
            seen.setdefault(".".join(parts[:i]), None)
    return list(seen)


def _in_module(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _module_ops(plan: Plan, module: str) -> list[PlannedOp]:
    return [op for op in plan.ops if _in_module(op.module_path, module)]


def _model_shapes(model_or_params: object) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` from an nn.Module (meta tensors work) or a mapping of name to shape."""
    named = getattr(model_or_params, "named_parameters", None)
    if callable(named):
        return {name: tuple(int(s) for s in p.shape) for name, p in named()}
    if isinstance(model_or_params, Mapping):
        out = {}
        for name, shape in model_or_params.items():
            shape = getattr(shape, "shape", shape)  # tensors stand for their shapes
            out[_str("validate: parameter name", name, empty=False)] = _shape(f"{name!r}", shape)
        return out
    raise PlanError(
        f"validate({type(model_or_params).__name__}): give an nn.Module or a mapping of "
        "parameter name to shape"
    )


# --------------------------------------------------------------------------- JSON writing


def _check_dataset_strategy(value: object) -> str | tuple[Any, ...]:
    """``value`` with per-input split counts as tuples; an error naming the field if bad."""
    if isinstance(value, str) and value in get_args(DatasetStrategy):
        return value
    entries_ok = isinstance(value, tuple | list) and all(
        isinstance(e, TensorLayout)
        or (
            isinstance(e, tuple | list)
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in e)
        )
        for e in value
    )
    if not entries_ok:
        raise _fail(
            "Plan.dataset_strategy",
            value,
            "must be 'data_parallel', 'full_batch' or a tuple of per-input strategies",
            "give ParallelConfig.dataset_strategy's value",
        )
    return tuple(e if isinstance(e, TensorLayout) else tuple(e) for e in value)  # type: ignore[union-attr]


def _dataset_strategy_data(value: str | tuple[Any, ...]) -> Any:
    if isinstance(value, str):
        return value
    return [_layout_data(e) if isinstance(e, TensorLayout) else list(e) for e in value]


def _dataset_strategy_from(top: Any, mesh: MeshSpec) -> str | tuple[Any, ...]:
    raw = top.get("dataset_strategy", (str, list), "a strategy name or list", "data_parallel")
    if isinstance(raw, str):
        return raw
    path = top.at("dataset_strategy")
    return tuple(
        _layout_from(e, f"{path}[{i}]", mesh)
        if isinstance(e, dict)
        else tuple(_int_list(f"{path}[{i}]", e))
        for i, e in enumerate(raw)
    )


def _comm_fusion_data(value: CommFusion | None) -> dict[str, Any] | None:
    if value is None:
        return None
    return {"mode": value.mode, "bucket_mb": value.bucket_mb, "boundaries": list(value.boundaries)}


def _comm_fusion_from(top: Any) -> CommFusion | None:
    raw = top.get("comm_fusion", (dict, type(None)), "an object or null", None)
    if raw is None:
        return None
    o = _Obj(raw, top.at("comm_fusion"))
    mode = o.get("mode", str, "'size' or 'index'")
    bucket_mb = o.get("bucket_mb", _NUMBER, "megabytes (a number)")
    boundaries = tuple(_int_list(o.at("boundaries"), o.get("boundaries", list, "a list")))
    o.done()
    return _build(
        top.at("comm_fusion"),
        lambda: CommFusion(mode=mode, bucket_mb=bucket_mb, boundaries=boundaries),  # type: ignore[arg-type]
    )


def _layout_data(layout: TensorLayout) -> dict[str, Any]:
    def tm(v: int | tuple[int, ...]) -> int | list[int]:
        return list(v) if isinstance(v, tuple) else v

    return {
        "dims": [list(axes) for axes in layout.dims],
        "partial": list(layout.partial),
        "reduce_op": layout.reduce_op,
        "tensor_map": [tm(v) for v in layout.tensor_map()],
    }


def _strategy_data(strategy: Strategy) -> list[list[int]]:
    return [list(cuts) for cuts in strategy]


def _op_data(op: PlannedOp) -> dict[str, Any]:
    return {
        "name": op.name,
        "target": op.target,
        "module": op.module_path,
        "layer": op.layer,
        "label": op.label,
        "covered": op.covered,
        "strategy": _strategy_data(op.strategy),
        "inputs": [_layout_data(t) for t in op.inputs],
        "outputs": [_layout_data(t) for t in op.outputs],
        "reason": op.reason,
        "alternatives": [
            {
                "label": a.label,
                "strategy": _strategy_data(a.strategy),
                "cost_s": a.cost_s,
                "note": a.note,
            }
            for a in op.alternatives
        ],
    }


def _param_data(p: PlannedParameter) -> dict[str, Any]:
    return {
        "shape": list(p.shape),
        "dtype": p.dtype,
        "layout": _layout_data(p.layout),
        "grad_reduce_axes": list(p.grad_reduce_axes),
        "op": p.op,
        "reason": p.reason,
    }


def _collective_data(c: PlannedCollective) -> dict[str, Any]:
    return {
        "kind": c.kind,
        "axes": list(c.axes),
        "phase": c.phase,
        "op": c.op,
        "nbytes": c.nbytes,
        "seconds": c.seconds,
        "count": c.count,
        "reason": c.reason,
    }


def _prediction_data(p: Prediction) -> dict[str, Any]:
    return {
        "step_time_s": p.step_time_s,
        "compute_s": p.compute_s,
        "communication_s": p.communication_s,
        "bubble_s": p.bubble_s,
        "memory_bytes": p.memory_bytes,
        "memory_by_kind": dict(p.memory_by_kind),
        "flops_per_step": p.flops_per_step,
    }


def _option_data(o: PlanOption) -> dict[str, Any]:
    return {
        "mesh": dict(o.mesh),
        "micro_batches": o.micro_batches,
        "optimizer_shard": o.optimizer_shard,
        "recompute": o.recompute,
        "step_time_s": o.step_time_s,
        "memory_bytes": o.memory_bytes,
        "feasible": o.feasible,
        "note": o.note,
    }


def _plan_to_data(plan: Plan) -> dict[str, Any]:
    return {
        "schema_version": plan.schema_version,
        "format": _FORMAT,
        "model": plan.model,
        "batch": [list(s) for s in plan.batch],
        "mesh": plan.mesh.as_dict(),
        "mode": plan.mode,
        "search": plan.search,
        "hardware": plan.hardware,
        "precision": plan.precision,
        "micro_batches": plan.micro_batches,
        "pipeline_stages": plan.pipeline_stages,
        "optimizer_shard": plan.optimizer_shard,
        "recompute": plan.recompute,
        "memory_limit": plan.memory_limit,
        "grad_accumulation": plan.grad_accumulation,
        "dp_axis": plan.dp_axis,
        "dataset_strategy": _dataset_strategy_data(plan.dataset_strategy),
        "comm_fusion": _comm_fusion_data(plan.comm_fusion),
        "predicted": _prediction_data(plan.predicted),
        "stages": [list(s) for s in plan.stages],
        "ops": [_op_data(op) for op in plan.ops],
        "parameters": {p.name: _param_data(p) for p in plan.parameters},
        "collectives": [_collective_data(c) for c in plan.collectives],
        "options": [_option_data(o) for o in plan.options],
        "notes": list(plan.notes),
    }


_WIDTH = 100


def _dump(value: Any, indent: int = 0) -> str:
    """JSON with small values on one line and big ones spread out, keys in insertion order.

    Deterministic by construction: only dicts built in a fixed order and lists reach it, and
    floats are written by ``float.__repr__`` (shortest round-tripping form).
    """
    if not isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    flat = _flat_within(value, _WIDTH - indent)
    if flat is not None:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [
            f"{pad}{json.dumps(k, ensure_ascii=False)}: {_dump(v, indent + 2)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + _dump(v, indent + 2) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _flat_within(value: Any, budget: int) -> str | None:
    """``json.dumps(value)`` on one line if it fits in ``budget`` characters, else None.

    Stops as soon as the budget is spent, so big plans are not dumped flat at every level.
    """
    if isinstance(value, dict):
        parts, used = [], 2
        for k, v in value.items():
            key = json.dumps(k, ensure_ascii=False)
            sub = _flat_within(v, budget - used - len(key) - 2)
            if sub is None:
                return None
            parts.append(f"{key}: {sub}")
            used += len(parts[-1]) + 2
        return "{" + ", ".join(parts) + "}" if used - 2 * bool(parts) <= budget else None
    if isinstance(value, list):
        parts, used = [], 2
        for v in value:
            sub = _flat_within(v, budget - used)
            if sub is None:
                return None
            parts.append(sub)
            used += len(sub) + 2
        return "[" + ", ".join(parts) + "]" if used - 2 * bool(parts) <= budget else None
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text if len(text) <= budget else None


# --------------------------------------------------------------------------- JSON reading


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PlanError(f"plan file repeats the key {key!r} in one object; keep one")
        out[key] = value
    return out


class _Obj:
    """Reads one JSON object of a plan file, naming ``path`` in every error."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, dict):
            raise _bad(path, data, "an object {...}")
        self.data, self.path, self.used = data, path, set()

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: type | tuple[type, ...], what: str, default: Any = ...) -> Any:
        if key not in self.data:
            if default is not ...:
                return default
            raise PlanError(f"plan file: {self.at(key)} is missing; add it (expected {what})")
        self.used.add(key)
        value = self.data[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
            raise _bad(self.at(key), value, what)
        return value

    def obj(self, key: str) -> _Obj:
        return _Obj(self.get(key, dict, "an object {...}"), self.at(key))

    def items(self, key: str, default: Any = ...) -> list[tuple[str, Any]]:
        """``(path, item)`` for each entry of list ``key``."""
        values = self.get(key, list, "a list [...]", default)
        return [(f"{self.at(key)}[{i}]", v) for i, v in enumerate(values)]

    def done(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise PlanError(
                f"plan file: {self.path or 'the top level'} has unknown field(s) {extra!r}; "
                f"remove them (schema_version {Plan.schema_version} does not define them)"
            )


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _bad(path: str, value: object, what: str) -> PlanError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return PlanError(f"plan file: {path} is {shown}; expected {what}; fix the file or plan again")


_NUMBER = (int, float)
_OPT_INT = (int, type(None))


def _build(path: str, make: Callable[[], Any]) -> Any:
    """Run a constructor, re-raising its validation error with the field path in front."""
    try:
        return make()
    except PlaitError as e:  # PlanError, LayoutError from a layout or mesh, ...
        raise PlanError(f"plan file: {path}: {e}") from None


def _str_list(path: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(path, value, "a list of strings")
    return tuple(value)


def _int_list(path: str, value: object) -> tuple[int, ...]:
    ok = isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )
    if not ok:
        raise _bad(path, value, "a list of integers")
    return tuple(value)  # type: ignore[arg-type]


def _strategy_from(path: str, value: object) -> Strategy:
    if not isinstance(value, list):
        raise _bad(path, value, "a list of lists of integers, e.g. [[2, 1], [1, 2]]")
    return tuple(_int_list(f"{path}[{i}]", v) for i, v in enumerate(value))


def _layout_from(data: object, path: str, mesh: MeshSpec) -> TensorLayout:
    o = _Obj(data, path)
    dims_raw = o.get("dims", list, "a list with one list of axis names per tensor dim")
    dims = tuple(_str_list(f"{o.at('dims')}[{i}]", d) for i, d in enumerate(dims_raw))
    partial = _str_list(o.at("partial"), o.get("partial", list, "a list of axis names"))
    reduce_op = o.get("reduce_op", str, "'sum', 'avg', 'max' or 'min'")
    if reduce_op not in get_args(ReduceOp):
        raise _bad(o.at("reduce_op"), reduce_op, "'sum', 'avg', 'max' or 'min'")
    tensor_map = o.get("tensor_map", list, "MindSpore's tensor map (a list)", None)
    o.done()
    layout = _build(path, lambda: TensorLayout(mesh, dims, partial, reduce_op))
    if tensor_map is not None and tensor_map != _layout_data(layout)["tensor_map"]:
        raise PlanError(
            f"plan file: {path}.tensor_map {tensor_map!r} disagrees with dims {list(map(list, dims))!r} "
            f"on mesh {mesh.as_dict()!r} (expected {_layout_data(layout)['tensor_map']!r}); "
            "edit dims and drop or fix tensor_map"
        )
    return layout


def _alternative_from(data: object, path: str) -> Alternative:
    o = _Obj(data, path)
    label = o.get("label", str, "a string")
    strategy = _strategy_from(o.at("strategy"), o.get("strategy", list, "a strategy list"))
    cost = o.get("cost_s", _NUMBER, "seconds (a number)")
    note = o.get("note", str, "a string", "")
    o.done()
    return _build(path, lambda: Alternative(label, strategy, cost, note))


def _op_from(data: object, path: str, mesh: MeshSpec) -> PlannedOp:
    o = _Obj(data, path)
    kw = {
        "name": o.get("name", str, "the op's name"),
        "target": o.get("target", str, "the op's target, e.g. 'aten.linear.default'"),
        "module_path": o.get("module", str, "a module path"),
        "layer": o.get("layer", (str, type(None)), "a layer name or null", None),
        "label": o.get("label", str, "a strategy label"),
        "covered": o.get("covered", bool, "true or false"),
        "strategy": _strategy_from(o.at("strategy"), o.get("strategy", list, "a strategy list")),
        "inputs": tuple(_layout_from(v, p, mesh) for p, v in o.items("inputs")),
        "outputs": tuple(_layout_from(v, p, mesh) for p, v in o.items("outputs")),
        "reason": o.get("reason", str, "a string"),
        "alternatives": tuple(_alternative_from(v, p) for p, v in o.items("alternatives", [])),
    }
    o.done()
    return _build(path, lambda: PlannedOp(**kw))


def _params_from(top: _Obj, mesh: MeshSpec) -> tuple[PlannedParameter, ...]:
    params = top.obj("parameters")
    out = []
    for name in params.data:
        o = params.obj(name)
        kw = {
            "name": name,
            "shape": _int_list(o.at("shape"), o.get("shape", list, "a list of integers")),
            "dtype": o.get("dtype", str, "a dtype name, e.g. 'float32'"),
            "layout": _layout_from(o.get("layout", dict, "a layout object"), o.at("layout"), mesh),
            "grad_reduce_axes": _str_list(
                o.at("grad_reduce_axes"), o.get("grad_reduce_axes", list, "axis names")
            ),
            "op": o.get("op", str, "the op that reads it first"),
            "reason": o.get("reason", str, "a string"),
        }
        o.done()
        out.append(_build(params.at(name), lambda kw=kw: PlannedParameter(**kw)))
    params.done()
    return tuple(out)


def _collective_from(data: object, path: str) -> PlannedCollective:
    o = _Obj(data, path)
    kw = {
        "kind": o.get("kind", str, f"one of {', '.join(COLLECTIVE_KINDS)}"),
        "axes": _str_list(o.at("axes"), o.get("axes", list, "a list of axis names")),
        "phase": o.get("phase", str, "'forward', 'backward' or 'optimizer'"),
        "op": o.get("op", str, "an op or parameter name"),
        "nbytes": o.get("nbytes", int, "bytes (an integer)"),
        "seconds": o.get("seconds", _NUMBER, "seconds (a number)"),
        "count": o.get("count", int, "an integer >= 1"),
        "reason": o.get("reason", str, "a string"),
    }
    o.done()
    return _build(path, lambda: PlannedCollective(**kw))


def _prediction_from(o: _Obj) -> Prediction:
    kinds = o.obj("memory_by_kind")
    kw = {
        "step_time_s": o.get("step_time_s", _NUMBER, "seconds"),
        "compute_s": o.get("compute_s", _NUMBER, "seconds"),
        "communication_s": o.get("communication_s", _NUMBER, "seconds"),
        "bubble_s": o.get("bubble_s", _NUMBER, "seconds"),
        "memory_bytes": o.get("memory_bytes", int, "bytes (an integer)"),
        "memory_by_kind": {k: kinds.get(k, int, "bytes (an integer)") for k in kinds.data},
        "flops_per_step": o.get("flops_per_step", int, "FLOPs (an integer)"),
    }
    o.done()
    return _build(o.path, lambda: Prediction(**kw))


def _option_from(data: object, path: str) -> PlanOption:
    o = _Obj(data, path)
    mesh = o.obj("mesh")
    kw = {
        "mesh": {k: mesh.get(k, int, "an axis size") for k in mesh.data},
        "micro_batches": o.get("micro_batches", int, "an integer >= 1"),
        "optimizer_shard": o.get("optimizer_shard", _OPT_INT, "1, 2, 3 or null"),
        "recompute": o.get("recompute", str, "'none', 'full' or 'selective'"),
        "step_time_s": o.get("step_time_s", _NUMBER, "seconds"),
        "memory_bytes": o.get("memory_bytes", int, "bytes (an integer)"),
        "feasible": o.get("feasible", bool, "true or false"),
        "note": o.get("note", str, "a string", ""),
    }
    o.done()
    return _build(path, lambda: PlanOption(**kw))


def _check_version(top: _Obj) -> None:
    if "schema_version" not in top.data:
        raise PlanError(
            "plan file has no schema_version: it is not a plait plan file (or was cut short); "
            "make one with plait.plan(...).save(path)"
        )
    version = top.get("schema_version", int, "an integer")
    if version != Plan.schema_version:
        newer = version > Plan.schema_version
        raise PlanError(
            f"plan file has schema_version {version}; this plait reads version "
            f"{Plan.schema_version} only; "
            + ("upgrade plait to read it" if newer else "plan again to write a current file")
        )
    fmt = top.get("format", str, repr(_FORMAT), _FORMAT)
    if fmt != _FORMAT:
        raise _bad("format", fmt, repr(_FORMAT))


def _mesh_from(top: _Obj) -> MeshSpec:
    mesh = top.obj("mesh")
    sizes = {k: mesh.get(k, int, "an axis size (integer >= 1)") for k in mesh.data}
    return _build("mesh", lambda: MeshSpec.from_dict(sizes))


def _plan_from_data(data: object) -> Plan:
    top = _Obj(data, "")
    _check_version(top)
    mesh = _mesh_from(top)
    kw = {
        "mesh": mesh,
        "model": top.get("model", str, "the model's class name", ""),
        "batch": tuple(_int_list(p, v) for p, v in top.items("batch", [])),
        "mode": top.get("mode", str, "a mode name"),
        "search": top.get("search", str, "a searcher name"),
        "hardware": top.get("hardware", str, "a hardware profile name"),
        "precision": top.get("precision", str, "'fp32', 'bf16' or 'fp16'"),
        "micro_batches": top.get("micro_batches", int, "an integer >= 1"),
        "pipeline_stages": top.get("pipeline_stages", int, "an integer >= 1"),
        "optimizer_shard": top.get("optimizer_shard", _OPT_INT, "1, 2, 3 or null"),
        "recompute": top.get("recompute", str, "'none', 'full' or 'selective'"),
        "memory_limit": top.get("memory_limit", _OPT_INT, "bytes or null", None),
        "grad_accumulation": top.get("grad_accumulation", int, "an integer >= 1", 1),
        "dp_axis": top.get("dp_axis", str, "a mesh axis name", "dp"),
        "dataset_strategy": _dataset_strategy_from(top, mesh),
        "comm_fusion": _comm_fusion_from(top),
        "predicted": _prediction_from(top.obj("predicted")),
        "stages": tuple(_str_list(p, v) for p, v in top.items("stages", [])),
        "ops": tuple(_op_from(v, p, mesh) for p, v in top.items("ops")),
        "parameters": _params_from(top, mesh),
        "collectives": tuple(_collective_from(v, p) for p, v in top.items("collectives")),
        "options": tuple(_option_from(v, p) for p, v in top.items("options", [])),
        "notes": _str_list("notes", top.get("notes", list, "a list of strings", [])),
    }
    top.done()
    return _build("the plan", lambda: Plan(**kw))


# --------------------------------------------------------------------------- human units


def fmt_seconds(s: float) -> str:
    """``0.01234`` -> ``'12.34 ms'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.2f} {unit}"
    return "0 s" if s == 0 else f"{s / 1e-9:.2f} ns"


def fmt_bytes(n: float) -> str:
    """``3 * 2**30`` -> ``'3.00 GiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_flops(n: float) -> str:
    """``1.5e12`` -> ``'1.50 TFLOP'``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} FLOP"


def _short_target(target: str) -> str:
    """``aten.linear.default`` -> ``linear``: the overload and namespace say little to people."""
    name = target.removeprefix("aten.")
    return name.removesuffix(".default")


def _strategy_text(strategy: Strategy) -> str:
    """Python's tuple form, as MindSpore writes strategies: ``((2, 1), (2,))``."""
    return repr(tuple(strategy))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


# --------------------------------------------------------------------------- summary


_LAYER_INDEX = re.compile(r"^(.*?)\.?(\d+)$")


def _layer_prefix(layer: str) -> str:
    """``blocks.3`` -> ``blocks``; a name without a trailing index is its own prefix."""
    match = _LAYER_INDEX.match(layer)
    return match.group(1) if match and match.group(1) else layer


def _layer_groups(plan: Plan) -> dict[str, list[str]]:
    """Representative layer -> its identical members (itself first), in graph order.

    Layers are identical when their ops, read in order with module paths relative to the
    layer, have the same targets, labels, strategies, coverage and output layouts: then one
    table row stands for all of them without hiding a difference.
    """
    ops_of: dict[str, list[PlannedOp]] = {}
    for op in plan.ops:
        if op.layer is not None:
            ops_of.setdefault(op.layer, []).append(op)
    groups: dict[tuple[object, ...], list[str]] = {}
    for layer, ops in ops_of.items():
        sig = tuple(
            (
                op.target,
                op.label,
                op.strategy,
                op.covered,
                op.module_path.removeprefix(layer),
                tuple(t.describe() for t in op.outputs),
            )
            for op in ops
        )
        groups.setdefault((_layer_prefix(layer), sig), []).append(layer)
    return {members[0]: members for members in groups.values()}


def _op_rows(plan: Plan) -> list[list[str]]:
    groups = _layer_groups(plan)
    rep_of = {m: rep for rep, members in groups.items() for m in members}
    rows: list[list[str]] = []
    headed: set[str] = set()
    for op in plan.ops:
        if op.layer is not None and rep_of[op.layer] != op.layer:
            continue
        if op.layer is not None and op.layer not in headed:
            headed.add(op.layer)
            members = groups[op.layer]
            span = f"{members[0]} .. {members[-1]}" if len(members) > 1 else members[0]
            rows.append([f"[{op.layer}] x{len(members)}", "", span, "", "", ""])
        outs = "; ".join(t.describe() for t in op.outputs)
        label = op.label if op.covered else f"{op.label} (no rule)"
        row = [
            op.name,
            _short_target(op.target),
            op.module_path,
            label,
            _strategy_text(op.strategy),
            outs,
        ]
        rows.append(row)
    return rows


def _header_lines(plan: Plan) -> list[str]:
    mesh = " x ".join(f"{a}={s}" for a, s in plan.mesh.as_dict().items())
    zero = "off" if plan.optimizer_shard is None else f"level {plan.optimizer_shard}"
    lines = [
        f"plan for {plan.model or 'model'} on mesh {mesh} ({plan.mesh.size} devices)",
        f"  mode {plan.mode}, search {plan.search or '-'}, hardware {plan.hardware}, "
        f"precision {plan.precision}",
        f"  micro-batches {plan.micro_batches}, pipeline stages {plan.pipeline_stages}, "
        f"optimizer shard {zero}, recompute {plan.recompute}",
    ]
    if plan.batch:
        per = (
            f" per micro-step, {plan.grad_accumulation} micro-steps (gradient accumulation)"
            if plan.grad_accumulation > 1
            else ""
        )
        lines.append("  batch " + ", ".join(str(s) for s in plan.batch) + per)
    return lines


def _prediction_lines(plan: Plan) -> list[str]:
    p = plan.predicted
    mem = f"  memory per device: {fmt_bytes(p.memory_bytes)} peak"
    if plan.memory_limit is not None:
        share = 100 * p.memory_bytes / plan.memory_limit
        verdict = "fits" if p.memory_bytes <= plan.memory_limit else "DOES NOT FIT"
        mem += f" of {fmt_bytes(plan.memory_limit)} limit ({share:.0f}%, {verdict})"
    kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in p.memory_by_kind.items())
    return [
        "predicted",
        f"  step time {fmt_seconds(p.step_time_s)}: compute {fmt_seconds(p.compute_s)}, "
        f"communication {fmt_seconds(p.communication_s)}, bubble {fmt_seconds(p.bubble_s)}",
        mem + (f": {kinds}" if kinds else ""),
        f"  FLOPs per step {fmt_flops(p.flops_per_step)}",
    ]


def _uncovered_lines(plan: Plan) -> list[str]:
    by_target: dict[str, list[str]] = {}
    for op in plan.ops:
        if not op.covered:
            by_target.setdefault(op.target, []).append(op.name)
    if not by_target:
        return []
    n = sum(map(len, by_target.values()))
    lines = [f"replicated: no rule ({n} op{'s' if n > 1 else ''})"]
    for target, names in by_target.items():
        lines.append(f"  {target} x{len(names)}: {_few(names, 3)}")
    return lines


def _collective_lines(plan: Plan) -> list[str]:
    if not plan.collectives:
        return ["collectives: none"]
    totals: dict[tuple[str, str, tuple[str, ...]], list[float]] = {}
    for c in plan.collectives:
        t = totals.setdefault((c.phase, c.kind, c.axes), [0, 0, 0.0])
        t[0] += c.count
        t[1] += c.total_bytes
        t[2] += c.total_seconds
    order = sorted(totals, key=lambda k: (PHASES.index(k[0]), k[1], k[2]))
    rows = []
    for phase, kind, axes in order:
        count, nbytes, seconds = totals[(phase, kind, axes)]
        row = [kind, ",".join(axes) or "-", phase, str(int(count)), fmt_bytes(nbytes)]
        rows.append([*row, fmt_seconds(seconds)])
    return [
        "collectives per step",
        *_table(["kind", "axes", "phase", "count", "bytes", "time"], rows),
    ]


def _extra_lines(plan: Plan) -> list[str]:
    lines = []
    if plan.stages:
        lines.append("pipeline stages")
        lines += [f"  {s}: {_few(list(stage), 4)}" for s, stage in enumerate(plan.stages)]
    if plan.options:
        rows = [
            [
                " x ".join(f"{a}={n}" for a, n in o.mesh.items()),
                str(o.micro_batches),
                str(o.optimizer_shard or "-"),
                o.recompute,
                fmt_seconds(o.step_time_s),
                fmt_bytes(o.memory_bytes),
                "yes" if o.feasible else "no",
                o.note,
            ]
            for o in plan.options
        ]
        headers = ["mesh", "micro", "zero", "recompute", "step", "memory", "fits", "note"]
        lines += ["options weighed", *_table(headers, rows)]
    if plan.notes:
        lines += ["notes", *(f"  {n}" for n in plan.notes)]
    return lines


def _summary_lines(plan: Plan) -> list[str]:
    rows = _op_rows(plan)
    shown = sum(1 for r in rows if not r[0].startswith("["))
    title = f"ops ({len(plan.ops)}"
    title += f", {shown} shown: repeated layers as one)" if shown < len(plan.ops) else ")"
    headers = ["op", "target", "module", "label", "strategy", "output layout"]
    return [
        *_header_lines(plan),
        *_prediction_lines(plan),
        title,
        *_table(headers, rows),
        *_uncovered_lines(plan),
        *_collective_lines(plan),
        *_extra_lines(plan),
    ]


# --------------------------------------------------------------------------- explain


def _collectives_at(plan: Plan, names: Iterable[str]) -> list[str]:
    wanted = set(names)
    lines = []
    for c in plan.collectives:
        if c.op in wanted:
            axes = ",".join(c.axes) or "-"
            times = f" x{c.count}" if c.count > 1 else ""
            lines.append(
                f"  {c.phase} {c.kind} over {axes}{times}: {fmt_bytes(c.nbytes)}, "
                f"{fmt_seconds(c.seconds)} each ({c.op}: {c.reason})"
            )
    return lines or ["  none"]


def _explain_options(plan: Plan) -> list[str]:
    lines = [f"mesh {plan.mesh.as_dict()!r}: why"]
    lines += [f"  {note}" for note in plan.notes]
    if plan.options:
        lines.append("best options weighed (step time, memory per device, fits)")
        for o in plan.options[:5]:
            zero = "off" if o.optimizer_shard is None else o.optimizer_shard
            lines.append(
                f"  {o.mesh!r} micro-batches {o.micro_batches}, optimizer shard {zero}, recompute "
                f"{o.recompute}: {fmt_seconds(o.step_time_s)}, {fmt_bytes(o.memory_bytes)}, "
                f"{'fits' if o.feasible else 'does not fit'}{' (' + o.note + ')' if o.note else ''}"
            )
    return lines


def _explain_op(plan: Plan, op: PlannedOp) -> list[str]:
    lines = [
        f"op {op.name}: {op.target} in module {op.module_path or '(root)'}"
        + (f", layer {op.layer}" if op.layer else ""),
        f"  strategy {_strategy_text(op.strategy)} ({op.label})"
        + ("" if op.covered else ": no rule in the catalogue, replicated"),
        f"  reason: {op.reason}",
    ]
    lines += [f"  input {i}: {t.describe()}" for i, t in enumerate(op.inputs)]
    lines += [f"  output {i}: {t.describe()}" for i, t in enumerate(op.outputs)]
    params = [p.name for p in plan.parameters if p.op == op.name]
    if params:
        lines.append(f"  parameters read first here: {', '.join(params)}")
    lines.append("alternatives")
    lines += [
        f"  {a.label} {_strategy_text(a.strategy)}: {fmt_seconds(a.cost_s)}"
        + (f" ({a.note})" if a.note else "")
        for a in op.alternatives
    ] or ["  none recorded"]
    return [*lines, "collectives", *_collectives_at(plan, [op.name])]


def _explain_param(plan: Plan, p: PlannedParameter) -> list[str]:
    try:
        local = f", {p.layout.local_shape(p.shape)!r} per device"
    except PlaitError:
        local = ", does not divide evenly (see validate)"
    reduce = ", ".join(p.grad_reduce_axes) or "none (each device owns its piece)"
    lines = [
        f"parameter {p.name}: {p.shape!r} {p.dtype}",
        f"  layout {p.layout.describe()} (tensor_map {p.layout.tensor_map()!r}){local}",
        f"  gradient summed over: {reduce}",
        f"  read first by op {p.op or '(none)'}",
        f"  reason: {p.reason}",
    ]
    if p.op in plan._ops:
        op = plan._ops[p.op]
        lines.append(f"  that op runs {_strategy_text(op.strategy)} ({op.label}): {op.reason}")
        lines += ["alternatives of that op"]
        lines += [
            f"  {a.label} {_strategy_text(a.strategy)}: {fmt_seconds(a.cost_s)}"
            for a in op.alternatives
        ] or ["  none recorded"]
    return [*lines, "collectives", *_collectives_at(plan, [p.name])]


def _explain_module(plan: Plan, module: str) -> list[str]:
    ops = _module_ops(plan, module)
    params = [p for p in plan.parameters if _in_module(p.name.rpartition(".")[0], module)]
    lines = [f"module {module}: {len(ops)} ops, {len(params)} parameters"]
    rows = [
        [
            op.name,
            _short_target(op.target),
            op.label if op.covered else "replicate (no rule)",
            _strategy_text(op.strategy),
            "; ".join(t.describe() for t in op.outputs),
            op.reason,
        ]
        for op in ops
    ]
    lines += _table(["op", "target", "label", "strategy", "output layout", "reason"], rows)
    if params:
        lines.append("parameters")
        prow = [
            [p.name, str(p.shape), p.layout.describe(), ",".join(p.grad_reduce_axes) or "-"]
            for p in params
        ]
        lines += _table(["name", "shape", "layout", "grad reduced over"], prow)
    names = [op.name for op in ops] + [p.name for p in params]
    return [*lines, "collectives", *_collectives_at(plan, names)]
