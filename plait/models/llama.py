"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Tensor-name legend: B batch, T sequence, D hidden, H heads, G kv heads, K head width, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.spec import Batch, ModelSpec

__all__ = ["GQAttention", "Llama", "LlamaBlock", "RMSNorm", "Rotary", "SwiGLU", "lm_loss"]


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

    cos: torch.Tensor  # buffers (nn.Module's attribute lookup types them loosely)
    sin: torch.Tensor

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
