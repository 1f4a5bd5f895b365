"""A small CNN: conv/batch-norm/relu/max-pool blocks, global average pool, classifier.

Tensor-name legend: B batch, C channels, S image side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.spec import Batch, ModelSpec

__all__ = ["SmallCNN", "classify_loss"]


class SmallCNN(nn.Module):
    """``layers`` blocks of conv3x3-batchnorm-relu-maxpool, global average pool, linear."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for i in range(spec.layers):
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(spec.channels if i == 0 else spec.hidden, spec.hidden, 3, padding=1),
                    nn.BatchNorm2d(spec.hidden),
                    nn.ReLU(),
                    nn.MaxPool2d(2),
                )
            )
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(spec.hidden, spec.classes)

    def forward(self, images_BCSS: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(images_BCSS)), 1))


def classify_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross entropy of a classifier: ``batch = (inputs, labels)``."""
    x, labels = batch
    return F.cross_entropy(model(x), labels)
