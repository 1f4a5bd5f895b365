"""ModelSpec: the size of a built-in model, validated at construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from plait.errors import ConfigError

__all__ = ["KINDS", "Batch", "LossFn", "ModelKind", "ModelSpec"]

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
