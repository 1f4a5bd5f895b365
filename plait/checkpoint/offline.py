"""Offline checkpoint tools: read a checkpoint on one process, with no job and no process group.

* :func:`inspect` reports what a checkpoint holds: its manifest (step, world, mesh, optimizer),
  the plan it ran, every tensor (global shape, dtype, how many pieces it was saved in, bytes),
  its files with their checksums and, on request, whether the files still match them;
* :func:`merge` writes the model's parameters and buffers as one safetensors file under the
  model's own names, loadable by ``model.load_state_dict(safetensors.torch.load_file(out))``
  and, next to a Hugging Face ``config.json``, by ``from_pretrained``.

Both work on a checkpoint saved under any plan: DCP's metadata gives every tensor's global
shape, and reading a tensor assembles it from all its saved pieces
(:func:`plait.comm.checkpoint_io.read_full_tensors`). ``plait checkpoint inspect`` and
``plait checkpoint merge`` (:mod:`plait.cli.checkpoint`) are their command-line faces.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from plait.checkpoint import files
from plait.checkpoint.files import MODEL, OPTIM
from plait.comm import checkpoint_io as io
from plait.errors import CheckpointError, PlaitError

__all__ = [
    "DTYPES",
    "TensorInfo",
    "inspect",
    "merge",
    "parse_dtype",
    "problems",
    "tensor_kind",
]

# The key prefixes of a saved job (plait/runtime/engine/checkpoint.py writes them). Spelled out here
# rather than imported: the runtime imports this package, and the format is what matters.
PLAN_FILE = "plan.json"

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
"""The names ``merge`` accepts for its output dtype."""

_MERGE_BATCH_BYTES = 1 << 30
"""Saved bytes read per DCP call while merging: the peak beyond the output is one batch."""

# DCP warns on every single-process read that it assumes one process: that is the point here.


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a checkpoint as :func:`inspect` reports it."""

    name: str
    """The checkpoint key: ``model.<state_dict name>`` or ``optim.<parameter>.<state>``."""
    kind: str
    """``model`` or ``optim.<state>`` (``optim.exp_avg``...), what totals are grouped by."""
    shape: tuple[int, ...]
    """Global shape (the whole tensor, whatever the plan split it into)."""
    dtype: str
    pieces: int
    """How many pieces it was saved in (1: whole, or replicated and written once)."""
    bytes: int


# ------------------------------------------------------------------------------------ inspect


def tensor_kind(key: str) -> str:
    """``model.blocks.0.fc1.weight`` -> ``model``; ``optim.fc1.weight.exp_avg`` ->
    ``optim.exp_avg`` (an optimizer state's name is the key's last part)."""
    if key.startswith(MODEL):
        return "model"
    if key.startswith(OPTIM):
        return OPTIM + key.rsplit(".", 1)[-1]
    return "other"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _read_metadata(path: Path) -> dict[str, io.SavedTensor]:
    try:
        return io.read_tensor_metadata(path)
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no DCP metadata file (.metadata): it is incomplete "
            "or not a plait checkpoint"
        ) from None
    except Exception as e:  # DCP raises whatever unpickling a damaged file raises
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its DCP metadata (.metadata) cannot be read "
            f"({type(e).__name__}: {e}); run `plait checkpoint inspect --verify` on it"
        ) from e


def _tensor_infos(saved: Mapping[str, io.SavedTensor]) -> list[TensorInfo]:
    return [
        TensorInfo(
            name=key,
            kind=tensor_kind(key),
            shape=tuple(t.shape),
            dtype=_dtype_name(t.dtype),
            pieces=t.pieces,
            bytes=_numel(t.shape) * t.dtype.itemsize,
        )
        for key, t in saved.items()
    ]


def _totals(tensors: Iterable[TensorInfo]) -> dict[str, dict[str, int]]:
    """Per kind (model first, then optimizer states by name): tensors, elements, bytes."""
    out: dict[str, dict[str, int]] = {}
    for t in tensors:
        row = out.setdefault(t.kind, {"tensors": 0, "elements": 0, "bytes": 0})
        row["tensors"] += 1
        row["elements"] += _numel(t.shape)
        row["bytes"] += t.bytes
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != "model", kv[0])))


def _jsonable(value: Any) -> Any:
    """Optimizer hyperparameters as JSON values (tensors as numbers, tuples as lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _extras_summary(path: Path) -> dict[str, Any]:
    """What rank 0's small state holds: the optimizer's hyperparameters, which objects."""
    file = path / "extra" / "rank0.pt"
    try:
        extras = torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is missing {str(file)!r}") from None
    except Exception as e:  # a damaged pickle raises anything
        raise CheckpointError(f"{str(file)!r} cannot be read ({type(e).__name__}: {e})") from e
    optimizer = extras.get("optimizer") or {}
    return {
        "optimizer_groups": _jsonable(optimizer.get("groups", [])),
        "loader": extras.get("loader") is not None,
        "loss_scaler": extras.get("loss_scaler") is not None,
        "objects": sorted(extras.get("objects") or {}),
    }


def _plan_summary(path: Path) -> dict[str, Any] | None:
    """The plan the job ran, in brief (None when the job ran none: stand_alone, one device)."""
    file = path / PLAN_FILE
    if not file.is_file():
        return None
    from plait.planning import Plan, fmt_bytes, fmt_seconds  # only checkpoints with a plan

    try:
        plan = Plan.load(file)
    except PlaitError as e:  # another plait's plan schema is no damage to the checkpoint
        return {"file": str(file), "error": str(e)}
    p = plan.predicted
    return {
        "file": str(file),
        "model": plan.model,
        "mesh": plan.mesh.as_dict(),
        "mode": plan.mode,
        "search": plan.search,
        "hardware": plan.hardware_label,
        "precision": plan.precision,
        "micro_batches": plan.micro_batches,
        "pipeline_stages": plan.pipeline_stages,
        "optimizer_shard": plan.optimizer_shard,
        "recompute": plan.recompute,
        "grad_accumulation": plan.grad_accumulation,
        "predicted_step_time": fmt_seconds(p.step_time_s),
        "predicted_memory_per_device": fmt_bytes(p.memory_bytes),
        "summary": plan.summary(),
    }


def problems(path: str | os.PathLike[str]) -> list[str]:
    """Every file of the checkpoint at ``path`` checked against the manifest: one sentence per
    missing, truncated or corrupted file (empty when it is intact). Reads every file."""
    p = files.resolve(path)
    manifest = files.read_manifest(p)
    return files.verify(p, manifest, sorted(manifest["files"]))


def _file_info(name: str, want: dict[str, Any]) -> dict[str, Any]:
    """One file of the manifest for the report: name, bytes, the checksum with its algorithm
    (both None when the entry carries none plait knows)."""
    algorithm = files.algorithm_of(want)
    return {
        "name": name,
        "bytes": want.get("bytes"),
        "algorithm": algorithm,
        "checksum": None if algorithm is None else want[algorithm],
    }


def inspect(path: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """What the checkpoint at ``path`` (or the latest in a directory of ``step-*``) holds.

    A dict of plain values (JSON-ready): ``path``, the manifest's fields (``step``,
    ``world_size``, ``mesh``, ``mode``, ``optimizer_shard``, ``model``, ``optimizer``,
    ``torch``, ``created``), ``plan`` (None, or the plan in brief with its full ``summary``),
    ``extras`` (the optimizer's hyperparameters, which other state was saved), ``tensors``
    (one dict per tensor, as :class:`TensorInfo`, in saved order), ``totals`` per kind,
    ``files`` (name, bytes, and the manifest's checksum: ``algorithm``, ``"xxh3_64"`` or, in
    older checkpoints, ``"crc32"``, and ``checksum``, its hex digest), ``unlisted`` (files on
    disk the manifest does not list), ``verified`` and ``problems``: sentences naming each
    damaged or unreadable part (checksums only with ``verify=True``, which reads every file).

    Raises :class:`~plait.errors.CheckpointError` when ``path`` is no checkpoint; a damaged
    checkpoint is reported in ``problems``, not raised, so a broken one can be inspected.
    """
    p = files.resolve(path)
    manifest = files.read_manifest(p)
    found: list[str] = []
    if verify:
        found += files.verify(p, manifest, sorted(manifest["files"]))
    try:
        tensors = _tensor_infos(_read_metadata(p))
    except CheckpointError as e:
        tensors = []
        found.append(str(e))
    try:
        extras: dict[str, Any] | None = _extras_summary(p)
    except CheckpointError as e:
        extras = None
        found.append(str(e))
    listed = manifest.get("files", {})
    fields = ("step", "world_size", "mesh", "mode", "optimizer_shard", "model", "optimizer")
    return {
        "path": str(p),
        **{k: manifest.get(k) for k in fields},
        "torch": manifest.get("torch"),
        "created": manifest.get("created"),
        "plan": _plan_summary(p),
        "extras": extras,
        "tensors": [asdict(t) for t in tensors],
        "totals": _totals(tensors),
        "files": [_file_info(n, listed[n]) for n in sorted(listed)],
        "unlisted": sorted(set(files.files_of(p)) - set(listed)),
        "verified": verify,
        "problems": found,
    }


# -------------------------------------------------------------------------------------- merge


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``, ``"fp16"``, ``"fp32"`` (or their long names, or a torch.dtype) -> dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise CheckpointError(
            f"dtype {dtype!r} is not one merge writes; use bf16, fp16 or fp32 (or none to keep "
            "the saved dtypes)"
        ) from None


def _batches(
    keys: list[str], saved: Mapping[str, io.SavedTensor], budget: int
) -> Iterator[list[str]]:
    """``keys`` in consecutive groups of at most ``budget`` saved bytes (one tensor at least)."""
    batch: list[str] = []
    size = 0
    for key in keys:
        t = saved[key]
        nbytes = _numel(t.shape) * t.dtype.itemsize
        if batch and size + nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += nbytes
    if batch:
        yield batch


def _standalone(value: torch.Tensor, dtype: torch.dtype | None, seen: set[int]) -> torch.Tensor:
    """``value`` as safetensors writes it: cast (floating point only: integer and bool buffers
    keep their dtype), contiguous, owning its storage alone. safetensors refuses tensors that
    share storage (tied weights, or pieces DCP returns as views of one buffer)."""
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    value = value.detach().contiguous()
    storage = value.untyped_storage()
    if storage.data_ptr() in seen or storage.nbytes() != value.nbytes:
        value = value.clone()
        storage = value.untyped_storage()
    seen.add(storage.data_ptr())
    return value


def _read_model(
    path: Path, saved: Mapping[str, io.SavedTensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The model's tensors under their own names, read a batch at a time so that at most one
    batch is held in the saved dtype beside the output."""
    keys = [k for k in saved if k.startswith(MODEL)]
    if not keys:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no model tensors (no {MODEL}* keys): it was not "
            "written by job.save"
        )
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for batch in _batches(keys, saved, _MERGE_BATCH_BYTES):
        for key, value in io.read_full_tensors(path, batch).items():
            out[key[len(MODEL) :]] = _standalone(value, dtype, seen)
    return out


def merge(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
    *,
    verify: bool = True,
) -> list[str]:
    """Write the model of the checkpoint at ``path`` as one safetensors file ``out``.

    The names are ``model.state_dict()``'s (the checkpoint's ``model.`` prefix stripped);
    optimizer states are left out. ``dtype`` (bf16, fp16, fp32) casts floating-point tensors;
    None keeps the saved dtypes. The file's metadata says ``{"format": "pt"}``, which
    transformers' ``from_pretrained`` wants. Every file is checked against the manifest first
    (``verify=False`` skips that, saving one read of the whole checkpoint): a damaged
    checkpoint raises :class:`~plait.errors.CheckpointError` naming the files and writes
    nothing. The file is written beside ``out`` and renamed, so ``out`` is never left half
    written. The whole model is held in memory once, in the output dtype.

    Returns the tensor names written, in saved order.
    """
    from safetensors.torch import save_file  # only merging needs it

    p = files.resolve(path)
    manifest = files.read_manifest(p)
    target = parse_dtype(dtype)
    if verify:
        bad = files.verify(p, manifest, sorted(manifest["files"]))
        if bad:
            raise CheckpointError(
                f"checkpoint {str(p)!r} is damaged, nothing was written: " + "; ".join(bad)
            )
    tensors = _read_model(p, _read_metadata(p), target)
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    try:
        save_file(tensors, tmp, metadata={"format": "pt", "plait.step": str(manifest["step"])})
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return list(tensors)
