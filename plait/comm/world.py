"""The current world as the runtime sees it: real process group or simulated ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from plait._compat import simulated_ranks

__all__ = ["CurrentWorld", "current_world"]


@dataclass(frozen=True, slots=True)
class CurrentWorld:
    rank: int
    world_size: int
    simulated: bool
    device_type: str


def current_world() -> CurrentWorld | None:
    """The initialised world, or None when no process group exists."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    ranks = simulated_ranks()
    backend = dist.get_backend()
    device = "cuda" if backend == "nccl" else "cpu"
    if ranks is not None:
        return CurrentWorld(0, len(ranks), True, device)
    return CurrentWorld(dist.get_rank(), dist.get_world_size(), False, device)
