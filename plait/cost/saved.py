"""What autograd saves for each op's backward: the op catalogue the memory model reads.

:func:`saved_by` gives, for one op of a captured graph and which of its inputs need a gradient,
the values autograd keeps for its backward (PyTorch's derivative formulas: a linear layer its
input, softmax its output, a view nothing); :func:`aliases_input` the ops whose outputs are
views of (or written into) their input, which hold no memory of their own; and
:func:`kept_by_selective` the one rule of what selective recompute keeps, which the per-rank
program's recompute pass and pipeline stages ask too. :mod:`plait.cost.step_memory` walks a
step with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, cast

# Types only: the graph package counts FLOPs and bytes with plait.cost.flops (no cost <-> graph
# import cycle).
if TYPE_CHECKING:
    from plait.graph import OpNode

__all__ = [
    "FLOATING_DTYPES",
    "RANDOM_OPS",
    "Saved",
    "aliases_input",
    "kept_by_selective",
    "op_base",
    "saved_by",
]

FLOATING_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "complex64"})

# Ops whose outputs alias their first input (views, and in-place ops): no memory of their own.
_ALIASING = frozenset(
    f"aten.{name}"
    for name in (
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "reshape",
        "view_as",
        "reshape_as",
        "t",
        "transpose",
        "swapaxes",
        "swapdims",
        "permute",
        "movedim",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "narrow",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "tensor_split",
        "unflatten",
        "flatten",
        "diagonal",
        "unfold",
        "as_strided",
        "detach",
        "alias",
        "lift_fresh",
        "contiguous",
        "real",
        "imag",
        "view_as_real",
        "view_as_complex",
        "numpy_T",
        "mT",
        "mH",
        "adjoint",
    )
)
_CONVOLUTIONS = (
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
)
# Selective recompute keeps the outputs of matrix products, convolutions, attention kernels and
# embedding lookups (the one rule: plait/runtime/program/remat.py's pass and pipeline stages ask
# :func:`kept_by_selective` too); random ops are never recomputed (their results are kept).
_SELECTIVE_KEEPS = frozenset(
    f"aten.{name}"
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "matmul",
        "linear",
        "_scaled_mm",
        *_CONVOLUTIONS,
        "embedding",
    )
)
_ATTENTION_PREFIXES = ("aten._scaled_dot_product", "aten.scaled_dot_product", "aten._flash_")


def kept_by_selective(base: str) -> bool:
    """Whether selective recompute keeps the result of op ``base``: a matrix product,
    convolution, attention kernel or embedding.

    ``base`` is the op's namespace and name without an overload, as the graph's targets give
    it (``"aten.mm"``) or as a schema names it (``"aten::mm"``: what the recompute pass of
    plait/runtime/program/remat.py and pipeline stages read), so the memory model and the runtime
    ask the same rule."""
    if "::" in base:
        base = base.replace("::", ".", 1)
    return base in _SELECTIVE_KEEPS or base.startswith(_ATTENTION_PREFIXES)


RANDOM_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "dropout",
        "native_dropout",
        "feature_dropout",
        "alpha_dropout",
        "_fused_dropout",
        "bernoulli",
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "multinomial",
        "normal",
        "uniform",
        "empty",
        "empty_like",
    )
)


def op_base(target: str) -> str:
    """``"aten.linear.default"`` -> ``"aten.linear"`` (the overload dropped)."""
    first = target.find(".")
    second = target.find(".", first + 1) if first >= 0 else -1
    return target if second < 0 else target[:second]


def aliases_input(target: str) -> bool:
    """Whether an op's outputs share its first input's memory (a view or an in-place op)."""
    base = op_base(target)
    return base in _ALIASING or (base.endswith("_") and not base.endswith("__"))


@dataclass(frozen=True, slots=True)
class Saved:
    """One tensor an op's backward reads: input ``index`` as the op reads it, or output
    ``index`` (``output=True``); with ``ratio``, a buffer of its own of ``ratio`` times that
    tensor's bytes (a norm's statistics, a dropout mask, a loss's log-probabilities)."""

    index: int
    output: bool = False
    ratio: Fraction | None = None


_Rule = Callable[["OpNode", Sequence[bool]], tuple[Saved, ...]]


def _names(*names: str) -> tuple[str, ...]:
    return tuple(f"aten.{n}" for n in names)


def _cross(*pairs: tuple[int, int]) -> _Rule:
    """Input ``i`` is saved when input ``j`` needs a gradient (a product's rule)."""

    def rule(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
        return tuple(Saved(i) for i, j in pairs if j < len(grads) and grads[j] and i < len(grads))

    return rule


def _inputs_from(first: int) -> _Rule:
    def rule(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
        return tuple(Saved(i) for i in range(first, len(op.inputs)))

    return rule


def _nothing(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    return ()


def _output(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    return (Saved(0, output=True),)


def _first_input(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    return (Saved(0),)


def _norm_numel(op: OpNode) -> int:
    shape = op.args[1] if len(op.args) > 1 else None
    if isinstance(shape, list | tuple) and shape and all(isinstance(d, int) for d in shape):
        return math.prod(cast("Sequence[int]", shape))
    meta = op.input_metas[0]
    return meta.shape[-1] if meta.shape else 1


def _norm(floats_per_row: int) -> _Rule:
    """A norm over ``_norm_numel`` elements: its input and float32 statistics per row."""

    def rule(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
        per_row = _norm_numel(op) * op.input_metas[0].itemsize
        return (Saved(0), Saved(0, ratio=Fraction(4 * floats_per_row, per_row)))

    return rule


def _cross_entropy(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    # log_softmax's output (a buffer the size of the logits), then the targets
    return (Saved(0, ratio=Fraction(1)), *(Saved(i) for i in range(1, len(op.inputs))))


def _dropout(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    p = op.args[1] if len(op.args) > 1 else op.kwarg("p", 0.5)
    train = op.args[2] if len(op.args) > 2 else op.kwarg("train", True)
    if not isinstance(p, int | float) or p == 0 or train is False:
        return ()
    return (Saved(0, ratio=Fraction(1, op.input_metas[0].itemsize)),)  # a one-byte mask


def _attention(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    meta = op.input_metas[0]
    lse = Fraction(4, (meta.shape[-1] if meta.shape else 1) * meta.itemsize)
    qkv = tuple(Saved(i) for i in range(min(len(op.inputs), 3)))
    return (*qkv, Saved(0, output=True), Saved(0, ratio=lse))


def _mul(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    return _cross((0, 1), (1, 0))(op, grads) if len(op.inputs) > 1 else ()


def _div(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    if len(op.inputs) < 2:
        return ()  # by a number
    return (Saved(1),) + ((Saved(0),) if grads[1] else ())


def _pow(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    both = len(op.inputs) > 1
    return (*(Saved(i) for i in range(len(op.inputs))), *((Saved(0, output=True),) if both else ()))


def _selectors(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    # the condition, mask or indices (the data's gradient is scattered back through them)
    return tuple(Saved(i) for i in range(len(op.inputs)) if not grads[i])


def _max_pool(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    indices = Fraction(8, op.outputs[0].itemsize)  # int64 per output element
    return (Saved(0), Saved(0, output=True, ratio=indices))


def _every_input(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    return tuple(Saved(i) for i in range(len(op.inputs)))


_RULES: dict[str, _Rule] = {
    **dict.fromkeys(_names("linear", "matmul", "mm", "bmm", "dot", "mv"), _cross((0, 1), (1, 0))),
    **dict.fromkeys(_names("addmm", "baddbmm", "addbmm", "addmv"), _cross((1, 2), (2, 1))),
    **dict.fromkeys(
        _names(*_CONVOLUTIONS),
        _cross((0, 1), (1, 0)),
    ),
    **dict.fromkeys(_names("embedding", "embedding_bag"), _inputs_from(1)),
    **dict.fromkeys(_names("layer_norm", "native_layer_norm"), _norm(2)),
    **dict.fromkeys(_names("rms_norm", "_fused_rms_norm"), _norm(1)),
    **dict.fromkeys(
        _names(
            "group_norm",
            "native_group_norm",
            "batch_norm",
            "native_batch_norm",
            "_native_batch_norm_legit",
            "instance_norm",
        ),
        _first_input,  # and per-channel statistics, negligible
    ),
    **dict.fromkeys(
        _names(
            "softmax",
            "_softmax",
            "log_softmax",
            "_log_softmax",
            "relu",
            "sigmoid",
            "tanh",
            "exp",
            "exp2",
            "sqrt",
            "rsqrt",
            "reciprocal",
            "elu",
        ),
        _output,
    ),
    "aten.cross_entropy_loss": _cross_entropy,
    **dict.fromkeys(_names("nll_loss", "nll_loss_nd", "nll_loss2d"), _inputs_from(1)),
    **dict.fromkeys(
        _names("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "_fused_dropout"),
        _dropout,
    ),
    **dict.fromkeys(
        _names(
            "scaled_dot_product_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        ),
        _attention,
    ),
    "aten.mul": _mul,
    "aten.div": _div,
    **dict.fromkeys(_names("pow", "float_power"), _pow),
    **dict.fromkeys(
        _names("where", "masked_fill", "index_select", "gather", "index", "take", "take_along_dim"),
        _selectors,
    ),
    **dict.fromkeys(_names("max_pool1d", "max_pool2d", "max_pool3d"), _max_pool),
    **dict.fromkeys(
        _names(
            "add",
            "sub",
            "rsub",
            "neg",
            "sum",
            "mean",
            "clone",
            "copy",
            "_to_copy",
            "to",
            "type_as",
            "cat",
            "stack",
            "pad",
            "constant_pad_nd",
            "repeat",
            "flip",
            "roll",
            "tril",
            "triu",
            "cumsum",
            "avg_pool1d",
            "avg_pool2d",
            "avg_pool3d",
            "adaptive_avg_pool1d",
            "adaptive_avg_pool2d",
            "adaptive_avg_pool3d",
            "zeros_like",
            "ones_like",
            "full_like",
            "scatter",
            "scatter_add",
            "index_add",
            "index_put",
            "upsample_nearest2d",
            "pixel_shuffle",
            "pixel_unshuffle",
        ),
        _nothing,
    ),
}


def saved_by(op: OpNode, grads: Sequence[bool]) -> tuple[Saved, ...]:
    """What autograd saves for ``op``'s backward, given which inputs need a gradient.

    PyTorch's derivative formulas (``tools/autograd/derivatives.yaml``): a product saves each
    factor for the other's gradient (a linear layer its input, for the weight's; nothing of
    it when the weight is frozen); a sum, a cast, a copy or a view saves nothing; softmax,
    exp, tanh, sigmoid and ReLU their output; GELU, SiLU and most other pointwise functions
    their input; layer norm its input and two float32 statistics per row (RMS norm one);
    dropout a one-byte mask; cross entropy the log-probabilities of its input (a buffer the
    size of the logits) and the targets; attention kernels the query, key, value, output
    and a float32 log-sum-exp per row. An op with no rule here saves its inputs. An op none
    of whose inputs needs a gradient saves nothing (autograd records nothing).
    """
    if not any(grads) or aliases_input(op.target):
        return ()
    return _RULES.get(op_base(op.target), _every_input)(op, grads)
