"""Pooling family: max, average and adaptive pooling in 1, 2 and 3 dims.

Pooling windows cover spatial dims only, so batch and channel dims split freely and the
spatial dims stay whole (a split would need a halo). ``*_with_indices`` outputs (flat indices
within one plane) are split like the values.
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.rules.einsum import (
    FIXED,
    Einsum,
    EinsumRule,
    dim_names,
    einsum_for,
    saved_inputs,
    saved_nothing,
)

__all__ = ["pooling_rules"]


def _spatial(target: str) -> int:
    for k in (1, 2, 3):
        if f"pool{k}d" in target:
            return k
    raise ValueError(target)


def pool_rule(op: OpNode) -> Einsum | None:
    if len(op.inputs) != 1:
        return None
    k = _spatial(op.target)
    nd = op.input_metas[0].ndim
    if nd < k + 1 or any(m.ndim != nd for m in op.outputs):
        return None
    xs = (*(f"d{i}" for i in range(nd - k)), *(FIXED,) * k)
    return einsum_for(op, [xs], [xs] * len(op.outputs), names=dim_names(nd - k))


def _targets(names: str) -> tuple[str, ...]:
    return tuple(f"aten.{n}.default" for n in names.split())


def pooling_rules() -> tuple[EinsumRule, ...]:
    maxes = _targets(
        "max_pool1d max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices "
        "adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d"
    )
    averages = _targets(
        "avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d "
        "adaptive_avg_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d"
    )
    return (
        EinsumRule("pooling", maxes, pool_rule, saved=saved_inputs),
        EinsumRule("pooling", averages, pool_rule, saved=saved_nothing),
    )
