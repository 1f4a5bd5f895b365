"""Strategy tuples (MindSpore's ``shard`` notation) resolved onto a named mesh.

A strategy gives, per input tensor of an op, how many equal pieces each dim is cut into:
``matmul.shard(((2, 1), (1, 4)))``. Each op has a *signature*: a factor letter per input dim,
shared letters being the same logical dim (matmul ``x[m, k] @ w[k, n]`` is ``("m", "k"),
("k", "n")``). The op's device matrix is its factors in order of first appearance,
``(m, k, n)``, and, as in MindSpore, it is laid onto the devices from the right: the last
factor takes the innermost mesh axes. Devices left over on the outer axes repeat the
computation (MindSpore's "repeated calculation").

Resolution rules (each broken rule is a :class:`~plait.errors.ShardingError` naming the op,
input, dim and numbers):

1. one inner tuple per input, one entry per tensor dim, entries integers >= 1;
2. dims with the same letter have the same split;
3. the product of the splits divides the device count;
4. each split > 1 is the product of consecutive mesh axes, taken from the right.

Example: on ``{"dp": 2, "tp": 2}``, ``Linear`` column parallel is the op strategy
``((2, 1), (2, 1))`` over ``x[b, k]``, ``w[n, k]``: factors ``(b=2, k=1, n=2)``, so ``n``
takes ``tp`` and ``b`` takes ``dp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from plait.errors import ShardingError
from plait.layout.layout import TensorLayout
from plait.mesh import MeshSpec

__all__ = ["OpSignature", "ResolvedStrategy", "resolve_strategy", "resolve_tensor_strategy"]

Strategy = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class OpSignature:
    """Factor letters of an op's inputs and output; letters missing from the output are summed."""

    op: str
    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    input_names: tuple[str, ...] = ()

    def input_name(self, i: int) -> str:
        return self.input_names[i] if i < len(self.input_names) else f"input {i}"


@dataclass(frozen=True, slots=True)
class ResolvedStrategy:
    """Layouts of an op's inputs and output (with pending sums) for one strategy."""

    inputs: tuple[TensorLayout, ...]
    output: TensorLayout
    factor_axes: dict[str, tuple[str, ...]]


def _check_shape_of_strategy(
    sig: OpSignature, strategy: Sequence[Sequence[int]], where: str
) -> None:
    if len(strategy) != len(sig.inputs):
        raise ShardingError(
            f"{where}: strategy {tuple(map(tuple, strategy))!r} gives {len(strategy)} input "
            f"strategies but {sig.op} takes {len(sig.inputs)} inputs "
            f"({', '.join(sig.input_name(i) for i in range(len(sig.inputs)))}); give one tuple per input"
        )
    for i, (dims, split) in enumerate(zip(sig.inputs, strategy, strict=True)):
        if len(split) != len(dims):
            raise ShardingError(
                f"{where}: strategy {tuple(split)!r} for {sig.input_name(i)} of {sig.op} has "
                f"{len(split)} entries but the tensor has {len(dims)} dims; give one split count "
                "per tensor dim (1 = not split)"
            )
        for d, n in enumerate(split):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ShardingError(
                    f"{where}: split {n!r} for dim {d} of {sig.input_name(i)} of {sig.op} is not "
                    "an integer >= 1"
                )


def _factor_splits(
    sig: OpSignature, strategy: Sequence[Sequence[int]], where: str
) -> dict[str, int]:
    factors: dict[str, int] = {}
    first: dict[str, tuple[int, int]] = {}
    for i, (dims, split) in enumerate(zip(sig.inputs, strategy, strict=True)):
        for d, (letter, n) in enumerate(zip(dims, split, strict=True)):
            if letter not in factors:
                factors[letter] = n
                first[letter] = (i, d)
            elif factors[letter] != n:
                fi, fd = first[letter]
                raise ShardingError(
                    f"{where}: {sig.op} needs dim {fd} of {sig.input_name(fi)} and dim {d} of "
                    f"{sig.input_name(i)} split alike (both are its '{letter}' dim) but they are "
                    f"split {factors[letter]} and {n}; make the two splits equal"
                )
    return factors


def _assign_axes(
    factors: dict[str, int], mesh: MeshSpec, where: str, op: str
) -> dict[str, tuple[str, ...]]:
    total = math.prod(factors.values())
    if total > mesh.size or mesh.size % total:
        rule = "exceeds" if total > mesh.size else "does not divide"
        raise ShardingError(
            f"{where}: the splits of {op} multiply to {total}, which {rule} the {mesh.size} "
            f"devices of mesh {mesh.as_dict()!r}; use splits whose product divides {mesh.size}"
        )
    axes: dict[str, tuple[str, ...]] = {}
    pos = mesh.ndim
    for letter in reversed(list(factors)):
        need = factors[letter]
        taken: list[str] = []
        while need > 1:
            if pos == 0 or need % mesh.shape[pos - 1]:
                raise ShardingError(
                    f"{where}: split {factors[letter]} of {op}'s '{letter}' dim does not match the "
                    f"mesh {mesh.as_dict()!r} (splits take whole mesh axes from the right); "
                    "choose splits that are products of adjacent axis sizes, or write a Layout "
                    "with explicit axis names"
                )
            pos -= 1
            taken.insert(0, mesh.axis_names[pos])
            need //= mesh.shape[pos]
        axes[letter] = tuple(taken)
    return axes


def resolve_strategy(
    sig: OpSignature, strategy: Sequence[Sequence[int]], mesh: MeshSpec, where: str
) -> ResolvedStrategy:
    """Resolve an op strategy to input and output layouts on ``mesh`` (rules in module doc)."""
    _check_shape_of_strategy(sig, strategy, where)
    factors = _factor_splits(sig, strategy, where)
    axes = _assign_axes(factors, mesh, where, sig.op)
    inputs = tuple(TensorLayout(mesh, tuple(axes[x] for x in dims)) for dims in sig.inputs)
    summed = tuple(a for letter in factors if letter not in sig.output for a in axes[letter])
    summed = tuple(a for a in mesh.axis_names if a in summed)
    output = TensorLayout(mesh, tuple(axes.get(x, ()) for x in sig.output), summed)
    return ResolvedStrategy(inputs, output, axes)


def resolve_tensor_strategy(
    strategy: Sequence[int], mesh: MeshSpec, where: str, shape: Sequence[int] | None = None
) -> TensorLayout:
    """Lay one tensor's strategy, e.g. a parameter's ``(2, 1)``, onto ``mesh`` from the right."""
    letters = tuple(f"d{i}" for i in range(len(strategy)))
    sig = OpSignature("tensor", (letters,), letters, (where,))
    if shape is not None and len(shape) != len(strategy):
        raise ShardingError(
            f"{where}: strategy {tuple(strategy)!r} has {len(strategy)} entries but the tensor "
            f"has {len(shape)} dims (shape {tuple(shape)!r}); give one split count per dim"
        )
    layout = resolve_strategy(sig, (tuple(strategy),), mesh, where).inputs[0]
    if shape is not None:
        layout.check_shape(shape, where)
    return layout
