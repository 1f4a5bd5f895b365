"""OpGraph: a captured model as operators over tensors, with shapes, FLOPs and bytes.

Pure data: building one needs no process group and no real memory (see :mod:`plait.capture`).
Values are named by *value refs*: ``"linear_3"`` is output 0 of op ``linear_3``, and
``"split_1:2"`` is its output 2; graph inputs are refs too: ``p_<fqn>`` for parameters,
``b_<fqn>`` for buffers, ``c_<name>`` for lifted constants (dots as underscores) and
``batch_<i>`` for the batch's tensors.

Repeated layers: ops of a member of a :class:`LayerGroup` carry ``layer="blocks.3"``;
members correspond op for op, so :meth:`OpGraph.representative` maps any member's op to the
matching op of ``members[0]`` and a search can solve one member for all.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from plait.errors import CaptureError

__all__ = [
    "GraphInput",
    "LayerGroup",
    "OpGraph",
    "OpNode",
    "Ref",
    "TensorMeta",
    "value_ref",
]

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of one tensor; ``dtype`` is torch's name without ``torch.``."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class Ref:
    """Marks, inside :attr:`OpNode.args`, the place of the op's tensor input number ``index``."""

    index: int


ValueKind = Literal["parameter", "buffer", "input", "constant"]


@dataclass(frozen=True, slots=True)
class GraphInput:
    """A value that enters the graph: a parameter, a buffer, or a tensor of the batch.

    ``requires_grad`` is the parameter's own flag (capture reads it from the model): a frozen
    parameter (False) gets no gradient, so no gradient reduction and no optimizer state. It is
    True for every other kind, which never matters: only parameters are trained.
    """

    name: str
    kind: ValueKind
    meta: TensorMeta
    target: str  # parameter/buffer FQN ("layers.0.attn.q.weight"), or "batch[0]" for inputs
    requires_grad: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.requires_grad, bool):
            raise CaptureError(
                f"GraphInput {self.name!r}: requires_grad={self.requires_grad!r} is not a bool; "
                "give True (trained) or False (frozen parameter)"
            )
        if not self.requires_grad and self.kind != "parameter":
            raise CaptureError(
                f"GraphInput {self.name!r} is a {self.kind}, so requires_grad=False means "
                "nothing; only parameters can be frozen: leave requires_grad=True"
            )

    @property
    def trainable(self) -> bool:
        """A parameter that gets a gradient (``requires_grad``)."""
        return self.kind == "parameter" and self.requires_grad


@dataclass(frozen=True, slots=True)
class OpNode:
    """One operator call of the forward pass (loss included).

    ``inputs`` are the value refs of the op's tensor arguments, in argument order; ``args``
    and ``kwargs`` are the call's arguments with each tensor replaced by :class:`Ref` to its
    position in ``inputs`` (so rules can read dims, shapes and flags).
    """

    name: str
    target: str  # "aten.linear.default"
    inputs: tuple[str, ...]
    input_metas: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    args: tuple[object, ...] = ()
    kwargs: tuple[tuple[str, object], ...] = ()
    flops: int = 0  # forward FLOPs of the whole (unsharded) op
    bytes: int = 0  # forward bytes read and written
    params: tuple[str, ...] = ()  # FQNs of the parameters among ``inputs``
    module_path: str = ""  # innermost module FQN, "" for the root
    layer: str | None = None  # member of a repeated layer, e.g. "blocks.3"

    def kwarg(self, key: str, default: object = None) -> object:
        for k, v in self.kwargs:
            if k == key:
                return v
        return default


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Structurally identical repeated layers, e.g. ``blocks.0`` .. ``blocks.95``.

    ``members[0]`` is the representative: search can solve it once and copy the result,
    op for op, to the other members (``OpGraph.representative``).
    """

    prefix: str
    members: tuple[str, ...]


def value_ref(op: str, index: int = 0) -> str:
    return op if index == 0 else f"{op}:{index}"


@dataclass(frozen=True)
class OpGraph:
    """Ops in topological order, the values entering the graph, and the outputs (loss first)."""

    inputs: tuple[GraphInput, ...]
    ops: tuple[OpNode, ...]
    outputs: tuple[str, ...]
    layers: tuple[LayerGroup, ...] = ()
    _by_name: dict[str, OpNode] = field(init=False, repr=False, compare=False)
    _inputs_by_name: dict[str, GraphInput] = field(init=False, repr=False, compare=False)
    _consumers: dict[str, list[tuple[str, int]]] = field(init=False, repr=False, compare=False)
    # member FQN -> its ops' names in order; op name -> position among its member's ops
    _member_ops: dict[str, list[str]] = field(init=False, repr=False, compare=False)
    _position: dict[str, int] = field(init=False, repr=False, compare=False)
    _group_of_member: dict[str, LayerGroup] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {op.name: op for op in self.ops}
        consumers: dict[str, list[tuple[str, int]]] = {}
        member_ops: dict[str, list[str]] = {}
        position: dict[str, int] = {}
        for op in self.ops:
            for i, ref in enumerate(op.inputs):
                consumers.setdefault(ref, []).append((op.name, i))
            if op.layer is not None:
                names = member_ops.setdefault(op.layer, [])
                position[op.name] = len(names)
                names.append(op.name)
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_inputs_by_name", {g.name: g for g in self.inputs})
        object.__setattr__(self, "_consumers", consumers)
        object.__setattr__(self, "_member_ops", member_ops)
        object.__setattr__(self, "_position", position)
        object.__setattr__(self, "_group_of_member", {m: g for g in self.layers for m in g.members})

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def op(self, name: str) -> OpNode:
        return self._by_name[name]

    def graph_input(self, name: str) -> GraphInput | None:
        return self._inputs_by_name.get(name)

    def producer(self, ref: str) -> tuple[OpNode | GraphInput, int]:
        """The op (and its output index) or graph input that makes value ``ref``."""
        if ref in self._inputs_by_name:
            return self._inputs_by_name[ref], 0
        name, _, index = ref.partition(":")
        return self._by_name[name], int(index) if index else 0

    def meta(self, ref: str) -> TensorMeta:
        node, index = self.producer(ref)
        return node.meta if isinstance(node, GraphInput) else node.outputs[index]

    def consumers(self, ref: str) -> list[tuple[OpNode, int]]:
        """Ops reading ``ref``, each with the position of ``ref`` among its inputs."""
        return [(self._by_name[n], i) for n, i in self._consumers.get(ref, [])]

    def parameters(self) -> dict[str, GraphInput]:
        """Parameters by FQN."""
        return {g.target: g for g in self.inputs if g.kind == "parameter"}

    def trainable_parameters(self) -> dict[str, GraphInput]:
        """Parameters by FQN that get a gradient (frozen ones, ``requires_grad=False``, left out)."""
        return {g.target: g for g in self.inputs if g.trainable}

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    # ------------------------------------------------------------------ repeated layers

    def group_of(self, op_name: str) -> LayerGroup | None:
        """The layer group whose member runs ``op_name``, or None."""
        layer = self._by_name[op_name].layer
        return None if layer is None else self._group_of_member.get(layer)

    def representative(self, op_name: str) -> str:
        """The op of ``members[0]`` that corresponds to ``op_name`` (itself outside groups).

        Members' ops correspond one to one in order (checked by :meth:`validate`), so a
        strategy chosen for the representative applies to every member's matching op.
        """
        group = self.group_of(op_name)
        if group is None:
            return op_name
        return self._member_ops[group.members[0]][self._position[op_name]]

    def layer_ops(self, member: str) -> tuple[OpNode, ...]:
        """The ops of one member of a layer group (``"blocks.3"``), in graph order."""
        return tuple(self._by_name[n] for n in self._member_ops.get(member, ()))

    def validate(self) -> None:
        """Check that refs resolve and that layer groups' members correspond op for op.

        Raises :class:`~plait.errors.CaptureError` naming the first broken op or member.
        """
        known: set[str] = set(self._inputs_by_name)
        for op in self.ops:
            for ref in op.inputs:
                if ref not in known:
                    raise CaptureError(
                        f"OpGraph op {op.name!r} ({op.target}) reads {ref!r}, which no earlier "
                        "op or graph input produces; ops must be in topological order and "
                        "refs must name existing values"
                    )
            known.update(value_ref(op.name, i) for i in range(len(op.outputs)))
        missing = [ref for ref in self.outputs if ref not in known]
        if missing:
            raise CaptureError(f"OpGraph outputs {missing} are produced by no op or input")
        for group in self.layers:
            self._check_group(group)

    def _check_group(self, group: LayerGroup) -> None:
        first = self.layer_ops(group.members[0])
        for member in group.members[1:]:
            ops = self.layer_ops(member)
            if len(ops) != len(first):
                raise CaptureError(
                    f"layer group {group.prefix!r}: member {member!r} runs {len(ops)} ops but "
                    f"{group.members[0]!r} runs {len(first)}; members of a group must "
                    "correspond op for op (drop the group or fix the capture)"
                )
            for a, b in zip(first, ops, strict=True):
                if (a.target, a.input_metas, a.outputs) != (b.target, b.input_metas, b.outputs):
                    raise CaptureError(
                        f"layer group {group.prefix!r}: op {b.name!r} ({b.target}) of "
                        f"{member!r} does not match {a.name!r} ({a.target}) of "
                        f"{group.members[0]!r} in target or shapes; members of a group must "
                        "correspond op for op"
                    )
