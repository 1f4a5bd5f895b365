"""TinyGPT: a GPT with learned positions and pre-norm blocks, and its Megatron annotations.

Tensor-name legend: B batch, T sequence, D model width, H heads, K head width, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from plait.annotate import shard
from plait.models.spec import Batch

__all__ = [
    "Attention",
    "Block",
    "GPTConfig",
    "TinyGPT",
    "annotate_megatron",
    "gpt_loss",
    "token_batches",
]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    width: int = 32
    heads: int = 4
    layers: int = 2


class Attention(nn.Module):
    mask: torch.Tensor  # a buffer (nn.Module's attribute lookup types it loosely)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.width, cfg.width)
        # No key bias: softmax ignores a constant added to every score of a row, so a key bias
        # has an exactly zero gradient and only collects rounding noise that Adam amplifies.
        self.k = nn.Linear(cfg.width, cfg.width, bias=False)
        self.v = nn.Linear(cfg.width, cfg.width)
        self.out = nn.Linear(cfg.width, cfg.width)
        mask = torch.full((cfg.seq, cfg.seq), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def _split(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        return x_BTD.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        q, k, v = self._split(self.q(x_BTD)), self._split(self.k(x_BTD)), self._split(self.v(x_BTD))
        scores_BHTT = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads) + self.mask[:t, :t]
        y_BHTK = scores_BHTT.softmax(dim=-1) @ v
        return self.out(y_BHTK.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc1 = nn.Linear(cfg.width, 4 * cfg.width)
        self.fc2 = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT: token and position embeddings, pre-norm blocks, a final norm and an LM head."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        t = ids_BT.shape[1]
        x = self.tok(ids_BT) + self.pos(torch.arange(t, device=ids_BT.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, targets = batch
    logits_BTV = model(ids)
    return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets.reshape(-1))


def token_batches(cfg: GPTConfig, batch: int, n: int, seed: int = 1) -> list[Batch]:
    """``n`` batches of ``batch`` random token rows for ``cfg`` with their next-token targets
    (the rows rolled by one): the same ones for the same ``seed``, what benchmarks train on."""
    gen = torch.Generator().manual_seed(seed)
    out: list[Batch] = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def annotate_megatron(model: TinyGPT, tp: int) -> TinyGPT:
    """Megatron tensor parallel over ``tp`` devices: heads and MLP columns split, then rows.

    ``nn.Linear`` weights are ``[out, in]``: ``(tp, 1)`` splits outputs (column parallel),
    ``(1, tp)`` splits inputs (row parallel, its partial sums all-reduced).
    """
    for block in cast("Iterable[Block]", model.blocks):
        for lin in (block.attn.q, block.attn.k, block.attn.v, block.fc1):
            shard(lin, parameter_strategy={"weight": (tp, 1)})
        for lin in (block.attn.out, block.fc2):
            shard(lin, parameter_strategy={"weight": (1, tp)})
    return model
