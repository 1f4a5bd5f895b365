"""Reduction family: ``sum``, ``mean``, ``amax``/``amin``, ``max``/``min``, and scans.

Splitting a reduced dim leaves each device the reduction of its piece; the op's result is
then a pending reduction of those pieces, exact for: ``sum`` (a pending sum), ``mean`` (a
pending average: every piece has the same number of elements, since splits are even),
``amax``/``max`` (pending max) and ``amin``/``min`` (pending min). Reductions that return
indices (``max.dim``, ``argmax``), or combine pieces non-linearly (``prod``, ``var``, ``std``,
``logsumexp``, ``norm``, ``any``/``all``) and scans (``cumsum``) keep the reduced dim whole.
Kept dims split freely; with ``keepdim`` the reduced dim stays at size 1.
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.layout.placement import ReduceOp
from plait.rules.args import arg, dims_arg
from plait.rules.einsum import (
    FIXED,
    Einsum,
    EinsumRule,
    dim_letters,
    dim_names,
    einsum_for,
    saved_inputs,
    saved_nothing,
)

__all__ = ["reduction_rules"]

_KIND: dict[str, ReduceOp | None] = {
    "sum": "sum",
    "mean": "avg",
    "amax": "max",
    "amin": "min",
    "max": "max",
    "min": "min",
}


def _reduced_dims(op: OpNode, nd: int) -> tuple[int, ...] | None:
    name, overload = op.target.split(".")[1:3]
    if overload == "default" and name in ("sum", "mean", "max", "min", "prod", "any", "all"):
        return tuple(range(nd))  # full reductions to a scalar
    if name in ("argmax", "argmin") and arg(op, 1, "dim") is None:
        return tuple(range(nd))
    return dims_arg(arg(op, 1, "dim"), nd)


def reduction_rule(op: OpNode) -> Einsum | None:
    """Kept dims split freely; reduced dims split into a pending reduction where exact."""
    if len(op.inputs) != 1 or not op.outputs:
        return None
    nd = op.input_metas[0].ndim
    reduced = _reduced_dims(op, nd)
    if reduced is None:
        return None
    name = op.target.split(".")[1]
    multi = op.target in ("aten.max.dim", "aten.min.dim")  # (values, indices)
    kind = None if multi else _KIND.get(name)
    xs = list(dim_letters(nd))
    for d in reduced:
        if kind is None:
            xs[d] = FIXED
    out = op.outputs[0]
    keep = out.ndim == nd
    ys = tuple(FIXED if d in reduced else x for d, x in enumerate(xs) if keep or d not in reduced)
    if len(ys) != out.ndim or any(m.ndim != out.ndim for m in op.outputs):
        return None
    reduce = {xs[d]: kind for d in reduced if kind is not None}
    return einsum_for(op, [tuple(xs)], [ys] * len(op.outputs), names=dim_names(nd), reduce=reduce)


def scan_rule(op: OpNode) -> Einsum | None:
    """``cumsum(x, dim)``: the scanned dim stays whole."""
    if len(op.inputs) != 1:
        return None
    nd = op.input_metas[0].ndim
    dims = dims_arg(arg(op, 1, "dim"), nd)
    if dims is None:
        return None
    xs = tuple(FIXED if d in dims else x for d, x in enumerate(dim_letters(nd)))
    return einsum_for(op, [xs], [xs] * len(op.outputs), names=dim_names(nd))


def reduction_rules() -> tuple[EinsumRule, ...]:
    linear = (
        "aten.sum.default",
        "aten.sum.dim_IntList",
        "aten.mean.default",
        "aten.mean.dim",
    )
    ordered = (
        "aten.amax.default",
        "aten.amin.default",
        "aten.max.default",
        "aten.min.default",
        "aten.max.dim",
        "aten.min.dim",
        "aten.argmax.default",
        "aten.argmin.default",
        "aten.prod.default",
        "aten.prod.dim_int",
        "aten.var.correction",
        "aten.var.dim",
        "aten.std.correction",
        "aten.std.dim",
        "aten.logsumexp.default",
        "aten.any.dim",
        "aten.any.dims",
        "aten.any.default",
        "aten.all.dim",
        "aten.all.default",
    )
    return (
        EinsumRule("reduction", linear, reduction_rule, saved=saved_nothing),
        EinsumRule("reduction", ordered, reduction_rule, saved=saved_inputs),
        EinsumRule("reduction", ("aten.cumsum.default",), scan_rule, saved=saved_nothing),
    )
