"""The door from checkpoints to ``torch.distributed.checkpoint`` (DCP) and the process group.

plait's checkpoints are DCP checkpoints: each rank writes the pieces it holds (a DTensor's
local piece, with its offset in the global tensor), rank 0 writes the metadata that says where
every piece of every tensor lies, and a load under any other layout reads, on each rank, just
the overlap of the saved pieces with the pieces it will hold. This module is the only place
checkpoints touch ``torch.distributed``: saving and loading flat tensor dicts, reading the
metadata, reading whole tensors on one process, and the few object collectives the save and
load protocol needs (``plait/runtime/engine/checkpoint.py`` holds the protocol itself).

The protocol rides on DCP's own collectives rather than adding its own. DCP's save is a plan
exchange (gather, scatter) then a write exchange (gather, broadcast); its load is a plan
exchange then an all-gather after the reads. :func:`save_tensors` writes each rank's small
files (and records every file's XXH3-64 checksum) inside the write step, carries the checksums to the
coordinator with DCP's own gather, and commits the checkpoint there before DCP's broadcast, so
every rank returns from it with the checkpoint committed. :func:`load_tensors` runs the
caller's checks inside the plan step, before DCP reads a byte into the state: what a rank
raises there reaches every rank, and none reads.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from plait._compat import load_dcp_keys
from plait.errors import PlaitError

__all__ = [
    "FileProblems",
    "SavedTensor",
    "abort_load",
    "all_gather_objects",
    "barrier",
    "checkpoint_group",
    "is_distributed",
    "load_tensors",
    "parse_metadata",
    "rank",
    "read_full_tensors",
    "read_tensor_metadata",
    "save_tensors",
    "tensors_of",
    "world_size",
]

Checksums = dict[str, tuple[int, int]]
"""File name (relative to the checkpoint) -> (size in bytes, XXH3-64 as an int): what
``plait.checkpoint.files.entry`` makes a manifest entry of."""

_CHECKSUMS = "__plait_checksums__"
"""The key of the extra write result that carries a rank's checksums to the coordinator."""


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """One tensor of a checkpoint as its metadata describes it (global shape and dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: int
    """How many saved pieces (chunks) it was written in."""


class FileProblems(Exception):
    """Damaged files a rank found (one sentence each, naming the file). Raised inside DCP's
    plan step, it fails the load on every rank; :func:`load_tensors` re-raises it on every rank
    with the sentences of all of them."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems)
        self.problems = problems


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


def send_tensor(tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` (contiguous, on CPU under gloo) to global rank ``dst``."""
    dist.send(tensor.contiguous(), dst)


def recv_tensor(shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` received from global rank ``src``."""
    out = torch.empty(shape, dtype=dtype)
    dist.recv(out, src)
    return out


def checkpoint_group() -> Any:
    """A new gloo group over every rank, for saves that run in a background thread: their
    coordination must not interleave with the training step's collectives on the default
    group. Every rank must call it at the same point (it is a collective)."""
    return dist.new_group(backend="gloo") if is_distributed() else None


# ------------------------------------------------------------------------------------- saving


def save_tensors(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    group: Any = None,
    *,
    files: Mapping[str, bytes] | None = None,
    fresh: bool = False,
    commit: Callable[[Checksums], None] | None = None,
    zip_crc: bool = True,
) -> Checksums:
    """Write ``state`` (flat: key -> tensor or DTensor) as a DCP checkpoint in directory ``path``.

    Every rank calls it; each writes the pieces it holds (a replicated tensor once) and its
    ``files`` (name relative to ``path`` -> bytes: its small state, the plan...), synced.
    ``fresh``: the coordinator removes what ``path`` held before anyone writes into it.
    ``commit`` runs on the coordinator once every rank has written and DCP's metadata is on
    disk, with every file's size and XXH3-64 (each rank's, carried by DCP's own gather); it
    finishes before any rank returns, and what it raises is raised on every rank.
    ``zip_crc=False``: DCP's ``torch.save`` of each piece leaves out the zip format's CRC-32 of
    each record (:func:`_zip_crc`); pass it only when no other thread saves meanwhile.

    Returns the files this rank wrote with their size and XXH3-64, computed from the bytes as
    they were written (no second pass over the data). A file written out of order (a seek) is
    left out, to be checksummed by reading it.
    """
    writer = _Writer(Path(path), dict(files or {}), fresh, commit, zip_crc)
    try:
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=not is_distributed())
    except CheckpointException as e:
        raise _first_error(e) from e
    return dict(writer.fs.written)


def _first_error(e: CheckpointException) -> BaseException:
    """What the lowest failing rank raised (an ordinary exception), else DCP's own."""
    for _, (error, _trace) in sorted(e.failures.items()):
        if isinstance(error, Exception):
            return error
    return e


class _Writer(dcp.FileSystemWriter):
    """DCP's file system writer, writing through a checksumming file system, with the small
    files and the commit folded into DCP's own steps."""

    fs: _ChecksummingFileSystem

    def __init__(
        self,
        path: Path,
        files: dict[str, bytes],
        fresh: bool,
        commit: Callable[[Checksums], None] | None,
        zip_crc: bool = True,
    ) -> None:
        super().__init__(os.fspath(path), single_file_per_rank=True, sync_files=True)
        self.fs = _ChecksummingFileSystem(path)  # DCP opens every file it writes through fs
        self._root = path
        self._files = files
        self._fresh = fresh
        self._commit = commit
        self._zip_crc = zip_crc
        self._coordinator = False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # No rank writes before the plans are scattered, after every rank's local step: the
        # coordinator's clearing (and making) of the directory comes before any rank writes.
        if not self._coordinator and self.use_collectives:
            return plan  # (DCP's own step would also warn about a stale metadata file here)
        if self._fresh:
            shutil.rmtree(self._root, ignore_errors=True)
        return super().prepare_local_plan(plan)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # The small files are written and synced beside DCP's writes (their syncs wait on
        # the disk, not on this thread), and are on disk before this rank reports back.
        failed: list[BaseException] = []

        def small() -> None:
            try:
                self._write_files()
            except BaseException as e:  # raised below, in DCP's write step
                failed.append(e)

        helper = threading.Thread(target=small, name="plait-small-files", daemon=True)
        helper.start()
        try:
            with _zip_crc(self._zip_crc):  # DCP writes in this thread (one writer thread)
                results = list(super().write_data(plan, planner).wait())
        finally:
            helper.join()
        if failed:
            raise failed[0]
        # This rank's checksums travel to the coordinator with its write results.
        results.append(WriteResult(MetadataIndex(_CHECKSUMS), 0, dict(self.fs.written)))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_files(self) -> None:
        """This rank's small files, synced (the manifest will vouch for them)."""
        for name, data in self._files.items():
            target = self._root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.create_stream(target, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        sums: Checksums = {}
        kept = []
        for part in results:
            kept.append([r for r in part if r.index.fqn != _CHECKSUMS])
            for r in part:
                if r.index.fqn == _CHECKSUMS:
                    sums.update(r.storage_data)
        super().finish(metadata, kept)  # DCP's metadata, through fs: checksummed too
        sums.update(self.fs.written)
        if self._commit is not None:
            self._commit(sums)


@contextlib.contextmanager
def _zip_crc(enabled: bool) -> Iterator[None]:
    """``torch.save`` with or without the zip format's CRC-32 of each record, for the block.

    Why without: DCP writes every piece with ``torch.save``, whose zip writer computes a
    CRC-32 of every record at about 4.5 GB/s (one process saving 200 MB here: 156 ms of CPU
    with it, 114 without), and nothing reads it back: ``torch.load`` never checks it (PyTorch
    builds its zip reader without CRC checks), and plait's XXH3-64 of each whole file, made as
    it is written and compared before a load reads, covers the same bytes. The files load as
    before with DCP, ``torch.load`` and plait's offline tools. The switch is torch's
    process-wide ``set_crc32_options``, restored after: another thread's ``torch.save`` during
    the block would leave its CRCs out too (the file loads the same), so background saves,
    which run beside training, keep them.
    """
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(enabled and before)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class _HashingStream(io.RawIOBase):
    """A raw write stream that passes bytes through to ``inner`` (an unbuffered file) and keeps
    their size and XXH3-64.

    The checksum is made as each write returns, from the caller's bytes. (A helper thread
    making it from the file's pages while DCP writes on was measured: it took more CPU in all,
    and on a machine whose cores the ranks already keep busy, more time.) XXH3-64 rather than
    zlib's CRC-32: about 18 GB/s a core against 3 to 4 (docs/checkpoints.md). It sits under a
    :class:`_SyncedWriter`, so it sees a few large writes per piece, not ``torch.save``'s many
    small ones.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.size, self.in_order = inner, 0, True
        self.hasher = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written: int = self.inner.write(view)
        self.hasher.update(view[:written])
        self.size += written
        return written

    def result(self) -> int | None:
        """The XXH3-64 of all that was written; None when it does not describe the file (a
        seek): then the file is read for it."""
        return self.hasher.intdigest() if self.in_order else None

    def tell(self) -> int:
        position: int = self.inner.tell()
        return position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.in_order = False  # the checksum no longer describes the file: read it instead
        position: int = self.inner.seek(offset, whence)
        return position

    def fileno(self) -> int:
        number: int = self.inner.fileno()
        return number

    def flush(self) -> None:
        self.inner.flush()


class _SyncedWriter(io.BufferedWriter):
    """The buffered writer DCP gets for each file it writes, over a :class:`_HashingStream`.

    Why a buffer above the hash: ``torch.save`` writes a piece in about 40 calls, most of a
    few bytes (zip headers, the pickle), and DCP's own file is a buffered one that takes them
    in C; with the hashing stream on top, each was a Python call (12 ms of a 260-piece save
    here). Below this buffer the stream sees the coalesced bytes and each large write once.
    ``fileno()`` flushes first: DCP fsyncs its metadata file through ``fileno()`` without a
    flush, and bytes still in a buffer would miss the sync.
    """

    def fileno(self) -> int:
        self.flush()
        return super().fileno()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording each file written (size, XXH3-64) under its name
    relative to ``root`` (a renamed file, the metadata, under its final name)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.written: Checksums = {}

    @contextlib.contextmanager
    def create_stream(  # type: ignore[override]  # torch annotates the yield as io.IOBase
        self, path: str | os.PathLike[str], mode: str
    ) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode, buffering=0) as raw:
            hashing = _HashingStream(raw)
            with _SyncedWriter(hashing) as stream:  # flushed and closed before the file
                yield stream
        value = hashing.result()
        if value is not None:
            self.written[self._name(path)] = (hashing.size, value)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        record = self.written.pop(self._name(path), None)
        if record is not None:
            self.written[self._name(new_path)] = record

    def _name(self, path: str | os.PathLike[str]) -> str:
        return Path(path).relative_to(self.root).as_posix()


# ------------------------------------------------------------------------------------ loading


def load_tensors(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    metadata: Any = None,
    before_read: Callable[[], None] | None = None,
) -> None:
    """Fill ``state``'s tensors (and DTensors' local pieces) in place from the checkpoint.

    ``metadata``: the checkpoint's DCP metadata as :func:`parse_metadata` made it (read
    already: DCP does not read it again). ``before_read`` runs on every rank inside DCP's plan
    step, before any rank reads anything into ``state``: what it raises on any rank is raised
    on every rank and nothing is read (:class:`FileProblems` with the sentences of every rank
    that raised one; else a plait error of the lowest rank that raised one).
    """
    reader = _Reader(Path(path), metadata, before_read)
    try:
        dcp.load(state, storage_reader=reader, no_dist=not is_distributed())
    except CheckpointException as e:
        errors = [error for _, (error, _trace) in sorted(e.failures.items())]
        problems = [
            p for error in errors if isinstance(error, FileProblems) for p in error.problems
        ]
        if problems:
            raise FileProblems(list(dict.fromkeys(problems))) from None
        for error in errors:
            if isinstance(error, PlaitError):
                raise error from None
        raise


def abort_load(path: str | os.PathLike[str], fail: Callable[[], None]) -> None:
    """Join the collective load every other rank is in, only to fail it: ``fail`` runs where
    :func:`load_tensors` runs ``before_read`` and raises this rank's reason not to load, which
    is raised on every rank as :func:`load_tensors` raises it."""
    empty = Metadata(state_dict_metadata={}, storage_data={})
    load_tensors({}, path, metadata=empty, before_read=fail)


class _Reader(dcp.FileSystemReader):
    """DCP's file system reader, with the metadata already read and a check in the plan step."""

    def __init__(
        self, path: Path, metadata: Metadata | None, before_read: Callable[[], None] | None
    ) -> None:
        super().__init__(os.fspath(path))
        self._metadata = metadata
        self._before_read = before_read

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata.storage_meta is None:  # as DCP's reader does with what it reads
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._before_read is not None:
            self._before_read()
        return super().prepare_local_plan(plan)


def parse_metadata(data: bytes) -> Any:
    """DCP's metadata from the bytes of its ``.metadata`` file (an opaque object for
    :func:`load_tensors` and :func:`tensors_of`)."""
    metadata = pickle.loads(data)  # what DCP's reader does with the file
    if not isinstance(metadata, Metadata):
        raise TypeError(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def tensors_of(metadata: Any) -> dict[str, SavedTensor]:
    """Every tensor the metadata describes: key -> global shape, dtype, pieces."""
    out: dict[str, SavedTensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            out[key] = SavedTensor(tuple(item.size), item.properties.dtype, len(item.chunks))
    return out


def read_tensor_metadata(path: str | os.PathLike[str]) -> dict[str, SavedTensor]:
    """Every tensor the checkpoint at ``path`` holds: key -> global shape, dtype, pieces.

    Reads the metadata file only (no collective). Raises ``FileNotFoundError`` when the
    metadata file is missing and other errors when it cannot be read.
    """
    return tensors_of(dcp.FileSystemReader(os.fspath(path)).read_metadata())


def read_full_tensors(
    path: str | os.PathLike[str], keys: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Whole tensors from the checkpoint at ``path`` on this one process (offline tools).

    Every key, or only ``keys``; each tensor is assembled from all its saved pieces.
    """
    wanted = None if keys is None else set(keys)
    return load_dcp_keys(os.fspath(path), wanted)
