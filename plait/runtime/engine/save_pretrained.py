"""``job.save_pretrained(directory)``: the trained model as a Hugging Face model directory.

From any layout (data parallel, tensor parallel, ZeRO 1/2/3, and the model's own pieces as
each rank holds them) the weights are gathered one tensor at a time: every rank takes part
in gathering a tensor whole (the collective its layout needs; nothing for a plain tensor),
the first rank keeps it in the shard being filled and the others let it go at once. A shard
is written (``safetensors``) as soon as it reaches ``max_shard_bytes`` and then freed, so the
first rank never holds more than one shard and one tensor beside its own pieces (never the
whole model twice). One shard is ``model.safetensors``; several are
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` naming each
tensor's file, as Hugging Face writes them.

Tied parameters (an LM head tied to the embedding) are one tensor under several names: it is
written once, under its first name, as Hugging Face does (``from_pretrained`` ties it again
from the config's ``tie_word_embeddings``). Persistent buffers are written as ``state_dict``
holds them.

A Hugging Face model's config (``model.config.save_pretrained``) and, for a model that
generates, its generation config are written beside the weights, so that
``AutoModelForCausalLM.from_pretrained(directory)`` loads a model equal to the trained one.
Any other model gets the safetensors alone: ``safetensors.torch.load_file`` (one shard) gives
its ``state_dict`` back, and ``job.load_pretrained(directory)`` loads it into any plan.

A pipeline job's ranks hold some stages each: the ranks that hold a tensor make it whole
among themselves and the lowest of them sends it to the first rank
(:func:`save_pretrained_from_stages`), one tensor at a time as above.

Every rank must call it; it returns on every rank once the files are written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from plait.comm.checkpoint_io import (
    all_gather_objects,
    barrier,
    rank,
    recv_tensor,
    send_tensor,
)
from plait.comm.dtensor import full_value, is_dtensor
from plait.errors import CheckpointError

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "save_pretrained",
    "save_pretrained_from_stages",
    "unique_tensors",
]

DEFAULT_SHARD_BYTES = 2 * 1024**3
"""A shard file's size before the next is started (Hugging Face's default is 5 GB; smaller
shards keep the first rank's extra memory smaller)."""


def unique_tensors(modules: Iterable[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every entry of the modules' ``state_dict``, a tensor tied under
    several names given once, under its first."""
    seen: set[int] = set()
    for module in modules:
        for name, value in module.state_dict(keep_vars=True).items():
            if id(value) in seen:
                continue
            seen.add(id(value))
            yield name, value


@dataclass
class _ShardWriter:
    """Fills shards of at most ``limit`` bytes and writes each when full (the first rank)."""

    directory: Path
    limit: int
    writing: bool
    current: dict[str, torch.Tensor] = field(default_factory=dict)
    size: int = 0
    written: list[tuple[str, list[str]]] = field(default_factory=list)
    """(temporary file name, the tensors in it) for each shard written so far."""
    total: int = 0

    def add(self, name: str, value: torch.Tensor) -> None:
        if not self.writing:
            return
        nbytes = value.numel() * value.element_size()
        if self.current and self.size + nbytes > self.limit:
            self.flush()
        self.current[name] = value.detach().cpu().contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.writing or not self.current:
            return
        temporary = f".shard-{len(self.written):05d}.safetensors"
        save_file(self.current, str(self.directory / temporary), metadata={"format": "pt"})
        self.written.append((temporary, list(self.current)))
        self.current, self.size = {}, 0

    def finish(self) -> list[str]:
        """The shards under their Hugging Face names (and the index for several)."""
        self.flush()
        if not self.writing:
            return []
        count = len(self.written)
        if count == 1:
            (self.directory / self.written[0][0]).rename(self.directory / "model.safetensors")
            return ["model.safetensors"]
        weight_map: dict[str, str] = {}
        names = []
        for i, (temporary, tensors) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.directory / temporary).rename(self.directory / final)
            weight_map.update(dict.fromkeys(tensors, final))
            names.append(final)
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )
        return names


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    holders: Sequence[nn.Module] | None = None,
    names: Sequence[str] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    gather: Callable[[str, torch.Tensor | None], torch.Tensor | None] | None = None,
) -> Path:
    """Write ``model``'s weights (and Hugging Face config) to ``directory`` (module docstring).

    ``holders``: the modules whose tensors this rank holds (default the model);
    ``names`` with ``gather(name, value)``: the tensors to write, in order, and how each is
    made whole on the first rank (value None where this rank holds none; a pipeline's, see
    :func:`save_pretrained_from_stages`); by default every rank holds every tensor and
    takes part in :func:`plait.comm.dtensor.full_value`.
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise CheckpointError(
            f"save_pretrained(max_shard_bytes={max_shard_bytes!r}): must be an int, the bytes "
            "of one shard file (at least 1)"
        )
    if max_shard_bytes < 1:
        raise CheckpointError(
            f"save_pretrained(max_shard_bytes={max_shard_bytes}): must be at least 1 byte"
        )
    path = Path(directory)
    writing = rank() == 0
    if writing:
        _prepare(path)
    writer = _ShardWriter(path, max_shard_bytes, writing)
    if names is not None and gather is not None:
        for name in names:
            whole = gather(name, None)
            if whole is not None:
                writer.add(name, whole)
            del whole
    else:
        for name, value in unique_tensors(holders if holders is not None else [model]):
            writer.add(name, _whole(value))
    writer.finish()
    if writing:
        _write_configs(model, path)
    barrier()  # every rank returns once the files are there
    return path


def save_pretrained_from_stages(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    holders: Sequence[nn.Module],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """:func:`save_pretrained` for a pipeline job, whose ranks hold some stages each.

    Every rank first learns who holds which tensor (one gather of names, shapes and dtypes);
    then, tensor after tensor in one order every rank knows, the ranks holding a tensor make
    it whole among themselves (their stage's layout) and the lowest of them sends it to the
    first rank, which writes it. A tensor two stages hold (a tie across stages) is written
    once."""
    held = dict(unique_tensors(holders))
    listing = [(name, tuple(v.shape), v.dtype) for name, v in held.items()]
    everyone = all_gather_objects(listing)
    order: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
    for source, names in enumerate(everyone):
        for name, shape, dtype in names:
            order.setdefault(name, (shape, dtype, source))  # the lowest holder sends it
    me = rank()

    def gather(name: str, _: torch.Tensor | None) -> torch.Tensor | None:
        shape, dtype, source = order[name]
        whole = _whole(held[name]) if name in held else None
        if source == me:
            if me != 0:
                assert whole is not None
                send_tensor(whole.cpu(), 0)
                return None
            return whole
        return recv_tensor(shape, dtype, source) if me == 0 else None

    return save_pretrained(
        model,
        directory,
        names=list(order),
        max_shard_bytes=max_shard_bytes,
        gather=gather,
    )


def _whole(value: torch.Tensor) -> torch.Tensor:
    return full_value(value) if is_dtensor(value) else value.detach()


def _prepare(path: Path) -> None:
    """An empty directory to write into: made, or emptied of an earlier save's weights."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"save_pretrained({str(path)!r}): a file is there; give a directory (made if "
            "missing) to write the model into"
        )
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("*.safetensors"), *path.glob("model.safetensors.index.json")]:
        old.unlink()  # an earlier save's shards: the new index must not sit beside them
    for stale in path.glob(".shard-*"):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()


def _write_configs(model: nn.Module, path: Path) -> None:
    """The Hugging Face config and generation config, for a model that has them."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config.architectures = [type(model).__name__]  # as Hugging Face's own save sets it
    config.save_pretrained(str(path))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and (can_generate is None or can_generate()):
        generation.save_pretrained(str(path))
