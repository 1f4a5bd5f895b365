"""Attention on each rank's own heads (:func:`plait.comm.dispatch.local_attention`, what
pipeline stages with tp run for ``F.scaled_dot_product_attention``) with masks of every
kind, on simulated ranks.

Reference: ``F.scaled_dot_product_attention`` on the whole tensors on one device. A mask that
broadcasts over heads is read whole; a per-head bias (ALiBi's) is read in pieces split as the
heads are, whether it comes whole (a plain tensor, a replicated DTensor) or split by the plan;
no case communicates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plait
from plait.comm.dispatch import local_attention
from plait.comm.dtensor import build_device_mesh, distribute
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.testing.comm import CollectiveLog

B, H, L, E = 2, 4, 6, 8
TP = MeshSpec.from_dict({"tp": 2})
HEADS = TensorLayout(TP, ((), ("tp",), (), ()))
WHOLE = TensorLayout.replicated(TP, 4)


def _qkv() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(B, H, L, E) for _ in range(3))


def _alibi() -> torch.Tensor:
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)]).view(1, H, 1, 1)
    distance = (torch.arange(L).view(1, L) - torch.arange(L).view(L, 1)).float()
    return (slopes * distance).expand(B, H, L, L).contiguous()


@pytest.mark.parametrize("given", ["plain", "replicated", "split_by_heads"])
def test_a_per_head_bias_is_read_in_pieces_without_communication(given: str) -> None:
    q, k, v = _qkv()
    bias = _alibi()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with plait.testing.simulate(2):
        mesh = build_device_mesh(TP)
        pieces = [distribute(t, mesh, HEADS) for t in (q, k, v)]
        mask = {
            "plain": bias,
            "replicated": distribute(bias, mesh, WHOLE),
            "split_by_heads": distribute(bias, mesh, HEADS),
        }[given]
        with CollectiveLog(mesh) as log:
            out = local_attention(tuple(pieces), {"attn_mask": mask})
        assert out is not None, "the bias should run on local heads"
        got = out.full_tensor()
    assert log.total() == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_mask_over_heads_is_read_whole() -> None:
    q, k, v = _qkv()
    padding = torch.ones(B, 1, L, L, dtype=torch.bool)
    padding[0, :, :, -2:] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=padding)
    with plait.testing.simulate(2):
        mesh = build_device_mesh(TP)
        pieces = [distribute(t, mesh, HEADS) for t in (q, k, v)]
        with CollectiveLog(mesh) as log:
            out = local_attention(tuple(pieces), {"attn_mask": padding})
        assert out is not None
        got = out.full_tensor()
    assert log.total() == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_learned_bias_is_left_to_dtensor() -> None:
    """Its gradient would be each rank's share of a sum: not run locally (None)."""
    q, k, v = _qkv()
    bias = _alibi().requires_grad_()
    with plait.testing.simulate(2):
        mesh = build_device_mesh(TP)
        pieces = [distribute(t, mesh, HEADS) for t in (q, k, v)]
        assert local_attention(tuple(pieces), {"attn_mask": bias}) is None
