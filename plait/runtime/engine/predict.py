"""Distributed inference: ``job.predict(batch)`` returns the model's outputs, whole, on every rank.

The batch is the whole batch, the same on every rank (a prompt, an evaluation batch). The
model is called the way its documentation shows: ``model(**batch)`` for a dict,
``model(*batch)`` for a tuple or list, ``model(batch)`` for a tensor, in eval mode without
gradients (``use_cache=False`` added for a model whose forward takes it: a key/value cache
is generation state, not an output). Each rank computes its part and the outputs (logits, hidden states, a Hugging Face
``ModelOutput`` and its fields) come back whole on every rank, equal to one device's:

* ``stand_alone``: the model, called;
* pure data parallel (plain tensors): each rank runs its slice of dim 0 and the pieces are
  gathered (one all-gather per output tensor); a batch whose dim 0 does not divide over the
  data-parallel ranks runs whole on every rank, with no communication;
* plans (``semi_auto``, ``auto``, plan files, ``data_parallel`` on a mesh with other axes):
  the model's eval-mode forward is captured once per batch shape (on meta stand-ins of the
  parameters: no rank builds the whole model) with the training plan's strategies wherever
  they apply to the same op (as ``evaluate`` does); an op only prediction runs, or whose
  shapes the training strategy does not fit, runs replicated. That forward is traced once into
  a per-rank program (the plan executor's DTensor ops lowered to local ops and collectives,
  ZeRO-3's gathers inside, as a training step's program), run on local pieces; the outputs
  are gathered from their layouts;
* ``hybrid``: the user's layout-aware forward on its DTensor parameters, outputs gathered;
* pipelines: :meth:`plait.runtime.pipeline.job.PipelineJob.predict`.

A 0-d output (the loss a model computes when the batch holds labels) is averaged over the
data-parallel ranks where each rank computed its own slice: it equals one device's when every
slice counts the same number of items (no ignored labels), as data parallel's loss does.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from plait._compat import simulation_suspended, tree_leaves, tree_map, tree_unflatten
from plait.comm.dispatch import PlaitDispatchMode
from plait.comm.dp import gather_pieces, rank_slice
from plait.comm.dtensor import (
    distribute,
    full_value,
    implicit_replication,
    local_piece,
)
from plait.errors import ShardingError
from plait.graph import in_mode
from plait.layout import TensorLayout
from plait.runtime.engine.meta_init import require_initialised
from plait.runtime.engine.precision import autocast_for

if TYPE_CHECKING:
    from plait.config import ParallelConfig
    from plait.mesh import MeshSpec
    from plait.runtime.engine.data_parallel import PlainDataParallel

__all__ = [
    "PlannedForward",
    "batch_key",
    "call_arguments",
    "call_model",
    "meta_stand_ins",
    "predict_laid_out",
    "predict_plain",
    "predict_program",
    "predict_stand_alone",
    "without_cache",
]

logger = logging.getLogger(__name__)


class Job(Protocol):
    """What prediction reads of a :class:`plait.Job` (named here, not imported: each engine's
    Job calls its function of this module)."""

    model: nn.Module
    config: ParallelConfig
    loss_fn: Any

    @property
    def mesh(self) -> MeshSpec | None: ...

    @property
    def device_mesh(self) -> Any: ...

    @property
    def device_type(self) -> str: ...


class PlainJob(Job, Protocol):
    plain: PlainDataParallel


class ProgramJob(Job, Protocol):
    def program_for_evaluation(self, executor: Any = None) -> Any: ...


def call_arguments(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's arguments for ``batch``, as its documentation calls it: a dict's items as
    keywords, a tuple's or list's items in order, anything else as the one argument."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    return (batch,), {}


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model`` called on ``batch`` as its documentation shows (:func:`call_arguments`)."""
    args, kwargs = call_arguments(batch)
    return model(*args, **kwargs)


@contextlib.contextmanager
def _predicting(job: Job, batch: Any) -> Iterator[Any]:
    """What every engine's prediction does around its own: the model initialised, the batch
    checked (``use_cache=False`` added where the model takes it), eval mode, no gradients."""
    require_initialised(job.model, "job.predict")
    _check_batch(batch)
    with torch.no_grad(), in_mode(job.model, training=False):
        yield without_cache(job.model, batch)


def _precision(job: Job) -> contextlib.AbstractContextManager[Any]:
    return autocast_for(job.config.precision, job.device_type)


def predict_stand_alone(job: Job, batch: Any) -> Any:
    """``job.predict`` on one device: the model, called."""
    with _predicting(job, batch) as batch, _precision(job):
        return call_model(job.model, batch)


def predict_plain(job: PlainJob, batch: Any) -> Any:
    """``job.predict`` under pure data parallel: each rank's slice, the outputs gathered."""
    with _predicting(job, batch) as batch:
        return _predict_plain(job, job.plain, batch, _precision(job))


def predict_program(job: ProgramJob, batch: Any) -> Any:
    """``job.predict`` of a plan's job: the eval-mode forward's per-rank program."""
    with _predicting(job, batch) as batch:
        executor = job.loss_fn
        if not isinstance(executor, PlannedForward):
            raise TypeError(f"a plan job's loss_fn is its executor, not {type(executor).__name__}")
        return _predict_program(job, executor, batch)


def predict_laid_out(job: Job, batch: Any) -> Any:
    """``job.predict`` under hybrid: the user's layout-aware forward on DTensors, its outputs
    gathered whole."""
    with (
        _predicting(job, batch) as batch,
        implicit_replication(),
        PlaitDispatchMode(),
        _precision(job),
    ):
        return tree_map(full_value, call_model(job.model, _laid_out(job, batch)))


def without_cache(model: nn.Module, batch: Any) -> Any:
    """``batch`` with ``use_cache=False`` added when it is a dict and the model's forward takes
    ``use_cache`` (Hugging Face models): a key/value cache is generation state, not an output
    (and not a tensor tree the program could return)."""
    if not isinstance(batch, dict) or "use_cache" in batch:
        return batch
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        takes = False
    return {**batch, "use_cache": False} if takes else batch


def _check_batch(batch: Any) -> None:
    if not any(isinstance(x, torch.Tensor) for x in tree_leaves(batch)):
        raise ShardingError(
            f"job.predict: the batch ({type(batch).__name__}) holds no tensor; pass the model's "
            "inputs as a tensor, a tuple or a dict of tensors (as model(**batch) takes them)"
        )


def _divides(batch: Any, parts: int) -> bool:
    """Every tensor of ``batch`` with a dim 0 splits into ``parts`` equal slices."""
    return all(
        x.ndim == 0 or x.shape[0] % parts == 0
        for x in tree_leaves(batch)
        if isinstance(x, torch.Tensor)
    )


# ------------------------------------------------------------------------ plain data parallel


def _predict_plain(
    job: Job,
    plain: PlainDataParallel,
    batch: Any,
    precision: contextlib.AbstractContextManager[Any],
) -> Any:
    batch = tree_map(lambda x: x.to(plain.device) if isinstance(x, torch.Tensor) else x, batch)
    if plain.size == 1 or not _divides(batch, plain.size):
        if plain.size > 1:
            logger.info("job.predict: batch dim 0 does not divide over %d ranks", plain.size)
        with precision:
            return tree_map(full_value, call_model(job.model, batch))

    def piece(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return x
        return rank_slice(x, plain.size, plain.rank)

    with precision:
        out = call_model(job.model, tree_map(piece, batch))
    gathered = tree_map(
        lambda x: gather_pieces(x, plain.group_mesh) if isinstance(x, torch.Tensor) else x, out
    )
    return tree_map(lambda x: full_value(x) if isinstance(x, torch.Tensor) else x, gathered)


# ------------------------------------------------------------------------------------ plans


@runtime_checkable
class PlannedForward(Protocol):
    """What a plan job's executor (:class:`plait.runtime.engine.plan_exec.PlanExecutor`) gives
    prediction: the executor of the eval-mode forward for a batch, and its outputs."""

    def predictor(self, model: nn.Module, batch: Any) -> PlannedForward: ...

    def outputs(self, model: nn.Module, batch: Any) -> Any: ...


def _predict_program(job: ProgramJob, training: PlannedForward, batch: Any) -> Any:
    """A plan job's prediction as a per-rank program: the eval-mode forward for ``batch``'s
    shapes traced once (the executor's, on this plan's strategies), run on local pieces, its
    outputs gathered whole."""
    from plait.runtime.program.compile import forward_outputs

    executor: Any = training.predictor(job.model, batch)
    program = job.program_for_evaluation(executor)
    with torch.no_grad():
        flat = [local_piece(x) for x in executor.flat_inputs(job.model, batch)]
        out = program.run(torch.ones(()), flat)
        tensors = sum(spec.placements is not None for spec in program.outputs)
        for name, value in zip(program.buffers, out[tensors:], strict=True):
            local_piece(job.model.get_buffer(name)).copy_(value)
        values = forward_outputs(program, out[:tensors])
        tree = tree_unflatten(values, executor.captured.program.call_spec.out_spec)
        return tree_map(lambda x: full_value(x) if isinstance(x, torch.Tensor) else x, tree)


def batch_key(batch: Any) -> tuple[Any, ...]:
    """What a captured forward depends on: the batch's structure, shapes, dtypes, constants."""
    leaves = [
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x), x)
        for x in tree_leaves(batch)
    ]
    return (type(batch), tuple(batch) if isinstance(batch, dict) else (), *leaves)


@contextlib.contextmanager
def meta_stand_ins(model: nn.Module) -> Iterator[None]:
    """Inside the block every parameter and buffer of ``model`` is an empty tensor of its
    global shape on meta (its DTensor pieces put back after): torch.export cannot trace DTensor
    parameters, and reads only shapes. Tied parameters keep one stand-in."""
    saved: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    stand_ins: dict[int, nn.Parameter] = {}
    try:
        # Made outside a simulated world: there a factory call gives a LocalTensor, which
        # export turns into a constant it then fails to lift (StopIteration).
        with simulation_suspended():
            for module in model.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        saved.append((module, name, True, p))
                        if id(p) not in stand_ins:
                            empty = torch.empty(p.shape, dtype=p.dtype, device="meta")
                            stand_ins[id(p)] = nn.Parameter(empty, p.requires_grad)
                        module._parameters[name] = stand_ins[id(p)]
                for name, b in module._buffers.items():
                    if b is not None:
                        saved.append((module, name, False, b))
                        module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        yield
    finally:
        for module, name, is_param, t in saved:
            table = module._parameters if is_param else module._buffers
            table[name] = t  # type: ignore[assignment]


# ------------------------------------------------------------------------------------ hybrid


def _laid_out(job: Job, batch: Any) -> Any:
    """The whole batch as DTensors: dim 0 split over the data-parallel axis where it divides
    (each rank keeps its slice, no communication), else whole on every rank."""
    mesh, dp = job.mesh, job.config.dp_axis
    assert mesh is not None
    size = mesh.axis_size(dp) if dp in mesh.axis_names else 1
    split = size > 1 and _divides(batch, size)

    def lay(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        dims: tuple[tuple[str, ...], ...] = ((),) * x.ndim
        if split and x.ndim:
            dims = ((dp,), *dims[1:])
        return distribute(x, job.device_mesh, TensorLayout(mesh, dims))

    return tree_map(lay, batch)
