"""A plait checkpoint on disk: its directory, manifest, checksums, atomic commit, and discovery.

A checkpoint is one directory::

    step-00000040/
      plait.json        manifest: format, step, world, mesh, optimizer, every file's size and
                        checksum (XXH3-64; CRC-32 in checkpoints of plait before it)
      plan.json         the plan the job ran (jobs that run a plan)
      .metadata         DCP's metadata: every tensor's global shape and where its pieces lie
      __0_0.distcp ...  DCP's data files, one per rank
      extra/rank0.pt... each rank's small state (RNG streams, data-loader position, loss scaler,
                        the optimizer's hyperparameters, user objects)

It is written under ``<name>.partial`` and renamed to ``<name>`` once every file is on disk
and the manifest (written last) lists them: a directory with a manifest is complete, and a
crash during a save leaves the previous checkpoint as it was. Nothing here touches a process
group; ``plait/runtime/engine/checkpoint.py`` runs the protocol across ranks.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import xxhash

from plait.errors import CheckpointError, DamagedCheckpointError

__all__ = [
    "ALGORITHM",
    "ALGORITHMS",
    "FORMAT",
    "MANIFEST",
    "MODEL",
    "OPTIM",
    "algorithm_of",
    "check_bytes",
    "checksum",
    "commit",
    "complete_checkpoints",
    "entry",
    "files_of",
    "latest",
    "partial_path",
    "prune",
    "read_manifest",
    "resolve",
    "size_problems",
    "step_name",
    "verify",
    "write_manifest",
]

logger = logging.getLogger(__name__)

FORMAT = "plait-checkpoint/1"
MANIFEST = "plait.json"
MODEL = "model."
"""Key prefix of the model's tensors (``model.<state_dict name>``)."""
OPTIM = "optim."
"""Key prefix of the optimizer's states (``optim.<parameter name>.<state>``)."""
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20  # bytes read at a time when a file cannot be mapped (fits a core's cache)

ALGORITHM = "xxh3_64"
"""The checksum of the files of new checkpoints: XXH3-64 (``xxhash``), a manifest entry
``{"bytes": n, "xxh3_64": "%016x"}``. It runs at about 18 GB/s a core where zlib's CRC-32 runs
at 3 to 4: the checksum is most of what a save and a load add to DCP's own work. A random
change of a file goes unnoticed with probability 2**-64 (CRC-32: 2**-32, but any burst of up
to 32 flipped bits is caught for sure)."""
ALGORITHMS = {"xxh3_64": "XXH3-64", "crc32": "CRC-32"}
"""Every checksum a manifest entry may carry (its key -> the name errors give it): XXH3-64,
and CRC-32 (``"%08x"``), which checkpoints written before XXH3-64 carry and which still
load and verify."""


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC-32 behind the same two methods as xxhash's hashers."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: Any, /) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def _hasher(algorithm: str) -> _Hasher:
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return _Crc32()
    raise ValueError(f"no checksum {algorithm!r}; plait knows {', '.join(ALGORITHMS)}")


def entry(size: int, digest: int) -> dict[str, Any]:
    """The manifest entry of a file of ``size`` bytes whose XXH3-64 is ``digest`` (an int, as
    the save's write stream makes it): ``{"bytes": size, "xxh3_64": "%016x"}``."""
    return {"bytes": size, ALGORITHM: f"{digest:016x}"}


def algorithm_of(want: dict[str, Any]) -> str | None:
    """The checksum a manifest entry carries (a key of :data:`ALGORITHMS`; None if none)."""
    return next((a for a in ALGORITHMS if a in want), None)


def step_name(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` steps: ``step-00000040``."""
    return f"step-{step:08d}"


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it is committed to ``path``."""
    return path.with_name(path.name + ".partial")


def checksum(path: Path, algorithm: str = ALGORITHM) -> dict[str, Any]:
    """``{"bytes": size, algorithm: hex digest}`` of one file (by default its XXH3-64,
    ``"xxh3_64": "%016x"``; ``"crc32"`` for an older checkpoint's ``"%08x"``).

    The file is hashed where it lies, mapped read-only (its pages are the page cache's own),
    not read into a buffer: the copy out of the page cache cost more than XXH3-64 itself
    (a 55 MB shard from the page cache: 4.0 ms read into a 1 MB buffer and hashed, 1.6 ms
    mapped and hashed). A file that cannot be mapped (an empty one; a file system without
    mmap) is read in chunks instead. (A file another process truncates while it is mapped
    stops this process with SIGBUS; loads check every file's size before they hash.)"""
    hasher = _hasher(algorithm)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        view = _mapped(f.fileno(), size)
        if view is None:
            return {"bytes": _read_into(f, hasher), algorithm: hasher.hexdigest()}
        with view:
            hasher.update(view)
    return {"bytes": size, algorithm: hasher.hexdigest()}


def _mapped(fd: int, size: int) -> mmap.mmap | None:
    """The first ``size`` bytes of open file ``fd`` mapped read-only, read-ahead hinted as
    sequential; None when there is nothing to map or the file cannot be mapped."""
    if size == 0:
        return None
    try:
        view = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    if hasattr(view, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
        view.madvise(mmap.MADV_SEQUENTIAL)
    return view


def _read_into(f: Any, hasher: _Hasher) -> int:
    """Hash what is left of open file ``f``, read into one reused buffer; its size."""
    buffer = memoryview(bytearray(_CHUNK))  # one buffer, read into: no allocation per chunk
    size = 0
    while n := f.readinto(buffer):
        hasher.update(buffer[:n])
        size += n
    return size


def check_bytes(path: Path, name: str, data: bytes, manifest: dict[str, Any]) -> list[str]:
    """The problems of file ``name`` of the checkpoint at ``path``, read as ``data``: its size
    and checksum against the manifest (one sentence naming the file, or none)."""
    want = manifest["files"].get(name)
    if want is None:
        return [f"{str(path / name)!r} is not listed in the manifest"]
    algorithm = algorithm_of(want)
    if algorithm is None:
        return _mismatch(path / name, {"bytes": len(data)}, want)
    hasher = _hasher(algorithm)
    hasher.update(data)
    return _mismatch(path / name, {"bytes": len(data), algorithm: hasher.hexdigest()}, want)


def size_problems(path: Path, manifest: dict[str, Any]) -> list[str]:
    """Every listed file that is missing or has another size than the manifest says (a look at
    each file's size, no read), one sentence each naming the file."""
    problems = []
    for name, want in sorted(manifest["files"].items()):
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            problems.append(f"{str(file)!r} is missing")
            continue
        if not file.is_file():
            problems.append(f"{str(file)!r} is missing")
        elif size != want["bytes"]:
            problems += _mismatch(file, {"bytes": size}, want)
    return problems


def _mismatch(file: Path, have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """``have`` (the file's size, and its checksum in ``want``'s algorithm when it was read)
    against the manifest's entry ``want``."""
    if have["bytes"] != want["bytes"]:
        return [
            f"{str(file)!r} has {have['bytes']} bytes, the manifest says {want['bytes']} "
            "(truncated or overwritten)"
        ]
    algorithm = algorithm_of(want)
    if algorithm is None:
        return [
            f"{str(file)!r} has no checksum in the manifest that this plait knows (it knows "
            f"{', '.join(ALGORITHMS)}; the entry has {', '.join(sorted(want))})"
        ]
    if algorithm in have and have[algorithm] != want[algorithm]:
        return [
            f"{str(file)!r} has {ALGORITHMS[algorithm]} {have[algorithm]}, the manifest says "
            f"{want[algorithm]} (corrupted)"
        ]
    return []


def files_of(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, relative, sorted (the same list on
    every rank, so ranks can split the checksumming by index)."""
    out = [
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    ]
    return sorted(out)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest (last: its presence marks the files complete) and sync it."""
    target = directory / MANIFEST
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def commit(partial: Path, path: Path) -> None:
    """Make the written ``partial`` directory the checkpoint ``path`` (replacing one there)."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(partial, path)
    _sync_directory(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory to load for ``path``.

    ``path`` is a checkpoint, or a directory of them (``step-*``: the latest complete one).
    A checkpoint replaced by a save that crashed between its two renames is found under
    ``<path>.old``.
    """
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    old = p.with_name(p.name + ".old")
    if not p.exists() and (old / MANIFEST).is_file():
        logger.warning("checkpoint %s: loading %s (a save replacing it did not finish)", p, old)
        return old
    if p.is_dir():
        found = latest(p)
        if found is not None:
            return found
        partial = [q.name for q in p.iterdir() if q.name.endswith(".partial")]
        extra = f" (unfinished saves: {', '.join(sorted(partial))})" if partial else ""
        if (p / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint {str(p)!r} has DCP data but no {MANIFEST}: the save that wrote it "
                "did not finish (the manifest is written last), or it is not a plait "
                "checkpoint; load an earlier checkpoint"
            )
        raise CheckpointError(
            f"no checkpoint in {str(p)!r}: it holds no {MANIFEST} and no complete step-* "
            f"checkpoint{extra}; pass a directory written by job.save or plait.checkpoint"
            ".Checkpoints"
        )
    raise CheckpointError(
        f"checkpoint {str(p)!r} does not exist; pass a directory written by job.save"
    )


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, checked for its format."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no {MANIFEST}: the save did not finish, or the "
            "directory is not a plait checkpoint"
        ) from None
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(
            f"checkpoint manifest {str(file)!r} cannot be read: {e}"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(
            f"{str(file)!r} has format {got!r}; this plait reads {FORMAT!r} checkpoints"
        )
    return manifest


def verify(path: Path, manifest: dict[str, Any], names: Iterable[str]) -> list[str]:
    """The problems (missing, wrong size, wrong checksum) of the listed files, each a sentence
    naming the file."""
    listed = manifest["files"]
    problems = []
    for name in names:
        file = path / name
        if not file.is_file():
            problems.append(f"{str(file)!r} is missing")
            continue
        want = listed[name]
        algorithm = algorithm_of(want)
        if algorithm is None:  # no checksum to compare: the size alone, and that said
            problems += _mismatch(file, {"bytes": file.stat().st_size}, want)
            continue
        problems += _mismatch(file, checksum(file, algorithm), want)
    return problems


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The complete ``step-*`` checkpoints in ``directory``, by step."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint of the highest step in ``directory`` (None if there is none)."""
    found = complete_checkpoints(Path(directory))
    return found[-1][1] if found else None


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints; returns what was deleted."""
    found = complete_checkpoints(directory)
    gone = [p for _, p in found[: max(len(found) - keep, 0)]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
