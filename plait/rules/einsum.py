"""Strategy enumeration shared by the rules: ops described as einsum-like letter signatures.

MindSpore's candidate generators (reference 7.1) split each dim of each input by powers of two
under per-op sharing rules. plait states the sharing once, as letters: every dim of every tensor
input and output carries a letter; dims with the same letter are the same logical dim and are
split alike; a letter missing from the outputs is reduced by the op, so splitting it leaves a
pending reduction (``partial``) on the outputs, of the kind the rule names (sum for matmul's
``k``, avg for a mean, max for amax). A dim that must never be split carries the empty letter.

Enumeration assigns each mesh axis (of size > 1) to one splittable letter or to none (the axis
repeats the computation); several axes on one letter split it outer-first in mesh order. A
split must divide the letter's size (uneven splits are not supported). Order is deterministic:
``itertools.product`` over axes in mesh order with "none" first, so the fully replicated
strategy comes first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from plait.errors import ShardingError
from plait.graph import OpNode, TensorMeta
from plait.layout import TensorLayout
from plait.layout.placement import ReduceOp
from plait.mesh import MeshSpec
from plait.rules.args import ref_index
from plait.rules.registry import OpStrategy, replicated_strategy

__all__ = [
    "FIXED",
    "Einsum",
    "EinsumRule",
    "aligned",
    "dim_letters",
    "dim_names",
    "einsum_for",
    "enumerate_strategies",
    "local_bytes",
    "saved_inputs",
    "saved_nothing",
    "saved_outputs",
]

FIXED = ""  # the letter of a dim that is never split


@dataclass(frozen=True, slots=True)
class Einsum:
    """Letters of an op's tensor inputs and outputs, and how each letter may be split.

    ``sizes`` lists the splittable letters in enumeration order with the number a split must
    divide (usually the dim's size; GQA heads use the kv head count). ``reduce`` gives the
    pending reduction of letters missing from the outputs; ``names`` the strategy labels.
    """

    inputs: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]
    sizes: tuple[tuple[str, int], ...]
    reduce: tuple[tuple[str, ReduceOp], ...] = ()
    names: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        seen = {letter for dims in self.inputs for letter in dims}
        kept = {letter for dims in self.outputs for letter in dims}
        reduced = dict(self.reduce)
        for letter, size in self.sizes:
            if not letter or letter not in seen:
                raise ShardingError(
                    f"einsum: splittable letter {letter!r} is on no input dim (inputs "
                    f"{self.inputs!r}); a rule may only split dims its inputs have"
                )
            if size < 1:
                raise ShardingError(f"einsum: letter {letter!r} has size {size}; sizes are >= 1")
            if letter not in kept and letter not in reduced:
                raise ShardingError(
                    f"einsum: letter {letter!r} is missing from the outputs {self.outputs!r} "
                    "but has no reduce op; name how the op combines its pieces, or fix it"
                )


def _letter_sizes(
    op: OpNode,
    inputs: Sequence[Sequence[str]],
    outputs: Sequence[Sequence[str]],
    override: Mapping[str, int],
) -> dict[str, int]:
    found: dict[str, int] = {}
    tensors = [*zip(inputs, op.input_metas, strict=True), *zip(outputs, op.outputs, strict=True)]
    for dims, meta in tensors:
        if len(dims) != meta.ndim:
            raise ShardingError(
                f"{op.name} ({op.target}): rule gives {len(dims)} letters {tuple(dims)!r} for a "
                f"tensor of shape {meta.shape!r}; this is a bug in the rule"
            )
        for letter, size in zip(dims, meta.shape, strict=True):
            if not letter or letter in override:
                continue
            if found.setdefault(letter, size) != size:
                raise ShardingError(
                    f"{op.name} ({op.target}): dims lettered {letter!r} have sizes "
                    f"{found[letter]} and {size}; this is a bug in the rule"
                )
    found.update(override)
    return found


def einsum_for(
    op: OpNode,
    inputs: Sequence[Sequence[str]],
    outputs: Sequence[Sequence[str]],
    *,
    names: Mapping[str, str] | None = None,
    reduce: Mapping[str, ReduceOp] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> Einsum:
    """An :class:`Einsum` for ``op``, reading letter sizes from its metas.

    Letters are enumerated in order of first appearance (inputs, then outputs); letters of
    size 1 are dropped (nothing to split). ``sizes`` overrides a letter's size.
    """
    found = _letter_sizes(op, inputs, outputs, sizes or {})
    order: list[str] = []
    for dims in (*inputs, *outputs):
        for letter in dims:
            if letter and letter not in order:
                order.append(letter)
    seen = {letter for dims in inputs for letter in dims}
    splittable = tuple((x, found[x]) for x in order if x in seen and found[x] > 1)
    reduce = reduce or {}
    return Einsum(
        tuple(tuple(d) for d in inputs),
        tuple(tuple(d) for d in outputs),
        splittable,
        tuple((x, reduce[x]) for x in order if x in reduce),
        tuple((names or {}).items()),
    )


def enumerate_strategies(es: Einsum, mesh: MeshSpec) -> list[OpStrategy]:
    """Every strategy of ``es`` on ``mesh`` (module doc), fully replicated first."""
    axes = tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1)
    letters = tuple(letter for letter, _ in es.sizes)
    out: list[OpStrategy] = []
    for choice in itertools.product((None, *letters), repeat=len(axes)):
        assign: dict[str, tuple[str, ...]] = {}
        for axis, letter in zip(axes, choice, strict=True):
            if letter is not None:
                assign[letter] = (*assign.get(letter, ()), axis)
        strategy = _strategy(es, mesh, assign)
        if strategy is not None:
            out.append(strategy)
    return out


def _strategy(
    es: Einsum, mesh: MeshSpec, assign: Mapping[str, tuple[str, ...]]
) -> OpStrategy | None:
    sizes = dict(es.sizes)
    for letter, axes in assign.items():
        if sizes[letter] % math.prod(mesh.axis_size(a) for a in axes):
            return None
    kept = {letter for dims in es.outputs for letter in dims}
    reduce = dict(es.reduce)
    summed = [letter for letter in assign if letter not in kept]
    ops = {reduce[letter] for letter in summed}
    if len(ops) > 1:
        return None  # one tensor holds one kind of pending reduction
    partial_axes = {a for letter in summed for a in assign[letter]}
    partial = tuple(a for a in mesh.axis_names if a in partial_axes)
    reduce_op: ReduceOp = ops.pop() if ops else "sum"

    def layout(dims: tuple[str, ...], pending: tuple[str, ...]) -> TensorLayout:
        return TensorLayout(mesh, tuple(assign.get(x, ()) for x in dims), pending, reduce_op)

    inputs = tuple(layout(dims, ()) for dims in es.inputs)
    outputs = tuple(layout(dims, partial) for dims in es.outputs)
    return OpStrategy(inputs, outputs, _label(es, assign))


def _label(es: Einsum, assign: Mapping[str, tuple[str, ...]]) -> str:
    if not assign:
        return "replicate"
    names = dict(es.names)
    parts: list[str] = []
    for letter, _ in es.sizes:
        if letter in assign:
            name = names.get(letter, letter)
            if name not in parts:
                parts.append(name)
    return "+".join(parts)


def dim_letters(ndim: int, prefix: str = "d") -> tuple[str, ...]:
    """One letter per dim: ``d0, d1, ...``."""
    return tuple(f"{prefix}{i}" for i in range(ndim))


def dim_names(ndim: int, prefix: str = "d") -> dict[str, str]:
    """Labels for :func:`dim_letters`: ``dim0, dim1, ...``."""
    return {f"{prefix}{i}": f"dim{i}" for i in range(ndim)}


def aligned(
    shape: Sequence[int], out_shape: Sequence[int], out_letters: Sequence[str]
) -> tuple[str, ...]:
    """Letters of a tensor broadcast against ``out_shape`` (aligned from the right).

    A dim of size 1 broadcast to a larger output dim is never split (every device reads it).
    """
    lead = len(out_shape) - len(shape)
    if lead < 0:
        raise ShardingError(
            f"broadcast: shape {tuple(shape)!r} has more dims than the result {tuple(out_shape)!r}"
        )
    return tuple(
        out_letters[lead + d] if size == out_shape[lead + d] else FIXED
        for d, size in enumerate(shape)
    )


def local_bytes(meta: TensorMeta, layout: TensorLayout) -> int:
    """Bytes of one device's piece of a tensor laid out as ``layout``."""
    return meta.numel // math.prod(layout.splits()) * meta.itemsize


SavedFn = Callable[[OpNode, OpStrategy, frozenset[int]], int]
Builder = Callable[[OpNode], Einsum | None]


def saved_inputs(op: OpNode, strategy: OpStrategy, params: frozenset[int]) -> int:
    """Default: backward reads every tensor input that is not a parameter."""
    return sum(
        local_bytes(m, lay)
        for i, (m, lay) in enumerate(zip(op.input_metas, strategy.inputs, strict=True))
        if i not in params
    )


def saved_outputs(op: OpNode, strategy: OpStrategy, params: frozenset[int]) -> int:
    """Backward reads the outputs (softmax, exp, sigmoid, tanh)."""
    return sum(local_bytes(m, lay) for m, lay in zip(op.outputs, strategy.outputs, strict=True))


def saved_nothing(op: OpNode, strategy: OpStrategy, params: frozenset[int]) -> int:
    """Backward reads nothing of the forward (add, views, sums)."""
    return 0


@dataclass(frozen=True, slots=True)
class EinsumRule:
    """A rule whose ops are described by an :class:`Einsum` built from the op.

    ``build`` returns None for a call it cannot describe honestly (unknown arguments,
    data-dependent shapes): the op is then offered replicated only. ``weights`` lists the
    aten argument positions and names that may hold parameters (for memory accounting).
    """

    family: str
    targets: tuple[str, ...]
    build: Builder
    saved: SavedFn = saved_inputs
    weights: tuple[tuple[int, str], ...] = ()

    def strategies(self, op: OpNode, mesh: MeshSpec) -> list[OpStrategy]:
        es = self.build(op)
        if es is None:
            return [replicated_strategy(op, mesh)]
        return enumerate_strategies(es, mesh)

    def weight_inputs(self, op: OpNode) -> tuple[int, ...]:
        """Indices in ``op.inputs`` of tensors in the argument slots that may be parameters."""
        found = (ref_index(op, pos, name) for pos, name in self.weights)
        return tuple(i for i in found if i is not None)

    def saved_bytes(self, op: OpNode, strategy: OpStrategy, params: frozenset[int]) -> int:
        return self.saved(op, strategy, params)
