"""Reading an :class:`~plait.graph.OpNode`'s call arguments: positions, keywords and tensor refs.

A captured op keeps its arguments with every tensor replaced by ``Ref(i)`` (``i`` = position in
``op.inputs``). Rules read flags by aten schema position or keyword, and find which of the op's
tensor inputs sits in a given argument.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.graph import OpNode, Ref, TensorMeta

__all__ = ["arg", "dims_arg", "input_meta", "ref_index", "ref_indices", "wrap_dim"]


def arg(op: OpNode, pos: int, name: str, default: object = None) -> object:
    """Argument ``pos`` of the call (or keyword ``name``), ``default`` when absent."""
    if pos < len(op.args):
        return op.args[pos]
    return op.kwarg(name, default)


def ref_index(op: OpNode, pos: int, name: str) -> int | None:
    """Index in ``op.inputs`` of the tensor passed as argument ``pos``/``name``, if any."""
    value = arg(op, pos, name)
    return value.index if isinstance(value, Ref) else None


def ref_indices(op: OpNode, pos: int, name: str) -> tuple[int, ...] | None:
    """Indices of a tensor-list argument (``cat``'s tensors); None if any entry is no tensor."""
    value = arg(op, pos, name)
    if not isinstance(value, Sequence) or isinstance(value, str):
        return None
    if not all(isinstance(v, Ref) for v in value):
        return None
    return tuple(v.index for v in value)  # type: ignore[union-attr]


def input_meta(op: OpNode, index: int | None) -> TensorMeta | None:
    return None if index is None else op.input_metas[index]


def wrap_dim(dim: object, ndim: int) -> int | None:
    """A dim argument made non-negative; None when it is not an int in range."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    if ndim == 0 and dim in (0, -1):
        return 0
    if not -ndim <= dim < ndim:
        return None
    return dim % ndim


def dims_arg(value: object, ndim: int) -> tuple[int, ...] | None:
    """A dim or list of dims made non-negative and sorted; ``None``/``[]`` mean every dim."""
    if value is None or (isinstance(value, Sequence) and len(value) == 0):
        return tuple(range(ndim))
    items = value if isinstance(value, Sequence) and not isinstance(value, str) else (value,)
    out = [wrap_dim(d, ndim) for d in items]
    if any(d is None for d in out):
        return None
    return tuple(sorted(set(out)))  # type: ignore[arg-type]
