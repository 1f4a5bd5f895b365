"""plait's own handling of a few ops on DTensors, ahead of DTensor's generic dispatch.

Active during a Job's forward and backward as a ``TorchFunctionMode``. Five cases:

1. **Mean-reduced losses.** In torch 2.13/2.14 DTensor runs the backward kernels of several
   losses (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy``,
   ``soft_margin_loss``) on each rank's piece with that piece's element count, so with the batch
   split ``n`` ways their ``reduction="mean"`` gradient comes out ``n`` times too large (the
   value is right). Computed as ``reduction="none"`` then ``.mean()`` they are exact, because
   DTensor's ``mean`` knows the global count; the terms are computed on the local pieces
   (:func:`elementwise_terms`), where DTensor's strategy for their backward would add
   collectives.
2. **Batched matmul with matching batch splits** (attention's ``q @ k.T`` and ``p @ v``).
   DTensor prices every candidate strategy of ``bmm`` with a search over placements that,
   on a 3-D mesh with 4-D activations, takes minutes. When both operands split their batch
   dims alike and neither splits the contraction dim, the product is purely local: plait's
   matmul rule says so and the op runs on the local pieces.

3. **Attention with matching head or batch splits** (``F.scaled_dot_product_attention``, also
   as its aten op in exported graphs). DTensor has no strategy for the CPU kernel it lowers
   to (``_scaled_dot_product_flash_attention_for_cpu``). When q, k and v split their batch
   and head dims alike (evenly) and nothing else, each rank's attention is the attention of its
   own heads: plait's attention rule (:mod:`plait.rules.attention`) says so, and the op runs on
   the local pieces, as the plan executor runs it.

4. **Mean class-index losses** (``F.cross_entropy``, ``F.nll_loss``) on a split batch: PyTorch
   divides the summed loss by the number of targets not equal to ``ignore_index``, which
   differs between ranks; DTensor averages per-rank means. Computed as ``reduction="none"``,
   summed, and divided by the global count of counted targets, they are exact (one scalar
   all-reduce for each; the backward needs none).

5. **Export's assertions** (:data:`plait.graph.convert.EXPORT_ASSERTIONS`) on DTensors: skipped (a pipeline
   stage is a piece of an exported graph).

Anything else goes to DTensor unchanged; plain tensors are never touched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from plait.comm.dtensor import contiguous_stride, layout_of, to_dtensor_placements, with_local
from plait.graph.convert import EXPORT_ASSERTIONS
from plait.layout import TensorLayout

__all__ = ["PlaitDispatchMode", "local_attention", "local_batched_matmul"]

_MEAN_LOSSES = {
    F.mse_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.binary_cross_entropy,
    F.soft_margin_loss,
}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_ATTENTION = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}
_ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def local_batched_matmul(x: DTensor, y: DTensor) -> DTensor | None:
    """``x @ y`` on local pieces when plait's batched-matmul rule needs no communication.

    Applies to ``x[..., m, k] @ y[..., k, n]`` with equal batch shapes and layouts, ``k``
    unsplit in both, no pending sums; ``m`` and ``n`` may be split on distinct axes.
    Returns None when the rule does not apply.
    """
    if (
        x.ndim < 3
        or x.ndim != y.ndim
        or x.shape[:-2] != y.shape[:-2]
        or x.device_mesh != y.device_mesh
    ):
        return None
    lx, ly = layout_of(x), layout_of(y)
    if lx.partial or ly.partial or lx.dims[:-2] != ly.dims[:-2] or lx.dims[-1] or ly.dims[-2]:
        return None
    m_axes, n_axes = lx.dims[-2], ly.dims[-1]
    if set(m_axes) & set(n_axes):
        return None
    out = TensorLayout(lx.mesh, (*lx.dims[:-2], m_axes, n_axes))
    local = torch.matmul(x.to_local(), y.to_local())
    shape = torch.Size((*x.shape[:-1], y.shape[-1]))
    return DTensor.from_local(
        local,
        x.device_mesh,
        to_dtensor_placements(out),
        run_check=False,
        shape=shape,
        stride=contiguous_stride(shape),
    )


def local_attention(args: Any, kwargs: dict[str, Any]) -> DTensor | None:
    """Scaled dot-product attention on local pieces when plait's attention rule needs no
    communication; None when it does not apply (DTensor then runs it, or says it cannot).

    Applies to DTensor ``q[..., H, L, E]``, ``k[..., Hk, S, E]``, ``v[..., Hk, S, Ev]`` on one
    mesh whose leading (batch and head) dims are split alike and evenly, the last two dims
    whole, no pending sum and no dropout (dropout would need each piece's own random
    stream). A mask is read whole by every rank where it broadcasts over the split dims (size
    1 there), as a causal or padding mask over heads does; a mask with its own per-head or
    per-row values on split dims is read in pieces split as q's (:func:`_local_mask`).
    Grouped-query attention (``enable_gqa``) keeps its ratio
    of query to kv heads on every rank because both head counts divide by the split.
    """
    if len(args) > len(_ATTENTION_ARGS):
        return None
    named = dict(zip(_ATTENTION_ARGS, args, strict=False))
    if set(named) & set(kwargs):
        return None
    named.update(kwargs)
    q, k, v = named.get("query"), named.get("key"), named.get("value")
    if not (isinstance(q, DTensor) and isinstance(k, DTensor) and isinstance(v, DTensor)):
        return None
    if named.get("dropout_p", 0.0) != 0.0:
        return None
    if set(named) - {*_ATTENTION_ARGS, "enable_gqa"} or q.ndim < 3:
        return None
    if not (q.ndim == k.ndim == v.ndim) or not (q.device_mesh == k.device_mesh == v.device_mesh):
        return None
    layouts = [layout_of(t) for t in (q, k, v)]
    lead = layouts[0].dims[:-2]
    if any(lay.partial or lay.dims[:-2] != lead or any(lay.dims[-2:]) for lay in layouts):
        return None
    mesh = layouts[0].mesh
    for t in (q, k, v):
        for size, axes in zip(t.shape[:-2], lead, strict=True):
            if size % math.prod(mesh.axis_size(a) for a in axes):
                return None  # uneven pieces would pair other heads or rows
    mask = _local_mask(named.get("attn_mask"), q, lead)
    if mask is False:
        return None
    local = torch.ops.aten.scaled_dot_product_attention.default(
        q.to_local(),
        k.to_local(),
        v.to_local(),
        attn_mask=mask,
        is_causal=bool(named.get("is_causal", False)),
        scale=named.get("scale"),
        enable_gqa=bool(named.get("enable_gqa", False)),
    )
    shape = torch.Size((*q.shape[:-1], v.shape[-1]))
    return DTensor.from_local(
        local,
        q.device_mesh,
        to_dtensor_placements(TensorLayout(mesh, (*lead, (), ()))),
        run_check=False,
        shape=shape,
        stride=contiguous_stride(shape),
    )


def _local_mask(mask: Any, q: DTensor, lead: tuple[tuple[str, ...], ...]) -> Any:
    """The attention mask each rank's local attention reads: None; the whole mask (a plain
    tensor, or a replicated DTensor's value) where every split dim of q's batch and heads is
    one the mask broadcasts over (size 1 or absent), as a causal or padding mask over heads
    does; else this rank's piece of it, split as q's batch and heads are (a per-head bias such
    as ALiBi's, a per-row mask): cut from a whole mask locally, or redistributed from the
    layout it came in (a plan lays it out so already, nothing moves). False where it cannot
    be read locally: a learned mask (each rank's gradient would be a share of the sum) or a
    pending sum."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        return False
    if mask.requires_grad and any(lead):
        return False
    scores = len(lead) + 2  # q's batch and head dims, then query and key positions
    want: list[tuple[str, ...]] = [() for _ in range(mask.ndim)]
    for i, axes in enumerate(lead):
        dim = i - scores + mask.ndim  # the mask aligned to the scores from the right
        if axes and dim >= 0 and mask.shape[dim] != 1:
            want[dim] = axes
    if isinstance(mask, DTensor):
        if any(p.is_partial() for p in mask.placements) or mask.device_mesh != q.device_mesh:
            return False
    elif any(want):
        mask = DTensor.from_local(
            mask, q.device_mesh, [Replicate()] * q.device_mesh.ndim, run_check=False
        )
    else:
        return mask  # read whole
    target = to_dtensor_placements(TensorLayout(layout_of(q).mesh, tuple(want)))
    if tuple(mask.placements) != target:
        mask = mask.redistribute(mask.device_mesh, target)  # whole to pieces: a local cut
    return mask.to_local()


# The same losses as aten ops (the plan executor runs exported graphs): argument position of
# ``reduction``; 1 is mean, 0 none.
_MEAN_LOSS_OPS = {
    torch.ops.aten.mse_loss.default: 2,
    torch.ops.aten.smooth_l1_loss.default: 2,
    torch.ops.aten.huber_loss.default: 2,
    torch.ops.aten.binary_cross_entropy.default: 3,
    torch.ops.aten.soft_margin_loss.default: 2,
}
_MEAN, _NONE = 1, 0


def _mean_loss_op_as_none(func: Any, args: Any, kwargs: dict[str, Any]) -> Any | None:
    """An aten mean-reduced loss on DTensors computed as ``reduction=none`` then ``mean``."""
    position = _MEAN_LOSS_OPS[func]
    if position < len(args):
        if args[position] != _MEAN:
            return None
        args = (*args[:position], _NONE, *args[position + 1 :])
    elif kwargs.get("reduction", _MEAN) == _MEAN:
        kwargs = {**kwargs, "reduction": _NONE}
    else:
        return None
    return elementwise_terms(func, args, kwargs).mean()


def elementwise_terms(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """An elementwise loss with ``reduction="none"`` (``kwargs`` say so): on the local pieces
    when its two tensors are DTensors laid out alike (same shape, placements, no pending sum),
    each rank's terms of its own elements; else DTensor's dispatch.

    Why local: DTensor's strategy for the backward kernel (``mse_loss_backward`` and
    friends) given the replicated gradient of the ``mean`` after it splits its inputs over
    every mesh axis they are replicated on, then all-gathers the result back, collectives the
    plan does not list (on a dp x sp x mp mesh: one all-gather over mp and one over sp). On
    the pieces, backward is the kernel on the pieces and the gradient of the terms arrives
    laid out as they are (a replicated gradient is cut locally)."""
    x, target = args[0], args[1] if len(args) > 1 else None
    if (
        isinstance(x, DTensor)
        and isinstance(target, DTensor)
        and x.shape == target.shape
        and x.device_mesh == target.device_mesh
        and tuple(x.placements) == tuple(target.placements)
        and not any(p.is_partial() for p in x.placements)
        and not any(isinstance(a, DTensor) for a in (*args[2:], *kwargs.values()))
    ):
        return with_local(x, func(x.to_local(), target.to_local(), *args[2:], **kwargs))
    return func(*args, **kwargs)


_CLASS_LOSSES = {F.cross_entropy, F.nll_loss}
_CLASS_LOSS_KWARGS = {"ignore_index", "reduction", "label_smoothing", "weight"}
_LEGACY = {"size_average", "reduce"}


def exact_mean_class_loss(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``F.cross_entropy`` / ``F.nll_loss`` with ``reduction="mean"`` on a DTensor input whose
    terms are split: ``sum(none-reduced) / global count``; None when that does not apply (a
    class weight, other arguments, a replicated input)."""
    # torch passes every argument by name, the legacy ones as None
    kwargs = {k: v for k, v in kwargs.items() if not (k in _LEGACY and v is None)}
    if len(args) != 2 or set(kwargs) - _CLASS_LOSS_KWARGS or kwargs.get("weight") is not None:
        return None
    x, target = args
    if kwargs.get("reduction", "mean") != "mean" or not isinstance(x, DTensor):
        return None
    if not any(p.is_shard() for p in x.placements):
        return None
    terms = func(x, target, **{**kwargs, "reduction": "none"})
    if target.is_floating_point():  # probability targets: every row counts
        return terms.mean()
    counted = (target != kwargs.get("ignore_index", -100)).sum().to(terms.dtype)
    return terms.sum() / counted


class PlaitDispatchMode(TorchFunctionMode):
    """Route the ops above to plait's rules when their inputs are DTensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if (
            func in _MEAN_LOSSES
            and kwargs.get("reduction", "mean") == "mean"
            and any(isinstance(a, DTensor) for a in args)
        ):
            kwargs["reduction"] = "none"
            return elementwise_terms(func, args, kwargs).mean()
        if func in _CLASS_LOSSES:
            out = exact_mean_class_loss(func, args, kwargs)
            if out is not None:
                return out
        if func in _MEAN_LOSS_OPS and any(isinstance(a, DTensor) for a in args):
            out = _mean_loss_op_as_none(func, args, kwargs)
            if out is not None:
                return out
        if (
            func in _MATMULS
            and len(args) == 2
            and not kwargs
            and all(isinstance(a, DTensor) for a in args)
        ):
            out = local_batched_matmul(*args)
            if out is not None:
                return out
        if (
            isinstance(func, torch._ops.OpOverload)
            and str(func) in EXPORT_ASSERTIONS
            and any(isinstance(a, DTensor) for a in args)
        ):
            return None
        if func in _ATTENTION:
            out = local_attention(args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
