"""Pointwise family: elementwise math, activations, casts, copies, masks, dropout, ``*_like``.

Every output dim ``d<i>`` may be split; inputs are broadcast against the output (aligned from
the right), and an input dim of size 1 that is broadcast is read whole on every device. All
outputs share the first output's shape (``native_dropout``'s mask too). Index-dependent ops
(``tril``/``triu``) keep their last two dims whole. Dropout split across devices draws its
mask per piece: the same distribution, not the same bits as one device.
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.rules.einsum import (
    FIXED,
    Einsum,
    EinsumRule,
    aligned,
    dim_letters,
    dim_names,
    einsum_for,
    saved_inputs,
    saved_nothing,
    saved_outputs,
)

__all__ = ["pointwise_rules"]


def _overloads(names: str, overloads: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"aten.{n}.{o}" for n in names.split() for o in overloads)


# Backward reads nothing: linear in each input with constant coefficients, or a copy.
_LINEAR = (
    _overloads("add sub add_ sub_", ("Tensor", "Scalar"))
    + _overloads("rsub", ("Scalar", "Tensor"))
    + _overloads(
        "neg clone contiguous alias detach lift_fresh_copy positive zeros_like ones_like "
        "empty_like full_like rand_like randn_like zero_",
        ("default",),
    )
    + _overloads("_to_copy", ("default",))
    + _overloads("to", ("dtype", "dtype_layout", "device", "other"))
    + _overloads("type_as", ("default",))
    + _overloads("fill fill_", ("Scalar", "Tensor"))
    + _overloads("eq ne lt le gt ge", ("Tensor", "Scalar"))
    + _overloads("logical_not bitwise_not sign isnan isinf", ("default",))
    + _overloads("logical_and logical_or bitwise_and bitwise_or", ("default", "Tensor"))
    # `a & b` on masks (transformers 5's mask builders): bitwise_and/or when run
    + _overloads("__and__ __or__", ("Tensor",))
    + _overloads("masked_fill masked_fill_", ("Scalar", "Tensor"))
    + _overloads("where", ("self", "ScalarSelf", "ScalarOther", "Scalar"))
)
# Backward reads the inputs.
_INPUTS = (
    _overloads("mul div mul_ div_", ("Tensor", "Scalar"))
    + _overloads("div", ("Tensor_mode", "Scalar_mode"))
    + _overloads("pow", ("Tensor_Scalar", "Tensor_Tensor", "Scalar"))
    + _overloads(
        "relu gelu silu mish log log1p log2 sqrt abs cos sin erf square reciprocal "
        "leaky_relu hardtanh softplus elu relu_ gelu_ silu_ native_dropout",
        ("default",),
    )
    + _overloads("maximum minimum", ("default",))
    + _overloads("max min", ("other",))  # torch.min(a, b): minimum when run
    + _overloads("clamp clamp_min clamp_max", ("default", "Tensor"))
    + _overloads("dropout", ("default",))
    + _overloads("lerp", ("Scalar", "Tensor"))
    + _overloads("addcmul addcdiv", ("default",))
)
# Backward reads the output.
_OUTPUTS = _overloads("exp tanh sigmoid rsqrt", ("default",))
_INDEXED = _overloads("tril triu", ("default",))


def pointwise_rule(op: OpNode) -> Einsum | None:
    """Broadcast every tensor input against the output; split any output dim."""
    if not op.outputs:
        return None
    out = op.outputs[0].shape
    if any(m.shape != out for m in op.outputs):
        return None
    letters = dim_letters(len(out))
    if op.target in _INDEXED:
        letters = (*letters[:-2], FIXED, FIXED)
    inputs = []
    for meta in op.input_metas:
        if meta.ndim > len(out):
            return None  # not a broadcast (e.g. a reducing op listed by mistake)
        inputs.append(aligned(meta.shape, out, letters))
    return einsum_for(op, inputs, [letters] * len(op.outputs), names=dim_names(len(out)))


def pointwise_rules() -> tuple[EinsumRule, ...]:
    return (
        EinsumRule("pointwise", _LINEAR, pointwise_rule, saved=saved_nothing),
        EinsumRule("pointwise", _INPUTS + _INDEXED, pointwise_rule, saved=saved_inputs),
        EinsumRule("pointwise", _OUTPUTS, pointwise_rule, saved=saved_outputs),
    )
