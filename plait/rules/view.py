"""View family: reshapes, transposes, squeezes, expands, slices, splits, concatenation.

Reshapes (``view``, ``reshape``, ``flatten``, ``unflatten``, ``squeeze``, ``unsqueeze``) are
matched dim groups: runs of input and output dims with equal products (size-1 dims ignored).
Splitting the *first* dim of a group on both sides by ``s`` gives every device the same
contiguous ``1/s`` of the group, so those two dims share a letter whose split must divide both
sizes; the other dims of a group stay whole (MindSpore: Reshape has no strategy, its layouts
are derived). Transposes permute letters. ``expand`` keeps broadcast dims whole. Slicing,
splitting, concatenating and scattering into (``select_scatter``, ``slice_scatter``) along a dim
keep that dim whole and split the others alike; so does constant padding, for the dims it pads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from plait.graph import OpNode
from plait.rules.args import arg, ref_index, ref_indices, wrap_dim
from plait.rules.einsum import (
    FIXED,
    Einsum,
    EinsumRule,
    aligned,
    dim_letters,
    dim_names,
    einsum_for,
    saved_nothing,
)

__all__ = ["view_groups", "view_rules"]

Group = tuple[tuple[int, ...], tuple[int, ...]]


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[Group] | None:
    """Runs of ``src`` and ``dst`` dims with equal products, skipping size-1 dims.

    None when the shapes hold different numbers of elements or an empty dim.
    """
    if math.prod(src) != math.prod(dst) or 0 in src or 0 in dst:
        return None
    a = [d for d, n in enumerate(src) if n != 1]
    b = [d for d, n in enumerate(dst) if n != 1]
    groups: list[Group] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ga, gb = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(a[i])
                pa *= src[a[i]]
                i += 1
            else:
                gb.append(b[j])
                pb *= dst[b[j]]
                j += 1
        groups.append((tuple(ga), tuple(gb)))
    return groups


def reshape_rule(op: OpNode) -> Einsum | None:
    """Any op whose output is its single input with a new shape (same elements, same order)."""
    if len(op.inputs) != 1 or len(op.outputs) != 1:
        return None
    src, dst = op.input_metas[0].shape, op.outputs[0].shape
    groups = view_groups(src, dst)
    if groups is None:
        return None
    xs, ys = [FIXED] * len(src), [FIXED] * len(dst)
    sizes: dict[str, int] = {}
    names: dict[str, str] = {}
    for ga, gb in groups:
        letter = f"d{ga[0]}"
        xs[ga[0]], ys[gb[0]] = letter, letter
        sizes[letter] = math.gcd(src[ga[0]], dst[gb[0]])
        names[letter] = f"dim{ga[0]}"
    return einsum_for(op, [xs], [ys], names=names, sizes=sizes)


def _permutation(op: OpNode, nd: int) -> list[int] | None:
    name = op.target.split(".")[1]
    if name in ("transpose", "swapaxes"):
        d0, d1 = wrap_dim(arg(op, 1, "dim0"), nd), wrap_dim(arg(op, 2, "dim1"), nd)
        if d0 is None or d1 is None:
            return None
        perm = list(range(nd))
        perm[d0], perm[d1] = d1, d0
        return perm
    if name == "t" or name == "numpy_T":
        return list(reversed(range(nd)))
    dims = arg(op, 1, "dims")
    if not isinstance(dims, Sequence) or len(dims) != nd:
        return None
    wrapped = [wrap_dim(d, nd) for d in dims]
    perm = [d for d in wrapped if d is not None]
    return perm if len(perm) == len(wrapped) else None


def permute_rule(op: OpNode) -> Einsum | None:
    """``transpose``, ``permute``, ``t``: output dim ``j`` is input dim ``perm[j]``."""
    if len(op.inputs) != 1:
        return None
    nd = op.input_metas[0].ndim
    perm = _permutation(op, nd)
    if perm is None:
        return None
    xs = dim_letters(nd)
    return einsum_for(op, [xs], [tuple(xs[p] for p in perm)], names=dim_names(nd))


def expand_rule(op: OpNode) -> Einsum | None:
    """``expand``/``broadcast_to``/``repeat``: dims that grow stay whole, others split alike."""
    if len(op.inputs) != 1 or len(op.outputs) != 1:
        return None
    out = op.outputs[0].shape
    ys = dim_letters(len(out))
    xs = aligned(op.input_metas[0].shape, out, ys)
    ys = tuple(y if y in xs else FIXED for y in ys)
    return einsum_for(op, [xs], [ys], names=dim_names(len(out)))


def _dim_arg(op: OpNode, nd: int, pos: int, name: str = "dim") -> int | None:
    return wrap_dim(arg(op, pos, name, 0), nd)


def slice_rule(op: OpNode) -> Einsum | None:
    """``slice``/``narrow``/``select``/``split``/``chunk``/``unbind`` along ``dim``."""
    if len(op.inputs) != 1:
        return None
    name = op.target.split(".")[1]
    nd = op.input_metas[0].ndim
    pos = 2 if name in ("split", "split_with_sizes", "chunk") else 1
    dim = _dim_arg(op, nd, pos)
    if dim is None:
        return None
    xs = tuple(FIXED if d == dim else x for d, x in enumerate(dim_letters(nd)))
    outputs = []
    for meta in op.outputs:
        if meta.ndim == nd:
            outputs.append(xs)
        elif meta.ndim == nd - 1:  # select and unbind drop the dim
            outputs.append(xs[:dim] + xs[dim + 1 :])
        else:
            return None
    return einsum_for(op, [xs], outputs, names=dim_names(nd))


def cat_rule(op: OpNode) -> Einsum | None:
    """``cat``/``stack``: every input split alike; the joined dim stays whole."""
    refs = ref_indices(op, 0, "tensors")
    if not refs or len(refs) != len(op.inputs) or len(op.outputs) != 1:
        return None
    shapes = {op.input_metas[i].shape for i in refs}
    if len(shapes) != 1 and not op.target.startswith("aten.cat"):
        return None
    nd = op.input_metas[refs[0]].ndim
    stack = op.target.startswith("aten.stack")
    dim = wrap_dim(arg(op, 1, "dim", 0), nd + 1 if stack else nd)
    if dim is None or any(op.input_metas[i].ndim != nd for i in refs):
        return None
    if not stack and len({s[:dim] + s[dim + 1 :] for s in shapes}) != 1:
        return None
    xs = tuple(FIXED if d == dim and not stack else x for d, x in enumerate(dim_letters(nd)))
    ys = (*xs[:dim], FIXED, *xs[dim:]) if stack else xs
    letters: list[tuple[str, ...]] = [()] * len(op.inputs)
    for i in refs:
        letters[i] = xs
    return einsum_for(op, letters, [ys], names=dim_names(nd))


def scatter_rule(op: OpNode) -> Einsum | None:
    """``select_scatter``/``slice_scatter(base, src, dim, ...)``: ``src`` written into ``base``
    along ``dim`` (functionalized ``x[:, 0] = v``): that dim stays whole, the others split
    alike on base, src and output."""
    base, src = ref_index(op, 0, "self"), ref_index(op, 1, "src")
    if base is None or src is None or len(op.inputs) != 2 or len(op.outputs) != 1:
        return None
    nd = op.input_metas[base].ndim
    dim = _dim_arg(op, nd, 2)
    if dim is None:
        return None
    xs = tuple(FIXED if d == dim else x for d, x in enumerate(dim_letters(nd)))
    selected = op.target.startswith("aten.select_scatter")
    ys = xs[:dim] + xs[dim + 1 :] if selected else xs
    if op.input_metas[src].ndim != len(ys):
        return None
    letters: list[tuple[str, ...]] = [()] * 2
    letters[base], letters[src] = xs, ys
    return einsum_for(op, letters, [xs], names=dim_names(nd))


def padded_dims(pad: object, ndim: int) -> frozenset[int] | None:
    """Dims a ``pad`` list changes: pairs from the last dim backwards, a pair of zeros changing
    nothing; None when ``pad`` is not such a list."""
    if not isinstance(pad, Sequence) or len(pad) % 2 or len(pad) // 2 > ndim:
        return None
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in pad):
        return None
    return frozenset(ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1])


def pad_rule(op: OpNode) -> Einsum | None:
    """``pad``/``constant_pad_nd`` with a constant: padded (or cropped) dims stay whole, the
    others split alike on input and output (each piece is padded as the whole would be).

    Reflect, replicate and circular padding read the input near the border of the padded dims
    only, so they could split alike; DTensor has no strategy for them, so they run replicated.
    """
    if len(op.inputs) != 1 or len(op.outputs) != 1:
        return None
    if op.target == "aten.pad.default" and arg(op, 2, "mode", "constant") != "constant":
        return None
    nd = op.input_metas[0].ndim
    fixed = padded_dims(arg(op, 1, "pad"), nd)
    if fixed is None:
        return None
    xs = tuple(FIXED if d in fixed else x for d, x in enumerate(dim_letters(nd)))
    return einsum_for(op, [xs], [xs], names=dim_names(nd))


def repeat_interleave_rule(op: OpNode) -> Einsum | None:
    """``repeat_interleave(x, repeats: int, dim)``: piece ``j`` of ``dim`` repeats into piece ``j``."""
    if len(op.inputs) != 1 or not isinstance(arg(op, 1, "repeats"), int):
        return None
    nd = op.input_metas[0].ndim
    dim = wrap_dim(arg(op, 2, "dim"), nd)
    if dim is None:
        return None
    xs = dim_letters(nd)
    return einsum_for(
        op, [xs], [xs], names=dim_names(nd), sizes={xs[dim]: op.input_metas[0].shape[dim]}
    )


def broadcast_tensors_rule(op: OpNode) -> Einsum | None:
    """``broadcast_tensors``: every output has the common shape; inputs aligned from the right."""
    if not op.outputs or len({m.shape for m in op.outputs}) != 1:
        return None
    out = op.outputs[0].shape
    ys = dim_letters(len(out))
    xs = [aligned(m.shape, out, ys) for m in op.input_metas]
    return einsum_for(op, xs, [ys] * len(op.outputs), names=dim_names(len(out)))


def view_rules() -> tuple[EinsumRule, ...]:
    reshapes = (
        "aten.view.default",
        "aten.reshape.default",
        "aten._unsafe_view.default",
        "aten.flatten.using_ints",
        "aten.unflatten.int",
        "aten.squeeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.unsqueeze.default",
        "aten._reshape_alias.default",
    )
    permutes = (
        "aten.transpose.int",
        "aten.swapaxes.default",
        "aten.permute.default",
        "aten.t.default",
        "aten.numpy_T.default",
    )
    slices = (
        "aten.slice.Tensor",
        "aten.narrow.default",
        "aten.select.int",
        "aten.split.Tensor",
        "aten.split_with_sizes.default",
        "aten.chunk.default",
        "aten.unbind.int",
    )
    return (
        EinsumRule("view", reshapes, reshape_rule, saved=saved_nothing),
        EinsumRule("view", permutes, permute_rule, saved=saved_nothing),
        EinsumRule(
            "view",
            ("aten.expand.default", "aten.broadcast_to.default", "aten.repeat.default"),
            expand_rule,
            saved=saved_nothing,
        ),
        EinsumRule("view", slices, slice_rule, saved=saved_nothing),
        EinsumRule(
            "view", ("aten.cat.default", "aten.stack.default"), cat_rule, saved=saved_nothing
        ),
        EinsumRule(
            "view",
            ("aten.pad.default", "aten.constant_pad_nd.default"),
            pad_rule,
            saved=saved_nothing,
        ),
        EinsumRule(
            "view",
            ("aten.select_scatter.default", "aten.slice_scatter.default"),
            scatter_rule,
            saved=saved_nothing,
        ),
        EinsumRule(
            "view",
            ("aten.repeat_interleave.self_int",),
            repeat_interleave_rule,
            saved=saved_nothing,
        ),
        EinsumRule(
            "view", ("aten.broadcast_tensors.default",), broadcast_tensors_rule, saved=saved_nothing
        ),
    )
