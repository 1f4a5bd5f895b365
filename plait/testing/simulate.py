"""``simulate``: a world of N ranks inside this one process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from plait._compat import FakeStore, LocalTensorMode
from plait.errors import ConfigError

__all__ = ["simulate"]


@contextlib.contextmanager
def simulate(world_size: int) -> Iterator[None]:
    """Run the enclosed code as ``world_size`` ranks in this process.

    Every tensor made by plait inside the block holds one real piece per rank, and collectives
    compute exact results. Batches passed to ``Job.step`` are global batches; plait slices them.

    Example:
        >>> import plait
        >>> with plait.testing.simulate(world_size=2):
        ...     pass
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"simulate(world_size={world_size!r}): use an integer >= 1")
    if dist.is_initialized():
        raise ConfigError(
            "simulate() found a process group already initialised; simulated ranks need their own "
            "fake one: call simulate() outside plait.init()/torchrun, or destroy the group first"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with LocalTensorMode(world_size):
            yield
    finally:
        dist.destroy_process_group()
