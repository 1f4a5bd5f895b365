"""A BERT encoder: post-norm layers, token/position/segment embeddings, pooler, classifier.

Tensor-name legend: B batch, T sequence, D hidden, H heads, K head width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.spec import Batch, ModelSpec

__all__ = ["Bert", "BertLayer", "bert_loss"]


class BertLayer(nn.Module):
    """Post-norm encoder layer: bidirectional attention, then a GELU MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads = spec.heads
        self.qkv = nn.Linear(spec.hidden, 3 * spec.hidden)
        self.out = nn.Linear(spec.hidden, spec.hidden)
        self.attn_norm = nn.LayerNorm(spec.hidden)
        self.fc1 = nn.Linear(spec.hidden, spec.ffn_or_default)
        self.fc2 = nn.Linear(spec.ffn_or_default, spec.hidden)
        self.mlp_norm = nn.LayerNorm(spec.hidden)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        qkv = self.qkv(x_BTD).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y_BHTK = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x_BTD = self.attn_norm(x_BTD + self.out(y_BHTK.transpose(1, 2).reshape(b, t, d)))
        return self.mlp_norm(x_BTD + self.fc2(F.gelu(self.fc1(x_BTD))))


class Bert(nn.Module):
    """A BERT encoder with a pooler (tanh over the first token) and a classification head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.seq, spec.hidden)
        self.seg = nn.Embedding(2, spec.hidden)
        self.emb_norm = nn.LayerNorm(spec.hidden)
        self.layers = nn.ModuleList(BertLayer(spec) for _ in range(spec.layers))
        self.pooler = nn.Linear(spec.hidden, spec.hidden)
        self.classifier = nn.Linear(spec.hidden, spec.classes)

    def forward(self, ids_BT: torch.Tensor, segments_BT: torch.Tensor) -> torch.Tensor:
        positions_T = torch.arange(ids_BT.shape[1], device=ids_BT.device)
        x_BTD = self.emb_norm(self.tok(ids_BT) + self.pos(positions_T) + self.seg(segments_BT))
        for layer in self.layers:
            x_BTD = layer(x_BTD)
        pooled_BD = torch.tanh(self.pooler(x_BTD[:, 0]))
        return self.classifier(pooled_BD)


def bert_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross entropy of the CLS classification: ``batch = (ids, segments, labels)``."""
    ids, segments, labels = batch
    return F.cross_entropy(model(ids, segments), labels)
