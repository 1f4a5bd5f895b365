"""Saving and loading a Job: sharded, resumable, loadable under any other plan.

One checkpoint holds, as a DCP checkpoint (:mod:`plait.comm.checkpoint_io`):

* ``model.<name>``: every entry of ``model.state_dict()`` (parameters and buffers), each rank
  writing the pieces it holds;
* ``optim.<parameter>.<state>``: the optimizer's per-parameter states (Adam's moments...) as
  global tensors laid out like the piece the optimizer updates: the parameter's layout, or
  under optimizer parallel its shard's (so ZeRO's 1/dp states are saved 1/dp per rank);
  scalar states (Adam's ``step``) whole;

and, beside it, each rank's small state (``extra/rank<r>.pt``: RNG streams, data-loader
position, loss scaler, the optimizer's hyperparameters, user objects with ``state_dict``), the
plan the job ran, and the manifest with the step and every file's checksum
(:mod:`plait.checkpoint.files`).

Because every tensor is saved with its global shape and each piece's offset, a load under
another mesh, layout or optimizer-parallel level reads on each rank just the parts of the
saved pieces that overlap the pieces it will hold (MindSpore's strategy transformation, done
by DCP): dp=4 to dp=2 x tp=2, to ZeRO-3, to one process, and back.

A load checks everything before it writes anything (the manifest, every file's checksum, the
model's names and shapes, the optimizer's class), so a bad checkpoint leaves the job as it was.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from plait._compat import TORCH_VERSION, simulated_ranks
from plait.checkpoint import files
from plait.checkpoint.manager import Stateful
from plait.comm import checkpoint_io as io
from plait.comm.dtensor import dtensor_from_local, is_dtensor, local_piece
from plait.errors import CheckpointError, DamagedCheckpointError
from plait.runtime.engine.meta_init import mark_initialised
from plait.runtime.program.local_optim import LocalShadows
from plait.runtime.program.zero import ZeroOptimizer


class CheckpointedJob(Protocol):
    """What saving and loading read and restore of a job (:class:`plait.runtime.engine.job.Job` and
    its subclasses are ones; this module is called by the job and does not import it)."""

    model: nn.Module
    optimizer: Any
    loss_fn: Any
    config: Any
    loss_scaler: Any
    mesh: Any
    steps_taken: int

    checkpoint_parts: list[CheckpointPart]

    def state_modules(self) -> list[nn.Module]: ...

    def wait_for_save(self) -> None: ...

    def checkpoint_group(self) -> Any: ...


class CheckpointPart(Protocol):
    """State a job keeps outside its processes' model and optimizer (a parameter server's
    tables), saved into and loaded from a directory of its own in the checkpoint
    (``parts/<name>``). Every worker calls both, together; each raises the same error
    everywhere (:class:`~plait.errors.CheckpointError`) when it fails."""

    name: str

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...


PARTS = "parts"
"""The checkpoint's folder of :class:`CheckpointPart` directories."""


__all__ = [
    "CheckpointPart",
    "SaveHandle",
    "Stateful",
    "load_job",
    "prepare_deferred_load",
    "read_extras",
    "save_job",
]

logger = logging.getLogger(__name__)

MODEL, OPTIM = files.MODEL, files.OPTIM


@dataclass(frozen=True, slots=True)
class _Slot:
    """One parameter as the optimizer sees it."""

    name: str
    param: torch.Tensor
    key: torch.Tensor
    """The tensor the optimizer keys its state by: a local shadow, or the parameter itself."""
    placements: tuple[Any, ...] | None
    """Placements of the piece the optimizer updates (None: its states are the parameter's
    own kind, a plain tensor or a DTensor, saved as they are)."""


# ----------------------------------------------------------------------------- state of a job


def _model_state(job: CheckpointedJob) -> dict[str, torch.Tensor]:
    """What this process holds of ``model.state_dict()`` (a pipeline rank: its stages)."""
    if not _holds_part(job):
        return job.model.state_dict()
    # A stage module may register as persistent what the model does not save (a traced
    # stage keeps every buffer): the model's own state_dict names decide.
    names = set(job.model.state_dict())
    return {k: v for m in job.state_modules() for k, v in m.state_dict().items() if k in names}


def _holds_part(job: CheckpointedJob) -> bool:
    """True when this process holds part of the model (a pipeline rank's stages)."""
    return job.state_modules() != [job.model]


def _named_parameters(job: CheckpointedJob) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for m in job.state_modules() for n, p in m.named_parameters()]


def _slots(job: CheckpointedJob) -> list[_Slot]:
    optimizer = job.optimizer
    names = {id(p): n for n, p in _named_parameters(job)}
    shadows = getattr(optimizer, "_plait_shadows", None)
    if isinstance(shadows, ZeroOptimizer):
        return [
            _Slot(names[id(p)], p, s, _zero_placements(shadows, p, spec))
            for p, s, spec in shadows.pairs
        ]
    if isinstance(shadows, LocalShadows):
        return [_Slot(names[id(p)], p, s, _layout(p)[1]) for p, s in shadows.pairs]
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [_Slot(n, p, p, None) for n, p in _named_parameters(job) if id(p) in in_optimizer]


def _zero_placements(zero: ZeroOptimizer, p: torch.Tensor, spec: Any) -> tuple[Any, ...] | None:
    """Placements of the piece a :class:`ZeroOptimizer` shadow holds of parameter ``p``: its
    shard's under optimizer parallel levels 1 and 2 (the shadow is a copy of it), else the
    parameter's own (the shadow is its local piece, or a host copy of it). A plain parameter
    (a pipeline stage's under ``offload="optimizer"``, neither tp nor FSDP2 splitting it) has
    none: its shadow is the whole tensor, so its states are saved as plain tensors of its
    shape, the same entries a job without offload saves."""
    if spec is not None and zero.level in (1, 2):
        return tuple(spec.placements)
    return _layout(p)[1] if is_dtensor(p) else None


def _layout(p: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """(device mesh, placements) of a parameter the optimizer updates a piece of: a DTensor
    (a local shadow or a ZeRO shard exists only for those)."""
    if not is_dtensor(p):
        raise TypeError(f"a sharded parameter should be a DTensor, not {type(p).__name__}")
    return p.device_mesh, tuple(p.placements)


def _as_global(value: torch.Tensor, slot: _Slot, where: str) -> torch.Tensor:
    """An optimizer state tensor as the global tensor a checkpoint stores."""
    if slot.placements is None or value.ndim == 0:
        return value
    if tuple(value.shape) != tuple(slot.key.shape):
        raise CheckpointError(
            f"{where} has shape {tuple(value.shape)}, neither a scalar nor the shape of the "
            f"piece the optimizer updates {tuple(slot.key.shape)}; plait saves per-element "
            "optimizer states (SGD, Adam, AdamW...) of sharded parameters; use one of those, or "
            "a layout that keeps this parameter whole"
        )
    p = slot.param
    return dtensor_from_local(value, _layout(p)[0], slot.placements, p.shape, p.stride())


def tensor_state(job: CheckpointedJob) -> dict[str, torch.Tensor]:
    """The flat tensor dict a checkpoint of ``job`` stores (sharing storage with the job)."""
    state: dict[str, torch.Tensor] = {MODEL + k: v for k, v in _model_state(job).items()}
    for slot in _slots(job):
        for k, v in job.optimizer.state.get(slot.key, {}).items():
            if isinstance(v, torch.Tensor):
                where = f"optimizer state {k!r} of parameter {slot.name!r}"
                state[f"{OPTIM}{slot.name}.{k}"] = _as_global(v, slot, where)
    return state


def _extras(
    job: CheckpointedJob, loader: Stateful | None, stateful: Mapping[str, Stateful]
) -> dict:
    scaler = job.loss_scaler
    return {
        "step": job.steps_taken,
        "rng": _rng_state(),
        "loader": None if loader is None else loader.state_dict(),
        "loss_scaler": None if scaler is None else dict(vars(scaler)),
        "optimizer": {
            "class": type(job.optimizer).__name__,
            "groups": [
                {k: v for k, v in g.items() if k != "params"} for g in job.optimizer.param_groups
            ],
        },
        "objects": {name: obj.state_dict() for name, obj in stateful.items()},
    }


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=True)
    if not isinstance(np_state, tuple):  # pragma: no cover - legacy=True gives the tuple
        raise TypeError(f"numpy's RNG state is a {type(np_state).__name__}, not a tuple")
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # Python's 625 state words as one tensor, not a tuple of ints: a load's weights-only
        # unpickler takes 0.4 ms for the small state then, against 1.1 ms with the tuple.
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_python_rng(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _python_rng(saved: Any) -> tuple[Any, ...]:
    """The state ``random.setstate`` takes, from either form a checkpoint holds: the words as
    a tensor (:func:`_rng_state`), or as a tuple or list (checkpoints before that)."""
    version, internal, gauss = saved
    words = internal.tolist() if isinstance(internal, torch.Tensor) else internal
    return (version, _tuples(words), gauss)


def _tuples(value: Any) -> Any:
    """Lists back to the tuples ``random.setstate`` wants."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


# ------------------------------------------------------------------------------------- saving


class SaveHandle:
    """A save in progress (``async_save=True``) or done: ``wait()`` until it is committed."""

    def __init__(self, path: Path, thread: threading.Thread | None = None) -> None:
        self.path = path
        self._thread = thread
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is committed; re-raise what the save raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.path


def _check_real(what: str) -> None:
    if simulated_ranks() is not None:
        raise CheckpointError(
            f"{what} in a simulated world (plait.testing.simulate): one process plays every "
            "rank there, and a checkpoint is written by real processes, each its own pieces; "
            "run it on real processes (plait run, or plait.testing.run_workers) or on one"
        )


def save_job(
    job: CheckpointedJob,
    path: str | os.PathLike[str],
    *,
    loader: Stateful | None = None,
    stateful: Mapping[str, Stateful] | None = None,
    async_save: bool = False,
) -> SaveHandle:
    """Write a checkpoint of ``job`` to directory ``path`` (see :meth:`plait.Job.save`).

    One DCP save does it all, with no collective of plait's own: the coordinator clears
    ``<path>.partial`` in DCP's plan step; each rank writes its small state (rank 0 the plan
    too) and its tensor pieces, checksumming the bytes as it writes them; DCP's gather brings
    every rank's checksums to the coordinator, which writes DCP's metadata, the manifest (last),
    and renames the directory into place before DCP's broadcast lets any rank return.
    """
    _check_real("job.save")
    job.wait_for_save()
    final = Path(path)
    partial = files.partial_path(final)
    rank = io.rank()
    extras = _extras(job, loader, dict(stateful or {}))
    state = tensor_state(job)
    if async_save:
        group = job.checkpoint_group()
        state = _staged(state)  # training may change the live tensors from now on
        extras = _copied(extras)
    else:
        group = None
    manifest = _manifest(job, extras)
    plan_text = _plan_text(job) if rank == 0 else None
    parts = _save_parts(job, final)


    def write() -> None:
        small = {f"extra/rank{rank}.pt": _serialized(extras)}
        if plan_text is not None:
            small["plan.json"] = plan_text.encode()

        def commit(written: dict[str, tuple[int, int]]) -> None:
            if parts is not None:  # written before DCP cleared the partial directory
                os.replace(parts, partial / PARTS)
            _commit(partial, final, manifest, written)

        # A synchronous save owns the process while it writes: torch.save's own CRC-32 of
        # each record, which nothing checks, is left out (io._zip_crc); a background one
        # keeps it, since the training thread may save meanwhile.
        io.save_tensors(
            state, partial, group, files=small, fresh=True, commit=commit, zip_crc=async_save
        )

    if not async_save:
        write()
        return SaveHandle(final)
    handle = SaveHandle(final)

    def background() -> None:
        try:
            write()
        except BaseException as e:  # handed to wait(), in the training thread
            handle.error = e

    thread = threading.Thread(target=background, name=f"plait-save-{final.name}")
    handle._thread = thread
    thread.start()
    return handle


def _save_parts(job: CheckpointedJob, final: Path) -> Path | None:
    """Every :class:`CheckpointPart` of ``job`` written now (in the training thread, also for
    a background save) to ``<final>.parts``, moved into the checkpoint when it commits."""
    if not job.checkpoint_parts:
        return None
    staging = final.with_name(final.name + ".parts")
    if io.rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    for part in job.checkpoint_parts:
        part.save(staging / part.name)
    return staging


def _plan_text(job: CheckpointedJob) -> str | None:
    """The plan file's text, made once per job (a plan never changes after the job is built;
    serialising a large one costs tens of milliseconds every save otherwise)."""
    plan = getattr(job.loss_fn, "plan", None)
    if plan is None:
        return None
    cached = getattr(job, "_plan_json", None)
    if cached is None or cached[0] is not plan:
        cached = (plan, plan.to_json())
        job._plan_json = cached  # type: ignore[attr-defined]
    return cached[1]


def _staged(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of every tensor (DTensors keep their layout), for a background write."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if is_dtensor(v):
            local = local_piece(v).detach().to("cpu", copy=True)
            out[k] = dtensor_from_local(local, v.device_mesh, v.placements, v.shape, v.stride())
        else:
            out[k] = v.detach().to("cpu", copy=True)
    return out


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copied(v) for v in value)
    return value


def _manifest(job: CheckpointedJob, extras: dict[str, Any]) -> dict[str, Any]:
    mesh = job.mesh
    return {
        "format": files.FORMAT,
        "step": extras["step"],
        "world_size": io.world_size(),
        "mesh": None if mesh is None else mesh.as_dict(),
        "mode": job.config.mode,
        "optimizer_shard": job.config.optimizer_shard,
        "model": type(job.model).__name__,
        "optimizer": extras["optimizer"]["class"],
        "torch": TORCH_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _serialized(obj: Any) -> bytes:
    """``torch.save`` of ``obj``, as bytes."""
    buffer = BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _commit(
    partial: Path,
    final: Path,
    manifest: dict[str, Any],
    written: dict[str, tuple[int, int]],
) -> None:
    """On the coordinator, once every rank has written: the manifest from the checksums each
    rank made of the files it wrote, as it wrote them (a file none of them recorded is read
    once here), written last; then the rename into place."""
    listed = {name: files.entry(size, digest) for name, (size, digest) in written.items()}
    for name in files.files_of(partial):
        if name not in listed:
            listed[name] = files.checksum(partial / name)
    files.write_manifest(partial, {**manifest, "files": listed})
    files.commit(partial, final)
    logger.info("checkpoint of step %d written to %s", manifest["step"], final)


# ------------------------------------------------------------------------------------ loading


def _extras_name(manifest: Mapping[str, Any], rank: int) -> str:
    """The small-state file rank ``rank`` loads: its own, or rank 0's when the world changed
    size and this rank did not exist."""
    name = f"extra/rank{rank}.pt"
    return name if name in manifest["files"] else "extra/rank0.pt"


def read_extras(path: Path, manifest: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This rank's small state from the checkpoint at ``path`` (rank 0's when the world
    changed size and this rank did not exist). With ``manifest``, the bytes read are checked
    against it before they are unpickled (:class:`io.FileProblems` naming the file)."""
    rank = io.rank()
    if manifest is not None:
        name = _extras_name(manifest, rank)
    else:
        name = f"extra/rank{rank}.pt"
        if not (path / name).is_file():
            name = "extra/rank0.pt"
    file = path / name
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is missing {str(file)!r}") from None
    if manifest is not None:
        problems = files.check_bytes(path, name, data, dict(manifest))
        if problems:
            raise io.FileProblems(problems)
    extras: dict[str, Any] = torch.load(BytesIO(data), weights_only=True)
    return extras


def _damaged(path: Path, problems: list[str]) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"checkpoint {str(path)!r} is damaged, nothing was loaded: "
        + "; ".join(problems[:5])
        + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        + ". Load an earlier checkpoint"
    )


def verify_collectively(path: Path, manifest: dict[str, Any]) -> None:
    """Every file's size and checksum, the ranks splitting the work; the same error on all
    (one object all-gather: for a load outside DCP's, see :func:`load_job` for the other)."""
    rank, world = io.rank(), io.world_size()
    names = sorted(manifest["files"])
    problems = files.verify(path, manifest, names[rank::world])
    everyone = [p for part in io.all_gather_objects(problems) for p in part]
    if everyone:
        raise _damaged(path, everyone)


def _shares(manifest: Mapping[str, Any], world: int) -> list[list[str]]:
    """The files each rank checksums during a load, balanced by size (largest first, each to
    the rank with the fewest bytes so far): every listed file but those that the ranks check
    as they read them (DCP's metadata, every rank; the small-state files they load)."""
    listed = manifest["files"]
    checked = {".metadata"} | {_extras_name(manifest, r) for r in range(world)}
    pool = sorted((n for n in listed if n not in checked), key=lambda n: (-listed[n]["bytes"], n))
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in pool:
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(name)
        load[r] += listed[name]["bytes"]
    return shares


def _verify_share(path: Path, manifest: dict[str, Any]) -> None:
    """This rank's share of the checksums (:func:`_shares`). DCP's plan step runs it: what
    it raises (:class:`io.FileProblems` naming each damaged file) fails the load on every
    rank before any rank reads. (A helper thread reading the share from the start of the
    load was measured: more CPU in all, and more time where the ranks keep the cores busy.)"""
    names = _shares(manifest, io.world_size())[io.rank()]
    problems = files.verify(path, manifest, names)
    if problems:
        raise io.FileProblems(problems)


def _open(path: Path, manifest: dict[str, Any]) -> tuple[Any, dict[str, io.SavedTensor], dict]:
    """DCP's metadata (and the tensors it lists) and this rank's small state, each read once
    and checked against the manifest first; every listed file's size."""
    problems = files.size_problems(path, manifest)
    if problems:
        raise io.FileProblems(problems)
    try:
        data = (path / ".metadata").read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no DCP metadata file '.metadata'; it is incomplete"
        ) from None
    problems = files.check_bytes(path, ".metadata", data, manifest)
    if problems:
        raise io.FileProblems(problems)
    try:
        metadata = io.parse_metadata(data)
    except Exception as e:  # what unpickling a damaged file raises
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its DCP metadata (.metadata) cannot be read "
            f"({type(e).__name__}: {e}); nothing was loaded"
        ) from e
    return metadata, io.tensors_of(metadata), read_extras(path, manifest)


def _collective_load(path: Path, load: Callable[[], None]) -> None:
    """Run one of checkpoint_io's collective loads; damaged files found by any rank become
    the same CheckpointError on every rank."""
    try:
        load()
    except io.FileProblems as e:
        raise _damaged(path, e.problems) from None


def check_model(
    path: Path,
    saved: Mapping[str, io.SavedTensor],
    model: Mapping[str, Any],
    partial: bool = False,
) -> None:
    """The checkpoint's model tensors are this model's: the same names and shapes (``partial``:
    this process holds part of the model, a pipeline stage; the rest is other ranks')."""
    have = {k[len(MODEL) :]: v for k, v in saved.items() if k.startswith(MODEL)}
    missing = [k for k in model if k not in have]
    unexpected = [] if partial else [k for k in have if k not in model]
    wrong = [
        f"{k}: saved {have[k].shape}, this model {tuple(v.shape)}"
        for k, v in model.items()
        if k in have and tuple(have[k].shape) != tuple(v.shape)
    ]
    if not (missing or unexpected or wrong):
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_few(missing)}")
    if unexpected:
        parts.append(f"not in this model: {_few(unexpected)}")
    if wrong:
        parts.append(f"shapes differ: {_few(wrong)}")
    raise CheckpointError(
        f"checkpoint {str(path)!r} does not fit this model, nothing was loaded: "
        + "; ".join(parts)
        + ". Load a checkpoint of the same model (the same class and config)"
    )


def _few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


def _optimizer_destinations(
    job: CheckpointedJob,
    saved: Mapping[str, io.SavedTensor],
    saved_class: str,
    partial: bool = False,
) -> tuple[dict[str, torch.Tensor], list[tuple[_Slot, str, torch.Tensor]]]:
    """Fresh tensors to load the saved optimizer states into, laid out as this job's optimizer
    pieces, and where each goes once loaded."""
    slots = {s.name: s for s in _slots(job)}
    ours = type(job.optimizer).__name__
    keys = [k for k in saved if k.startswith(OPTIM)]
    if keys and saved_class != ours:
        raise CheckpointError(
            f"the checkpoint's optimizer states are {saved_class}'s; this job's optimizer is "
            f"{ours}; nothing was loaded. Build the job with {saved_class}, or load the model "
            "alone with job.load(..., optimizer=False)"
        )
    dest: dict[str, torch.Tensor] = {}
    install: list[tuple[_Slot, str, torch.Tensor]] = []
    for key in keys:
        name, _, state_key = key[len(OPTIM) :].rpartition(".")
        slot = slots.get(name)
        if slot is None and partial:
            continue  # another stage's parameter: another rank loads it
        if slot is None:
            raise CheckpointError(
                f"checkpoint has optimizer state {key!r} for parameter {name!r}, which this "
                "job's optimizer does not train; nothing was loaded. Load with optimizer=False "
                "to take the model alone"
            )
        meta = saved[key]
        existing = job.optimizer.state.get(slot.key, {}).get(state_key)
        local, target = _destination(slot, meta, existing)
        dest[key] = target
        install.append((slot, state_key, local))
    return dest, install


def _destination(
    slot: _Slot, meta: io.SavedTensor, existing: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the optimizer will hold, what DCP loads into) for one saved state."""
    p = slot.param
    if _reusable(existing, meta, slot):
        # Load in place (as DCP does for the model): no fresh memory to touch. Every check
        # has passed by the time DCP writes into it.
        if slot.placements is None or existing.ndim == 0:
            return existing, existing
        mesh = _layout(p)[0]
        target = dtensor_from_local(existing, mesh, slot.placements, p.shape, p.stride())
        return existing, target
    if len(meta.shape) == 0:
        device = existing.device if isinstance(existing, torch.Tensor) else torch.device("cpu")
        t = torch.zeros((), dtype=meta.dtype, device=device)
        return t, t
    if tuple(meta.shape) != tuple(p.shape):
        raise CheckpointError(
            f"saved optimizer state of {slot.name!r} has shape {meta.shape}, the parameter "
            f"{tuple(p.shape)}; nothing was loaded"
        )
    if slot.placements is None:
        if is_dtensor(p):
            local = torch.zeros_like(local_piece(p), dtype=meta.dtype)
            t = dtensor_from_local(local, p.device_mesh, p.placements, p.shape, p.stride())
            return t, t
        # Like the tensor the optimizer keys its states by: under offload a host copy of
        # the parameter, so the states live on the host beside it, not on the device.
        t = torch.zeros_like(slot.key, dtype=meta.dtype)
        return t, t
    local = torch.zeros(slot.key.shape, dtype=meta.dtype, device=slot.key.device)
    target = dtensor_from_local(local, _layout(p)[0], slot.placements, p.shape, p.stride())
    return local, target


def _reusable(existing: Any, meta: io.SavedTensor, slot: _Slot) -> bool:
    """An optimizer state the job already holds with the saved dtype and this piece's shape."""
    if not isinstance(existing, torch.Tensor) or existing.dtype != meta.dtype:
        return False
    if len(meta.shape) == 0:
        return existing.ndim == 0
    if slot.placements is None:
        return tuple(existing.shape) == tuple(slot.param.shape)
    return tuple(existing.shape) == tuple(slot.key.shape) and not is_dtensor(existing)


def load_job(
    job: CheckpointedJob,
    path: str | os.PathLike[str],
    *,
    loader: Stateful | None = None,
    stateful: Mapping[str, Stateful] | None = None,
    optimizer: bool = True,
) -> int:
    """Load the checkpoint at ``path`` into ``job`` (see :meth:`plait.Job.load`).

    Every file is checked before DCP reads anything into the job, inside one DCP load and
    its own collectives: each rank checks what it reads itself (the manifest, every file's
    size, DCP's metadata, its small state) and then, in DCP's plan step, its share of the
    other files' checksums. A rank that finds a problem (or that refuses the checkpoint:
    another model, optimizer...) fails that step, and DCP's plan exchange carries the
    failure to every rank before any reads: the same error everywhere, nothing loaded.
    """
    _check_real("job.load")
    job.wait_for_save()
    where = files.resolve(path)
    manifest = files.read_manifest(where)
    model_state = {MODEL + k: v for k, v in _model_state(job).items()}
    partial = _holds_part(job)
    try:
        metadata, saved, extras = _open(where, manifest)
        check_model(where, saved, {k[len(MODEL) :]: v for k, v in model_state.items()}, partial)
        if not optimizer:
            saved = {k: v for k, v in saved.items() if not k.startswith(OPTIM)}
        dest, install = _optimizer_destinations(job, saved, extras["optimizer"]["class"], partial)
        check_host_state(where, extras, loader, stateful)
    except Exception as refused:  # every other rank is about to join DCP's load: fail it there
        reason = refused
        _collective_load(where, lambda: _refuse(where, manifest, reason))
        raise  # pragma: no cover - _refuse raised on every rank

    def before_read() -> None:
        _verify_share(where, manifest)

    _collective_load(
        where,
        lambda: io.load_tensors(
            {**model_state, **dest}, where, metadata=metadata, before_read=before_read
        ),
    )
    for part in job.checkpoint_parts:
        part.load(where / PARTS / part.name)
    for module in job.state_modules():
        mark_initialised(module)  # meta init: the pieces hold the checkpoint's values now
    # Everything below only writes what was read and checked.
    for slot, state_key, local in install:
        job.optimizer.state[slot.key][state_key] = local
    if optimizer:
        _restore_groups(job.optimizer, extras["optimizer"]["groups"])
    shadows = getattr(job.optimizer, "_plait_shadows", None)
    if isinstance(shadows, ZeroOptimizer):
        shadows.reload_from_parameters()
    if job.loss_scaler is not None and extras.get("loss_scaler"):
        vars(job.loss_scaler).update(extras["loss_scaler"])
    restore_host_state(where, manifest, extras, loader, stateful)
    job.steps_taken = int(extras["step"])
    logger.info("loaded checkpoint %s (step %d)", where, job.steps_taken)
    return job.steps_taken


def _refuse(where: Path, manifest: dict[str, Any], refused: Exception) -> None:
    """Fail the collective load on every rank with this rank's reason (damaged files found
    by any rank first: this rank still checks its share of them)."""

    def fail() -> None:
        try:
            _verify_share(where, manifest)
        except io.FileProblems as e:
            if isinstance(refused, io.FileProblems):
                raise io.FileProblems(refused.problems + e.problems) from None
            raise
        if isinstance(refused, CheckpointError | io.FileProblems):
            raise refused
        # Anything else (an unreadable file...) travels to the other ranks as plait's error.
        raise CheckpointError(
            f"checkpoint {str(where)!r} cannot be loaded, nothing was loaded: "
            f"{type(refused).__name__}: {refused}"
        ) from refused

    io.abort_load(where, fail)


def check_host_state(
    where: Path,
    extras: Mapping[str, Any],
    loader: Stateful | None,
    stateful: Mapping[str, Stateful] | None,
) -> None:
    """The checkpoint holds the loader position and user objects asked for."""
    if loader is not None and extras.get("loader") is None:
        raise CheckpointError(
            f"checkpoint {str(where)!r} was saved without a data loader, nothing was loaded; "
            "call job.load without loader=, or save with job.save(path, loader=...)"
        )
    objects = extras.get("objects", {})
    for name in stateful or {}:
        if name not in objects:
            raise CheckpointError(
                f"checkpoint {str(where)!r} holds no object {name!r} (it holds "
                f"{sorted(objects) or 'none'}), nothing was loaded; pass the names given to "
                "job.save(stateful=...)"
            )


def restore_host_state(
    where: Path,
    manifest: Mapping[str, Any],
    extras: Mapping[str, Any],
    loader: Stateful | None,
    stateful: Mapping[str, Stateful] | None,
    *,
    rng: bool = True,
) -> None:
    """The data-loader position, user objects and (same world size only) RNG streams."""
    if loader is not None:
        loader.load_state_dict(extras["loader"])
    for name, obj in (stateful or {}).items():
        obj.load_state_dict(extras["objects"][name])
    if not rng:
        return
    if manifest.get("world_size") == io.world_size():
        _set_rng_state(extras["rng"])
    else:
        logger.info(
            "checkpoint %s was saved by %s processes, loaded by %d: RNG streams are per process "
            "and were not restored",
            where,
            manifest.get("world_size"),
            io.world_size(),
        )


def _restore_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """The saved hyperparameters (a scheduler's learning rate...), group by group."""
    if len(groups) != len(optimizer.param_groups):
        logger.warning(
            "checkpoint optimizer has %d parameter groups, this one %d: hyperparameters "
            "(learning rates...) kept as they are",
            len(groups),
            len(optimizer.param_groups),
        )
        return
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update(saved)


def prepare_deferred_load(
    path: str | os.PathLike[str],
    *,
    loader: Stateful | None,
    stateful: Mapping[str, Stateful] | None,
) -> tuple[Path, int]:
    """For a job not planned yet: check the checkpoint, restore the loader's position and the
    user objects now (the loop reads batches before the first step plans the job); return
    the checkpoint and its step. The tensors and RNG streams load once the job is planned."""
    _check_real("job.load")
    where = files.resolve(path)
    manifest = files.read_manifest(where)
    verify_collectively(where, manifest)
    try:
        extras = read_extras(where, manifest)
    except io.FileProblems as e:  # changed since it was verified
        raise _damaged(where, e.problems) from None
    check_host_state(where, extras, loader, stateful)
    restore_host_state(where, manifest, extras, loader, stateful, rng=False)
    return where, int(extras["step"])
