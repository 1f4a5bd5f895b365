"""The zoo: built-in models by kind for ``plait plan --model``, tests and benchmarks.

Each kind is a plain ``torch.nn.Module`` with a loss function and an example batch. Nothing
here allocates on its own: build under ``with torch.device("meta"):`` to get a model of any
size with no memory, or without it for a small real model that trains on a CPU.

| kind    | model                                                              | batch                       |
|---------|--------------------------------------------------------------------|-----------------------------|
| `gpt`   | :class:`~plait.models.gpt.TinyGPT` (pre-norm, learned positions)   | ``(ids, targets)``          |
| `llama` | :class:`~plait.models.llama.Llama`: RMSNorm, rotary, SwiGLU, GQA   | ``(ids, targets)``          |
| `bert`  | :class:`~plait.models.bert.Bert`: post-norm encoder, pooler        | ``(ids, segments, labels)`` |
| `mlp`   | :class:`~plait.models.mlp.MLP`, ``layers`` linears of ``hidden``   | ``(x, y)``                  |
| `cnn`   | :class:`~plait.models.cnn.SmallCNN`: conv/bn/relu/pool blocks      | ``(images, labels)``        |

Tensor-name legend: B batch, T sequence, D hidden, H heads, G kv heads, K head width, V vocab,
F feed-forward width, C channels, S image side.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.models.bert import Bert, bert_loss
from plait.models.cnn import SmallCNN, classify_loss
from plait.models.gpt import GPTConfig, TinyGPT, gpt_loss
from plait.models.llama import Llama, lm_loss
from plait.models.mlp import MLP, mlp_loss
from plait.models.spec import Batch, LossFn, ModelSpec

__all__ = ["build", "parameter_count"]


def _token_batch(spec: ModelSpec) -> Batch:
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), dtype=torch.int64)
    targets = torch.randint(0, spec.vocab, (spec.batch, spec.seq), dtype=torch.int64)
    return ids, targets


def build(spec: ModelSpec) -> tuple[nn.Module, Batch, LossFn]:
    """The model, an example batch and the loss function of ``spec``.

    Tensors are made on the current default device: under ``torch.device("meta")`` nothing
    is allocated, so a 175B-parameter spec builds in well under a second.
    """
    if spec.kind == "gpt":
        cfg = GPTConfig(
            vocab=spec.vocab, seq=spec.seq, width=spec.hidden, heads=spec.heads, layers=spec.layers
        )
        return TinyGPT(cfg), _token_batch(spec), gpt_loss
    if spec.kind == "llama":
        return Llama(spec), _token_batch(spec), lm_loss
    if spec.kind == "bert":
        ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), dtype=torch.int64)
        segments = torch.randint(0, 2, (spec.batch, spec.seq), dtype=torch.int64)
        labels = torch.randint(0, spec.classes, (spec.batch,), dtype=torch.int64)
        return Bert(spec), (ids, segments, labels), bert_loss
    if spec.kind == "mlp":
        dims = (spec.hidden,) * (spec.layers + 1)
        x, y = torch.randn(spec.batch, spec.hidden), torch.randn(spec.batch, spec.hidden)
        return MLP(dims), (x, y), mlp_loss
    # cnn (ModelSpec validated the kind)
    images = torch.randn(spec.batch, spec.channels, spec.image, spec.image)
    labels = torch.randint(0, spec.classes, (spec.batch,), dtype=torch.int64)
    return SmallCNN(spec), (images, labels), classify_loss


def parameter_count(spec: ModelSpec) -> int:
    """Parameters of ``spec``'s model, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model, _, _ = build(spec)
    return sum(p.numel() for p in model.parameters())
