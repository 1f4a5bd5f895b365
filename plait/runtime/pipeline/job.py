"""Pipeline parallel: the model cut into stages, run by a schedule over micro-batches.

The mesh has a ``pp`` axis (stages) and optionally a ``dp`` axis (replicas of the whole
pipeline). The model is cut into ``pipeline_stages * virtual_stages`` stages, where the user
marked them (``plait.pipeline_stage(module, k)``, MindSpore's ``cell.pipeline_stage``) or
evenly over the model's longest list of layers; torch's pipelining traces the forward once on
one micro-batch and splits the graph there, each stage keeping the original parameter names.
Every rank builds its stages (one, or several for the interleaved and zero-bubble schedules)
and the optimizer over their parameters only.

A step cuts this rank's batch into ``micro_batches`` pieces; the schedule runs forward and
backward of every micro-batch through the stages (the gradients summed over micro-batches
and scaled by 1/micro_batches: the pipeline's own gradient accumulation), then each stage's
gradients are averaged over ``dp`` in one fused all-reduce, and the optimizer updates.

The user's ``loss_fn(model, batch)`` is used as it is: the model's inputs are found by calling
it with a stand-in model that records its arguments, and the last stage computes each
micro-batch's loss by calling it with a stand-in that returns the pipeline's output.

With tensor parallel inside the stages (axes besides ``pp`` and ``dp``), each stage's
parameters are DTensors on the inner sub-mesh, and where it applies the stage runs as a
per-rank program: its forward and backward traced once into FX graphs over local tensors,
collectives explicit (:mod:`plait.runtime.pipeline.stage_program`; ``job.stage_programs``).

Offload: ``offload="optimizer"`` builds the optimizer over host copies of the stages'
parameter pieces (:func:`stage_optimizer`, the per-rank program's ``ZeroOptimizer``);
``offload="activations"`` runs each stage's forward and the loss under saved-tensor hooks that
keep what backward reads in host memory
(:class:`~plait.runtime.pipeline.stage_wrappers.SavedOnHost`; recompute, autocast and offload
around each stage's forward are :mod:`plait.runtime.pipeline.stage_wrappers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.utils.checkpoint
from torch import nn

from plait import support
from plait._compat import dtensor_like, output_structure, tree_leaves, tree_map, tree_unflatten
from plait.annotate import pipeline_stage_marks
from plait.comm import pipeline as pp_comm
from plait.comm.dtensor import (
    DeviceMesh,
    coordinate_of,
    distribute,
    full_value,
    implicit_replication,
    is_dtensor,
    local_piece,
    sync_grad,
)
from plait.config import ParallelConfig
from plait.data import split_micro_batches
from plait.errors import ConfigError, NotBuiltError, PlaitError, ShardingError
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.planning import Plan, PlannedParameter
from plait.planning.timeline import (
    SPLIT_BACKWARD,
    Timeline,
    timeline_from_records,
)
from plait.runtime.engine.job import LossFn, MeshJob, OptimizerFactory
from plait.runtime.engine.meta_init import require_initialised
from plait.runtime.engine.precision import autocast_for
from plait.runtime.engine.predict import call_arguments
from plait.runtime.pipeline.planned_stage import PlannedStage, follow_plan
from plait.runtime.pipeline.stage_balance import balanced_layer_starts as _balanced_starts
from plait.runtime.pipeline.stage_program import (
    StageProgram,
    compile_stage,
    compiles,
    planned_stage_collectives,
)
from plait.runtime.pipeline.stage_timer import StageTimer
from plait.runtime.pipeline.stage_wrappers import wrap_stages
from plait.runtime.program.zero import ZeroOptimizer, check_elementwise
from plait.support import Engine, Where

if TYPE_CHECKING:
    from plait.runtime.engine.measure import MemoryMeasurement
    from plait.runtime.engine.report import RunReport

__all__ = ["PipelineJob", "model_inputs", "stage_optimizer", "stage_starts"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------ stage assignment


def stage_starts(model: nn.Module, stages: int) -> list[str]:
    """The module each stage after the first begins with (``stages - 1`` names, model order).

    From ``plait.pipeline_stage`` marks when there are any, else the longest list of layers
    (an ``nn.ModuleList`` or ``nn.Sequential``) cut where per-stage cost balances, the
    embeddings counted in the first stage and the head in the last
    (:mod:`plait.runtime.pipeline.stage_balance`).
    """
    marks = pipeline_stage_marks(model)
    return _starts_from_marks(model, marks, stages) if marks else _balanced_starts(model, stages)


def _starts_from_marks(
    model: nn.Module, marks: tuple[tuple[str, int], ...], stages: int
) -> list[str]:
    for name, k in marks:
        if k >= stages:
            raise ConfigError(
                f"plait.pipeline_stage: module {name!r} is in stage {k}, but the job has "
                f"{stages} stages (0..{stages - 1}: pipeline_stages x virtual_stages); mark it "
                f"0..{stages - 1} or raise pipeline_stages"
            )
    for (outer, a), (inner, b) in itertools.pairwise(marks):
        if inner.startswith(outer + ".") and a != b:
            raise ConfigError(
                f"plait.pipeline_stage: module {inner!r} is marked stage {b} inside {outer!r}, "
                f"marked stage {a}: a module is in one stage; remove one of the marks"
            )
    # Marks nested in a marked module of the same stage add nothing: keep the outermost.
    top = [(n, k) for n, k in marks if not any(n.startswith(o + ".") for o, _ in marks)]
    empty = sorted(set(range(stages)) - {k for _, k in top})
    if empty:
        raise ConfigError(
            f"plait.pipeline_stage: stage{'s' if len(empty) > 1 else ''} "
            f"{', '.join(map(str, empty))} of {stages} ha{'ve' if len(empty) > 1 else 's'} no "
            "module; every stage needs at least one marked module (or remove every mark to "
            "let plait split the layers evenly)"
        )
    for (a_name, a), (b_name, b) in itertools.pairwise(top):
        if b < a:
            raise ConfigError(
                f"plait.pipeline_stage: module {b_name!r} (stage {b}) comes after {a_name!r} "
                f"(stage {a}) in the model; stages run in model order, so number them in "
                "the order the modules are defined"
            )
    return [next(n for n, k in top if k == s) for s in range(1, stages)]


# ------------------------------------------------------------------------ the loss function


class _Recorded(Exception):  # control flow, not an error
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class _Recorder:
    """Stands in for the model: records the arguments of the call and stops the loss function."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _Recorded(args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _Returns:
    """Stands in for the model: a call returns the pipeline's output."""

    def __init__(self, model: nn.Module, output: Any) -> None:
        self._model, self._output = model, output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._output

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def model_inputs(model: nn.Module, loss_fn: LossFn, batch: Any) -> tuple[tuple, dict]:
    """The arguments ``loss_fn`` calls ``model`` with on ``batch``."""
    try:
        loss_fn(_Recorder(model), batch)  # type: ignore[arg-type]
    except _Recorded as call:
        return call.args, call.kwargs
    raise ShardingError(
        "pipeline parallel: loss_fn(model, batch) returned without calling the model; the "
        "pipeline runs the model's forward, so the loss function must call model(...) once"
    )


# ------------------------------------------------------------------------------------ the job


class PipelineJob(MeshJob):
    """A job whose model runs as pipeline stages (see the module docstring)."""

    engine: ClassVar[Engine] = "pipeline"

    def __init__(
        self,
        model: nn.Module,
        config: ParallelConfig,
        *,
        mesh: MeshSpec,
        device_mesh: DeviceMesh,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        example_batch: Any,
        plan: Plan | None = None,
    ) -> None:
        # parallelize ran these before building the mesh; again here for a job built directly
        # (the optimizer's class is checked on the one built below: the user's factory is
        # called once here, as without a pipeline)
        check_pipeline_config(config, mesh, planned=plan is not None)
        pp = mesh.axis_size("pp")
        dp = mesh.axis_size(config.dp_axis) if config.dp_axis in mesh.axis_names else 1
        virtual = config.virtual_stages or 1
        count = pp * virtual
        micro = config.micro_batches
        coordinate = list(coordinate_of(device_mesh))
        pp_rank = coordinate[mesh.axis_index("pp")]
        starts = plan_stage_starts(plan) if plan is not None and virtual == 1 else None
        starts = starts or stage_starts(model, count)
        local = _local_example(example_batch, dp * micro)
        args, kwargs = model_inputs(model, loss_fn, local)
        inner = inner_axes(mesh, config)
        # Planned on the model as the user gave it: after the split its capture is not the
        # same (the plan of a split model met an op with no output).
        layouts: dict[str, TensorLayout] = {}
        if inner and plan is not None:
            layouts = inner_layouts(plan.parameters, mesh, config)
        elif inner:  # semi_auto: the plan of the user's annotations, stages included
            whole = semi_auto_plan(model, config, mesh, loss_fn, local, dp * micro)
            if whole is not None and virtual == 1 and plan_stage_starts(whole) == starts:
                plan = whole  # the stages are the plan's: checked against it (plan_mismatches)
            layouts = (
                inner_layouts(whole.parameters, mesh, config)
                if whole is not None
                else stage_parameter_layouts(model, config, mesh, loss_fn, local, dp)
            )
        with pp_comm.without_cache(model):
            self._output_spec = output_structure(model, args, kwargs)
        """The model's output structure: torch's split hands the last stage's output over as
        its tensors (a Hugging Face ``ModelOutput`` comes as its logits), rebuilt for the
        loss function (:meth:`_structured`)."""
        pipe = pp_comm.split_model(model, args, kwargs, starts)
        self._carried = pp_comm.carry_late_inputs(pipe)
        """Model inputs a later stage reads (``labels=``), carried from the first stage on;
        inputs no stage reads, which the first stage is not given."""
        _refuse_unread_positional(model, args, pipe, self._carried)
        indices = pp_comm.stage_indices(config.schedule, pp_rank, pp, virtual)
        device = torch.device("cpu" if device_mesh.device_type == "cpu" else "cuda")
        stages = pp_comm.build_stages(
            pipe, indices, device, device_mesh.get_group("pp"), example=(args, kwargs)
        )
        modules = [pp_comm.stage_module(s) for s in stages]
        submesh = None
        follows = inner and plan is not None and virtual == 1 and plan_stage_starts(plan) == starts
        if inner:
            submesh = device_mesh[inner if len(inner) > 1 else inner[0]]
            for m in modules:
                distribute_stage(m, layouts, submesh, MeshSpec.from_dict(
                    {a: mesh.axis_size(a) for a in inner}
                ))  # fmt: skip
                pp_comm.stage_on_submesh(m, submesh, planned=bool(follows))
        followed: list[PlannedStage] = []
        if follows and plan is not None:
            ops = {op.name: op for op in plan.ops}
            followed = [
                follow_plan(m, [ops[n] for n in plan.stages[i] if n in ops], inner)
                for i, m in zip(indices, modules, strict=True)
            ]
        programs: list[StageProgram] = []
        if compiles(config):
            split = config.schedule in SPLIT_BACKWARD  # their weight passes come later
            programs = [
                compile_stage(m, weight_pass=split, recompute=config.recompute) for m in modules
            ]
            for stage, program in zip(stages, programs, strict=True) if split else ():
                pp_comm.defer_weight_pass(stage, program.weight_pass)
        offload = wrap_stages(model, modules, config, device, programs=programs)
        reduced_here = shard_stages(modules, config, device_mesh, dp)
        built = stage_optimizer(
            modules,
            optimizer,
            host=config.offload == "optimizer",
            device_mesh=device_mesh,
            dp_axis=config.dp_axis,
        )
        if config.offload == "optimizer":
            check_elementwise(built, None)
        super().__init__(
            model,
            built,
            loss_fn,
            config,
            mesh=mesh,
            device_mesh=device_mesh,
            slice_inputs=False,
            layouts={},
        )
        self.stages = stages
        self.stage_modules = modules
        self.stage_programs = programs
        """Each stage as a per-rank program (:mod:`plait.runtime.pipeline.stage_program`) where it
        applies (tensor parallel in the stages); empty where the stages run eagerly."""
        self.stage_follows_plan = followed
        """Per stage, what the pass that lays its ops' inputs out as the plan says did
        (:mod:`plait.runtime.pipeline.planned_stage`); empty where the stages hold no plan."""
        self.plan = plan
        """The plan the stages run (mode auto, plan files), None for marks and even splits."""
        self.plan_mismatches: list[str] | None = None
        """After the first training step: each compiled stage whose collectives differ from
        those the plan lists for its ops (empty when all agree or there is no plan)."""
        self.stage_indices = indices
        self.stage_starts = starts
        self._dp = dp
        self._dp_group = device_mesh.get_group(config.dp_axis) if dp > 1 else None
        self._dp_averaged = reduced_here
        """Parameters whose gradients ``step`` averages over dp itself (None: all of them;
        under optimizer parallel, those kept whole: FSDP reduce-scatters the others)."""
        self._micro_batches: list[Any] = []
        self._schedule = pp_comm.make_schedule(
            config.schedule, stages, micro, self._micro_loss, pp_comm.output_merge(pipe, micro)
        )
        self._ties = tied_copies(model, modules)
        release_other_stages(model, modules)
        self._device = device
        self._pp_group = device_mesh.get_group("pp")
        self._timer = StageTimer(
            pp_rank, sync=torch.cuda.synchronize if device.type == "cuda" else None
        )
        for stage in stages:
            self._timer.wrap(stage)
        self._first = all(c == 0 for c in coordinate)
        self._dp_index = coordinate[mesh.axis_index(config.dp_axis)] if dp > 1 else 0
        self._rows = _rows(example_batch)
        self._inner = inner
        self.inner_mesh = submesh
        """The device mesh of the axes inside a stage (tensor parallel); None without."""
        self.activation_offload = offload
        """``offload="activations"``: what keeps the stages' saved tensors on the host (its
        ``moved`` and ``moved_bytes`` count the last training step's copies); None without."""
        self._predicting = False
        self._loss_scale = 1.0
        """The fp16 loss scale of the step running (1 outside a training step)."""
        logger.info(
            "pipeline: %d stages (%s), this rank runs %s, schedule %s, %d micro-batches",
            count,
            ", ".join(["start", *starts]),
            indices,
            config.schedule,
            micro,
        )

    def _on_submesh(self) -> contextlib.AbstractContextManager[Any]:
        """Around a schedule with tensor parallel in the stages: plain tensors a stage makes
        (positions, masks) count as replicated, in forward and in backward, where they are
        read again."""
        return implicit_replication() if self._inner else contextlib.nullcontext()

    def _micro_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        if self._predicting:  # job.predict: outputs wanted, no loss (the batch has no labels)
            return torch.zeros((), device=self._device)
        batch = self._micro_batches[int(index.reshape(-1)[0])]
        offload = self.activation_offload
        # the loss's own saved tensors (cross entropy's log-probabilities) wait on the host too
        saving = offload.saving((output, batch)) if offload else contextlib.nullcontext()
        with saving, autocast_for(self.config.precision, self._device.type):  # as one device's
            returned = _Returns(self.model, self._structured(output))
            loss = self.loss_fn(returned, batch)  # type: ignore[arg-type]
        # fp16: the loss scaled before the schedule's backward (exact: a power of two)
        return loss * self._loss_scale if self._loss_scale != 1.0 else loss

    def _structured(self, output: Any) -> Any:
        """The last stage's output in the structure the model returns (the loss function reads
        ``.logits`` of a Hugging Face output, say); as it is where the leaves do not match."""
        spec = self._output_spec
        leaves = tree_leaves(output)
        if spec.is_leaf() or spec.num_leaves != len(leaves):
            return output
        return tree_unflatten(leaves, spec)

    def _step(self, batch: Any) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        for m in self.stage_modules:  # an offloaded optimizer's parameters are host copies
            m.zero_grad(set_to_none=True)
        if self.activation_offload is not None:
            self.activation_offload.moved = self.activation_offload.moved_bytes = 0
        scaler = self.loss_scaler
        self._loss_scale = scaler.scale if scaler is not None else 1.0
        try:
            losses = self._run(self.shard_batch(batch), training=True)
        finally:
            scale, self._loss_scale = self._loss_scale, 1.0
        if self.plan_mismatches is None:  # the programs are traced by the first step
            self.plan_mismatches = self._check_against_plan()
        if scale != 1.0:
            losses = [x.detach() / scale for x in losses]
        loss = self._start_mean_loss(losses)
        stage_params = [p for m in self.stage_modules for p in m.parameters()]
        for p in stage_params:  # tensor parallel in a stage: pending sums to the layout
            sync_grad(p)
        self._sync_ties()
        params = stage_params if self._dp_averaged is None else self._dp_averaged
        grads = [local_piece(p.grad) for p in params if p.grad is not None]
        pp_comm.mean_over_group(grads, self._dp_group, self._dp)
        if scaler is not None:
            # an inf or NaN on any stage of any replica skips the update on every rank
            finite = scaler.unscale_and_check(stage_params, self.device_mesh)
            scaler.update(finite)
            if not finite:
                return loss()
        self._update()
        return loss()

    def _check_against_plan(self) -> list[str]:
        """What each compiled stage issues against what the plan lists for its ops (each
        logged as a warning): the stages lay their planned ops' inputs out as the plan says
        (:mod:`plait.runtime.pipeline.planned_stage`), but ops the pass could not match follow
        DTensor's propagation, which can differ from the plan's own per-op strategies."""
        if self.plan is None or not self.stage_programs:
            return []  # no plan, or stages without axes inside: nothing compiled to check
        found = []
        for index, program in zip(self.stage_indices, self.stage_programs, strict=True):
            if program.forward is None:
                continue  # runs eagerly (program.refused says why)
            planned = planned_stage_collectives(self.plan, index, self._inner)
            ran = program.collectives()
            if planned != ran:
                found.append(
                    f"pipeline stage {index} issues {dict(sorted(ran.items()))} a micro-batch "
                    f"where the plan lists {dict(sorted(planned.items()))} for its ops (the "
                    "ops the stage could not match to the plan's follow DTensor's propagation: "
                    "job.stage_follows_plan lists them)"
                )
                logger.warning("%s", found[-1])
        return found

    def _update(self) -> None:
        """The optimizer's step; with ``offload="optimizer"`` on host copies of this rank's
        pieces: gradients copied to the host first, the new values back after."""
        shadows = getattr(self.optimizer, "_plait_shadows", None)
        if not isinstance(shadows, ZeroOptimizer):
            self.optimizer.step()
            return
        shadows.load_grads()  # waits for its copies to the host before the host's step
        self.optimizer.step()
        shadows.after_step()

    def _sync_ties(self) -> None:
        """Parameters the model ties (an embedding and its LM head) are one tensor split into
        copies, one in each stage that reads it: every copy gets the sum of all copies'
        gradients (one all-reduce over the pipeline per tie), so the copies, equal at the
        start and updated alike, stay equal (Megatron's embedding group)."""
        for tie in self._ties:
            shape = local_piece(tie.copies[0]).shape if tie.copies else tie.shape
            total = torch.zeros(shape, dtype=tie.dtype, device=self._device)
            for p in tie.copies:
                if p.grad is not None:
                    total += local_piece(p.grad)
            total = pp_comm.sum_over_group(total, self._pp_group)
            for p in tie.copies:
                if p.grad is None:
                    p.grad = dtensor_like(p, total.clone()) if is_dtensor(p) else total.clone()
                else:
                    local_piece(p.grad).copy_(total)

    def evaluate(self, batch: Any) -> float:
        """The global loss on ``batch`` without training: the stages' forwards alone, in
        eval mode, micro-batch by micro-batch (the mean of their losses, as ``step``)."""
        with torch.no_grad():
            return self._start_mean_loss(self._run(self.shard_batch(batch), training=False))()

    @torch.no_grad()
    def predict(self, batch: Any) -> Any:
        """The model's outputs on ``batch`` (the whole batch, the same on every rank), whole,
        on every rank: each pipeline replica runs its data-parallel slice through the stages
        (forwards only, micro-batch by micro-batch), and the last stages' outputs are gathered
        (as CPU copies, then moved to this rank's device). The stages are built for the
        training batch size, so ``batch`` has that many rows."""
        require_initialised(self.model, "job.predict")
        rows = _rows(batch)
        if rows != self._rows:
            raise ShardingError(
                f"job.predict on a pipeline: the batch has {sorted(rows)} rows but the stages "
                f"were built for batches of {sorted(self._rows)} (the training batch: "
                f"{self._dp} data-parallel replicas x {self.config.micro_batches} micro-batches); "
                "pass a batch of that size (pad it, or cut it into such batches)"
            )
        local = tree_map(
            lambda x: (
                x.chunk(self._dp)[self._dp_index] if isinstance(x, torch.Tensor) and x.ndim else x
            ),
            batch,
        )
        args, kwargs = self._first_stage_inputs(*call_arguments(local), predicting=True)
        for m in self.stage_modules:
            m.eval()
        self._timer.stop()  # job.timeline() shows the last training step
        outputs: list[Any] = []
        self._predicting = True
        try:
            with self._on_submesh():
                pp_comm.run_schedule(
                    self._schedule,
                    self.stages,
                    args,
                    kwargs,
                    torch.arange(self.config.micro_batches),
                    forward_only=True,
                    outputs=outputs,
                )
        finally:
            self._predicting = False
        return self._structured(self._gather_outputs(outputs[0] if outputs else None))

    def _gather_outputs(self, mine: Any) -> Any:
        """Every data-parallel replica's last-stage outputs, concatenated in replica order,
        on every rank."""
        from plait.comm.checkpoint_io import all_gather_objects

        cpu = None if mine is None else (self._dp_index, tree_map(_to_cpu, mine))
        pieces: dict[int, Any] = {}
        for part in all_gather_objects(cpu):
            if part is not None:
                pieces.setdefault(part[0], part[1])
        ordered = [pieces[i] for i in range(self._dp)]
        whole = ordered[0] if len(ordered) == 1 else tree_map(_concat, *ordered)
        return tree_map(lambda x: x.to(self._device) if isinstance(x, torch.Tensor) else x, whole)

    def _run(self, batch: Any, *, training: bool) -> list[torch.Tensor]:
        """The schedule over ``batch`` cut into micro-batches; this rank's micro losses."""
        micro = self.config.micro_batches
        for m in self.stage_modules:
            m.train(training)
        self._micro_batches = split_micro_batches(batch, micro)
        args, kwargs = self._first_stage_inputs(*model_inputs(self.model, self.loss_fn, batch))
        if training:
            self._timer.begin_step()
        else:
            self._timer.stop()  # job.timeline() shows the last training step
        try:
            with self._on_submesh():
                return pp_comm.run_schedule(
                    self._schedule,
                    self.stages,
                    args,
                    kwargs,
                    torch.arange(micro),
                    forward_only=not training,
                )
        finally:
            self._micro_batches = []

    def _first_stage_inputs(
        self, args: tuple, kwargs: dict[str, Any], *, predicting: bool = False
    ) -> tuple[tuple, dict[str, Any]]:
        """The model's arguments as the first stage takes them: keywords no stage reads left
        out (:class:`~plait.comm.pipeline.CarriedInputs`); for ``job.predict``, the inputs
        the stages carry to a later stage must be in the batch (the split was traced with
        them)."""
        carried = self._carried
        missing = [name for name in carried.carried if name not in kwargs] if predicting else []
        if missing:
            raise ShardingError(
                f"job.predict on a pipeline: the batch has no {missing}, which the stages "
                "were split to read (the training batch had it: the model computes its loss "
                "from it in the last stage); pass it in the batch as in training (its values "
                "do not change the outputs), or predict on a job without a 'pp' axis"
            )
        if not carried.unread:
            return args, kwargs
        return args, {k: v for k, v in kwargs.items() if k not in carried.unread}

    def _start_mean_loss(self, losses: list[torch.Tensor]) -> Callable[[], float]:
        """The step's loss on every rank: the last stages' micro losses, averaged over
        micro-batches and data-parallel replicas (one all-reduce, started now; call the
        result for the value)."""
        local = torch.stack([x.detach().float() for x in losses]).mean() if losses else None
        total = pp_comm.start_sum_over_world(local if local is not None else torch.zeros(()))
        # every rank of a last stage holds the loss: dp replicas x the ranks inside a stage
        holders = self._dp * math.prod(self.mesh.axis_size(a) for a in self._inner)
        return lambda: float(total()) / holders

    def state_modules(self) -> list[nn.Module]:
        return list(self.stage_modules)

    def load_pretrained(self, path: Any) -> list[str]:
        """As :meth:`Job.load_pretrained`, into the stages this rank holds: the files are
        checked against the whole model, and each stage's tensors (the model's own, or the
        pieces tensor parallel and optimizer parallel gave the stage) are filled with this
        rank's slices of them; the optimizer's host copies (``offload="optimizer"``) follow."""
        from plait.runtime.engine.pretrained import load_pretrained

        return load_pretrained(self.model, self.optimizer, path, holders=self.stage_modules)

    def report(self, memory: MemoryMeasurement | None = None, *, warmup: int = 1) -> RunReport:
        """As :meth:`Job.report`, with the last training step's measured timeline and the
        plan's predicted one (``report.plot(DIR)`` draws them). Every rank calls it: it
        gathers the pipeline group's pass times, as :meth:`timeline` does."""
        from plait.runtime.engine.report import run_report

        measured = self.timeline() if self.steps_taken else None
        return run_report(self, self._step_seconds, memory, warmup, measured_timeline=measured)

    def save_pretrained(self, directory: Any, *, max_shard_bytes: int | None = None) -> Any:
        """As :meth:`Job.save_pretrained`, from the stages each rank holds (each tensor made
        whole on its stage and sent to the first rank, one at a time)."""
        from plait.runtime.engine.save_pretrained import (
            DEFAULT_SHARD_BYTES,
            save_pretrained_from_stages,
        )

        shard = DEFAULT_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
        return save_pretrained_from_stages(
            self.model, directory, holders=self.stage_modules, max_shard_bytes=shard
        )

    def timeline(self, path: Any = None, *, trace: Any = None) -> Timeline:
        """The last training step's measured schedule: each stage's forward, backward and
        weight-gradient passes in time, per pipeline rank. Every rank calls it (it gathers the
        pipeline group's records); the first rank writes the picture to ``path`` (PNG) and a
        Chrome trace to ``trace`` (JSON, for chrome://tracing or Perfetto)."""
        from plait.comm.checkpoint_io import all_gather_objects

        parts = all_gather_objects(self._timer.records(), group=self._pp_group)
        pp, cfg = self.mesh.axis_size("pp"), self.config
        timeline = timeline_from_records(
            [record for part in parts for record in part],
            labels=[f"pp {r}" for r in range(pp)],
            title=f"measured {cfg.schedule}: {pp} stages, {cfg.micro_batches} micro-batches",
        )
        if self._first and path is not None:
            timeline.to_png(path)
        if self._first and trace is not None:
            timeline.to_chrome_trace(trace)
        return timeline

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters and buffers, gathered on every rank (model names)."""
        from plait.comm.checkpoint_io import all_gather_objects

        mine = {
            k: full_value(v).cpu() if is_dtensor(v) else v.detach().cpu()
            for m in self.stage_modules
            for k, v in m.state_dict().items()
        }
        merged: dict[str, torch.Tensor] = {}
        for part in all_gather_objects(mine):
            merged.update(part)
        order = [k for k in self.model.state_dict() if k in merged]
        return {k: merged[k] for k in order}

    def _batch_processes(self, batch: Any) -> int:
        """Each data-parallel replica passes its own rows (``full_batch``: every rank the
        global batch); the ranks of one replica pass the same."""
        return 1 if self.config.dataset_strategy == "full_batch" else self._dp

    def shard_batch(self, batch: Any) -> Any:
        """This pipeline replica's part of a step's batch. ``dataset_strategy="data_parallel"``:
        each rank passes its replica's own rows, taken as they are; ``"full_batch"``: every
        rank passes the global batch, whose dim 0 is cut into the data-parallel replicas'
        pieces here (MindSpore's ``full_batch``)."""
        if self.config.dataset_strategy != "full_batch" or self._dp == 1:
            return batch
        return tree_map(self._replica_rows, batch)

    def _replica_rows(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return x
        if x.shape[0] % self._dp:
            raise ShardingError(
                f"job.step on a pipeline with dataset_strategy='full_batch': a batch tensor of "
                f"shape {tuple(x.shape)} has {x.shape[0]} rows, which do not divide into the "
                f"{self._dp} data-parallel replicas (mesh axis {self.config.dp_axis!r}); pass "
                f"a global batch whose rows divide by {self._dp}"
            )
        return x.chunk(self._dp)[self._dp_index]


@dataclass(frozen=True)
class _Tie:
    """One tensor the model ties under several names, and this rank's stage copies of it."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    copies: tuple[nn.Parameter, ...]


def release_other_stages(model: nn.Module, stage_modules: Sequence[nn.Module]) -> int:
    """Keep on this rank only the parameters its stages hold: the storage of every other
    parameter of the user's ``model`` (the other ranks' stages, and this rank's own whole
    tensors once tensor parallel or FSDP2 gave its stages new pieces) is let go, as FSDP lets
    an unsharded parameter go: resized to nothing, shape and dtype kept. torch's split shares
    the user's parameters with every stage module it makes and keeps them reachable, so
    without this each rank would hold the whole model; resizing reaches every holder at once.
    A storage a stage still reads (a replicated piece made without a copy) is kept. Returns
    the bytes let go."""
    kept = {id(p) for m in stage_modules for p in m.parameters()}
    in_use = {
        local_piece(p).untyped_storage().data_ptr() for m in stage_modules for p in m.parameters()
    }
    released = 0
    for p in model.parameters():  # each tensor once, ties included
        if id(p) in kept or p.is_meta:
            continue
        storage = p.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in in_use:
            continue
        released += storage.nbytes()
        storage.resize_(0)
    return released


def tied_copies(model: nn.Module, stage_modules: list[nn.Module]) -> list[_Tie]:
    """Every tie of ``model`` (the same order on every rank, whether or not this rank holds a
    copy), with the copies this rank's stages hold under any of its names."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    ties = []
    for key, group in sorted(names.items(), key=lambda item: item[1][0]):
        if len(group) < 2:
            continue
        copies = {
            id(q): q
            for m in stage_modules
            for n, q in m.named_parameters(remove_duplicate=False)
            if n in group
        }
        p = tensors[key]
        ties.append(_Tie(tuple(group), tuple(p.shape), p.dtype, tuple(copies.values())))
    return ties


def inner_axes(mesh: MeshSpec, config: ParallelConfig) -> tuple[str, ...]:
    """The mesh axes inside a stage (tensor parallel): all but ``pp`` and the data-parallel
    axis, those of size 1 left out."""
    return tuple(
        a for a in mesh.axis_names if a not in ("pp", config.dp_axis) and mesh.axis_size(a) > 1
    )


def stage_parameter_layouts(
    model: nn.Module,
    config: ParallelConfig,
    mesh: MeshSpec,
    loss_fn: LossFn,
    micro_batch: Any,
    dp: int,
) -> dict[str, TensorLayout]:
    """Each parameter's layout over the axes inside a stage: from the semi_auto plan of the
    whole model on the mesh without ``pp`` (the user's ``plait.shard`` annotations and their
    propagation), made on one micro-batch of every data-parallel replica."""
    from plait.planning import plan as make_plan

    flat = {a: mesh.axis_size(a) for a in mesh.axis_names if a != "pp"}
    planned = make_plan(
        model,
        dataclasses.replace(
            config, mesh=flat, pipeline_stages=1, micro_batches=1, schedule="1f1b",
            virtual_stages=None,
        ),
        example_batch=tree_map(lambda x: _repeat_rows(x, dp), micro_batch),
        loss_fn=loss_fn,
    )  # fmt: skip
    return inner_layouts(planned.parameters, mesh, config)


def semi_auto_plan(
    model: nn.Module,
    config: ParallelConfig,
    mesh: MeshSpec,
    loss_fn: LossFn,
    micro_batch: Any,
    micro_batches: int,
) -> Plan | None:
    """The semi_auto plan of the whole model on the pipeline's mesh (the user's
    ``plait.shard`` annotations, their propagation, and the planner's stage cut), made on
    the global batch; the stages are checked against its collectives when they are the
    plan's stages. None, with the reason logged, where the planner refuses the config for
    pipelines (the stages then take their layouts from the plan without ``pp``,
    :func:`stage_parameter_layouts`, and are not checked)."""
    from plait.planning import plan as make_plan

    try:
        return make_plan(
            model, config, example_batch=tree_map(lambda x: _repeat_rows(x, micro_batches), micro_batch),
            loss_fn=loss_fn,
        )  # fmt: skip
    except PlaitError as e:
        logger.info("pipeline: the semi_auto stages are not checked against a plan: %s", e)
        return None


def inner_layouts(
    parameters: Sequence[PlannedParameter], mesh: MeshSpec, config: ParallelConfig
) -> dict[str, TensorLayout]:
    """Planned parameter layouts restricted to the axes inside a stage (a split over ``pp``
    or the data-parallel axis is not a stage's to make: the stage holds that dim whole)."""
    inner = set(inner_axes(mesh, config))
    sub = MeshSpec.from_dict({a: mesh.axis_size(a) for a in mesh.axis_names if a in inner})
    return {
        p.name: TensorLayout(sub, tuple(tuple(a for a in d if a in inner) for d in p.layout.dims))
        for p in parameters
    }


def plan_stage_starts(plan: Plan) -> list[str] | None:
    """The module each of a plan's stages after the first begins with: the repeated layer (or
    else the module) of the stage's first op; None if a stage's first op has neither."""
    ops = {op.name: op for op in plan.ops}
    starts = []
    for stage in plan.stages[1:]:
        first = ops.get(stage[0]) if stage else None
        start = None if first is None else (first.layer or first.module_path)
        if not start:
            return None
        starts.append(start)
    return starts or None


def _repeat_rows(x: Any, times: int) -> Any:
    if not isinstance(x, torch.Tensor) or x.ndim == 0 or times == 1:
        return x
    return torch.cat([x] * times)


def distribute_stage(
    module: nn.Module, layouts: dict[str, TensorLayout], submesh: DeviceMesh, sub: MeshSpec
) -> None:
    """Replace ``module``'s parameters by DTensors laid out as ``layouts`` (by the model's
    names) on ``submesh``, the device mesh of the axes inside a stage; parameters the plan
    does not name are replicated. Shared parameters stay shared."""
    done: dict[int, nn.Parameter] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if id(p) not in done:
            layout = layouts.get(name, TensorLayout.replicated(sub, p.ndim))
            done[id(p)] = nn.Parameter(distribute(p.detach(), submesh, layout), p.requires_grad)
        owner._parameters[attr] = done[id(p)]


def shard_stages(
    modules: list[nn.Module], config: ParallelConfig, device_mesh: DeviceMesh, dp: int
) -> list[nn.Parameter] | None:
    """Optimizer parallel in the stages (``optimizer_shard``), by FSDP2 over the dp sub-mesh
    (:func:`plait.comm.pipeline.shard_stage`): level 3 gathers a stage's parameters for each
    micro-batch's forward and backward and frees them between; levels 1 and 2 keep them
    gathered from a step's first forward to its last backward (FSDP2's ZeRO-2: the same
    traffic as level 1's whole all-reduce, and less memory, so level 1 runs so too).
    Parameters under ``optimizer_shard_threshold`` bytes or named in
    ``optimizer_shard_exclude`` stay whole. With ``optimizer_weight_shard_size`` (HSDP) the
    dp sub-mesh is cut into (replicate, shard) dims and FSDP2 shards over groups of that many
    ranks, replicated across the groups. Returns the parameters kept whole (the step averages
    their gradients itself), or None without optimizer parallel."""
    level = config.optimizer_shard
    if level is None or dp == 1:
        return None
    threshold = int(config.optimizer_shard_threshold)
    excluded = set(config.optimizer_shard_exclude)
    kept: list[nn.Parameter] = []
    dp_mesh = pp_comm.dp_shard_mesh(device_mesh, config.dp_axis, config.optimizer_weight_shard_size)
    for m in modules:
        whole = [
            p
            for name, p in m.named_parameters()
            if name in excluded or local_piece(p).numel() * p.element_size() < threshold
        ]
        pp_comm.shard_stage(
            m,
            dp_mesh,
            reshard_after_forward=level == 3,
            whole=whole,
            gather_dtype=torch.bfloat16 if config.precision == "bf16" else None,
        )
        kept.extend(whole)
    logger.info(
        "pipeline: optimizer_shard=%d over %r (FSDP2, %s), %d parameters kept whole",
        level,
        config.dp_axis,
        "parameters freed after each forward" if level == 3 else "parameters kept for backward",
        len(kept),
    )
    return kept


def stage_optimizer(
    modules: Sequence[nn.Module],
    factory: OptimizerFactory,
    *,
    host: bool,
    device_mesh: DeviceMesh,
    dp_axis: str,
) -> torch.optim.Optimizer:
    """The user's optimizer over this rank's stages' parameters. ``host``
    (``offload="optimizer"``, ZeRO-Offload): over host copies of their local pieces instead
    (:class:`plait.runtime.program.zero.ZeroOptimizer`, the same object the per-rank program's
    offload uses), so its states and its step live in host memory; under optimizer parallel
    the pieces are FSDP2's shards, so each rank keeps only its shard's states there. On a
    CPU device the host is the device: the pieces themselves, nothing copied."""
    named = [(n, p) for m in modules for n, p in m.named_parameters()]
    if not host:
        return factory([p for _, p in named])
    zero = ZeroOptimizer(
        named, [], level=None, buckets=[], device_mesh=device_mesh, axis=dp_axis, host=True
    )
    optimizer = factory(zero.shadows)
    optimizer._plait_shadows = zero  # type: ignore[attr-defined]
    return optimizer


def check_pipeline_config(
    config: ParallelConfig,
    mesh: MeshSpec,
    *,
    planned: bool = False,
) -> None:
    """What the pipeline runs with today (:mod:`plait.support`'s rules for pipeline stages),
    refused by name otherwise, and the stage and micro-batch counts checked (before anything
    waits). ``planned``: the stages run a plan of mode auto (or a plan file)."""
    where = Where("pipeline", inner_axes(mesh, config), planned)
    support.check(config, where, engine_only=True)  # the others: checked by parallelize
    if mesh.axis_size("pp") != config.pipeline_stages:
        raise ConfigError(
            f"ParallelConfig(pipeline_stages={config.pipeline_stages}) but the mesh's 'pp' axis "
            f"has {mesh.axis_size('pp')} devices; give the stages as the mesh's pp axis"
        )
    count = config.pipeline_stages * (config.virtual_stages or 1)
    minimum = config.pipeline_stages if config.schedule != "gpipe" else 1
    if config.micro_batches < minimum:
        raise ConfigError(
            f"ParallelConfig(schedule={config.schedule!r}, micro_batches="
            f"{config.micro_batches}): this schedule needs at least {minimum} micro-batches on "
            f"{config.pipeline_stages} stages ranks ({count} stages); raise micro_batches"
        )


def check_pipeline_optimizer(
    model: nn.Module, config: ParallelConfig, optimizer: OptimizerFactory
) -> None:
    """``offload="optimizer"`` updates each piece of a parameter apart, on the host: the
    user's optimizer must be elementwise (:func:`plait.runtime.program.zero.check_elementwise`; built
    once over the model's parameters to see its class, meta ones included)."""
    if config.offload == "optimizer":
        check_elementwise(optimizer(list(model.parameters())), None)


def _refuse_unread_positional(
    model: nn.Module, args: tuple, pipe: Any, carried: pp_comm.CarriedInputs
) -> None:
    """A positional model input that no stage reads cannot be left out of the first stage's
    arguments (the others would shift): refused, with the keyword way that works."""
    names = [n.name for n in pipe.split_gm.graph.nodes if n.op == "placeholder"][: len(args)]
    unread = [n for n in names if n in carried.unread]
    if unread:
        raise NotBuiltError(
            f"pipeline stages of {type(model).__name__}: the positional model inputs {unread} "
            "are read by no stage (the trace found each to be the same tensor as another "
            "input); pass the model's inputs by keyword in loss_fn (model(input_ids=ids, "
            "labels=ids)), or pass distinct tensors (labels=ids.clone())"
        )


def _rows(batch: Any) -> set[int]:
    """The dim-0 sizes of a batch's tensors."""
    return {x.shape[0] for x in tree_leaves(batch) if isinstance(x, torch.Tensor) and x.ndim}


def _to_cpu(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _concat(*pieces: Any) -> Any:
    if isinstance(pieces[0], torch.Tensor):
        return torch.cat(pieces) if pieces[0].ndim else torch.stack(pieces).mean()
    return pieces[0]


def _local_example(batch: Any, parts: int) -> Any:
    """One micro-batch of one data-parallel rank from a global example batch, as real tensors
    (the stages are traced on it)."""

    def piece(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return x
        if x.shape[0] % parts:
            raise ShardingError(
                f"pipeline parallel: batch tensor of shape {tuple(x.shape)}: dim 0 does not "
                f"divide into {parts} pieces (data-parallel ranks x micro_batches); use a "
                f"global batch size divisible by {parts}"
            )
        shape = (x.shape[0] // parts, *x.shape[1:])
        if x.device.type == "meta":
            return torch.zeros(shape, dtype=x.dtype)
        return x[: shape[0]].clone()

    return tree_map(piece, batch)
