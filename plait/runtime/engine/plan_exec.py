"""Running a :class:`~plait.Plan` operator by operator (MindSpore's ``step_parallel``).

The model and its loss are exported once (:func:`plait.graph.capture_program`, on fake
tensors: no parameter is copied) and the exported graph is run by an fx interpreter whose
inputs are the user's own parameters, turned into DTensors with the plan's layouts, the
model's buffers (replicated) and the batch (laid out as the plan's inputs). For every op the
plan lists:

1. each tensor input is redistributed to the op's planned input layout, where it differs, with
   the planned steps (:func:`plait.comm.redistribute.execute_redistribution`: the collective
   kinds are the plan's); a value redistributed to one layout is reused by later readers;
2. the op runs on DTensors; DTensor's propagation from those inputs gives the output layout,
   which is checked against the planned output (a difference is recorded in
   :attr:`PlanExecutor.mismatches` and, with ``strict=True``, raised);
3. ops without a rule in plait's catalogue run on whole (replicated) tensors, as planned.

Backward is DTensor's autograd: a redistribution's backward brings the gradient to its
source's layout with a planned redistribution; elsewhere DTensor reduces pending sums where
the next op needs it. Parameter gradients left pending over an axis (the plan's
``grad_reduce_axes``) are reduced by the Job: over the data-parallel axis in fused buckets
(:class:`~plait.runtime.program.grad_sync.GradSync`), over other axes one by one (``sync_grad``).

Evaluation (``model.eval()``, as ``Job.evaluate`` sets it) runs the model's evaluation-mode
program: the model is exported a second time in eval mode, so dropout is off, batch norm reads
its running statistics and updates no buffer, and any ``if self.training`` branch of the
user's code is taken as on one device. Its ops are matched to planned ones by module, target
and occurrence, and keep the plan's strategies where the call is the same or the strategy is
valid for it too; any other op runs replicated (:func:`evaluation_plan`). ``Job.evaluate``
runs it as a per-rank program of its own (the forward alone, traced once per batch shape, with
ZeRO-3's gathers: :mod:`plait.runtime.engine.plan_job`), as a step runs the training program;
so does
``job.predict`` the model's eval-mode forward without its loss (:meth:`PlanExecutor.predictor`),
its outputs the program's.

:func:`plait.runtime.engine.plan_job.build_plan_job` builds the
:class:`~plait.runtime.engine.job.Job` for a plan around this executor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from plait._compat import tree_unflatten
from plait.comm.dtensor import (
    DeviceMesh,
    distribute,
    from_local_piece,
    full_value,
    is_dtensor,
    layout_of,
    local_piece,
    to_dtensor_placements,
    with_contiguous_local,
)
from plait.comm.redistribute import (
    execute_redistribution,
    redistribute_to,
    replicated_from_local,
    settled,
)
from plait.errors import CaptureError, PlanError, ShardingError
from plait.graph import (
    AUTOCAST_META,
    GRAD_ENABLED_META,
    ExecutableCapture,
    OpGraph,
    OpNode,
    batch_leaves,
    capture_program,
    in_mode,
)
from plait.graph.convert import EXPORT_ASSERTIONS
from plait.layout import TensorLayout
from plait.layout.redistribute import plan_redistribution
from plait.mesh import MeshSpec
from plait.planning import Plan, PlannedOp
from plait.rules.catalogue import default_catalogue
from plait.rules.loss import divides_by_target_count
from plait.rules.pooling import pooling_rules
from plait.rules.registry import OpStrategy, grad_reduce_axes, replicated_strategy
from plait.runtime.engine.job import LossFn
from plait.runtime.engine.meta_init import capture_on_device
from plait.runtime.engine.predict import batch_key, meta_stand_ins
from plait.runtime.program.compile import strip_wrapper
from plait.runtime.program.zero import (
    gathered_onto,
)
from plait.search.constraints import batch_layouts

__all__ = [
    "LayoutMismatch",
    "PlanExecutor",
    "capture_in_mode",
    "check_plan_fits",
    "evaluation_plan",
]

logger = logging.getLogger(__name__)

# Ops run on local pieces as plait's rule says: with the planned input layouts the local op
# computes this rank's piece of the output, or its share of a pending sum. DTensor has no
# strategy for the CPU kernel of attention and shards convolutions on the batch only; for the
# matmul family its own strategy choice may differ from the plan's (a split sequence dim of a
# 3-D linear input is gathered by its flattening decomposition), and its search for batched
# matmuls on 4-D operands costs seconds per shape. Torch 2.13's DTensor has no strategy for
# the backward of average, adaptive-max and 3-D pooling, and runs group norm's backward with
# the global sizes on local pieces: pooling (spatial dims never split) and group norm (whole
# groups per rank) run locally too, and a parameter server's lookup (plait.ps.ops: each rank
# pulls the rows of its own ids; DTensor knows nothing of the op).
_GROUP_NORM = "aten.group_norm.default"
_EMBEDDING = "aten.embedding.default"
_POOLING = frozenset(t for rule in pooling_rules() for t in rule.targets)
_LOCAL_BY_RULE = _POOLING | frozenset(
    {
        _GROUP_NORM,
        "aten.scaled_dot_product_attention.default",
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv3d.default",
        "aten.convolution.default",
        "aten.linear.default",
        "aten.matmul.default",
        "aten.mm.default",
        "aten.bmm.default",
        "aten.addmm.default",
        "aten.baddbmm.default",
        "plait.ps_lookup.default",
    }
)

# Composite ops whose schema does not say that they update inputs in place: argument
# positions they write (running mean and variance of batch and instance norms in training).
_UPDATES_INSIDE = {
    "aten.batch_norm.default": (3, 4),
    "aten.instance_norm.default": (3, 4),
}


@dataclass(frozen=True, slots=True)
class LayoutMismatch:
    """An op whose DTensor output layout differs from the plan's (the value was moved to it)."""

    op: str
    output: int
    planned: TensorLayout
    actual: TensorLayout

    def describe(self) -> str:
        return (
            f"{self.op} output {self.output}: planned {self.planned.describe()}, DTensor "
            f"gave {self.actual.describe()}"
        )


def check_plan_fits(plan: Plan, graph: OpGraph) -> None:
    """The plan names the graph's ops, with the same targets, in a form the executor runs.

    Raises PlanError naming the first ops that differ (the model changed since planning, or
    the plan is for another model), and for pipeline plans, which this executor does not run.
    """
    if plan.pipeline_stages != 1:
        raise PlanError(
            f"plan has pipeline_stages={plan.pipeline_stages}: the operator executor runs "
            "plans without pipeline stages; plan again with pipeline_stages=1"
        )
    problems: list[str] = []
    planned = {op.name: op for op in plan.ops}
    for op in graph.ops:
        found = planned.get(op.name)
        if found is None:
            problems.append(f"op {op.name!r} ({op.target}) of the model is not in the plan")
        elif found.target != op.target:
            problems.append(
                f"op {op.name!r} is {op.target} in the model but {found.target} in the plan"
            )
        elif len(found.inputs) != len(op.inputs) or len(found.outputs) != len(op.outputs):
            problems.append(
                f"op {op.name!r} has {len(op.inputs)} inputs and {len(op.outputs)} outputs in "
                f"the model but {len(found.inputs)} and {len(found.outputs)} in the plan"
            )
    extra = sorted(set(planned) - {op.name for op in graph.ops})
    if extra:
        problems.append(f"plan ops the model does not run: {extra[:6]}")
    if problems:
        shown = "\n  - ".join(problems[:8])
        raise PlanError(
            f"plan for {plan.model or 'the model'} does not match the model's ops "
            f"({len(problems)} problems):\n  - {shown}\nplan again for this model and batch shape"
        )


class PlanExecutor:
    """Runs ``loss_fn(model, batch)`` as the plan says, op by op, on DTensors.

    Build it before the parameters become DTensors (the export reads the model as given);
    call it as the Job's loss function: ``executor(model, batch)`` returns the loss DTensor.

    Args:
        model: the user's model (its parameters are read at every call, so the DTensors the
            job installs and the optimizer updates are the ones used).
        plan: the plan to run; it must match the model's captured ops (:func:`check_plan_fits`).
        example_batch: a batch of the shape training will use (only shapes are read).
        loss_fn: ``loss_fn(model, batch)`` -> scalar loss, as for ``parallelize``.
        device_mesh: the DeviceMesh of ``plan.mesh``.
        dp_axis, dataset_strategy: how the batch is laid out (ParallelConfig's fields).
        strict: raise ShardingError when DTensor's output layout differs from the plan's,
            instead of redistributing to the planned layout and recording the difference.
        captured: the model's :func:`~plait.graph.capture_program` in its current mode,
            when the caller has it (otherwise the model is exported here).
        evaluation: also export the model in eval mode, run when ``model.training`` is False
            (see the module docstring); False for that evaluation executor itself.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        example_batch: Any,
        loss_fn: LossFn | None,
        device_mesh: DeviceMesh,
        *,
        dp_axis: str = "dp",
        dataset_strategy: object = "data_parallel",
        strict: bool = False,
        captured: ExecutableCapture | None = None,
        evaluation: bool = True,
    ) -> None:
        self.plan = plan
        self.device_mesh = device_mesh
        self.strict = strict
        self._dp_axis = dp_axis
        self._dataset_strategy = dataset_strategy
        self.captured = captured or capture_in_mode(model, example_batch, loss_fn, training=True)
        check_plan_fits(plan, self.captured.graph)
        self.input_layouts = batch_layouts(
            self.captured.graph, plan.mesh, dp_axis, dataset_strategy
        )
        self._planned = {op.name: op for op in plan.ops}
        self._signature = self.captured.program.graph_signature
        # Per-node decisions, made once: a training step only looks them up.
        self._steps = _node_steps(self.captured, self._planned)
        self._sources = _input_sources(self._signature)
        self._batch_names = [g.name for g in self.captured.graph.inputs if g.kind == "input"]
        self._example_leaves = batch_leaves(example_batch)
        self._batch_shapes = [
            tuple(g.meta.shape) for g in self.captured.graph.inputs if g.kind == "input"
        ]
        self._interpreter: _PlanInterpreter | None = None  # built at the first call, reused
        self._owners_of: tuple[nn.Module, list[tuple[Any, str]]] | None = None
        self.mismatches: list[LayoutMismatch] = []
        """Ops whose DTensor output layout differed from the plan (first call records)."""
        self._seen_mismatch: set[tuple[str, int]] = set()
        self._evaluation: PlanExecutor | CaptureError | None = None
        self.predictors: dict[tuple[Any, ...], PlanExecutor] = {}
        """job.predict's executors by batch structure and shapes (:meth:`predictor`)."""
        if evaluation:
            self._evaluation = self._evaluation_executor(model, example_batch, loss_fn)

    def _evaluation_executor(
        self, model: nn.Module, example_batch: Any, loss_fn: LossFn | None
    ) -> PlanExecutor | CaptureError | None:
        """The executor of the model's eval-mode program; None when it is the training one.

        Exported now, while the parameters are still the user's tensors (export cannot trace
        DTensor parameters). A model that does not export in eval mode keeps the error, raised
        by the first evaluation, so training is not refused for it.
        """
        try:
            # a meta model (meta init) is exported all on meta, run on the mesh's device
            device = torch.device(self.device_mesh.device_type)
            captured = capture_on_device(
                model, example_batch, loss_fn, training=False, device=device
            )
            if captured.program.graph_module.code == self.captured.program.graph_module.code:
                return None  # no mode-dependent op: evaluation runs the training program
            executor = PlanExecutor(
                model,
                evaluation_plan(self.plan, captured.graph, self.captured.graph),
                example_batch,
                loss_fn,
                self.device_mesh,
                dp_axis=self._dp_axis,
                dataset_strategy=self._dataset_strategy,
                strict=self.strict,
                captured=captured,
                evaluation=False,
            )
        except Exception as e:  # training must not be refused for its evaluation program
            logger.warning("plan executor: no evaluation program (%s: %s)", type(e).__name__, e)
            return CaptureError(f"{type(e).__name__}: {e}")
        executor.mismatches = self.mismatches  # one record of layout differences
        executor._seen_mismatch = self._seen_mismatch
        return executor

    # ------------------------------------------------------------------ inputs

    def buffer_layouts(self) -> dict[str, TensorLayout]:
        """Where each buffer lives: in the layout of the op that updates it in place (batch
        norm's running statistics split with its channels), so updates need no collective;
        other buffers are replicated (the plan reads them locally, in any layout)."""
        graph = self.captured.graph
        nodes = {n.name: n for n in self.captured.program.graph.nodes}
        node_of_op = {op: node for node, op in self.captured.op_of_node.items()}
        out: dict[str, TensorLayout] = {}
        for g in graph.inputs:
            if g.kind != "buffer":
                continue
            for op, i in graph.consumers(g.name):
                if _writes_input(nodes[node_of_op[op.name]], i):
                    out[g.target] = settled(self._planned[op.name].inputs[i])
                    break
        return out

    def _flat_inputs(self, model: nn.Module, batch: Any) -> list[Any]:
        """The exported program's inputs, in its order: parameters, buffers, constants, batch."""
        user = batch_leaves(batch)
        batch_names = self._batch_names
        owners = self._owners(model)
        out: list[Any] = []
        k = 0  # position among user inputs
        t = 0  # position among the batch's tensors
        for kind, target in self._sources:
            if kind == InputKind.USER_INPUT:
                value = user[k]
                k += 1
                if isinstance(value, torch.Tensor):
                    self._check_batch_shape(value, t)
                    value = self._batch_tensor(value, self.input_layouts[batch_names[t]])
                    t += 1
                else:
                    self._check_batch_constant(value, k - 1)
                out.append(value)
            elif kind == InputKind.PARAMETER:
                out.append(getattr(*owners[len(out)]))
            elif kind == InputKind.BUFFER:
                out.append(self._replicated(getattr(*owners[len(out)])))
            else:  # a constant tensor (_input_sources refuses other kinds)
                out.append(self._replicated(self.captured.program.constants[target]))
        return out

    def _check_batch_shape(self, value: torch.Tensor, t: int) -> None:
        """The program was exported for one batch shape: another one is refused by name."""
        expected = self._batch_shapes[t]
        if tuple(value.shape) != expected:
            raise ShardingError(
                f"batch tensor {t} has global shape {tuple(value.shape)} but the plan's program "
                f"runs {expected} (the shape it was planned and exported for, one micro-step "
                "with gradient accumulation); a job running a given plan (a Plan or plan "
                "file) takes the batch shapes it was made for: cut the batch to them, or plan "
                "again for this batch size (jobs plait plans, modes semi_auto and auto, plan "
                "again for a new shape by themselves)"
            )

    def _check_batch_constant(self, value: Any, k: int) -> None:
        """Python values of the batch were baked into the program: another one is refused."""
        example = self._example_leaves[k]
        if type(value) is not type(example) or value != example:
            raise ShardingError(
                f"batch leaf {k} is {value!r} but the plan's program was exported with "
                f"{example!r}: Python values in the batch (numbers, flags, strings) are fixed "
                "when the model is exported, and a job running a given plan (a Plan or plan "
                "file) runs its own values only; pass a 0-d tensor instead, or keep the value"
            )

    def _owners(self, model: nn.Module) -> list[tuple[Any, str]]:
        """Per exported input that is a parameter or buffer: (its module, its attribute name).

        Resolved once per model (``get_parameter`` walks the path at every call); the values
        themselves are read at every call, so replaced parameters (DTensors) are the ones used.
        """
        if self._owners_of is not None and self._owners_of[0] is model:
            return self._owners_of[1]
        owners: list[tuple[Any, str]] = []
        for kind, target in self._sources:
            if kind in (InputKind.PARAMETER, InputKind.BUFFER):
                assert target is not None
                get = model.get_parameter if kind == InputKind.PARAMETER else model.get_buffer
                get(target)  # raises as before when the model has no such parameter or buffer
                prefix, _, name = target.rpartition(".")
                owners.append((model.get_submodule(prefix) if prefix else model, name))
            else:
                owners.append((None, ""))
        self._owners_of = (model, owners)
        return owners

    def _replicated(self, value: torch.Tensor) -> torch.Tensor:
        if is_dtensor(value):
            return value
        layout = TensorLayout.replicated(self.plan.mesh, value.ndim)
        return distribute(value, self.device_mesh, layout)

    def _batch_tensor(self, value: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        if not is_dtensor(value):
            return distribute(value, self.device_mesh, layout)
        have = layout_of(value)  # type: ignore[arg-type]
        if have == layout:
            return value  # type: ignore[return-value]
        redistribution = plan_redistribution(have, layout, tuple(value.shape), value.element_size())
        return execute_redistribution(value, redistribution)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ running

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of ``batch`` (a DTensor), computed as the plan says; with the model in eval
        mode, by its evaluation-mode program."""
        if not model.training and self._evaluation is not None:
            return self.evaluator(model)(model, batch)
        interpreter = self._interpreter
        if interpreter is None:
            interpreter = self._interpreter = _PlanInterpreter(self)
        try:
            outputs = interpreter.run(*self._flat_inputs(model, batch), enable_io_processing=False)
        finally:
            interpreter.forget()  # values of this call are not kept alive until the next
        outputs = outputs if isinstance(outputs, tuple | list) else (outputs,)
        loss: Any = None
        for spec, value in zip(self._signature.output_specs, outputs, strict=True):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                _write_buffer(model, strip_wrapper(spec.target), value)
            elif loss is None and spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
                loss = value
        return loss

    def evaluator(self, model: nn.Module) -> PlanExecutor:
        """The executor of the model's eval-mode program: its own, or this one where the
        training program has no mode-dependent op. A model whose eval-mode program could not
        be exported is refused here, by name."""
        if isinstance(self._evaluation, CaptureError):
            raise CaptureError(
                f"evaluating {type(model).__name__}: its eval-mode program could not be "
                f"prepared when the job was built ({self._evaluation}); make the forward "
                "under model.eval() exportable (torch.export, as in training), or evaluate "
                "on one device"
            ) from self._evaluation
        return self if self._evaluation is None else self._evaluation

    def run_flat(self, values: list[Any]) -> tuple[Any, ...]:
        """The exported program on ``values`` (its inputs, laid out): its outputs, as a tuple.

        This is what :func:`plait.runtime.program.compile.compile_program` traces into the per-rank
        program; a training step runs that program, not this.
        """
        interpreter = self._interpreter
        if interpreter is None:
            interpreter = self._interpreter = _PlanInterpreter(self)
        try:
            outputs = interpreter.run(*values, enable_io_processing=False)
        finally:
            interpreter.forget()
        return tuple(outputs) if isinstance(outputs, tuple | list) else (outputs,)

    def example_flat_inputs(self, model: nn.Module) -> list[Any]:
        """Inputs of the planned shapes for tracing: the model's own parameters, buffers and
        constants, and zero batch tensors laid out as planned (only shapes are read).

        A parameter that no longer has its planned layout (ZeRO-3 keeps each rank's shard
        only once the first program is compiled) is stood in for by an empty tensor of the
        planned layout: the program reads parameters as the plan lays them out.
        """
        owners = self._owners(model)
        planned = {p.name: p.layout for p in self.plan.parameters}
        out: list[Any] = []
        k = t = 0
        for kind, target in self._sources:
            if kind == InputKind.USER_INPUT:
                example = self._example_leaves[k]
                k += 1
                if isinstance(example, torch.Tensor):
                    layout = self.input_layouts[self._batch_names[t]]
                    local = [
                        s // n for s, n in zip(self._batch_shapes[t], layout.splits(), strict=True)
                    ]
                    zeros = torch.zeros(local, dtype=example.dtype)
                    out.append(from_local_piece(zeros, self.device_mesh, layout))
                    t += 1
                else:
                    out.append(example)
            elif kind == InputKind.PARAMETER:
                value = getattr(*owners[len(out)])
                want = planned.get(target or "")
                if want is not None and is_dtensor(value) and layout_of(value) != want:
                    local = [s // n for s, n in zip(value.shape, want.splits(), strict=True)]
                    empty = torch.empty(local, dtype=value.dtype, device=local_piece(value).device)
                    value = from_local_piece(empty, self.device_mesh, want)
                out.append(value)
            elif kind == InputKind.BUFFER:
                out.append(self._replicated(getattr(*owners[len(out)])))
            else:
                out.append(self._replicated(self.captured.program.constants[target]))
        return out

    def accepts(self, batch: Any) -> bool:
        """Whether ``batch`` (laid out: global shapes) has the tensor shapes and the Python
        values this executor's program was exported for."""
        leaves = batch_leaves(batch)
        if len(leaves) != len(self._example_leaves):
            return False
        shapes = iter(self._batch_shapes)
        for value, example in zip(leaves, self._example_leaves, strict=True):
            if isinstance(value, torch.Tensor) != isinstance(example, torch.Tensor):
                return False
            if isinstance(value, torch.Tensor):
                if tuple(value.shape) != next(shapes):
                    return False
            elif type(value) is not type(example) or value != example:
                return False
        return True

    def predictor(self, model: nn.Module, batch: Any) -> PlanExecutor:
        """The executor of the model's eval-mode forward (no loss) on batches shaped like
        ``batch``, for ``job.predict``: made at the first such batch, then reused.

        The forward is captured on meta stand-ins of the parameters (no rank builds the whole
        model) and runs with this plan's strategies wherever they fit the same op
        (:func:`evaluation_plan`); the batch is split over the data-parallel axis where its
        dim 0 divides, else whole on every rank.
        """
        key = batch_key(batch)
        found = self.predictors.get(key)
        if found is not None:
            return found
        with meta_stand_ins(model):
            captured = capture_on_device(
                model,
                batch,
                None,
                training=False,
                device=torch.device(self.device_mesh.device_type),
            )
        plan = evaluation_plan(self.plan, captured.graph, self.captured.graph)
        inputs = [g for g in captured.graph.inputs if g.kind == "input"]
        axis = self._dp_axis
        dp = plan.mesh.axis_size(axis) if axis in plan.mesh.axis_names else 1
        strategy: object = "data_parallel"
        if not all(g.meta.ndim == 0 or g.meta.shape[0] % dp == 0 for g in inputs):
            strategy = tuple((1,) * g.meta.ndim for g in inputs)  # whole on every rank
        executor = PlanExecutor(
            model, plan, batch, None, self.device_mesh, dp_axis=axis, dataset_strategy=strategy,
            strict=self.strict, captured=captured, evaluation=False,
        )  # fmt: skip
        logger.info(
            "job.predict: forward for batch shapes %s captured (%d ops, %d run replicated)",
            [g.meta.shape for g in inputs],
            len(plan.ops),
            sum(op.label == "replicate" for op in plan.ops),
        )
        self.predictors[key] = executor
        return executor

    def outputs(self, model: nn.Module, batch: Any) -> Any:
        """The exported forward's own outputs on ``batch`` (DTensors in the structure the model
        returns: a tensor, a tuple, a Hugging Face ``ModelOutput``)."""
        values = self.run_flat(self._flat_inputs(model, batch))
        for spec, value in zip(self._signature.output_specs, values, strict=True):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                _write_buffer(model, strip_wrapper(spec.target), value)
        user = [
            value
            for spec, value in zip(self._signature.output_specs, values, strict=True)
            if spec.kind == OutputKind.USER_OUTPUT
        ]
        return tree_unflatten(user, self.captured.program.call_spec.out_spec)

    def flat_inputs(self, model: nn.Module, batch: Any) -> list[Any]:
        """The exported program's inputs for ``batch``, laid out as planned (DTensors)."""
        return self._flat_inputs(model, batch)

    def planned(self, node_name: str) -> PlannedOp | None:
        op = self.captured.op_of_node.get(node_name)
        return None if op is None else self._planned[op]

    def note_mismatch(self, op: PlannedOp, k: int, actual: TensorLayout) -> None:
        planned = op.outputs[k]
        if self.strict:
            raise ShardingError(
                f"op {op.name!r} ({op.target}): torch.Tensor gives output {k} the layout "
                f"{actual.describe()} but the plan says {planned.describe()}; the plan's rule "
                "and DTensor's disagree: fix the rule in plait/rules, or run with strict=False "
                "to redistribute to the planned layout"
            )
        if (op.name, k) not in self._seen_mismatch:
            self._seen_mismatch.add((op.name, k))
            self.mismatches.append(LayoutMismatch(op.name, k, planned, actual))
            logger.warning("plan executor: %s", self.mismatches[-1].describe())


def capture_in_mode(
    model: nn.Module, example_batch: Any, loss_fn: LossFn | None, *, training: bool
) -> ExecutableCapture:
    """:func:`~plait.graph.capture_program` with the model in training or eval mode
    (:func:`~plait.graph.in_mode`): Job.step runs under ``model.train()`` and Job.evaluate
    under ``model.eval()``, so their programs are exported so."""
    with in_mode(model, training=training):
        return capture_program(model, example_batch, loss_fn)


def evaluation_plan(plan: Plan, graph: OpGraph, training: OpGraph) -> Plan:
    """``plan`` (made for ``training``, the model's training-mode graph) for ``graph``, its
    evaluation-mode graph (same parameters).

    Ops are matched by module, target and occurrence within the module (so an op that only
    training runs, a dropout or a drop-path, shifts nothing outside its module). A matched op
    keeps its planned strategy when it has the same arguments and shapes, or when that
    strategy is also one of the catalogue's strategies for the evaluation op (batch norm with
    running statistics accepts training's channel split); any other op runs replicated, as an
    op without a rule does. Each parameter is read first by its first reader in ``graph`` (none
    for a parameter only training reads). Collectives are not listed: they are the training
    step's.
    """
    planned = {op.name: op for op in plan.ops}
    trained = {key: op for key, op in _keyed_ops(training)}
    ops = []
    for key, op in _keyed_ops(graph):
        match = trained.get(key)
        found = None if match is None else planned.get(match.name)
        ops.append(_evaluation_op(op, found, match, plan.mesh))
    readers = {
        g.target: next((reader.name for reader, _ in graph.consumers(g.name)), "")
        for g in graph.inputs
        if g.kind == "parameter"
    }
    parameters = tuple(dataclasses.replace(p, op=readers.get(p.name, "")) for p in plan.parameters)
    return dataclasses.replace(
        plan, ops=tuple(ops), parameters=parameters, collectives=(), stages=(), options=()
    )


def _keyed_ops(graph: OpGraph) -> Iterable[tuple[tuple[str, str, int], OpNode]]:
    """Each op with (module path, target, its occurrence among that module's such ops)."""
    seen: dict[tuple[str, str], int] = {}
    for op in graph.ops:
        k = seen.get((op.module_path, op.target), 0)
        seen[(op.module_path, op.target)] = k + 1
        yield (op.module_path, op.target, k), op


def _evaluation_op(
    op: OpNode, found: PlannedOp | None, trained: OpNode | None, mesh: MeshSpec
) -> PlannedOp:
    if found is not None and trained is not None:
        same = (trained.args, trained.kwargs, trained.input_metas, trained.outputs) == (
            op.args,
            op.kwargs,
            op.input_metas,
            op.outputs,
        )
        valid = same or (found.inputs, found.outputs) in {
            (s.inputs, s.outputs) for s in default_catalogue().strategies(op, mesh)
        }
        if valid:
            return dataclasses.replace(found, name=op.name, layer=op.layer)
    whole = replicated_strategy(op, mesh)
    return PlannedOp(
        name=op.name,
        target=op.target,
        module_path=op.module_path,
        strategy=whole.cuts(),
        inputs=whole.inputs,
        outputs=whole.outputs,
        label="replicate",
        covered=False,
        reason="evaluation mode only: run whole on every device",
        layer=op.layer,
    )


@torch.no_grad()
def _write_buffer(model: nn.Module, fqn: str, value: torch.Tensor) -> None:
    """A buffer the forward updated in place (batch-norm statistics) takes its new value."""
    buffer = model.get_buffer(fqn)
    if is_dtensor(buffer) and is_dtensor(value):
        local_piece(buffer).copy_(
            local_piece(value.redistribute(buffer.device_mesh, buffer.placements))
        )  # type: ignore[union-attr]
    elif is_dtensor(value):
        buffer.copy_(value.full_tensor())  # type: ignore[union-attr]
    else:
        buffer.copy_(value)


@dataclass(frozen=True, slots=True)
class _LocalOp:
    """How an op run on local pieces (:func:`_run_local`) treats each tensor input."""

    grad_placements: tuple[tuple[Any, ...], ...]
    """Per tensor input: DTensor placements its local gradient is declared with."""
    bias_like: tuple[bool, ...]
    """Per tensor input: added after a pending sum, so it enters as one of ``share`` shares."""
    share: int
    """Ranks summing the output's pending sum (1 when the output is not pending)."""
    groups_split: int = 1
    """Group norm: ranks its channels (whole groups) are split over; each runs 1/n of them."""


@dataclass(frozen=True, slots=True)
class _NodeStep:
    """What the executor does at one node of the exported graph, decided once per executor.

    A training step runs every node once: these lookups replace the per-call work of finding
    the planned op, testing targets by name and reading schemas.
    """

    op: PlannedOp | None
    """The planned op; None for getitem and aliases (run as they are) and non-op nodes."""
    skipped: bool
    """A shape or metadata assertion dropped by the capture: nothing to run on DTensors."""
    local: _LocalOp | None
    """Set for covered ops run on local pieces by plait's rule (``_LOCAL_BY_RULE``)."""
    writes: bool
    """The op updates an input in place: inputs moved to its layout are copied back."""
    pin: bool
    """Gradients of the outputs are pinned (not for the graph's outputs: backward starts there)."""
    no_grad: bool
    """Inside the model's no_grad region."""
    autocast: tuple[Any, ...] | None
    """The model's autocast region (device, dtype, enabled, cache), if any."""
    inputs: tuple[tuple[Any, ...], ...] = ()
    """DTensor placements of each planned input layout: a value that has them is in place
    (comparing placements skips decoding the value's layout)."""
    outputs: tuple[tuple[Any, ...], ...] = ()
    """DTensor placements of each planned output layout."""
    settled: tuple[tuple[TensorLayout, tuple[Any, ...]], ...] = ()
    """Per planned output: where its gradient is pinned (:func:`_gradient_pin`: its layout
    with pending sums reduced) and that layout's placements."""
    mean_loss: tuple[str, ...] = ()
    """A mean class-index loss on a split batch: the mesh axes splitting it
    (:func:`_run_mean_class_loss`)."""
    table_grad: tuple[Any, ...] | None = None
    """A vocab-split embedding: the placements its table's gradient is brought to (the
    table's own split, pending over the axes that divide the lookups); None for other ops."""


def _node_steps(captured: ExecutableCapture, planned: dict[str, PlannedOp]) -> dict[str, _NodeStep]:
    """The decision for every call_function node, and for other nodes inside a region."""
    graph = captured.program.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = {n.name for n in output.all_input_nodes}
    steps: dict[str, _NodeStep] = {}
    for n in graph.nodes:
        no_grad = n.meta.get(GRAD_ENABLED_META) is False
        autocast = n.meta.get(AUTOCAST_META)
        if n.op != "call_function":
            if no_grad or autocast is not None:
                steps[n.name] = _NodeStep(None, False, None, False, False, no_grad, autocast)
            continue
        name = captured.op_of_node.get(n.name)
        op = None if name is None else planned[name]
        by_rule = op is not None and op.covered and str(n.target) in _LOCAL_BY_RULE
        mean_loss = _mean_class_loss_axes(op)
        ins = () if op is None else op.inputs
        outs = () if op is None else op.outputs
        steps[n.name] = _NodeStep(
            op=op,
            skipped=str(n.target) in EXPORT_ASSERTIONS,
            local=_local_op(op) if by_rule and op is not None else None,
            mean_loss=mean_loss,
            table_grad=_vocab_table_grad(op) if str(n.target) == _EMBEDDING else None,
            writes=_writes_any(n.target),
            pin=n.name not in outputs,
            no_grad=no_grad,
            autocast=autocast,
            inputs=tuple(to_dtensor_placements(layout) for layout in ins),
            outputs=tuple(to_dtensor_placements(layout) for layout in outs),
            settled=tuple(_gradient_pin(layout, op) for layout in outs),
        )
    return steps


def _gradient_pin(layout: TensorLayout, op: PlannedOp | None) -> tuple[TensorLayout, Any]:
    """Where the gradient of an output laid out as ``layout`` is pinned, with its placements:
    pending sums reduced, but those the plan keeps pending into the op's parameters
    (``PlannedOp.pending_grad``: the fused buckets reduce them)."""
    pin = settled(layout)
    if op is not None and op.pending_grad:
        pin = pin.with_partial(op.pending_grad)
    return pin, to_dtensor_placements(pin)


def _local_op(op: PlannedOp) -> _LocalOp:
    """Per-input decisions of :func:`_run_local` for ``op`` (see its docstring)."""
    strategy = OpStrategy(op.inputs, op.outputs, op.label)
    partial = op.outputs[0].partial if op.outputs else ()
    share = math.prod(op.outputs[0].mesh.axis_size(a) for a in partial) if partial else 1
    return _LocalOp(
        grad_placements=tuple(
            to_dtensor_placements(layout.with_partial(grad_reduce_axes(strategy, i)))
            for i, layout in enumerate(op.inputs)
        ),
        bias_like=tuple(
            share > 1 and not any(set(d) & set(partial) for d in layout.dims)
            for layout in op.inputs
        ),
        share=share,
        groups_split=op.inputs[0].splits()[1] if op.target == _GROUP_NORM else 1,
    )


def _vocab_table_grad(op: PlannedOp | None) -> tuple[Any, ...] | None:
    """An embedding whose table is split over its rows (Megatron's vocab-parallel embedding):
    the placements of its table's gradient (the table's split, pending over the axes the
    rule divides the lookups over); None otherwise.

    DTensor looks the rows up as planned (each rank its slice, out-of-slice ids zeros, a
    pending sum), but its backward knows nothing of the split and computes the whole
    table's gradient on every rank: left so, the job reduces the whole table over dp and
    slices it after, where the plan sums this rank's rows in its gradient bucket.
    """
    if op is None or not op.covered or not op.inputs or not op.inputs[0].dims[0]:
        return None
    strategy = OpStrategy(op.inputs, op.outputs, op.label)
    return to_dtensor_placements(op.inputs[0].with_partial(grad_reduce_axes(strategy, 0)))


class _TableGradient(torch.autograd.Function):
    """Identity forward; backward brings the table's gradient to ``placements`` (its rows'
    split: a local slice of a whole gradient, nothing sent)."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, placements: tuple[Any, ...]) -> torch.Tensor:
        ctx.placements = placements
        return table.view_as(table)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if tuple(grad.placements) == ctx.placements:  # type: ignore[attr-defined]
            return grad, None
        return grad.redistribute(grad.device_mesh, ctx.placements), None  # type: ignore[attr-defined]


def _writes_any(target: Any) -> bool:
    """Whether the op ``target`` can update any of its inputs in place (see _write_back)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    if _UPDATES_INSIDE.get(str(target)):
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _input_sources(signature: Any) -> list[tuple[InputKind, str | None]]:
    """Where each exported input comes from: (kind, path in the user's model or constant name;
    None for the batch's leaves)."""
    out: list[tuple[InputKind, str | None]] = []
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            out.append((spec.kind, None))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            out.append((spec.kind, strip_wrapper(spec.target)))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            out.append((spec.kind, spec.target))
        else:  # capture refuses these before a plan can exist
            raise PlanError(f"exported input {spec.arg.name!r} of kind {spec.kind.name}")
    return out


class _PlanInterpreter(torch.fx.Interpreter):
    """Runs the exported graph; planned ops get their planned input layouts.

    One per executor, reused by every call: what to do at each node is looked up in the
    executor's per-node decisions (:class:`_NodeStep`); only values live in a call.
    """

    def __init__(self, executor: PlanExecutor) -> None:
        super().__init__(executor.captured.program.graph_module, garbage_collect_values=True)
        self.executor = executor
        self.steps = executor._steps
        # (value node, layout) -> the value redistributed to that layout, for later readers
        self.moved: dict[tuple[str, TensorLayout], torch.Tensor] = {}
        # Each op's node carries the model's module that runs it: the Interpreter makes a
        # node's meta the current trace meta, so the per-rank program's nodes traced from it
        # carry the tag too (recompute regions, plait.runtime.program.remat; the plan's op
        # and reason beside a collective in hang reports, plait.launch.hang).
        modules = {op.name: op.module_path for op in executor.captured.graph.ops}
        for node in cast(torch.fx.GraphModule, self.module).graph.nodes:
            if node.name in modules:
                node.meta["custom"] = {
                    **(node.meta.get("custom") or {}),
                    "plait_module": modules[node.name],
                    "plait_op": node.name,  # the plan's op: named by hang reports
                }

    def forget(self) -> None:
        """Drop the values of the last call (its outputs stay in the fx environment)."""
        self.env = {}
        self.moved = {}

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        step = self.steps[self._current_node.name]
        if step.skipped:
            return None
        op = step.op
        if op is None:  # getitem, alias: pass through
            return super().call_function(target, args, kwargs)
        position = [0]
        given = (args, kwargs)
        args = self._laid_out(self._current_node.args, args, step, position)
        kwargs = {
            k: self._laid_out(self._current_node.kwargs[k], v, step, position)
            for k, v in kwargs.items()
        }
        out = self._run(step, op, target, args, kwargs)
        if step.writes:
            _write_back(target, given, (args, kwargs))
        return self._checked(step, op, out)

    def _run(
        self, step: _NodeStep, op: PlannedOp, target: Any, args: Any, kwargs: dict[str, Any]
    ) -> Any:
        if not op.covered and not any(is_dtensor(o) for o in _tensors((args, kwargs))):
            out = target(*args, **kwargs)
        elif not op.covered:
            out = self._run_replicated(target, args, kwargs)
        elif step.mean_loss:
            out = _run_mean_class_loss(op, step.mean_loss, target, args, kwargs)
        elif step.table_grad is not None:  # embedding(weight, indices, ...)
            table = _TableGradient.apply(args[0], step.table_grad)
            out = target(table, *args[1:], **kwargs)
        elif step.local is not None:
            out = _run_local(op, step.local, target, args, kwargs)
        else:
            out = target(*args, **kwargs)
        return out

    @property
    def _current(self) -> torch.fx.Node:
        return self._current_node  # set by run_node

    def run_node(self, n: torch.fx.Node) -> Any:
        self._current_node = n
        step = self.steps.get(n.name)
        if step is None or (not step.no_grad and step.autocast is None):
            return super().run_node(n)
        with contextlib.ExitStack() as regions:  # the model's no_grad / autocast blocks
            if step.no_grad:
                regions.enter_context(torch.no_grad())
            if step.autocast is not None:
                device, dtype, enabled, cache = step.autocast
                regions.enter_context(
                    torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
                )
            return super().run_node(n)

    def _laid_out(self, fx_arg: Any, value: Any, step: _NodeStep, position: list[int]) -> Any:
        """``value`` with each tensor input moved to the op's planned layout (in ref order)."""
        if isinstance(fx_arg, torch.fx.Node):
            if not isinstance(value, torch.Tensor):
                return value  # a non-tensor batch leaf: a constant of the graph
            i = position[0]
            position[0] += 1
            return self._to_layout(fx_arg.name, value, step.op.inputs[i], step.inputs[i])  # type: ignore[union-attr]
        if isinstance(fx_arg, tuple | list):
            items = [
                self._laid_out(a, v, step, position) for a, v in zip(fx_arg, value, strict=True)
            ]
            return type(value)(items) if isinstance(value, tuple | list) else items
        return value

    def _to_layout(
        self, name: str, value: torch.Tensor, layout: TensorLayout, placements: tuple[Any, ...]
    ) -> torch.Tensor:
        if not is_dtensor(value):
            value = self.executor._replicated(value)
        elif value.device_mesh.mesh_dim_names != self.executor.device_mesh.mesh_dim_names:
            # HSDP's ZeRO-3 shards, on the mesh with dp cut in two
            value = gathered_onto(value, self.executor.device_mesh)
        if value.placements == placements:  # type: ignore[attr-defined]
            return value  # already laid out as planned (the usual case)
        have = layout_of(value)  # type: ignore[arg-type]
        if have == layout:
            return value
        key = (name, layout)
        found = self.moved.get(key)
        if found is None:
            redistribution = plan_redistribution(
                have, layout, tuple(value.shape), value.element_size()
            )
            found = self.moved[key] = execute_redistribution(value, redistribution)  # type: ignore[arg-type]
        return found

    def _run_replicated(self, target: Any, args: Any, kwargs: Any) -> Any:
        """An op without a rule: on whole tensors (inputs are replicated, as planned)."""
        mesh = self.executor.device_mesh

        def local(x: Any) -> Any:
            if is_dtensor(x):
                # a split over an axis of size 1 is the whole tensor (a batch on dp=1)
                whole = TensorLayout.replicated(self.executor.plan.mesh, x.ndim)
                if _without_unit_axes(layout_of(x)) != _without_unit_axes(whole):
                    raise PlanError(
                        f"op {self._current.name!r} has no rule but its planned inputs are not "
                        f"replicated ({layout_of(x).describe()}); the plan is inconsistent"
                    )
                return x.to_local()
            return x

        local_args, local_kwargs = _map(local, args), _map(local, kwargs)
        if _writes_any(target):
            # An in-place op (``x.copy_(v)`` on a fresh tensor) on a DTensor's local view is
            # refused by autograd: it runs on a copy, and the graph reads the op's output
            # (export routes later uses of the written tensor through it).
            local_args = tuple(
                a.clone() if isinstance(a, torch.Tensor) and is_dtensor(b) else a
                for a, b in zip(local_args, args, strict=True)
            )
        out = target(*local_args, **local_kwargs)
        return _map(
            lambda t: replicated_from_local(t, mesh) if isinstance(t, torch.Tensor) else t,
            out,
        )

    def _checked(self, step: _NodeStep, op: PlannedOp, out: Any) -> Any:
        """Outputs as DTensors in the planned layouts (plain ones are replicated values)."""
        if isinstance(out, tuple | list):
            return type(out)(self._one_output(step, op, k, o) for k, o in enumerate(out))
        return self._one_output(step, op, 0, out)

    def _one_output(self, step: _NodeStep, op: PlannedOp, k: int, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or k >= len(op.outputs):
            return value
        if not is_dtensor(value):
            value = self.executor._replicated(value)
        if value.placements == step.outputs[k]:  # type: ignore[attr-defined]
            pinned, pinned_placements = step.settled[k]  # laid out as planned
        else:
            actual = layout_of(value)  # type: ignore[arg-type]
            planned = op.outputs[k]
            if actual != planned:
                if _without_unit_axes(actual) != _without_unit_axes(planned):
                    self.executor.note_mismatch(op, k, actual)
                if not set(planned.partial) - set(actual.partial):
                    redistribution = plan_redistribution(
                        actual, planned, tuple(value.shape), value.element_size()
                    )
                    value = execute_redistribution(value, redistribution)  # type: ignore[arg-type]
            pinned, pinned_placements = _gradient_pin(layout_of(value), op)  # type: ignore[arg-type]
        if step.pin and value.requires_grad:
            _pin_gradient(value, pinned, pinned_placements)
        return value


def _without_unit_axes(layout: TensorLayout) -> tuple[Any, ...]:
    """A layout's splits and pending sums over mesh axes larger than one (an axis of size one
    splits nothing: Shard and Replicate over it are the same piece)."""
    mesh = layout.mesh
    big = lambda axes: tuple(a for a in axes if mesh.axis_size(a) > 1)  # noqa: E731
    return tuple(big(d) for d in layout.dims), big(layout.partial)


def _writes_input(node: torch.fx.Node, ref: int) -> bool:
    """Whether the op of ``node`` updates its tensor input number ``ref`` in place."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    tensors = [j for j, a in enumerate(node.args) if isinstance(a, torch.fx.Node)]
    if ref >= len(tensors):
        return False
    j = tensors[ref]
    updated = _UPDATES_INSIDE.get(str(node.target), ())
    alias = schema.arguments[j].alias_info if j < len(schema.arguments) else None
    return j in updated or (alias is not None and alias.is_write)


@torch.no_grad()
def _write_back(target: Any, given: Any, used: Any) -> None:
    """Inputs an op updates in place (batch-norm running statistics) that were moved to the
    op's layout first: the update is copied back into the original, in its own layout."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return
    (given_args, given_kwargs), (used_args, used_kwargs) = given, used
    updated = _UPDATES_INSIDE.get(str(target), ())
    for j, argument in enumerate(schema.arguments):
        written = argument.alias_info is not None and argument.alias_info.is_write
        if not written and j not in updated:
            continue
        if j < len(given_args):
            original, moved = given_args[j], used_args[j]
        elif argument.name in given_kwargs:
            original, moved = given_kwargs[argument.name], used_kwargs[argument.name]
        else:
            continue
        if moved is original or not is_dtensor(original) or not is_dtensor(moved):
            continue
        back = redistribute_to(moved, layout_of(original))
        local_piece(original).copy_(local_piece(back))


def _run_local(op: PlannedOp, plan: _LocalOp, target: Any, args: Any, kwargs: Any) -> Any:
    """``op`` on this rank's local pieces (inputs already in the planned layouts).

    Each input's local gradient is declared with the layout the rule gives it (pending over
    the axes that divide the op's work but not the input, :func:`grad_reduce_axes`). For a
    pending-sum output, inputs that do not carry the summed dim (a bias) are added on every
    rank, so they enter divided by the number of ranks summing (the op is linear in them);
    their gradient is the whole output gradient on every rank (:class:`_ShareOfSum`).
    ``plan`` holds these per-input decisions (:func:`_local_op`).
    """
    mesh = None
    position = [0]

    def local(x: Any) -> Any:
        nonlocal mesh
        if not isinstance(x, torch.Tensor):
            return x
        i = position[0]
        position[0] += 1
        mesh = x.device_mesh  # type: ignore[attr-defined]
        piece = x.to_local(grad_placements=plan.grad_placements[i])  # type: ignore[attr-defined]
        return _ShareOfSum.apply(piece, plan.share) if plan.bias_like[i] else piece

    local_args = _map(local, args)
    if plan.groups_split > 1:  # group_norm(input, num_groups, ...): this rank's groups
        local_args = (local_args[0], local_args[1] // plan.groups_split, *local_args[2:])
    out = target(*local_args, **_map(local, kwargs))
    assert mesh is not None, f"op {op.name} has no DTensor input"
    if isinstance(out, tuple | list):
        return type(out)(
            from_local_piece(o, mesh, op.outputs[k]) if isinstance(o, torch.Tensor) else o
            for k, o in enumerate(out)
        )
    return from_local_piece(out, mesh, op.outputs[0])


_SUM = 2  # ``reduction`` argument of the class-index losses


def _mean_class_loss_axes(op: PlannedOp | None) -> tuple[str, ...]:
    """Mesh axes splitting the terms (batch and spatial dims) of a mean class-index loss
    planned as a pending average, which then runs as :func:`_run_mean_class_loss`; () for
    any other op."""
    if op is None or not op.covered or not divides_by_target_count(op.target, op.outputs[0]):
        return ()
    return tuple(a for d in op.inputs[0].dims for a in d)


def _run_mean_class_loss(
    op: PlannedOp, axes: tuple[str, ...], target: Any, args: Any, kwargs: Any
) -> torch.Tensor:
    """A mean class-index loss on a split batch, exact with ignored targets.

    PyTorch divides the summed loss by the number of targets that are not ``ignore_index``
    (by the number of rows for probability targets); ranks hold different numbers of them,
    so a mean of per-rank means is wrong. Each rank sums its terms, the global count is
    all-reduced (the scalar all-reduce the plan lists for the loss), and the rank contributes
    ``sum * ranks / count`` to the planned pending average: the average over ranks is the
    global mean, and each rank's gradient is its terms' gradients over the global count, as
    on one device.
    """
    names = [a.name for a in target._schema.arguments]
    call = {**dict(zip(names, args, strict=False)), **kwargs}
    x, t = call[names[0]], call[names[1]]
    mesh = x.device_mesh
    x_local = x.to_local(grad_placements=to_dtensor_placements(op.inputs[0]))
    t_local = t.to_local()
    call.update({names[0]: x_local, names[1]: t_local, "reduction": _SUM})
    total = target(**call)
    if t_local.is_floating_point():  # probability targets: one term per row
        # (built from the local target, so that a simulated rank counts its own rows)
        count = torch.ones_like(t_local.select(1, 0), dtype=torch.float64).sum()
    else:
        count = (t_local != call.get("ignore_index", -100)).sum(dtype=torch.float64)
    layout = op.outputs[0]
    pending = from_local_piece(count, mesh, TensorLayout(layout.mesh, (), axes))
    ranks = math.prod(layout.mesh.axis_size(a) for a in axes)
    count = full_value(pending).to(total.dtype)
    return from_local_piece(_ShareOfMean.apply(total, count, ranks), mesh, layout)


class _ShareOfMean(torch.autograd.Function):
    """``total * ranks / count`` forward (this rank's term of a pending average over
    ``ranks``), gradient ``grad / count``: backward hands every rank the whole gradient of the
    averaged value, and the global mean depends on this rank's sum with slope 1/count."""

    @staticmethod
    def forward(ctx: Any, total: torch.Tensor, count: torch.Tensor, ranks: int) -> torch.Tensor:
        ctx.save_for_backward(count)
        return total * (ranks / count)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (count,) = ctx.saved_tensors
        return grad / count, None, None


class _ShareOfSum(torch.autograd.Function):
    """``x / n`` forward, gradient passed unchanged: ``x`` is one of ``n`` equal shares of a
    pending sum, so the summed value depends on ``x`` with slope 1 and every rank holds the
    whole gradient (the rule reduces nothing over the summing axes for it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int) -> torch.Tensor:
        return x / n

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _pin_gradient(value: torch.Tensor, layout: TensorLayout, placements: tuple[Any, ...]) -> None:
    """The gradient of ``value``, once summed over its readers, is brought to ``layout``.

    The plan prices every value's gradient as arriving in its producer's layout with pending
    sums reduced (MindSpore reduces them inside the consuming op). DTensor would otherwise
    carry a pending sum on through earlier ops, reducing it later and elsewhere. Readers that
    hand back pending sums over the same axis are summed first, then reduced once.

    The gradient's local piece is made contiguous where it is not: DTensor decides whether a
    view's backward can stay a view from the global strides, and a transposed local piece
    (the backward of a transpose of a split tensor) can fail that view on one rank.

    ``placements`` are ``layout``'s: a gradient that has them is left as it is.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if getattr(grad, "placements", None) != placements:
            grad = redistribute_to(grad, layout)  # type: ignore[arg-type]
        return with_contiguous_local(grad) if is_dtensor(grad) else grad  # type: ignore[arg-type]

    value.register_hook(hook)


def _map(fn: Any, obj: Any) -> Any:
    if isinstance(obj, tuple | list):
        return type(obj)(_map(fn, v) for v in obj)
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    return fn(obj)


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, tuple | list):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
