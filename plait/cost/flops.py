"""FLOP and byte counts of one captured op, from its aten target and tensor shapes.

Capture (:mod:`plait.graph.convert`) stores both on every :class:`~plait.graph.OpNode`
(``flops``, ``bytes``); the roofline (:mod:`plait.cost.compute`) turns them into seconds. The
counts are of the whole, unsharded forward op; a sharded op does ``1/pieces`` of each.

Pure functions of names and shapes: no torch, and nothing from :mod:`plait.graph` at run time
(the metadata is read through its attributes), so the graph package can import this one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.graph.opgraph import TensorMeta

__all__ = ["elementwise_name", "is_batched_matmul", "matmul_dims", "op_bytes", "op_flops"]

# Ops that only reinterpret memory: no arithmetic and no traffic.
_VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "transpose",
        "t",
        "permute",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "alias",
        "as_strided",
        "detach",
        "diagonal",
        "unflatten",
        "view_as",
        "movedim",
        "_reshape_alias",
    ]
)
# Ops that move or create data without arithmetic.
_NO_FLOPS = _VIEWS | frozenset(
    [
        "reshape",
        "flatten",
        "contiguous",
        "clone",
        "cat",
        "stack",
        "embedding",
        "index_select",
        "gather",
        "index",
        "_to_copy",
        "to",
        "copy",
        "zeros",
        "ones",
        "full",
        "empty",
        "arange",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "scalar_tensor",
        "lift_fresh_copy",
        "repeat",
        "repeat_interleave",
        "pad",
        "constant_pad_nd",
    ]
)
# Normalisations, softmax and losses: a handful of passes per element (mean, variance, scale).
_PER_INPUT_ELEMENT = {
    "layer_norm": 5,
    "rms_norm": 5,
    "batch_norm": 5,
    "group_norm": 5,
    "instance_norm": 5,
    "softmax": 5,
    "_softmax": 5,
    "log_softmax": 5,
    "_log_softmax": 5,
    "cross_entropy_loss": 5,
    "nll_loss": 1,
    "nll_loss_nd": 1,
    "mse_loss": 3,
    "l1_loss": 3,
    "smooth_l1_loss": 4,
    "binary_cross_entropy_with_logits": 5,
    "sum": 1,
    "mean": 1,
    "amax": 1,
    "amin": 1,
    "max": 1,
    "min": 1,
    "var": 3,
    "std": 3,
    "var_mean": 3,
    "norm": 2,
    "linalg_vector_norm": 2,
    "adaptive_avg_pool1d": 1,
    "adaptive_avg_pool2d": 1,
    "adaptive_avg_pool3d": 1,
}


def _packet(target: str) -> str:
    """``"aten.add_.Tensor"`` -> ``"add"``: the op's name without overload or in-place mark."""
    parts = target.split(".")
    name = parts[1] if len(parts) == 3 else target
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def _matmul_flops(a: TensorMeta, out_numel: int) -> int:
    k = a.shape[-1] if a.ndim else 1
    return 2 * out_numel * k


def op_flops(
    target: str,
    input_metas: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta],
    args: Sequence[object] = (),
) -> int:
    """Forward FLOPs of one whole (unsharded) op; a multiply-add counts 2.

    matmul-like ops (linear, matmul, mm, bmm, addmm, baddbmm, conv, attention) count
    ``2*M*N*K`` (a linear's bias add is not counted); norms, softmax and cross entropy 5 per
    input element; reductions 1 per input element; views, copies and creation ops 0; any
    other op one per output element.
    """
    name = _packet(target)
    ins = input_metas
    if name in _NO_FLOPS:
        return 0
    out_numel = outputs[0].numel if outputs else 1  # no output: count as a scalar
    if name == "linear":
        x, w = ins[0], ins[1]
        return 2 * (x.numel // max(x.shape[-1], 1)) * w.shape[0] * x.shape[-1]
    if name in ("matmul", "mm", "bmm", "dot", "mv"):
        return _matmul_flops(ins[0], out_numel)
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        return _matmul_flops(ins[1], out_numel)
    if name in ("conv1d", "conv2d", "conv3d", "convolution", "_convolution"):
        transposed = name in ("convolution", "_convolution") and len(args) > 6 and args[6] is True
        base = (
            ins[0].numel if transposed else out_numel
        )  # a transposed conv scatters from its input
        return 2 * base * math.prod(ins[1].shape[1:])
    if name.startswith("conv_transpose"):
        return 2 * ins[0].numel * math.prod(ins[1].shape[1:])
    if name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention"):
        q, k, v = ins[0], ins[1], ins[2]
        rows = q.numel // max(q.shape[-1], 1)  # batch * heads * query length
        return 2 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])  # QK^T and PV
    if name in ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d"):
        kernel = args[1] if len(args) > 1 and isinstance(args[1], tuple) else ()
        return out_numel * math.prod(int(k) for k in kernel)
    if name in _PER_INPUT_ELEMENT:
        return _PER_INPUT_ELEMENT[name] * (ins[0].numel if ins else out_numel)
    return sum(o.numel for o in outputs)


def matmul_dims(
    target: str, input_metas: Sequence[TensorMeta], outputs: Sequence[TensorMeta]
) -> tuple[int, int, int] | None:
    """``(M, N, K)`` of one product of a matmul-like op (linear, matmul, mm, bmm, addmm,
    baddbmm; batch dims and a linear's leading dims folded into ``M``), or None for any other
    op: what a matmul's efficiency by shape is read from (``HardwareProfile.matmul_efficiency``)."""
    name = _packet(target)
    ins = input_metas
    if not outputs or not ins:
        return None
    if name == "linear" and len(ins) >= 2 and ins[1].ndim == 2:
        x, w = ins[0], ins[1]
        k = x.shape[-1] if x.ndim else 1
        return (x.numel // max(k, 1), w.shape[0], k)
    a_at = {"matmul": 0, "mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1}.get(name)
    if a_at is None or len(ins) < a_at + 2:
        return None
    a, b, out = ins[a_at], ins[a_at + 1], outputs[0]
    if a.ndim < 2 or b.ndim < 2 or out.ndim < 2:
        return None  # a vector product: no tile to speak of
    return (out.shape[-2], out.shape[-1], a.shape[-1])


def is_batched_matmul(target: str, input_metas: Sequence[TensorMeta]) -> bool:
    """Whether a matmul-like op is a batch of products with a batch dimension in both
    operands (attention's ``(b, h, s, d) @ (b, h, d, s)``), not a 2-D product (a linear's
    leading dims fold into its rows): what ``batched_matmul_efficiency`` prices."""
    name = _packet(target)
    a_at = {"matmul": 0, "bmm": 0, "baddbmm": 1}.get(name)
    if a_at is None or len(input_metas) < a_at + 2:
        return False
    return input_metas[a_at].ndim > 2 and input_metas[a_at + 1].ndim > 2


def elementwise_name(target: str) -> str:
    """The name an op's measured element rate is kept under (``elementwise_rates``):
    ``"aten.gelu.default"`` -> ``"gelu"``."""
    return _packet(target)


def _nbytes(meta: TensorMeta) -> int:
    return 0 if meta.dtype == "none" else meta.nbytes


def op_bytes(target: str, input_metas: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> int:
    """Bytes an op reads and writes: every input and output once; 0 for pure views;
    an embedding reads only its gathered rows."""
    name = _packet(target)
    if name in _VIEWS:
        return 0
    if name == "embedding" and len(input_metas) >= 2 and outputs:
        # a gather reads the looked-up rows and the indices, not the whole table
        return _nbytes(input_metas[1]) + 2 * _nbytes(outputs[0])
    return sum(_nbytes(m) for m in input_metas) + sum(_nbytes(m) for m in outputs)
