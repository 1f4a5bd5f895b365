"""Running an elementwise optimizer on the local pieces of DTensor parameters.

SGD, Adam, AdamW and their kin update every element from that element's own gradient and
state, so updating each rank's local piece is the same as updating the whole tensor. Doing it
on plain local tensors skips DTensor's per-op dispatch, which costs more than the arithmetic
for every parameter and every op of the update. Each plain "shadow" parameter shares storage
with its DTensor's local piece, so in-place updates land in the model.

Optimizers that look across elements (gradient-norm based ones such as LAMB, or anything the
class list below does not name) keep running on the DTensors, where those reductions are
global.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from plait.comm.dtensor import is_dtensor, local_piece

__all__ = ["LocalShadows", "build_optimizer", "is_elementwise"]

_ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """True for optimizers whose update of an element reads only that element's data."""
    return type(optimizer) in _ELEMENTWISE


class LocalShadows:
    """Plain parameters aliasing the local pieces of a model's DTensor parameters."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.pairs = [
            (p, nn.Parameter(local_piece(p).detach(), requires_grad=p.requires_grad))
            for p in params
            if is_dtensor(p)
        ]

    @property
    def shadows(self) -> list[nn.Parameter]:
        return [s for _, s in self.pairs]

    def load_grads(self) -> None:
        """Point each shadow's gradient at its DTensor parameter's local gradient."""
        for p, s in self.pairs:
            s.grad = None if p.grad is None else local_piece(p.grad)


def build_optimizer(
    model: nn.Module, factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    """The user's optimizer, on local pieces when its update is elementwise.

    A probe instance tells whether the optimizer is elementwise; DTensor parameters then get
    local shadows (:class:`LocalShadows`) that the real instance updates.
    """
    params = list(model.parameters())
    probe = factory(params)
    if not is_elementwise(probe) or not any(is_dtensor(p) for p in params):
        return probe
    shadows = LocalShadows(params)
    optimizer = factory(shadows.shadows)
    optimizer._plait_shadows = shadows  # type: ignore[attr-defined]
    return optimizer
