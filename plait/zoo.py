"""Built-in models for ``plait plan --model``, tests and benchmarks.

Each kind is a plain ``torch.nn.Module`` with a loss function and an example batch. Nothing
here allocates on its own: build under ``with torch.device("meta"):`` to get a model of any
size with no memory, or without it for a small real model that trains on a CPU.

| kind    | model                                                                   | batch                      |
|---------|-------------------------------------------------------------------------|----------------------------|
| `gpt`   | :class:`plait.testing.models.TinyGPT` (pre-norm, learned positions)     | ``(ids, targets)``         |
| `llama` | RMSNorm, rotary positions, SwiGLU, grouped-query attention              | ``(ids, targets)``         |
| `bert`  | post-norm encoder, token/position/segment embeddings, pooler, classifier| ``(ids, segments, labels)``|
| `mlp`   | :class:`plait.testing.models.MLP`, ``layers`` linears of ``hidden``     | ``(x, y)``                 |
| `cnn`   | conv/batch-norm/relu/max-pool blocks, global average pool, classifier   | ``(images, labels)``       |

Tensor-name legend: B batch, T sequence, D hidden, H heads, G kv heads, K head width, V vocab,
F feed-forward width, C channels, S image side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import ConfigError
from plait.testing.models import MLP, GPTConfig, TinyGPT, gpt_loss, mlp_loss

__all__ = [
    "KINDS",
    "Batch",
    "Bert",
    "Llama",
    "LossFn",
    "ModelSpec",
    "SmallCNN",
    "build",
    "parameter_count",
]

ModelKind = Literal["gpt", "llama", "bert", "mlp", "cnn"]
KINDS: tuple[str, ...] = get_args(ModelKind)
Batch = tuple[torch.Tensor, ...]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def _spec_error(field: str, value: object, rule: str, fix: str) -> ConfigError:
    return ConfigError(f"ModelSpec.{field}={value!r}: {rule}; {fix}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Size of a zoo model. Fields that a kind does not use are ignored by it.

    ``layers`` counts transformer blocks (gpt, llama, bert), linear layers (mlp) or
    conv blocks (cnn); ``hidden`` is the model width (mlp: every layer's width; cnn: the
    channels of every conv block). ``kv_heads`` (llama) defaults to ``heads``; ``ffn``
    defaults to ``4 * hidden`` (llama: the SwiGLU width ``8/3 * hidden`` rounded up to 8).
    """

    kind: str = "gpt"
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    seq: int = 16
    vocab: int = 64
    batch: int = 2
    kv_heads: int | None = None
    ffn: int | None = None
    tied: bool = False  # llama: LM head shares the token embedding
    classes: int = 4  # bert, cnn: classifier outputs
    channels: int = 3  # cnn: input image channels
    image: int = 16  # cnn: input image side

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _spec_error(
                "kind", self.kind, f"unknown model kind; known: {KINDS}", "pick one of those"
            )
        for name in (
            "layers",
            "hidden",
            "heads",
            "seq",
            "vocab",
            "batch",
            "classes",
            "channels",
            "image",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _spec_error(name, value, "must be a positive int", f"set {name} >= 1")
        for name in ("kv_heads", "ffn"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise _spec_error(
                    name,
                    value,
                    "must be None or a positive int",
                    f"set {name}=None for the default",
                )
        if self.kind in ("gpt", "llama", "bert"):
            self._check_attention()
        if self.kind == "cnn" and self.image < 2**self.layers:
            raise _spec_error(
                "image",
                self.image,
                f"each of the {self.layers} conv blocks halves the image side",
                f"set image >= {2**self.layers} or fewer layers",
            )

    def _check_attention(self) -> None:
        if self.hidden % self.heads:
            raise _spec_error(
                "heads",
                self.heads,
                f"must divide hidden={self.hidden}",
                "pick heads that divide hidden",
            )
        kv = self.kv_heads_or_default
        if self.kind != "llama" and kv != self.heads:
            raise _spec_error(
                "kv_heads",
                self.kv_heads,
                f"{self.kind} has no grouped-query attention",
                "leave kv_heads=None or use kind='llama'",
            )
        if self.heads % kv:
            raise _spec_error(
                "kv_heads", kv, f"must divide heads={self.heads}", "pick kv_heads that divide heads"
            )
        if self.kind == "llama" and self.head_dim % 2:
            raise _spec_error(
                "hidden",
                self.hidden,
                f"rotary embeddings need an even head width, got {self.head_dim}",
                "make hidden / heads even",
            )
        if self.kind == "gpt" and self.ffn not in (None, 4 * self.hidden):
            raise _spec_error(
                "ffn",
                self.ffn,
                f"TinyGPT's MLP is fixed at 4 * hidden = {4 * self.hidden}",
                "leave ffn=None",
            )

    @property
    def kv_heads_or_default(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_or_default(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.kind == "llama":
            return -(-(8 * self.hidden // 3) // 8) * 8
        return 4 * self.hidden


# --------------------------------------------------------------------------- llama


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Precomputed rotary cos/sin tables, ``[seq, head_dim]``, shared by every block."""

    def __init__(self, head_dim: int, seq: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles_TK = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles_TK.cos(), persistent=False)
        self.register_buffer("sin", angles_TK.sin(), persistent=False)

    def forward(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:t], self.sin[:t]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rotary(x_BHTK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    return x_BHTK * cos_TK + _rotate_half(x_BHTK) * sin_TK


class GQAttention(nn.Module):
    """Causal attention whose ``kv_heads`` key/value heads each serve ``heads / kv_heads`` queries."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            spec.heads,
            spec.kv_heads_or_default,
            spec.head_dim,
        )
        self.q = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=False)
        self.k = nn.Linear(spec.hidden, self.kv_heads * spec.head_dim, bias=False)
        self.v = nn.Linear(spec.hidden, self.kv_heads * spec.head_dim, bias=False)
        self.o = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)

    def forward(
        self, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor
    ) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q_BHTK = self.q(x_BTD).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k_BGTK = self.k(x_BTD).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v_BGTK = self.v(x_BTD).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q_BHTK, k_BGTK = (
            _apply_rotary(q_BHTK, cos_TK, sin_TK),
            _apply_rotary(k_BGTK, cos_TK, sin_TK),
        )
        # enable_gqa keeps one attention op in the graph instead of repeat_interleave copies.
        y_BHTK = F.scaled_dot_product_attention(
            q_BHTK, k_BGTK, v_BGTK, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        return self.o(y_BHTK.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden)
        self.attn = GQAttention(spec)
        self.mlp_norm = RMSNorm(spec.hidden)
        self.mlp = SwiGLU(spec.hidden, spec.ffn_or_default)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama-style decoder: pre-RMSNorm blocks, rotary positions, SwiGLU, GQA."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)
        self.rope = Rotary(spec.head_dim, spec.seq)
        self.blocks = nn.ModuleList(LlamaBlock(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied:
            self.head.weight = self.tok.weight

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        x_BTD = self.tok(ids_BT)
        cos, sin = self.rope(ids_BT.shape[1])
        for block in self.blocks:
            x_BTD = block(x_BTD, cos, sin)
        return self.head(self.norm(x_BTD))


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross entropy: ``batch = (ids, targets)``."""
    ids, targets = batch
    logits_BTV = model(ids)
    return F.cross_entropy(logits_BTV.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------- bert


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


# --------------------------------------------------------------------------- cnn


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


# --------------------------------------------------------------------------- build


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
