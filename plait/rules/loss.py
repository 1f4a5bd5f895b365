"""Loss family: ``cross_entropy_loss``, ``nll_loss``, ``mse_loss`` and other elementwise losses.

Batch (and, for ``[N, C, d1, ...]`` inputs, spatial) dims split; the class dim stays whole
(its softmax is reduced inside the op). By ``reduction``: ``none`` (0) splits the output
alike; ``sum`` (2) leaves a pending sum; ``mean`` (1) leaves a pending average, which is
exact when every device averages the same number of terms: true for elementwise losses
(even splits); for class-index losses PyTorch divides by the number of targets not equal to
``ignore_index``, which may differ between devices, so the executor makes each device's term
exact with the all-reduced global count (the plan lists that scalar all-reduce:
:func:`divides_by_target_count`). Class-weighted means (``weight`` given) divide by a weight
sum that differs per device: they are not split.
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.layout import TensorLayout
from plait.layout.placement import ReduceOp
from plait.rules.args import arg, ref_index
from plait.rules.einsum import FIXED, Einsum, EinsumRule, aligned, dim_letters, einsum_for

__all__ = ["CLASS_LOSS_TARGETS", "divides_by_target_count", "loss_rules"]

CLASS_LOSS_TARGETS = (
    "aten.cross_entropy_loss.default",
    "aten.nll_loss.default",
    "aten.nll_loss_nd.default",
    "aten.nll_loss2d.default",
)
"""Class-index losses ``(input, target, weight, reduction, ignore_index, ...)``: a mean divides
by the number of targets not ignored (rows, for probability targets), which differs between
the ranks of a split batch; the executor all-reduces it (one scalar per batch axis)."""

_REDUCE: dict[int, ReduceOp] = {1: "avg", 2: "sum"}


def divides_by_target_count(target: str, output: TensorLayout) -> bool:
    """A class-index loss whose planned output is a pending mean over split terms: each device
    divides by the global count of its targets (one scalar all-reduce per splitting axis)."""
    return target in CLASS_LOSS_TARGETS and bool(output.partial) and output.reduce_op == "avg"


def _reduced(
    op: OpNode, pos: int, letters: tuple[str, ...]
) -> tuple[tuple[str, ...], dict[str, ReduceOp]] | None:
    """Output letters and pending reductions for ``reduction`` argument ``pos``."""
    reduction = arg(op, pos, "reduction", 1)
    if reduction == 0:
        return letters, {}
    if reduction not in _REDUCE:
        return None
    return (), {x: _REDUCE[reduction] for x in letters if x}


def class_loss_rule(op: OpNode) -> Einsum | None:
    """``cross_entropy_loss(x[N, C, *], target, weight, reduction, ignore_index, ...)``, ``nll_loss``."""
    x, t, w = ref_index(op, 0, "self"), ref_index(op, 1, "target"), ref_index(op, 2, "weight")
    if x is None or t is None or len(op.outputs) != 1 or op.input_metas[x].ndim < 2:
        return None
    nd = op.input_metas[x].ndim
    batch = ("n", *dim_letters(nd - 2, "s"))
    xs = (batch[0], FIXED, *batch[1:])
    probs = op.input_metas[t].shape == op.input_metas[x].shape
    letters: list[tuple[str, ...]] = [()] * len(op.inputs)
    letters[x], letters[t] = xs, xs if probs else batch
    if w is not None:
        letters[w] = (FIXED,)
        if arg(op, 3, "reduction", 1) == 1:
            batch = (FIXED,) * len(batch)
            letters[x] = (FIXED,) * nd
            letters[t] = (FIXED,) * op.input_metas[t].ndim
    found = _reduced(op, 3, batch)
    if found is None:
        return None
    names = {"n": "batch", **{f"s{i}": f"spatial{i}" for i in range(nd - 2)}}
    return einsum_for(op, letters, [found[0]], names=names, reduce=found[1])


_REDUCTION_POS = {
    "aten.mse_loss.default": 2,
    "aten.l1_loss.default": 2,
    "aten.smooth_l1_loss.default": 2,
    "aten.huber_loss.default": 2,
    "aten.soft_margin_loss.default": 2,
    "aten.kl_div.default": 2,
    "aten.binary_cross_entropy.default": 3,
    "aten.binary_cross_entropy_with_logits.default": 4,
}


def elementwise_loss_rule(op: OpNode) -> Einsum | None:
    """``mse_loss(x, target, reduction)`` and friends: every element is one term."""
    if not op.inputs or len(op.outputs) != 1:
        return None
    shape = op.input_metas[0].shape
    if any(m.ndim > len(shape) for m in op.input_metas):
        return None
    xs = dim_letters(len(shape))
    letters = [aligned(m.shape, shape, xs) for m in op.input_metas]
    found = _reduced(op, _REDUCTION_POS[op.target], xs)
    if found is None:
        return None
    names = {x: f"dim{i}" for i, x in enumerate(xs)}
    return einsum_for(op, letters, [found[0]], names=names, reduce=found[1])


def loss_rules() -> tuple[EinsumRule, ...]:
    return (
        EinsumRule(
            "loss",
            CLASS_LOSS_TARGETS,
            class_loss_rule,
        ),
        EinsumRule("loss", tuple(_REDUCTION_POS), elementwise_loss_rule),
    )
