"""Shared fixtures for simulated-rank tests: tiny models and fixed batches."""

import pytest
import torch

from plait.models import MLP, GPTConfig, TinyGPT

GPT_CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
STEPS = 10


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


@pytest.fixture
def mlp_and_batches():
    torch.manual_seed(0)
    model = MLP((16, 32, 16, 8))
    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(STEPS)]
    return model, batches


@pytest.fixture
def gpt_and_batches():
    torch.manual_seed(0)
    model = TinyGPT(GPT_CFG)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, GPT_CFG.vocab, (8, GPT_CFG.seq))
        batches.append((ids, torch.roll(ids, -1, dims=1)))
    return model, batches


def sgd(params):
    """SGD: a parameter's error is lr times its gradient's error (no Adam normalisation)."""
    return torch.optim.SGD(params, lr=0.1)
