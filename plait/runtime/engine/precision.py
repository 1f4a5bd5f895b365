"""Mixed precision: low-precision compute over fp32 master weights and optimizer states.

``precision="bf16"`` runs the forward (and so the backward) under ``torch.autocast`` with
bfloat16; parameters, their gradients and the optimizer's states stay fp32, so the update is
done in full precision. ``"fp16"`` does the same with float16 and adds dynamic loss scaling:
the loss is multiplied by ``scale`` before backward so small gradients survive float16, the
gradients are divided by it before the update, and a step whose gradients hold an inf or NaN
on any rank is skipped on every rank and the scale halved; after ``growth_interval`` clean
steps the scale doubles. ``"fp32"`` changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from plait.comm.dtensor import DeviceMesh, any_rank_true, local_piece

__all__ = ["LossScaler", "autocast_for"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast_for(precision: str, device_type: str) -> Iterator[None]:
    """Autocast to the compute dtype of ``precision`` (a no-op for fp32)."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device_type, dtype=_DTYPES[precision]):
        yield


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16 (see module docstring)."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    clean_steps: int = 0
    skipped_steps: int = 0

    def unscale_and_check(
        self, params: Iterable[torch.nn.Parameter], device_mesh: DeviceMesh | None
    ) -> bool:
        """Divide gradients by the scale; True when every rank's gradients are finite."""
        grads = [p.grad for p in params if p.grad is not None]
        finite = all(bool(torch.isfinite(local_piece(g)).all()) for g in grads)
        if any_rank_true(not finite, device_mesh):
            return False
        for g in grads:
            g.mul_(1.0 / self.scale)
        return True

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale /= 2.0
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
