"""Matmul family: ``linear``, ``matmul``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``.

Letters: batch dims ``b0, b1, ...`` (labels ``batch``, ``b1``, ...), rows ``m``, columns ``n``,
the contracted dim ``k``. Splitting ``k`` leaves a pending sum on the output (MindSpore's
forward AllReduce). A bias added by the op (``linear``, ``addmm``) is read whole on every
device of a ``k`` split: executing the op must add it on one device of the group only
(DTensor does this by turning the replicated bias into a pending sum locally).
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.rules.args import ref_index
from plait.rules.einsum import Einsum, EinsumRule, aligned, einsum_for

__all__ = ["matmul_rules"]

_NAMES = {"b0": "batch", "m": "m", "n": "n", "k": "k"}
_LINEAR_NAMES = {"b0": "batch", "n": "column", "k": "row"}


def _batch(ndim: int) -> tuple[str, ...]:
    return tuple(f"b{i}" for i in range(ndim))


def _names(base: dict[str, str], nbatch: int) -> dict[str, str]:
    names = dict(base)
    names.update({f"b{i}": f"b{i}" for i in range(1, nbatch)})
    return names


def linear_rule(op: OpNode) -> Einsum | None:
    """``y[..., n] = x[..., k] @ w[n, k].T + b[n]``."""
    x, w, b = (ref_index(op, p, n) for p, n in ((0, "input"), (1, "weight"), (2, "bias")))
    if x is None or w is None or op.input_metas[w].ndim != 2:
        return None
    nd = op.input_metas[x].ndim
    batch = _batch(nd - 1)
    letters: list[tuple[str, ...]] = [()] * len(op.inputs)
    letters[x] = (*batch, "k")
    letters[w] = ("n", "k")
    if b is not None:
        if op.input_metas[b].ndim != 1:
            return None
        letters[b] = ("n",)
    return einsum_for(
        op, letters, [(*batch, "n")], names=_names(_LINEAR_NAMES, len(batch)), reduce={"k": "sum"}
    )


def _matmul_letters(
    xs: tuple[int, ...], ws: tuple[int, ...], out: tuple[int, ...]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None:
    """Letters of ``torch.matmul`` operands (1-D operands and broadcast batch dims)."""
    if not xs or not ws:
        return None
    if len(xs) == 1 and len(ws) == 1:
        return ("k",), ("k",), ()
    if len(xs) == 1:
        batch = _batch(len(ws) - 2)
        return ("k",), (*batch, "k", "n"), (*batch, "n")
    if len(ws) == 1:
        batch = _batch(len(xs) - 2)
        return (*batch, "m", "k"), ("k",), (*batch, "m")
    batch = _batch(len(out) - 2)
    out_batch = out[:-2]
    xb = aligned(xs[:-2], out_batch, batch)
    wb = aligned(ws[:-2], out_batch, batch)
    return (*xb, "m", "k"), (*wb, "k", "n"), (*batch, "m", "n")


def matmul_rule(op: OpNode) -> Einsum | None:
    """``torch.matmul``, ``mm`` and ``bmm``: ``[..., m, k] @ [..., k, n]``."""
    x, w = ref_index(op, 0, "self"), ref_index(op, 1, "other")
    if x is None or w is None or len(op.inputs) != 2 or len(op.outputs) != 1:
        return None
    found = _matmul_letters(op.input_metas[x].shape, op.input_metas[w].shape, op.outputs[0].shape)
    if found is None:
        return None
    letters: list[tuple[str, ...]] = [()] * 2
    letters[x], letters[w] = found[0], found[1]
    nbatch = sum(1 for x in found[2] if x.startswith("b"))
    return einsum_for(op, letters, [found[2]], names=_names(_NAMES, nbatch), reduce={"k": "sum"})


def addmm_rule(op: OpNode) -> Einsum | None:
    """``addmm(bias, x, w)`` and ``baddbmm``: a matmul plus a broadcast bias."""
    b, x, w = ref_index(op, 0, "self"), ref_index(op, 1, "mat1"), ref_index(op, 2, "mat2")
    if op.target.startswith("aten.baddbmm"):
        x, w = ref_index(op, 1, "batch1"), ref_index(op, 2, "batch2")
    if b is None or x is None or w is None or len(op.inputs) != 3:
        return None
    out = op.outputs[0].shape
    found = _matmul_letters(op.input_metas[x].shape, op.input_metas[w].shape, out)
    if found is None:
        return None
    letters: list[tuple[str, ...]] = [()] * 3
    letters[x], letters[w] = found[0], found[1]
    letters[b] = aligned(op.input_metas[b].shape, out, found[2])
    nbatch = len(found[2]) - 2
    return einsum_for(op, letters, [found[2]], names=_names(_NAMES, nbatch), reduce={"k": "sum"})


def matmul_rules() -> tuple[EinsumRule, ...]:
    weights = ((1, "weight"), (2, "bias"))
    return (
        EinsumRule("matmul", ("aten.linear.default",), linear_rule, weights=weights),
        EinsumRule(
            "matmul",
            ("aten.matmul.default", "aten.mm.default", "aten.bmm.default"),
            matmul_rule,
            weights=((1, "other"),),
        ),
        EinsumRule(
            "matmul",
            ("aten.addmm.default", "aten.baddbmm.default"),
            addmm_rule,
            weights=((0, "self"), (2, "mat2")),
        ),
    )
