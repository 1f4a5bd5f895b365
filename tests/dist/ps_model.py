"""The recommender the parameter-server tests train: two tables and a small MLP.

Shared by the worker script (`plait run` processes) and the test's one-device reference.
"""

from __future__ import annotations

import torch
from torch import nn

ROWS, DIM, BATCH, STEPS = 96, 8, 12, 6


class Recommender(nn.Module):
    """A user table (nn.Embedding, padding row 0), an item table (nn.EmbeddingBag, a bag of
    three ids a sample) and an MLP over both."""

    def __init__(self, *, sparse: bool = False) -> None:
        super().__init__()
        self.users = nn.Embedding(ROWS, DIM, padding_idx=0, sparse=sparse)
        self.items = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        both = torch.cat([self.users(users), self.items(items)], dim=-1)
        return self.mlp(both).squeeze(-1)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["users"], batch["items"]), batch["label"])


def batches(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """Global batches: skewed ids (low ids hot), the padding id 0 among the users, labels a
    fixed function of the ids (learnable) plus a little noise."""
    g = torch.Generator().manual_seed(7)
    taste = torch.randn(ROWS, generator=g)
    out = []
    for _ in range(steps):
        users = torch.empty(BATCH).exponential_(0.08, generator=g).long().clamp(max=ROWS - 1)
        users[torch.randint(0, BATCH, (2,), generator=g)] = 0
        items = torch.randint(0, ROWS, (BATCH, 3), generator=g)
        label = taste[users] + taste[items].mean(1) + 0.05 * torch.randn(BATCH, generator=g)
        out.append({"users": users, "items": items, "label": label})
    return out
