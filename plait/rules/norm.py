"""Norm family: ``layer_norm``, ``rms_norm``, ``batch_norm``, ``group_norm`` and their native forms.

The normalised dims are reduced inside the op (mean and variance), so they are never split;
every other dim may be. Layer/RMS norm's weight and bias cover the normalised dims and are
read whole. Batch norm in training normalises over the batch and spatial dims: only the
channel dim is split (with weight, bias and running statistics); a batch split would change
the statistics (SyncBatchNorm's all-reduce is not expressible as an output layout). In eval
(``training=False``) the running statistics are used and batch and spatial dims split freely.
Group norm splits the batch, and channels by whole groups (the split divides ``num_groups``).
RMSNorm written out by hand (pow, mean, rsqrt, mul) is covered by the pointwise and
reduction rules.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.graph import OpNode
from plait.rules.args import arg, ref_index
from plait.rules.einsum import (
    FIXED,
    Einsum,
    EinsumRule,
    dim_letters,
    dim_names,
    einsum_for,
    local_bytes,
)
from plait.rules.registry import OpStrategy

__all__ = ["norm_rules"]


def _normalized_ndim(op: OpNode) -> int | None:
    shape = arg(op, 1, "normalized_shape")
    return len(shape) if isinstance(shape, Sequence) else None


def layer_norm_rule(op: OpNode) -> Einsum | None:
    """``layer_norm(x, normalized_shape, weight, bias, eps)``, ``rms_norm`` and native forms."""
    x = ref_index(op, 0, "input")
    k = _normalized_ndim(op)
    if x is None or k is None:
        return None
    nd = op.input_metas[x].ndim
    lead = dim_letters(nd - k)
    letters: list[tuple[str, ...]] = [(FIXED,) * m.ndim for m in op.input_metas]
    letters[x] = (*lead, *(FIXED,) * k)
    # native_layer_norm's mean and rstd keep the leading dims, the normalised ones at size 1.
    outputs = [(*lead, *(FIXED,) * (m.ndim - len(lead))) for m in op.outputs]
    return einsum_for(op, letters, outputs, names=dim_names(nd - k))


def _batch_norm_training(op: OpNode) -> bool | None:
    if op.target.startswith("aten._native_batch_norm_legit_no_training"):
        return False
    pos = 5  # batch_norm, native_batch_norm, _native_batch_norm_legit(_functional)
    flag = arg(op, pos, "training")
    return flag if isinstance(flag, bool) else None


def batch_norm_rule(op: OpNode) -> Einsum | None:
    """``batch_norm(x[N, C, *], weight, bias, running_mean, running_var, training, ...)``."""
    x = ref_index(op, 0, "input")
    training = _batch_norm_training(op)
    if x is None or training is None or op.input_metas[x].ndim < 2:
        return None
    nd = op.input_metas[x].ndim
    channels = op.input_metas[x].shape[1]
    xs = ("n", "c", *(f"s{i}" for i in range(nd - 2)))
    if training:
        xs = (FIXED, "c", *(FIXED,) * (nd - 2))
    letters: list[tuple[str, ...]] = []
    for i, meta in enumerate(op.input_metas):
        if i == x:
            letters.append(xs)
        elif meta.shape == (channels,):
            letters.append(("c",))
        else:
            return None
    outputs = [
        xs if m.ndim == nd else ("c",) if m.shape == (channels,) else (FIXED,) * m.ndim
        for m in op.outputs
    ]
    names = {"n": "batch", "c": "channel", **{f"s{i}": f"spatial{i}" for i in range(nd - 2)}}
    return einsum_for(op, letters, outputs, names=names)


def group_norm_rule(op: OpNode) -> Einsum | None:
    """``group_norm(x[N, C, *], num_groups, weight, bias, eps)`` and ``native_group_norm``."""
    x = ref_index(op, 0, "input")
    native = op.target.startswith("aten.native_group_norm")
    groups = arg(op, 6, "group") if native else arg(op, 1, "num_groups")
    if x is None or not isinstance(groups, int) or op.input_metas[x].ndim < 2:
        return None
    nd = op.input_metas[x].ndim
    xs = ("n", "c", *(FIXED,) * (nd - 2))
    letters = [xs if i == x else ("c",) for i in range(len(op.inputs))]
    # native_group_norm also returns mean and rstd of shape [N, groups].
    outputs = [xs, *(("n", "c"),) * (len(op.outputs) - 1)]
    return einsum_for(
        op, letters, outputs, names={"n": "batch", "c": "groups"}, sizes={"c": groups}
    )


def _saved_norm(op: OpNode, strategy: OpStrategy, params: frozenset[int]) -> int:
    """The input, plus a float32 mean and rstd per normalised row (an estimate for batch norm)."""
    x = ref_index(op, 0, "input")
    if x is None:
        return 0
    piece = local_bytes(op.input_metas[x], strategy.inputs[x])
    row = op.input_metas[x].shape[-1] if op.input_metas[x].ndim else 1
    return piece + 8 * (piece // op.input_metas[x].itemsize) // max(1, row)


def norm_rules() -> tuple[EinsumRule, ...]:
    return (
        EinsumRule(
            "norm",
            (
                "aten.layer_norm.default",
                "aten.native_layer_norm.default",
                "aten.rms_norm.default",
                "aten._fused_rms_norm.default",
            ),
            layer_norm_rule,
            saved=_saved_norm,
            weights=((2, "weight"), (3, "bias")),
        ),
        EinsumRule(
            "norm",
            (
                "aten.batch_norm.default",
                "aten.native_batch_norm.default",
                "aten._native_batch_norm_legit.default",
                "aten._native_batch_norm_legit_functional.default",
                "aten._native_batch_norm_legit_no_training.default",
            ),
            batch_norm_rule,
            saved=_saved_norm,
            weights=((1, "weight"), (2, "bias")),
        ),
        EinsumRule(
            "norm",
            ("aten.group_norm.default", "aten.native_group_norm.default"),
            group_norm_rule,
            saved=_saved_norm,
            weights=((2, "weight"), (3, "bias")),
        ),
    )
