"""The Job: one training step (forward, backward, gradient sync, update) on a parallel model."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn
from torch.export.graph_signature import InputKind

from plait._compat import (
    dtensor_like,
    greedy_redistribution_planning,
    same_on_every_rank,
    tree_map,
)
from plait.comm.dispatch import PlaitDispatchMode
from plait.comm.dtensor import (
    DeviceMesh,
    distribute,
    dtensor_from_local,
    from_local_piece,
    full_value,
    implicit_replication,
    is_dtensor,
    local_piece,
    sync_grad,
)
from plait.comm.world import current_world
from plait.config import ParallelConfig
from plait.data import input_layouts, planned_piece, split_micro_batches
from plait.errors import CheckpointError, NotBuiltError, ShardingError
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.runtime.engine.data_parallel import PlainDataParallel, PlainGradSync
from plait.runtime.engine.meta_init import require_initialised
from plait.runtime.engine.metrics import metrics_log, step_metrics
from plait.runtime.engine.precision import LossScaler, autocast_for
from plait.runtime.engine.predict import batch_key
from plait.runtime.program.compile import Program, check_loss
from plait.runtime.program.grad_sync import GradSync
from plait.runtime.program.zero import ZeroOptimizer, reduce_scatter_accumulated
from plait.support import Engine

if TYPE_CHECKING:
    from plait.runtime.engine.checkpoint import CheckpointPart, SaveHandle, Stateful
    from plait.runtime.engine.measure import MemoryMeasurement
    from plait.runtime.engine.report import RunReport

__all__ = [
    "DeferredJob",
    "HybridJob",
    "Job",
    "LossFn",
    "MeshJob",
    "OptimizerFactory",
    "PlainJob",
    "ProgramJob",
    "StandAloneJob",
]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Job:
    """A model laid out on its devices, with its optimizer and loss; ``step(batch)`` trains
    once.

    Create it with :func:`plait.parallelize`, not directly. Each engine a config runs on
    (:func:`plait.support.engine_of`) is a subclass: :class:`StandAloneJob` (one device),
    :class:`PlainJob` (pure data parallel on plain tensors), :class:`ProgramJob` (a plan's
    compiled per-rank program), :class:`HybridJob` (the user's own code on DTensors), and the
    pipeline's :class:`~plait.runtime.pipeline.job.PipelineJob`; :class:`DeferredJob` becomes
    one of them at its first step. What they share (checkpoints, reports, metrics,
    generation) is here; nothing here chooses an engine.
    """

    engine: ClassVar[Engine]
    """The engine this job runs on (:data:`plait.support.Engine`)."""
    parameters_laid_out: ClassVar[bool] = True
    """The parameters are DTensors in a layout (False: plain tensors, whole on every rank)."""
    device_mesh: DeviceMesh | None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: ParallelConfig,
        *,
        mesh: MeshSpec | None,
        device_mesh: DeviceMesh | None,
        slice_inputs: bool,
        layouts: dict[str, TensorLayout],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.mesh = mesh
        self.device_mesh = device_mesh
        self.parameter_layouts = layouts
        self._slice_inputs = slice_inputs
        self.loss_scaler = LossScaler() if config.precision == "fp16" else None
        self.steps_taken = 0
        """Optimizer steps taken (restored by :meth:`load`)."""
        self.before_update: list[Callable[[], None]] = []
        """Called after a step's last backward, before the optimizer's update (a
        parameter-server job pushes its tables' row gradients there)."""
        self.checkpoint_parts: list[CheckpointPart] = []
        """State kept outside this job's processes, saved and loaded with it (a
        parameter-server job's tables)."""
        self.parameter_server: Any = None
        """A parameter-server job's link to its servers (:class:`plait.ps.worker.PsClient`:
        its ``traffic``); None for other jobs (nothing reads it to choose a path)."""
        self._saving: SaveHandle | None = None
        self._save_group: Any = None
        self._step_seconds: list[float] = []
        """Wall time of each ``step`` call on this rank (for :meth:`report`)."""
        self.metrics = None if config.log_dir is None else metrics_log(config, _global_rank())
        """Global rank 0's metrics files under ``ParallelConfig.log_dir``, written at every
        step (:mod:`plait.runtime.engine.metrics`); None without ``log_dir`` and on other ranks."""
        if self.metrics is not None:  # closed when the job goes, or at the process's end
            weakref.finalize(self, self.metrics.close)

    # ------------------------------------------------------------ what each engine writes

    def _step(self, batch: Any) -> float:
        """One step (see :meth:`step`) on this job's engine."""
        raise NotImplementedError(f"{type(self).__name__} has no training step")

    def evaluate(self, batch: Any) -> float:
        """The global loss on ``batch`` without training (the model in eval mode).

        A job running a plan takes the batch size ``step`` takes: with ``grad_accumulation=k``
        the batch is cut into ``k`` micro-batches and the mean of their losses is returned, as
        ``step`` computes its loss.
        """
        raise NotImplementedError(f"{type(self).__name__} has no evaluation")

    def predict(self, batch: Any) -> Any:
        """The model's outputs on ``batch``, whole, on every rank (distributed inference).

        ``batch`` is the whole batch, the same on every rank; the model is called as its
        documentation shows (``model(**batch)`` for a dict, ``model(*batch)`` for a tuple,
        ``model(batch)`` for a tensor) in eval mode without gradients. Each rank computes its
        part under the job's layout and the outputs (logits, hidden states, a Hugging Face
        ``ModelOutput``) come back whole, equal to one device's. Every rank must call it.
        See :mod:`plait.runtime.engine.predict`.
        """
        raise NotImplementedError(f"{type(self).__name__} has no prediction")

    def shard_batch(self, batch: Any) -> Any:
        """``batch`` as this rank's step reads it (its slice, or DTensors in the batch's
        layout; see each engine)."""
        return batch

    @property
    def device_type(self) -> str:
        """The device type this job computes on (autocast's, the metrics' peak memory)."""
        first = next(iter(self.model.parameters()), None)
        return "cpu" if first is None else local_piece(first).device.type

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers, same keys as ``model.state_dict()``.

        Gathers sharded tensors: on real processes every rank must call it. The values are
        copies, never the live parameters.
        """
        return {k: full_value(v).clone() for k, v in self.model.state_dict().items()}

    def _batch_processes(self, batch: Any) -> int:
        """How many processes' batches make up a step's global batch (for the metrics'
        samples per second): 1 where ``step`` takes the global batch."""
        return 1

    def _finite_check_mesh(self) -> DeviceMesh | None:
        """The mesh fp16's inf/NaN check agrees over (None: every rank's gradients are
        already the same, nothing to agree on)."""
        return None

    # ------------------------------------------------------------------------- shared

    def step(self, batch: Any) -> float:
        """Forward, backward, gradient reduction and one optimizer update; returns the global loss.

        With ``grad_accumulation=k`` the batch is cut into ``k`` micro-batches along dim 0, run
        one after another with their gradients summed locally, and reduced across devices once,
        after the last: the update equals one step on the whole batch (MindSpore's gradient
        accumulation).
        """
        require_initialised(self.model)  # meta init: nothing loaded into the empty pieces yet
        started = time.perf_counter()
        loss = self._step(batch)
        self._step_seconds.append(time.perf_counter() - started)
        self.steps_taken += 1
        if self.metrics is not None:
            self.metrics.write(step_metrics(self, batch, loss, self._step_seconds[-1]))
        return loss

    def close(self) -> None:
        """Close this job's metrics files (``ParallelConfig.log_dir``), flushed after every
        step already; the end of the process, or the job's collection, closes them too.
        Steps after it are not logged."""
        if self.metrics is not None:
            self.metrics.close()

    def report(self, memory: MemoryMeasurement | None = None, *, warmup: int = 1) -> RunReport:
        """What the plan predicted beside what this rank measured: the median step time of
        the steps so far (the first ``warmup`` left out) and the peak memory of ``memory``
        (``plait.runtime.engine.measure.measure_step_memory(job, batch)``; on CUDA the allocator's
        peak when not given). ``print(job.report())`` shows the table; see
        :mod:`plait.runtime.engine.report`."""
        from plait.runtime.engine.report import run_report

        return run_report(self, self._step_seconds, memory, warmup)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        loader: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
        async_save: bool = False,
    ) -> SaveHandle:
        """Write a sharded checkpoint of this job to directory ``path``; every rank calls it.

        Saved: the model's parameters and buffers and the optimizer's states (each rank writes
        the pieces it holds), the step count, RNG streams, the loss scaler, the optimizer's
        hyperparameters, ``loader``'s position and each of ``stateful``'s objects (anything
        with ``state_dict``, such as an LR scheduler), with the plan and a manifest of every
        file's checksum beside them. The checkpoint appears at ``path`` only once complete: a
        crash during a save leaves what was there before.

        ``async_save=True`` copies the state to host memory and returns at once; the files are
        written in a background thread while training goes on. The next save, load, or
        ``handle.wait()`` waits for it. Returns a handle either way.
        """
        from plait.runtime.engine.checkpoint import save_job

        self._saving = save_job(self, path, loader=loader, stateful=stateful, async_save=async_save)
        return self._saving

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        loader: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
        optimizer: bool = True,
    ) -> int:
        """Load a checkpoint written by :meth:`save`, under this job's plan; returns the number
        of steps already taken.

        ``path`` is a checkpoint, or a directory of them (the newest complete ``step-*``). The
        checkpoint may come from another mesh, layout, optimizer-parallel level or number of
        processes: each rank reads just the parts it holds. Every file's checksum, the model's
        names and shapes and the optimizer's class are checked first; on an error nothing is
        loaded. ``optimizer=False`` loads the model alone. RNG streams are restored when the
        number of processes is the same.
        """
        from plait.runtime.engine.checkpoint import load_job

        return load_job(self, path, loader=loader, stateful=stateful, optimizer=optimizer)

    def load_pretrained(self, path: str | os.PathLike[str]) -> list[str]:
        """Load pretrained weights (a ``.safetensors`` file, or a Hugging Face model directory
        with one or several of them) into this job's parameters and buffers, each rank reading
        only the slices it holds. Returns the names loaded. See :mod:`plait.runtime.engine.pretrained`.
        """
        from plait.runtime.engine.pretrained import load_pretrained

        return load_pretrained(self.model, self.optimizer, path)

    def state_modules(self) -> list[nn.Module]:
        """The modules whose state this process holds and saves (the model; a pipeline job's
        own stages)."""
        return [self.model]

    def wait_for_save(self) -> None:
        """Block until an ``async_save`` in progress is committed (re-raising its error)."""
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.wait()

    def checkpoint_group(self) -> Any:
        """The process group background saves coordinate on (made at the first one)."""
        if self._save_group is None:
            from plait.comm.checkpoint_io import checkpoint_group

            self._save_group = checkpoint_group()
        return self._save_group

    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> torch.Tensor:
        """Greedy decoding of ``max_new_tokens`` tokens after each prompt of ``input_ids``
        (``[batch, sequence]``, the whole batch, the same on every rank; ``attention_mask``: 0
        for left padding); returns the whole ids, prompt and new tokens, on every rank.

        The forward runs on the job's layout, its key/value cache laid out as the plan lays
        out attention (heads over tp, rows over dp); the tokens equal the model's own greedy
        generation on one device. ``eos_token_id`` (default: the model's generation config's)
        ends a row. Every rank must call it. See :mod:`plait.runtime.engine.generate`.
        """
        from plait.runtime.engine.generate import generate

        return generate(
            self,
            input_ids,
            max_new_tokens=max_new_tokens,
            attention_mask=attention_mask,
            eos_token_id=eos_token_id,
        )

    def save_pretrained(
        self, directory: str | os.PathLike[str], *, max_shard_bytes: int | None = None
    ) -> Path:
        """Write the model's weights (safetensors, gathered one tensor at a time to the first
        rank, in shards of at most ``max_shard_bytes``) and, for a Hugging Face model, its
        config and generation config to ``directory``: ``from_pretrained(directory)`` loads
        the trained model, and ``job.load_pretrained(directory)`` loads it into any plan.
        Every rank must call it. See :mod:`plait.runtime.engine.save_pretrained`."""
        from plait.runtime.engine.save_pretrained import DEFAULT_SHARD_BYTES, save_pretrained

        require_initialised(self.model, "job.save_pretrained")
        return save_pretrained(
            self.model,
            directory,
            holders=self.state_modules(),
            max_shard_bytes=DEFAULT_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes,
        )

    def _gradients_usable(self) -> bool:
        """Unscale fp16 gradients; False (skip the update) if any rank saw an inf or NaN."""
        if self.loss_scaler is None:
            return True
        finite = self.loss_scaler.unscale_and_check(
            self.model.parameters(), self._finite_check_mesh()
        )
        self.loss_scaler.update(finite)
        return finite

    def _eager_step(self, batch: Any, grad_sync: GradSync | None) -> float:
        """A step run eagerly, op by op: the model's own code on its parameters (plain
        tensors on one device, DTensors under hybrid), ``grad_sync`` reducing the gradients
        once the last micro-batch's backward has made them."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        k = self.config.grad_accumulation
        total: torch.Tensor | None = None
        if grad_sync is not None:
            grad_sync.launched_in_backward = 0
        with greedy_redistribution_planning():
            for i, micro in enumerate(split_micro_batches(batch, k)):
                if grad_sync is not None:
                    # Reduce gradients only once they are complete: after the last micro-batch.
                    grad_sync.enabled = i == k - 1
                loss = self._loss(micro)
                # Backward from the loss as it is (a pending mean over the data-parallel axis):
                # going through a replicated copy would add an all-reduce to the backward pass.
                scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
                (loss * (scale / k) if scale != 1.0 or k != 1 else loss).backward()
                total = loss.detach() if total is None else total + loss.detach()
            if grad_sync is not None:
                grad_sync.finish()
        for p in self.model.parameters():
            sync_grad(p)
        if self._gradients_usable():
            shadows = getattr(self.optimizer, "_plait_shadows", None)
            if shadows is not None:
                shadows.load_grads()
            self.optimizer.step()
        assert total is not None
        return float(full_value(total if k == 1 else total / k).item())

    @torch.no_grad()
    def _eager_evaluate(self, batch: Any, k: int) -> float:
        """``evaluate`` run eagerly: the mean of ``k`` micro-batches' global losses."""
        require_initialised(self.model, "job.evaluate")
        self.model.eval()
        with greedy_redistribution_planning():
            losses = [full_value(self._loss(m)) for m in split_micro_batches(batch, k)]
        return float(sum(loss.item() for loss in losses)) / k

    def _loss(self, batch: Any) -> torch.Tensor:
        """The loss function on ``batch`` as this engine runs it eagerly."""
        raise NotImplementedError(f"{type(self).__name__} runs no eager loss")


class StandAloneJob(Job):
    """The model as it is, on one process (``mode="stand_alone"``): the reference every
    parallel job is compared with."""

    engine: ClassVar[Engine] = "stand_alone"
    parameters_laid_out: ClassVar[bool] = False
    device_mesh: None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: ParallelConfig,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            loss_fn,
            config,
            mesh=None,
            device_mesh=None,
            slice_inputs=False,
            layouts={},
        )

    def _step(self, batch: Any) -> float:
        return self._eager_step(batch, None)

    def evaluate(self, batch: Any) -> float:
        return self._eager_evaluate(batch, 1)

    def predict(self, batch: Any) -> Any:
        from plait.runtime.engine.predict import predict_stand_alone

        return predict_stand_alone(self, batch)

    def _loss(self, batch: Any) -> torch.Tensor:
        with autocast_for(self.config.precision, self.device_type):
            return self.loss_fn(self.model, batch)


class MeshJob(Job):
    """What the jobs on a device mesh share: the mesh, the batch laid out as
    ``dataset_strategy`` says, the loss run on DTensors."""

    mesh: MeshSpec
    device_mesh: DeviceMesh

    @property
    def device_type(self) -> str:
        return str(self.device_mesh.device_type)

    def _finite_check_mesh(self) -> DeviceMesh | None:
        return self.device_mesh

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # a gathered DTensor is a new tensor already: no copy on top
        return {k: full_value(v) for k, v in self.model.state_dict().items()}

    def _batch_processes(self, batch: Any) -> int:
        """How many processes' batches make up a step's global batch (for the metrics'
        samples per second): 1 where ``step`` takes the global batch (simulated worlds,
        ``full_batch``), else the data-parallel processes whose slices it is (per-input
        strategies: the cuts of the first input's dim 0)."""
        if self._slice_inputs:
            return 1
        strategies = self.config.dataset_strategy
        if isinstance(strategies, tuple):
            first = strategies[0] if strategies else ()
            cuts = first.splits() if isinstance(first, TensorLayout) else tuple(first)
            return int(cuts[0]) if cuts else 1
        dp = self.config.dp_axis
        return self.mesh.axis_size(dp) if dp in self.mesh.axis_names else 1

    def _loss(self, batch: Any) -> torch.Tensor:
        batch = self.shard_batch(batch)
        precision = autocast_for(self.config.precision, self.device_type)
        with implicit_replication(), PlaitDispatchMode(), precision:
            loss = self.loss_fn(self.model, batch)
        check_loss(loss)
        return loss

    def shard_batch(self, batch: Any) -> Any:
        """Lay out every tensor of ``batch`` as ``dataset_strategy`` says.

        ``"data_parallel"``/``"full_batch"``: dim 0 across the data-parallel axis. Per-input
        strategies: each input of a tuple/list batch takes its own layout (``plait.data``).
        """
        strategies = self.config.dataset_strategy
        if isinstance(strategies, tuple):
            return self._shard_per_input(batch, strategies)
        return tree_map(self._shard_input, batch)

    def _shard_per_input(self, batch: Any, strategies: tuple[Any, ...]) -> Any:
        if not isinstance(batch, tuple | list) or len(batch) != len(strategies):
            raise ShardingError(
                f"dataset_strategy gives {len(strategies)} per-input strategies, so step() takes a "
                f"tuple of {len(strategies)} tensors; got {type(batch).__name__} "
                f"{'of ' + str(len(batch)) if isinstance(batch, tuple | list) else ''}"
            )
        # Layouts depend on the strategies and ranks only; shapes are checked when slicing.
        probe = [(self.mesh.size,) * x.ndim for x in batch]
        layouts = input_layouts(strategies, probe, self.mesh, dp_axis=self.config.dp_axis)
        out = [
            distribute(x, self.device_mesh, layout)
            if self._slice_inputs
            else from_local_piece(x, self.device_mesh, layout)
            for x, layout in zip(batch, layouts, strict=True)
        ]
        return type(batch)(out)

    def _shard_input(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or is_dtensor(x):
            return x
        mesh, dp = self.mesh, self.config.dp_axis
        dp_size = mesh.axis_size(dp) if dp in mesh.axis_names else 1
        if x.ndim == 0 or dp_size == 1:
            return distribute(x, self.device_mesh, TensorLayout.replicated(mesh, x.ndim))
        layout = TensorLayout(mesh, ((dp,),) + ((),) * (x.ndim - 1))
        if self._slice_inputs:
            if x.shape[0] % dp_size:
                raise ShardingError(
                    f"batch tensor of shape {tuple(x.shape)}: dim 0 ({x.shape[0]}) does not divide "
                    f"into {dp_size} data-parallel pieces (mesh axis {dp!r}); use a global batch "
                    f"size divisible by {dp_size}"
                )
            return distribute(x, self.device_mesh, layout)
        return from_local_piece(x, self.device_mesh, layout)


class HybridJob(MeshJob):
    """MindSpore's hybrid (manual) mode: the user's layout-aware code run eagerly on its
    DTensor parameters (``plait.ops`` and DTensor's propagation decide the collectives);
    ``grad_sync`` reduces the gradients the user left to data parallel."""

    engine: ClassVar[Engine] = "hybrid"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: ParallelConfig,
        *,
        mesh: MeshSpec,
        device_mesh: DeviceMesh,
        slice_inputs: bool,
        layouts: dict[str, TensorLayout],
        grad_sync: GradSync | None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            loss_fn,
            config,
            mesh=mesh,
            device_mesh=device_mesh,
            slice_inputs=slice_inputs,
            layouts=layouts,
        )
        self.grad_sync = grad_sync
        """The fused data-parallel reduction; None where nothing is reduced over dp."""

    def _step(self, batch: Any) -> float:
        return self._eager_step(batch, self.grad_sync)

    def evaluate(self, batch: Any) -> float:
        return self._eager_evaluate(batch, 1)

    def predict(self, batch: Any) -> Any:
        from plait.runtime.engine.predict import predict_laid_out

        return predict_laid_out(self, batch)


class PlainJob(MeshJob):
    """Pure data parallelism on plain tensors (:mod:`plait.runtime.engine.data_parallel`):
    each rank runs the model as it is on its slice of the batch, gradients all-reduced in
    fused buckets during backward."""

    engine: ClassVar[Engine] = "plain"
    parameters_laid_out: ClassVar[bool] = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: ParallelConfig,
        *,
        mesh: MeshSpec,
        device_mesh: DeviceMesh,
        layouts: dict[str, TensorLayout],
        plain: PlainDataParallel,
        grad_sync: PlainGradSync | None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            loss_fn,
            config,
            mesh=mesh,
            device_mesh=device_mesh,
            slice_inputs=plain.slice_inputs,
            layouts=layouts,
        )
        self.plain = plain
        """This rank's place in the data-parallel group and its batch slicing."""
        self.grad_sync = grad_sync
        """The fused all-reduce buckets; None with one rank or nothing trained."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return Job.full_state_dict(self)  # plain tensors: copies, not the live parameters

    def _finite_check_mesh(self) -> DeviceMesh | None:
        # the gradients are summed over ranks already, the same on every rank (an inf or NaN
        # anywhere is in the sum): no extra collective is needed to agree
        return None

    def shard_batch(self, batch: Any) -> Any:
        """This rank's slice of ``batch``'s dim 0 (the batch as given where each process
        passes its own)."""
        return self.plain.local_batch(batch)

    def _step(self, batch: Any) -> float:
        plain = self.plain
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        k = self.config.grad_accumulation
        sync = self.grad_sync
        if sync is not None:
            sync.launched_in_backward = 0
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # Gradients are summed over ranks: scaling the loss by 1/dp makes the sum the mean.
        weight = scale / (k * plain.size)
        total: torch.Tensor | None = None
        started: torch.Tensor | None = None
        for i, micro in enumerate(split_micro_batches(batch, k)):
            if sync is not None:
                # Reduce gradients only once they are complete: after the last micro-batch.
                sync.enabled = i == k - 1
            loss = self._loss(micro)
            total = loss.detach() if total is None else total + loss.detach()
            if i == k - 1:
                started = plain.start_loss_sum(total)  # runs while backward computes
            (loss * weight if weight != 1.0 else loss).backward()
        if sync is not None:
            sync.finish()
        for hook in self.before_update:
            hook()
        if self._gradients_usable():
            self.optimizer.step()
        assert started is not None
        return plain.mean_of(started) / k

    @torch.no_grad()
    def evaluate(self, batch: Any) -> float:
        require_initialised(self.model, "job.evaluate")
        self.model.eval()
        return self.plain.mean_of(self.plain.start_loss_sum(self._loss(batch)))

    def predict(self, batch: Any) -> Any:
        from plait.runtime.engine.predict import predict_plain

        return predict_plain(self, batch)

    def _loss(self, batch: Any) -> torch.Tensor:
        """The loss on this rank's slice of ``batch``, checked (a training step's must depend
        on the parameters: with gradients on, it does)."""
        training = torch.is_grad_enabled()
        local = self.plain.local_batch(batch)
        with autocast_for(self.config.precision, self.device_type):
            loss = self.loss_fn(self.model, local)
        if not isinstance(loss, torch.Tensor) or (training and not loss.requires_grad):
            raise ShardingError(
                f"loss_fn returned a {type(loss).__name__} that does not depend on the model's "
                "parameters; return the loss tensor itself (no .item() or .detach())"
            )
        if loss.numel() != 1:
            raise ShardingError(
                f"loss_fn returned a tensor of shape {tuple(loss.shape)}; return a scalar loss"
            )
        return loss


class ProgramJob(MeshJob):
    """A plan's job: each step runs the plan's compiled per-rank program
    (:mod:`plait.runtime.program.compile`: forward and backward on local pieces, every
    collective explicit, the passes of ZeRO, recompute, offload and gradient buckets over
    it); ``loss_fn`` is the plan's executor, ``evaluate`` and ``predict`` run the forward of
    its eval-mode program."""

    engine: ClassVar[Engine] = "program"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: ParallelConfig,
        *,
        mesh: MeshSpec,
        device_mesh: DeviceMesh,
        slice_inputs: bool,
        layouts: dict[str, TensorLayout],
        grad_sync: GradSync | None,
        program: Program,
        program_for: Callable[[Any], Program],
        evaluation_for: Callable[[Any, bool], Program],
    ) -> None:
        super().__init__(
            model,
            optimizer,
            loss_fn,
            config,
            mesh=mesh,
            device_mesh=device_mesh,
            slice_inputs=slice_inputs,
            layouts=layouts,
        )
        self.grad_sync = grad_sync
        """The plan's fused data-parallel buckets; None where nothing is reduced over dp."""
        self.program = program
        """The compiled per-rank program the step runs: the one of the last batch shape
        stepped or evaluated."""
        self.program_for = program_for
        """The program for another executor of the plan (a new batch shape): traced and
        given the same passes as :attr:`program`."""
        self.evaluation_for = evaluation_for
        """``evaluation_for(executor, outputs)``: the evaluation program for an executor of
        the plan, the forward of the model's eval-mode program (traced at the first
        ``evaluate`` of a batch shape); with ``outputs``, of the model without its loss
        (``predict``'s executor, returning the model's outputs)."""
        self._evaluations: dict[int, tuple[Any, Program]] = {}
        """id(executor) -> (executor, its evaluation or prediction program)."""
        self.replan: Callable[[Any, Any], tuple[Any, Program]] | None = None
        """``replan(executor, batch)`` plans and compiles again for a laid-out batch of a new
        shape (:mod:`plait.runtime.engine.replan`); None: the job runs its planned shapes only."""
        self._by_shape: dict[tuple[Any, ...], tuple[Any, Program]] = {}
        self._trained_cache: tuple[Program, list[nn.Parameter]] | None = None

    def _step(self, batch: Any) -> float:
        """``step`` by the compiled per-rank program.

        Each micro-batch is one call of the program (forward and backward on local pieces,
        the plan's redistributions inside it); gradients are summed locally, then reduced over
        the data-parallel axis in the plan's fused buckets and over other pending axes one by
        one, then the optimizer updates the local pieces.
        """
        program = self._for_batch_shape(batch)  # may trace a new program: autograd on
        # The rest records no autograd graph: the program holds its own backward, and a
        # DTensor's local piece is then its tensor (``to_local`` is an autograd function
        # otherwise, tens of microseconds per parameter and step).
        with torch.no_grad():
            return self._run_program_step(batch, program)

    def _run_program_step(self, batch: Any, program: Program) -> float:
        """:meth:`_step_program` once the program for ``batch``'s shapes is known."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        k = self.config.grad_accumulation
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        weight = torch.tensor(scale / k, dtype=torch.float32)
        trained = self._trained_parameters(program)
        grads: list[torch.Tensor] | None = None
        total: torch.Tensor | None = None
        for micro in split_micro_batches(batch, k):
            # the program was traced on contiguous inputs: a batch sliced by the user
            # (``ids[:, :-1]``) arrives strided, and its views would not fit it (the batch
            # only: parameters are the program's own, checked by nothing on this hot path)
            micro = tree_map(_contiguous, micro)
            flat = self._program_inputs(micro, program)
            out = program.run(weight, flat)
            loss, new = out[0], out[1 : 1 + len(trained)]
            if grads is None:
                grads = list(new)
            else:  # summed in place: one set of summed gradients, not a third alongside
                for a, b in zip(grads, new, strict=True):
                    a.add_(b)
            for name, value in zip(program.buffers, out[1 + len(trained) :], strict=True):
                local_piece(self.model.get_buffer(name)).copy_(value)
            total = loss.detach() if total is None else total + loss.detach()
            del out, new, loss  # the last micro-step's gradients die here, not after the update
        assert grads is not None and total is not None
        for hook in self.before_update:  # after the step's last backward (a server's push)
            hook()
        meshes = program.grad_meshes  # HSDP's gradient shards: on the shard groups' mesh
        for i, (p, g, placements) in enumerate(
            zip(trained, grads, program.grad_placements, strict=True)
        ):
            dp = cast(Any, p)  # a DTensor parameter: a plan job places every one
            mesh = meshes.get(i, dp.device_mesh)
            if placements == dp.placements and mesh is dp.device_mesh:  # the cheap wrapper
                p.grad = dtensor_like(p, g)
            else:
                p.grad = dtensor_from_local(g, mesh, placements, p.shape, p.stride())
        shadows = getattr(self.optimizer, "_plait_shadows", None)
        zero = shadows if isinstance(shadows, ZeroOptimizer) else None
        self._reduce_gradients(program, trained, zero)
        if self._gradients_usable():
            if shadows is not None:
                shadows.load_grads()
            self.optimizer.step()
            if zero is not None:
                zero.after_step()
        local = total / k if k != 1 else total
        if all(p.is_replicate() for p in program.loss_placements):  # reduced in the program
            return float(same_on_every_rank(local, "the loss").item())
        loss_value = dtensor_from_local(local, self.device_mesh, program.loss_placements, (), ())
        return float(full_value(loss_value).item())

    def _program_inputs(self, micro: Any, program: Program) -> list[Any]:
        """The program's inputs for one micro-batch, local pieces: the executor's (its
        parameters, buffers, constants and the batch laid out as planned); with multi-copy
        parallel each batch input holds the copies' pieces one after another along dim 0, as
        the program cuts them."""
        flat_inputs = self.loss_fn.flat_inputs  # type: ignore[attr-defined]
        if program.copies == 1:
            return [local_piece(x) for x in flat_inputs(self.model, self.shard_batch(micro))]
        copies = split_micro_batches(micro, program.copies)
        flats = [flat_inputs(self.model, self.shard_batch(c)) for c in copies]
        out: list[Any] = []
        for i, spec in enumerate(program.inputs):
            if spec.kind == InputKind.USER_INPUT and isinstance(flats[0][i], torch.Tensor):
                out.append(torch.cat([local_piece(f[i]) for f in flats]))
            else:
                out.append(local_piece(flats[0][i]))
        return out

    def _for_batch_shape(self, batch: Any) -> Program:
        """The program for ``batch``'s micro-batch shapes, made active (``loss_fn`` and
        ``program``): the planned one, one planned before for these shapes, or planned now
        (once per shape, logged; :mod:`plait.runtime.engine.replan`). A job that cannot plan again
        keeps its program, whose executor refuses other shapes by name."""
        piece = planned_piece(batch, self.config)  # with interleave_num: one copy
        key = batch_key(piece)
        found = self._by_shape.get(key)
        if found is None:
            found = self._program_of_shape(piece)
            if found is None:
                return self.program
            self._by_shape[key] = found
        self.loss_fn, self.program = found
        return found[1]

    def _program_of_shape(self, micro: Any) -> tuple[Any, Program] | None:
        laid_out = self.shard_batch(micro)
        known = [(self.loss_fn, self.program), *self._by_shape.values()]
        for executor, program in known:
            if executor.accepts(laid_out):  # type: ignore[attr-defined]
                return executor, program
        if self.replan is None:
            return None
        return self.replan(self.loss_fn, laid_out)

    def _reduce_gradients(
        self, program: Program, trained: list[nn.Parameter], zero: ZeroOptimizer | None
    ) -> None:
        """What the program left pending: the fused buckets when it did not sum them itself
        (gradient accumulation: once, after the last micro-batch), then other pending axes."""
        owned: set[int] = set()
        if self.grad_sync is not None:
            owned = self.grad_sync.skip  # reduce-scattered by optimizer parallel
            if program.fused_buckets:  # summed inside the program, during its backward
                self.grad_sync.launched_in_backward = program.fused_buckets
            else:
                if zero is not None:
                    reduce_scatter_accumulated(zero)
                self.grad_sync.finish()
        for p in trained:
            if id(p) not in owned:
                sync_grad(p)

    def _trained_parameters(self, program: Program) -> list[nn.Parameter]:
        """The parameters whose gradients the program returns, resolved once per program."""
        cached = self._trained_cache
        if cached is None or cached[0] is not program:
            cached = (program, [self.model.get_parameter(n) for n in program.trained])
            self._trained_cache = cached
        return cached[1]

    @torch.no_grad()
    def evaluate(self, batch: Any) -> float:
        require_initialised(self.model, "job.evaluate")
        self.model.eval()
        self._for_batch_shape(batch)
        # the evaluation program runs one planned piece a call (one copy with interleave_num)
        return self._evaluate_program(
            batch, self.config.planned_pieces, self.program_for_evaluation()
        )

    def predict(self, batch: Any) -> Any:
        from plait.runtime.engine.predict import predict_program

        return predict_program(self, batch)

    @property
    def evaluation_program(self) -> Program | None:
        """The per-rank program ``evaluate`` runs for the active batch shape (a plan job's,
        traced at its first ``evaluate``: the forward of the model's eval-mode program), None
        before it or for other jobs."""
        found = self._evaluations.get(id(self.loss_fn))
        return None if found is None else found[1]

    def program_for_evaluation(self, executor: Any = None) -> Program:
        """The evaluation program of the active executor (traced once per executor); given a
        prediction's ``executor``, its forward program."""
        outputs = executor is not None
        executor = self.loss_fn if executor is None else executor
        found = self._evaluations.get(id(executor))
        if found is None:
            found = self._evaluations[id(executor)] = (
                executor,
                self.evaluation_for(executor, outputs),
            )
        return found[1]

    def _evaluate_program(self, batch: Any, k: int, program: Program) -> float:
        """``evaluate`` by the evaluation program: each micro-batch's forward on local pieces,
        the mean of their global losses."""
        one = torch.ones((), dtype=torch.float32)
        evaluator = self.loss_fn.evaluator(self.model)  # type: ignore[attr-defined]
        losses = []
        for micro in split_micro_batches(batch, k):
            micro = tree_map(_contiguous, micro)
            flat = [
                local_piece(x) for x in evaluator.flat_inputs(self.model, self.shard_batch(micro))
            ]
            out = program.run(one, flat)
            for name, value in zip(program.buffers, out[1:], strict=True):
                local_piece(self.model.get_buffer(name)).copy_(value)
            loss = dtensor_from_local(out[0], self.device_mesh, program.loss_placements, (), ())
            losses.append(float(full_value(loss).item()))
        return sum(losses) / k


class DeferredJob(Job):
    """A Job planned at its first step, on that step's batch (``parallelize`` without
    ``example_batch``), as MindSpore compiles at the first call and torch.compile at the first
    run.

    Until then the model is untouched and only ``model`` and ``config`` exist; ``step``,
    ``evaluate`` and ``full_state_dict`` plan first; any other attribute (``optimizer``,
    ``program``, ``loss_fn``...) is there once the job is planned. The plan is for the first
    batch's shapes; a later batch of another shape plans again (:mod:`plait.runtime.engine.replan`).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ParallelConfig,
        build: Callable[[Any], Job],
        *,
        mesh: MeshSpec | None = None,
        device_mesh: DeviceMesh | None = None,
        to_global: Callable[[Any], Any] | None = None,
        engine: Engine = "program",
    ) -> None:
        self.model = model
        self._engine: Engine = engine
        self._to_global = to_global
        """A real process's own slice of a batch -> the global batch's shapes (for planning)."""
        self.config = config
        self._build = build
        self._built: Job | None = None
        self._mesh = mesh
        self._device_mesh = device_mesh
        self._pending_load: tuple[Any, bool, int] | None = None
        """(checkpoint, optimizer, step) that :meth:`load` left for the planned job."""

    @property
    def mesh(self) -> MeshSpec | None:  # type: ignore[override]
        """The job's mesh: known now when the config fixes it, else once planned."""
        return self._built.mesh if self._built is not None else self._mesh

    @property
    def device_mesh(self) -> DeviceMesh | None:  # type: ignore[override]
        """The DeviceMesh the planned job runs on (built at parallelize when the mesh is known)."""
        return self._built.device_mesh if self._built is not None else self._device_mesh

    @property  # type: ignore[misc]
    def engine(self) -> Engine:  # type: ignore[override]
        """The engine the planned job runs on: a plan's program, or pipeline stages."""
        return self._built.engine if self._built is not None else self._engine

    def shard_batch(self, batch: Any) -> Any:
        return self._job(batch).shard_batch(batch)

    def _job(self, batch: Any) -> Job:
        if self._built is None:
            logger.info(
                "planning %s (mode %s) at the first step, on batch shapes %s",
                type(self.model).__name__,
                self.config.mode,
                _shapes(batch),
            )
            example = batch if self._to_global is None else self._to_global(batch)
            built = self._build(example)
            if self._pending_load is not None:
                where, optimizer, _ = self._pending_load
                built.load(where, optimizer=optimizer)
                self._pending_load = None
            self._built = built
        return self._built

    @property
    def built(self) -> Job | None:
        """The planned job, once the first step has made it."""
        return self._built

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in (
            "_built",
            "_build",
            "_mesh",
            "_device_mesh",
            "_to_global",
            "_pending_load",
            "_engine",
        ):
            raise AttributeError(name)
        built = self.__dict__.get("_built")
        if built is None:
            raise AttributeError(
                f"job.{name} exists once the job is planned, at its first step(batch); call "
                "step first, or pass example_batch= to plait.parallelize to plan at once"
            )
        return getattr(built, name)

    def step(self, batch: Any) -> float:
        return self._job(batch).step(batch)

    def evaluate(self, batch: Any) -> float:
        return self._job(batch).evaluate(batch)

    def predict(self, batch: Any) -> Any:
        built = self._built
        if built is None:
            raise NotBuiltError(
                "job.predict before the job is planned: a job made without example_batch= is "
                "planned at its first step(batch), on a training batch; call step first, or "
                "pass example_batch= to plait.parallelize to plan at once"
            )
        return built.predict(batch)

    def save_pretrained(self, directory: str | os.PathLike[str], **kwargs: Any) -> Path:
        """As :meth:`Job.save_pretrained`; before the first step every rank holds the whole
        model as it was passed in, and that is written."""
        if self._built is not None:
            return self._built.save_pretrained(directory, **kwargs)
        from plait.runtime.engine.save_pretrained import DEFAULT_SHARD_BYTES, save_pretrained

        shard = kwargs.get("max_shard_bytes") or DEFAULT_SHARD_BYTES
        return save_pretrained(self.model, directory, max_shard_bytes=shard)

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self._built is None:
            from plait.runtime.engine.generate import refuse_unbuilt

            raise refuse_unbuilt("generate")
        return self._built.generate(input_ids, **kwargs)

    def report(self, memory: MemoryMeasurement | None = None, *, warmup: int = 1) -> RunReport:
        if self._built is None:
            raise NotBuiltError(
                "job.report() before the first step: the job is planned at its first "
                "step(batch) and nothing has run yet; step first"
            )
        return self._built.report(memory, warmup=warmup)

    @property
    def steps_taken(self) -> int:  # type: ignore[override]
        if self._built is not None:
            return self._built.steps_taken
        return 0 if self._pending_load is None else self._pending_load[2]

    def save(self, path: Any, **kwargs: Any) -> Any:
        if self._built is None:
            raise CheckpointError(
                f"job.save({os.fspath(path)!r}) before the first step: this job is planned at "
                "its first step(batch), and until then there is nothing but the model you "
                "passed in; save after a step, or pass example_batch= to plait.parallelize"
            )
        return self._built.save(path, **kwargs)

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        loader: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
        optimizer: bool = True,
    ) -> int:
        """As :meth:`Job.load`. Before the first step the checkpoint is checked now and the
        loader's position and ``stateful`` objects restored; the model and optimizer states
        are loaded once the first step has planned the job."""
        if self._built is not None:
            return self._built.load(path, loader=loader, stateful=stateful, optimizer=optimizer)
        from plait.runtime.engine.checkpoint import prepare_deferred_load

        where, step = prepare_deferred_load(path, loader=loader, stateful=stateful)
        self._pending_load = (where, optimizer, step)
        return step

    def wait_for_save(self) -> None:
        if self._built is not None:
            self._built.wait_for_save()

    def close(self) -> None:
        if self._built is not None:
            self._built.close()

    def load_pretrained(self, path: str | os.PathLike[str]) -> list[str]:
        """As :meth:`Job.load_pretrained`. Before the first step the whole model is loaded on
        every rank (placement slices it at the first step); a meta model is refused."""
        if self._built is not None:
            return self._built.load_pretrained(path)
        from plait.runtime.engine.meta_init import has_meta_tensors
        from plait.runtime.engine.pretrained import load_pretrained

        if has_meta_tensors(self.model):
            raise CheckpointError(
                f"job.load_pretrained({os.fspath(path)!r}) on a job planned at its first step, "
                "whose model is on the meta device: its pieces are placed only once it is "
                "planned, so there is nothing to load into yet. Pass example_batch= to "
                "plait.parallelize (the global batch; meta tensors are fine) to plan at once"
            )
        return load_pretrained(self.model, None, path)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self._built is None:  # not planned yet: the model is still whole
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return self._built.full_state_dict()


def _global_rank() -> int:
    """This process's rank in the whole job: the world's (0 in a simulated world, which one
    process runs), else the launcher's (a stand-alone job under several processes)."""
    world = current_world()
    if world is not None:
        return world.rank
    from plait.launch.environment import detect_environment

    return detect_environment().rank


def _shapes(batch: Any) -> list[tuple[int, ...]]:
    from plait._compat import tree_leaves

    return [tuple(x.shape) for x in tree_leaves(batch) if isinstance(x, torch.Tensor)]


def _contiguous(x: Any) -> Any:
    """``x`` laid out contiguously when it is a tensor that is not (no copy otherwise)."""
    return x.contiguous() if isinstance(x, torch.Tensor) and not x.is_contiguous() else x
