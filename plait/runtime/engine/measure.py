"""Measured memory of one training step, by kind, beside the plan's prediction.

:func:`measure_step_memory` runs one ``job.step(batch)`` and returns this rank's
:class:`MemoryMeasurement`:

* **parameters**: bytes of the model's parameters as this rank holds them (the local piece of a
  DTensor parameter: under ZeRO-3 its 1/dp shard);
* **gradients**: bytes of the gradients held after the step (the parameters' and the optimizer's
  own, a ZeRO shard's included), which stay until the next step's ``zero_grad``;
* **optimizer**: bytes of the optimizer's states (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``)
  and of the tensors it updates that are not the parameters themselves: the shard copies
  ("shadows") optimizer parallel levels 1 and 2 keep (the fp32 master copy of mixed precision
  plays that part in the ZeRO paper's count);
* **activations**: the peak minus the model states (the three kinds above) alive at the moment
  of the peak: everything else the step holds at once: values kept from forward for backward,
  the program's temporaries, ZeRO-3's gathered parameters, communication buffers, the batch and
  the model's buffers (on CUDA not ``other``, below);
* **peak**: the most bytes alive at once during the step, the model states included (on CUDA
  also what the allocator holds outside tensors, ``other``: cuBLAS workspaces and the like).

Every storage is counted once, however many tensors view it (a gradient bucket's flat buffer,
a ZeRO-3 shadow sharing its parameter's piece).

How the bytes are counted. On CPU a dispatch mode (:class:`_LiveStorages`) sees every op the
step runs (DTensor ops after DTensor has turned them into local ops, and the per-rank program's
aten ops), keeps a weak reference to each storage it meets and the running total of bytes
alive, and remembers which storages were alive at the peak; after the step the model states'
storages are looked up in that set. It is the technique of PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` (whose peak ``tests/unit/test_measure.py``
checks this one's against), kept here because MemTracker sorts bytes by module hooks, which a
compiled per-rank program never calls. Memory outside tensors (gloo's own buffers, Python
objects) is not counted. On CUDA the peak is the caching allocator's
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``), the same tracker says
which model states were alive at its own peak (the two moments can differ slightly), and the
allocator's bytes at the start that no tensor of the job, its optimizer or the batch accounts
for are reported apart (``other``), not as activations.

Under ``plait.testing.simulate`` one simulated rank is measured (``rank=``, default the first):
its piece of every LocalTensor.

The step's own cost is not part of a measurement: run a warm-up step first, so the optimizer
has made its states (the first step creates them inside ``optimizer.step``) and lazily built
caches exist.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from plait._compat import LocalTensor, TorchDispatchMode, simulated_ranks, tree_leaves
from plait.comm.dtensor import is_dtensor, local_piece

__all__ = [
    "KINDS",
    "ComparisonRow",
    "MemoryMeasurement",
    "compare",
    "format_bytes",
    "measure_step_memory",
    "model_state_tensors",
    "plan_of",
    "storage_bytes",
]

KINDS = ("parameters", "gradients", "optimizer", "activations")
"""The kinds of a measurement, as ``Plan.predicted.memory_by_kind`` names them."""


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True, slots=True)
class MemoryMeasurement:
    """One rank's memory during one training step, in bytes (see the module docstring)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak: int
    states_at_peak: int
    """Bytes of parameters, gradients and optimizer states alive at the peak (``peak -
    activations - other``); less than their sum when the peak comes before every gradient
    exists."""
    source: str
    """Where the peak comes from: ``"tracker"`` (CPU) or ``"cuda allocator"``."""
    other: int = 0
    """CUDA: the allocator's bytes outside every tensor the step can reach, at its start
    (cuBLAS workspaces and the like), part of the peak but not of the activations; 0 on CPU."""

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states held after the step."""
        return self.parameters + self.gradients + self.optimizer

    def by_kind(self) -> dict[str, int]:
        """``{parameters, gradients, optimizer, activations, peak}``."""
        return {**{k: getattr(self, k) for k in KINDS}, "peak": self.peak}

    def table_row(self, name: str = "") -> str:
        """A markdown row: ``| name | parameters | gradients | optimizer | activations | peak |``."""
        cells = [name, *(format_bytes(v) for v in self.by_kind().values())]
        return "| " + " | ".join(cells) + " |"

    @staticmethod
    def table_header() -> str:
        """The header :meth:`table_row` rows go under."""
        return (
            "| case | parameters | gradients | optimizer | activations | peak |\n"
            "|---|---:|---:|---:|---:|---:|"
        )


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One kind of memory, predicted by the plan and measured."""

    kind: str
    predicted: int
    measured: int

    @property
    def ratio(self) -> float:
        """predicted / measured (``inf`` when nothing was measured but something predicted)."""
        if self.measured == 0:
            return 1.0 if self.predicted == 0 else math.inf
        return self.predicted / self.measured


def compare(measurement: MemoryMeasurement, plan: Any) -> list[ComparisonRow]:
    """The measurement beside ``plan.predicted``: one row per kind, then the peak.

    The prediction's peak is ``plan.predicted.memory_bytes``; a kind the prediction lacks is 0.
    """
    predicted = plan.predicted
    by_kind = dict(predicted.memory_by_kind)
    rows = [ComparisonRow(k, int(by_kind.get(k, 0)), getattr(measurement, k)) for k in KINDS]
    rows.append(ComparisonRow("peak", int(predicted.memory_bytes), measurement.peak))
    return rows


def plan_of(job: Any) -> Any:
    """The plan a job runs: a plan job's executor's, a pipeline's made from a plan, or None
    (plain data parallel, stand-alone, pipelines of marks)."""
    built = getattr(job, "built", job)  # a DeferredJob: the job it planned
    if built is None:
        return None
    plan = getattr(built, "plan", None)
    if plan is not None:
        return plan
    return getattr(getattr(built, "loss_fn", None), "plan", None)


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"`` (binary units, 3 significant figures)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- storages


def _pieces(tensor: torch.Tensor, rank: int | None) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``tensor``'s memory on ``rank``: a DTensor's local piece, a
    simulated LocalTensor's piece for ``rank``, other wrapper subclasses' inner tensors."""
    if is_dtensor(tensor):
        yield from _pieces(local_piece(tensor), rank)
    elif isinstance(tensor, LocalTensor):
        pieces = tensor._local_tensors
        chosen = rank if rank in pieces else min(pieces)
        yield from _pieces(pieces[chosen], rank)
    elif hasattr(tensor, "__tensor_flatten__"):  # a traceable wrapper subclass
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _pieces(getattr(tensor, name), rank)
    else:
        yield tensor


def _storages(tensor: torch.Tensor, rank: int | None) -> list[torch.UntypedStorage]:
    out = []
    for piece in _pieces(tensor, rank):
        if piece.device.type == "meta" or type(piece).__name__ == "FakeTensor":
            continue
        out.append(piece.untyped_storage())
    return out


def storage_bytes(tensors: Iterable[torch.Tensor], rank: int | None = None) -> int:
    """Bytes of the storages behind ``tensors`` on ``rank``, each storage counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        for st in _storages(t, rank):
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def model_state_tensors(job: Any) -> dict[str, list[torch.Tensor]]:
    """The job's model states by kind: ``{"parameters", "gradients", "optimizer"}``.

    Parameters are those of the modules this process holds (the model; a pipeline rank's stages); the optimizer's are its states and the tensors it updates
    (under optimizer parallel: shard copies, or the ZeRO-3 pieces themselves, which share the
    parameters' storage and so count once, as parameters); gradients are both sides'.
    """
    optimizer: torch.optim.Optimizer = job.optimizer
    # the modules whose state this process holds (a pipeline rank: its stages)
    modules: list[torch.nn.Module] = (
        job.state_modules() if hasattr(job, "state_modules") else [job.model]
    )
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    updated = [p for group in optimizer.param_groups for p in group["params"]]
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    grads = [p.grad for p in [*params, *updated] if p.grad is not None]
    return {"parameters": params, "gradients": grads, "optimizer": [*updated, *states]}


def _storage_kinds(
    job: Any, rank: int | None
) -> tuple[dict[int, tuple[str, torch.UntypedStorage]], dict[str, int]]:
    """Each model-state storage's kind (the first kind that names it: parameters, then
    optimizer, then gradients), keyed by id; and the bytes of each kind."""
    tensors = model_state_tensors(job)
    kinds: dict[int, tuple[str, torch.UntypedStorage]] = {}
    for kind in ("parameters", "optimizer", "gradients"):
        for t in tensors[kind]:
            for st in _storages(t, rank):
                kinds.setdefault(id(st), (kind, st))
    held = dict.fromkeys(("parameters", "gradients", "optimizer"), 0)
    for kind, st in kinds.values():
        held[kind] += st.nbytes()
    return kinds, held


# --------------------------------------------------------------------------- the tracker


class _Storage:
    """One storage the tracker met: its bytes (a record, compared by identity)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class _LiveStorages(TorchDispatchMode):
    """Bytes of the storages alive while it is active, their peak and the set alive at it.

    Storages are met as inputs and outputs of dispatched ops (and by :meth:`add`); a weak
    reference to each tells when it is freed. The set alive at the peak is copied lazily: when
    the first storage is freed after a new peak, or when asked.
    """

    def __init__(self, rank: int | None) -> None:
        super().__init__()
        self._rank = rank
        self._live: dict[int, tuple[_Storage, weakref.ref[torch.UntypedStorage]]] = {}
        self.bytes = 0
        self.peak = 0
        self._at_peak: set[_Storage] = set()
        self._pending = False  # a new peak whose live set is not copied yet
        self._open = True

    def add(self, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        for st in _storages(tensor, self._rank):
            key = id(st)
            known = self._live.get(key)
            if known is not None:
                if known[0].nbytes != st.nbytes():  # resized in place
                    self._change(known[0], st.nbytes())
                continue
            record = _Storage(st.nbytes())
            ref = weakref.ref(st, self._freed_callback(key, record))
            self._live[key] = (record, ref)
            self._change(record, record.nbytes, new=True)

    def _freed_callback(self, key: int, record: _Storage) -> Any:
        def freed(_: Any) -> None:
            if not self._open:
                return
            known = self._live.get(key)
            if known is None or known[0] is not record:
                return
            self._snapshot_if_pending()
            del self._live[key]
            self.bytes -= record.nbytes

        return freed

    def _change(self, record: _Storage, nbytes: int, *, new: bool = False) -> None:
        delta = nbytes if new else nbytes - record.nbytes
        if delta < 0:
            self._snapshot_if_pending()
        record.nbytes = nbytes
        self.bytes += delta
        if self.bytes > self.peak:
            self.peak = self.bytes
            self._pending = True

    def _snapshot_if_pending(self) -> None:
        if self._pending:
            self._at_peak = {record for record, _ in self._live.values()}
            self._pending = False

    def alive_at_peak(self, storage: torch.UntypedStorage) -> int:
        """Bytes ``storage`` held at the peak (0 if it was not alive then)."""
        self._snapshot_if_pending()
        known = self._live.get(id(storage))
        if known is None or known[0] not in self._at_peak:
            return 0
        return known[0].nbytes

    def close(self) -> None:
        self._snapshot_if_pending()
        self._open = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        inputs = tree_leaves((args, kwargs))
        if any(is_dtensor(x) for x in inputs):
            # Let DTensor turn the op into local ops first; they come back through this mode.
            return NotImplemented
        for x in inputs:
            self.add(x)
        out = func(*args, **kwargs)
        for x in tree_leaves(out):
            self.add(x)
        return out


# --------------------------------------------------------------------------- measuring


def _device_type(job: Any) -> str:
    for p in job.model.parameters():
        return local_piece(p).device.type
    return "cpu"


def _measured_rank(rank: int | None) -> int | None:
    ranks = simulated_ranks()
    if ranks is None:
        return None
    if rank is None:
        return ranks[0]
    if rank not in ranks:
        raise ValueError(f"measure_step_memory(rank={rank}): the simulated ranks are {ranks}")
    return rank


def measure_step_memory(job: Any, batch: Any, *, rank: int | None = None) -> MemoryMeasurement:
    """Run one ``job.step(batch)`` and measure this rank's memory (see the module docstring).

    Args:
        job: a :class:`~plait.runtime.engine.job.Job` (a DeferredJob that has planned: step it once
            first, or give ``parallelize`` an ``example_batch``).
        batch: what ``job.step`` takes on this rank.
        rank: under ``plait.testing.simulate``, the simulated rank to measure (default the
            first); ignored on real processes, which measure themselves.

    Returns the measurement; the step's loss is not kept (call ``job.step`` for it).
    """
    if getattr(job, "built", job) is None:
        raise ValueError(
            "measure_step_memory: the job plans at its first step, which would be measured "
            "with the planning; step it once first (a warm-up), or pass example_batch= to "
            "plait.parallelize"
        )
    measured_rank = _measured_rank(rank)
    cuda = _device_type(job) == "cuda"
    tracker = _LiveStorages(measured_rank)
    for tensors in model_state_tensors(job).values():
        for t in tensors:
            tracker.add(t)
    for t in job.model.buffers():
        tracker.add(t)
    for x in tree_leaves(batch):
        tracker.add(x)
    other = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        other = max(0, int(torch.cuda.memory_allocated()) - tracker.bytes)
    with tracker:
        job.step(batch)
    if cuda:
        torch.cuda.synchronize()
    tracker.close()
    kinds, held = _storage_kinds(job, measured_rank)
    states_at_peak = sum(tracker.alive_at_peak(st) for _, st in kinds.values())
    peak = int(torch.cuda.max_memory_allocated()) if cuda else tracker.peak
    return MemoryMeasurement(
        parameters=held["parameters"],
        gradients=held["gradients"],
        optimizer=held["optimizer"],
        activations=max(0, peak - states_at_peak - other),
        peak=peak,
        states_at_peak=states_at_peak,
        source="cuda allocator" if cuda else "tracker",
        other=other,
    )
