"""Op signatures for the strategies users write by hand (``plait.ops.matmul``, tests).

A signature names each dim of each input and of the output (MindSpore's strategy tuples cut
them); ``resolve_strategy`` checks a user's strategy against it. PyTorch's Linear weight is
``[out, in]``: ``x[b..., k] * w[n, k] -> y[b..., n]`` with ``k`` summed.
"""

from __future__ import annotations

from plait.errors import ShardingError
from plait.layout import OpSignature

__all__ = ["linear_signature", "matmul_signature"]


def linear_signature(x_ndim: int) -> OpSignature:
    batch = tuple(f"b{i}" for i in range(x_ndim - 1))
    return OpSignature("linear", ((*batch, "k"), ("n", "k")), (*batch, "n"), ("input", "weight"))


def matmul_signature(x_ndim: int, w_ndim: int) -> OpSignature:
    """``x[..., m, k] @ w[..., k, n]``; batch dims of ``w`` align with ``x``'s from the right."""
    if x_ndim < 2 or w_ndim < 2 or w_ndim > x_ndim:
        raise ShardingError(
            f"plait.ops.matmul takes x with >= 2 dims and w with 2..x.ndim dims, got {x_ndim} and {w_ndim}"
        )
    batch = tuple(f"b{i}" for i in range(x_ndim - 2))
    w_batch = batch[len(batch) - (w_ndim - 2) :] if w_ndim > 2 else ()
    return OpSignature(
        "matmul", ((*batch, "m", "k"), (*w_batch, "k", "n")), (*batch, "m", "n"), ("x", "w")
    )
