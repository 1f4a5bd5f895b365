"""A stack of linear layers with GELU between them, and its regression loss."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.spec import Batch

__all__ = ["MLP", "mlp_loss"]


class MLP(nn.Module):
    """Linear layers with GELU between them."""

    def __init__(self, dims: Sequence[int] = (16, 32, 16, 8)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class FeedForward(nn.Module):
    """Residual feed-forward blocks ``x + down(relu(up(x)))``: a transformer's two matmuls a
    block without its attention and norms (MindSpore's high-dimensional tensor parallel page
    models them so: activation ``[bs, h]``, weights ``[h, e]`` and ``[e, h]``)."""

    def __init__(self, hidden: int = 16, inner: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(hidden, inner, bias=False) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(inner, hidden, bias=False) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.ups, self.downs, strict=True):
            x = x + down(torch.relu(up(x)))
        return x


def mlp_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)
