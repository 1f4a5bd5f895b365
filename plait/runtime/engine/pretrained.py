"""Loading pretrained weights (safetensors, Hugging Face model directories) into a Job.

``job.load_pretrained(path)`` fills every entry of ``job.model.state_dict()`` (parameters and
persistent buffers) from ``path``: a ``.safetensors`` file, a directory holding
``model.safetensors``, or a sharded Hugging Face directory (``model.safetensors.index.json``,
whose ``weight_map`` names the file of each tensor). Each rank reads only the slice it holds:
for a DTensor, its local piece's shape and global offset (DTensor's own rule, strided shards
included, :func:`plait._compat.local_shape_and_offset`); safetensors maps the file and copies
just those bytes. Jobs whose ranks hold the whole model (stand-alone, plain data parallel)
read whole tensors. Under :func:`plait.testing.simulate` the one process reads each
simulated rank's slice into that rank's piece.

With meta init (a model built under ``torch.device("meta")``, :mod:`plait.runtime.engine.meta_init`)
no rank ever holds the whole model: parallelize places empty pieces and this fills them.

Everything is checked before anything is written: every name present (no missing, no
unexpected), shapes equal, dtypes of the same kind (floating point to floating point, with
conversion; integers to integers). On any error a :class:`~plait.errors.CheckpointError`
names the file, the tensors, the rule and the fix, and nothing is loaded.

Tied parameters (a Hugging Face ``lm_head.weight`` tied to the embedding) are one tensor
under several names of ``state_dict``; the file needs to hold it under one of them (Hugging
Face saves it once). A Hugging Face model's ``base_model_prefix`` may be present in the
model's names and absent from the file's, or the other way round (weights of the base model
loaded into a model with a head, and back); names its class lists in
``_keys_to_ignore_on_load_unexpected`` may be in the file without being in the model.

A job planned at its first step (:class:`~plait.runtime.engine.job.DeferredJob`) that is not planned
yet still holds the whole model: its weights are loaded whole, on every rank, and placement
slices them at the first step. A meta model there has nothing to load into: that is refused
(pass ``example_batch=`` to ``plait.parallelize`` so the job is planned, and its pieces
placed, at once).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait._compat import (
    local_shape_and_offset,
    rank_pieces,
    simulated_ranks,
    simulation_suspended,
)
from plait.comm.dtensor import DeviceMesh, is_dtensor, layout_of, local_piece
from plait.errors import CheckpointError
from plait.runtime.engine.meta_init import mark_initialised
from plait.runtime.program.zero import ZeroOptimizer

__all__ = ["load_pretrained", "pretrained_files"]

logger = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors' dtype names -> kind; a kind never changes on loading (see _kind)
_FILE_KINDS = {"F": "floating point", "B": "floating point", "I": "integer", "U": "integer"}


@dataclass(frozen=True, slots=True)
class _Stored:
    """One tensor of the files: where it is, its shape and dtype name (``F32``, ``BF16``...)."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of the model (tied names together) and the stored tensor it loads from."""

    names: tuple[str, ...]
    tensor: torch.Tensor
    source: _Stored | None


# ----------------------------------------------------------------------------- the files


def pretrained_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Each tensor name of the pretrained weights at ``path`` -> the file that holds it."""
    where = Path(path)
    if not where.exists():
        raise CheckpointError(
            f"pretrained weights {str(where)!r} do not exist; give a .safetensors file or a "
            f"Hugging Face model directory (with {SINGLE} or {INDEX})"
        )
    if where.is_file():
        if where.name == INDEX:
            return _indexed(where)
        if where.suffix != ".safetensors":
            raise CheckpointError(
                f"pretrained weights {str(where)!r} are not a .safetensors file; convert them "
                "(safetensors.torch.save_file(model.state_dict(), 'model.safetensors'), or "
                "model.save_pretrained(dir) for a Hugging Face model)"
            )
        return dict.fromkeys(_names_in(where), where)
    if (where / INDEX).is_file():
        return _indexed(where / INDEX)
    if (where / SINGLE).is_file():
        return dict.fromkeys(_names_in(where / SINGLE), where / SINGLE)
    present = sorted(p.name for p in where.iterdir())[:8]
    raise CheckpointError(
        f"directory {str(where)!r} holds neither {SINGLE} nor {INDEX} (it has {present}); "
        "save the weights as safetensors (model.save_pretrained(dir) saves them so by default)"
    )


def _names_in(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # a truncated or foreign file: safetensors' own words
        raise CheckpointError(
            f"pretrained weights {str(file)!r} are not a readable safetensors file ({e}); "
            "save them again"
        ) from e


def _indexed(index: Path) -> dict[str, Path]:
    """A sharded Hugging Face checkpoint: ``weight_map`` gives the file of every tensor."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"index {str(index)!r} has no weight_map (name -> file) ({type(e).__name__}: {e}); "
            "write it again with model.save_pretrained(dir)"
        ) from e
    files = {name: index.parent / file for name, file in weight_map.items()}
    missing = sorted({repr(str(f)) for f in files.values() if not f.is_file()})
    if missing:
        raise CheckpointError(
            f"index {str(index)!r} lists files that are not there: {_few(missing)}; copy the "
            "whole directory"
        )
    for file in set(files.values()):
        held = set(_names_in(file))
        absent = [repr(n) for n, f in files.items() if f == file and n not in held]
        if absent:
            raise CheckpointError(
                f"index {str(index)!r} says {str(file)!r} holds {_few(absent)}, which it does "
                "not; the directory mixes two saves: save it again"
            )
    return files


def _stored(files: Mapping[str, Path]) -> dict[str, _Stored]:
    """Shape and dtype of every tensor, from the files' headers (no tensor data is read)."""
    from safetensors import safe_open

    out: dict[str, _Stored] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                piece = f.get_slice(name)
                out[name] = _Stored(name, file, tuple(piece.get_shape()), piece.get_dtype())
    return out


# ----------------------------------------------------------------------------- checks


def _entries(model: nn.Module, stored: Mapping[str, _Stored]) -> list[_Entry]:
    """The model's state_dict tensors (a tied tensor once, with all its names), each with the
    stored tensor it loads from (None when the files have none of its names)."""
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = []
    for key, names in groups.items():
        found = (_file_name(n, stored, prefix) for n in names)
        source = next((stored[f] for f in found if f is not None), None)
        out.append(_Entry(tuple(names), tensors[key], source))
    return out


def _held_entries(entries: list[_Entry], holders: Sequence[nn.Module]) -> list[_Entry]:
    """The holders' tensors (each once), each with the source of the model entry its name
    belongs to (checked already: every name has one)."""
    source = {name: e.source for e in entries for name in e.names}
    out: dict[int, _Entry] = {}
    for module in holders:
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in out:
                out[id(t)] = dataclasses.replace(out[id(t)], names=(*out[id(t)].names, name))
            elif name in source:
                out[id(t)] = _Entry((name,), t, source[name])
    return list(out.values())


def _file_name(name: str, stored: Mapping[str, _Stored], prefix: str) -> str | None:
    """The name ``name`` has in the files: itself, or with a Hugging Face model's base-model
    prefix taken off or put on (a base model's weights in a model with a head, and back)."""
    if name in stored:
        return name
    if not prefix:
        return None
    if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in stored:
        return name[len(prefix) + 1 :]
    with_prefix = f"{prefix}.{name}"
    return with_prefix if with_prefix in stored else None


def _kind(dtype: torch.dtype | str) -> str:
    """Floating point, integer, bool or complex: loading converts within a kind, never across
    (an integer table loaded into float weights is a wrong file, not a conversion)."""
    if isinstance(dtype, str):
        if dtype == "BOOL":
            return "bool"
        if dtype.startswith("C"):
            return "complex"
        return _FILE_KINDS.get(dtype[:1], dtype)
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating point" if dtype.is_floating_point else "integer"


def _check(
    where: Path, model: nn.Module, entries: list[_Entry], stored: Mapping[str, _Stored]
) -> None:
    """Every model tensor in the files with its shape and a convertible dtype, and every
    file tensor in the model; else one error listing every problem."""
    missing = [" = ".join(repr(n) for n in e.names) for e in entries if e.source is None]
    used = {e.source.name for e in entries if e.source is not None}
    prefix = getattr(model, "base_model_prefix", "") or ""
    # A tied tensor's other names may be in the files as well (both saved): not unexpected.
    for e in entries:
        used.update(f for f in (_file_name(n, stored, prefix) for n in e.names) if f)
    ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    ignored = [re.compile(p) for p in ignore]
    unexpected = [
        repr(n) for n in stored if n not in used and not any(p.search(n) for p in ignored)
    ]
    shapes, dtypes = [], []
    for e in entries:
        s = e.source
        if s is None:
            continue
        if s.shape != tuple(e.tensor.shape):
            shapes.append(f"{e.names[0]!r} (file {list(s.shape)}, model {list(e.tensor.shape)})")
        elif _kind(s.dtype) != _kind(e.tensor.dtype):
            dtypes.append(f"{e.names[0]!r} (file {s.dtype}, model {e.tensor.dtype})")
    problems = []
    if missing:
        problems.append(f"missing from the files: {_few(missing)}")
    if unexpected:
        problems.append(f"in the files but not in the model: {_few(unexpected)}")
    if shapes:
        problems.append(f"shapes differ: {_few(shapes)}")
    if dtypes:
        problems.append(
            f"dtypes of another kind (a float tensor loads into a float tensor, an integer one "
            f"into an integer one): {_few(dtypes)}"
        )
    if problems:
        raise CheckpointError(
            f"pretrained weights {str(where)!r} do not fit {type(model).__name__}, nothing was "
            "loaded: every entry of model.state_dict() must be in the files under its name, "
            "with its shape, and nothing else: "
            + "; ".join(problems)
            + ". Load weights saved from the same model class and config"
        )


def _few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


# ----------------------------------------------------------------------------- reading


def _slices(shape: tuple[int, ...], offset: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _coordinates(device_mesh: DeviceMesh) -> dict[int, list[int]]:
    """Where each rank sits on ``device_mesh`` (one index per mesh axis)."""
    grid = device_mesh.mesh
    return {
        int(grid[index].item()): list(index)
        for index in itertools.product(*(range(n) for n in grid.shape))
    }


def _block_offset(tensor: Any, coordinate: Sequence[int]) -> tuple[int, ...]:
    """Offset of a rank's piece by plait's own rule: along each dim the piece index counts
    the layout's axes outermost first. Must agree with DTensor's (a cross-check: a piece that
    is not one block of the tensor could not be read as one slice)."""
    layout = layout_of(tensor)
    mesh = layout.mesh
    out = []
    for size, axes in zip(tensor.shape, layout.dims, strict=True):
        index, parts = 0, 1
        for axis in axes:
            n = mesh.axis_size(axis)
            index, parts = index * n + coordinate[mesh.axis_index(axis)], parts * n
        out.append(index * (size // parts))
    return tuple(out)


def _piece_slices(tensor: Any, coordinate: Sequence[int]) -> tuple[slice, ...]:
    """The global slice of ``tensor`` (a DTensor) that the rank at ``coordinate`` holds."""
    placements = tuple(tensor.placements)
    if any(p.is_partial() for p in placements):
        raise CheckpointError(
            f"a tensor laid out as a pending sum {placements} cannot be loaded from a file; "
            "it is not a parameter or buffer plait places"
        )
    shape, offset = local_shape_and_offset(
        tuple(tensor.shape), tuple(tensor.device_mesh.shape), coordinate, placements
    )
    ours = _block_offset(tensor, coordinate)
    if offset != ours:  # this torch's strided shards would be read wrong: say so, read nothing
        raise CheckpointError(
            f"DTensor placements {placements} put the piece at mesh coordinate {coordinate} at "
            f"offset {offset}, plait's layout at {ours}; torch {torch.__version__} splits "
            "strided shards unlike the versions plait supports (torch>=2.13,<2.15)"
        )
    return _slices(shape, offset)


class _Reader:
    """Open files, kept open for one load; reads the slices asked for."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[Path, Any] = {}
        self._meshes: dict[int, dict[int, list[int]]] = {}
        self.elements = 0
        """Elements read so far (what this process took from the files)."""

    def coordinate(self, device_mesh: DeviceMesh, rank: int) -> list[int]:
        """Simulated ``rank``'s coordinate on ``device_mesh`` (worked out once per mesh)."""
        known = self._meshes.get(id(device_mesh))
        if known is None:
            known = self._meshes[id(device_mesh)] = _coordinates(device_mesh)
        return known[rank]

    def read(self, source: _Stored, where: tuple[slice, ...] | None) -> torch.Tensor:
        from safetensors import safe_open

        f = self._open.get(source.file)
        if f is None:
            f = self._stack.enter_context(safe_open(str(source.file), framework="pt"))
            self._open[source.file] = f
        value = f.get_slice(source.name)[where if where else ...]
        self.elements += value.numel()
        return value


@torch.no_grad()
def _fill(entry: _Entry, reader: _Reader) -> None:
    """Copy this process's pieces of one tensor from the files (each simulated rank's own)."""
    assert entry.source is not None
    t: Any = entry.tensor
    local = local_piece(t.detach())
    if local.numel() and local.untyped_storage().nbytes() == 0:
        return  # another pipeline rank's stage: this rank let its storage go
    ranks = simulated_ranks()
    with simulation_suspended():  # plain reads and copies, rank by rank when simulated
        if is_dtensor(t):
            if ranks is None:
                coordinate = t.device_mesh.get_coordinate()
                if coordinate is not None:  # None: this rank is off the mesh, holds nothing
                    _copy(local, reader.read(entry.source, _piece_slices(t, coordinate)))
                return
            pieces = rank_pieces(local, ranks)
            read: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}  # replicas read once
            for r in ranks:
                where = _piece_slices(t, reader.coordinate(t.device_mesh, r))
                key = tuple((s.start, s.stop) for s in where)  # slices hash from Python 3.12
                if key not in read:
                    read[key] = reader.read(entry.source, where)
                _copy(pieces[r], read[key])
            return
        whole = reader.read(entry.source, None)
        for piece in _plain_pieces(local, ranks):
            _copy(piece, whole)


def _plain_pieces(local: torch.Tensor, ranks: tuple[int, ...] | None) -> Iterator[torch.Tensor]:
    """A whole tensor's copies: its own, or each simulated rank's (a LocalTensor)."""
    if ranks is None:
        yield local
        return
    # one tensor shared by every rank is filled once
    yield from {id(p): p for p in rank_pieces(local, ranks).values()}.values()


def _copy(dest: torch.Tensor, value: torch.Tensor) -> None:
    dest.copy_(value)  # converts the dtype (checked to be of the same kind) and device


# ----------------------------------------------------------------------------- entry point


def load_pretrained(
    model: nn.Module,
    optimizer: Any,
    path: str | os.PathLike[str],
    *,
    holders: Sequence[nn.Module] | None = None,
) -> list[str]:
    """Load the pretrained weights at ``path`` into a job's ``model`` (see the module
    docstring) and refresh ``optimizer``'s copies of them (ZeRO's shards; None before the job
    is planned); returns the ``state_dict`` names loaded. Every rank calls it; no rank waits
    on another.

    ``holders``: the modules that hold this rank's tensors where they are not the model's own
    (a pipeline's stages, whose parameters tensor parallel or FSDP2 replaced with pieces of
    their own, under the model's names): the files are checked against the whole model, and
    each holder's tensors are filled from the file tensor of their name (a tie split over
    two stages, each stage's copy, from the one name the file holds it under)."""
    files = pretrained_files(path)
    stored = _stored(files)
    entries = _entries(model, stored)
    _check(Path(path), model, entries, stored)
    if holders is not None:
        entries = _held_entries(entries, holders)
    with ExitStack() as stack:
        reader = _Reader(stack)
        for entry in entries:
            _fill(entry, reader)
    for module in (model, *(holders or ())):
        mark_initialised(module)
    shadows = getattr(optimizer, "_plait_shadows", None)
    if isinstance(shadows, ZeroOptimizer):
        shadows.reload_from_parameters()  # its shards and host copies are copies
    names = [n for n in model.state_dict(keep_vars=True)]
    logger.info(
        "loaded %d pretrained tensors from %s (%d elements read by this process)",
        len(entries),
        path,
        reader.elements,
    )
    return names
