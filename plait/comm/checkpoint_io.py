"""The door from checkpoints to ``torch.distributed.checkpoint`` (DCP) and the process group.

plait's checkpoints are DCP checkpoints: each rank writes the pieces it holds (a DTensor's
local piece, with its offset in the global tensor), rank 0 writes the metadata that says where
every piece of every tensor lies, and a load under any other layout reads, on each rank, just
the overlap of the saved pieces with the pieces it will hold. This module is the only place
checkpoints touch ``torch.distributed``: saving and loading flat tensor dicts, reading the
metadata, reading whole tensors on one process, and the few object collectives the save and
load protocol needs (``plait/runtime/checkpoint.py`` holds the protocol itself).
"""

from __future__ import annotations

import contextlib
import io
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plait._compat import load_dcp_keys

__all__ = [
    "SavedTensor",
    "all_gather_objects",
    "barrier",
    "checkpoint_group",
    "is_distributed",
    "load_tensors",
    "rank",
    "read_full_tensors",
    "read_tensor_metadata",
    "save_tensors",
    "world_size",
]


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """One tensor of a checkpoint as its metadata describes it (global shape and dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: int
    """How many saved pieces (chunks) it was written in."""


def is_distributed() -> bool:
    """True when a default process group exists (a real multi-process job)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier(group: Any = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` on one process)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def checkpoint_group() -> Any:
    """A new gloo group over every rank, for saves that run in a background thread: their
    coordination must not interleave with the training step's collectives on the default
    group. Every rank must call it at the same point (it is a collective)."""
    return dist.new_group(backend="gloo") if is_distributed() else None


def save_tensors(
    state: dict[str, Any], path: str | os.PathLike[str], group: Any = None
) -> dict[str, tuple[int, int]]:
    """Write ``state`` (flat: key -> tensor or DTensor) as a DCP checkpoint in directory ``path``.

    Every rank calls it; each writes the pieces it holds (a replicated tensor once). Returns the
    files this rank wrote (names relative to ``path``) with their size and CRC-32, computed from
    the bytes as they were written: the manifest needs no second pass over the data. A file
    written out of order (a seek) is left out, to be checksummed by reading it.
    """
    writer = dcp.FileSystemWriter(os.fspath(path), single_file_per_rank=True, sync_files=True)
    sums = _ChecksummingFileSystem(Path(path))
    writer.fs = sums  # DCP opens every file it writes through ``fs``
    dcp.save(state, storage_writer=writer, process_group=group, no_dist=not is_distributed())
    return sums.written


class _CrcStream(io.RawIOBase):
    """A write stream that passes bytes through to ``inner`` and keeps their size and CRC-32."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.size, self.crc, self.in_order = inner, 0, 0, True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.inner.write(view)
        self.crc = zlib.crc32(view[:written], self.crc)
        self.size += written
        return written

    def tell(self) -> int:
        return self.inner.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.in_order = False  # the CRC no longer describes the file: read it instead
        return self.inner.seek(offset, whence)

    def fileno(self) -> int:
        return self.inner.fileno()

    def flush(self) -> None:
        self.inner.flush()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording each file written (size, CRC-32) under its name
    relative to ``root`` (a renamed file, the metadata, under its final name)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.written: dict[str, tuple[int, int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            crc = _CrcStream(stream)
            yield crc
            stream.flush()
        if crc.in_order:
            self.written[self._name(path)] = (crc.size, crc.crc)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        record = self.written.pop(self._name(path), None)
        if record is not None:
            self.written[self._name(new_path)] = record

    def _name(self, path: str | os.PathLike[str]) -> str:
        return Path(path).relative_to(self.root).as_posix()


def load_tensors(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Fill ``state``'s tensors (and DTensors' local pieces) in place from the checkpoint."""
    reader = dcp.FileSystemReader(os.fspath(path))
    dcp.load(state, storage_reader=reader, no_dist=not is_distributed())


def read_tensor_metadata(path: str | os.PathLike[str]) -> dict[str, SavedTensor]:
    """Every tensor the checkpoint at ``path`` holds: key -> global shape, dtype, pieces.

    Reads the metadata file only (no collective). Raises ``FileNotFoundError`` when the
    metadata file is missing and other errors when it cannot be read.
    """
    metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
    out: dict[str, SavedTensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            out[key] = SavedTensor(tuple(item.size), item.properties.dtype, len(item.chunks))
    return out


def read_full_tensors(
    path: str | os.PathLike[str], keys: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Whole tensors from the checkpoint at ``path`` on this one process (offline tools).

    Every key, or only ``keys``; each tensor is assembled from all its saved pieces.
    """
    wanted = None if keys is None else set(keys)
    return load_dcp_keys(os.fspath(path), wanted)
