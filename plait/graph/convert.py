"""Conversion: one ``torch.export`` ExportedProgram -> graph inputs, ops and outputs.

The exported program's placeholders become :class:`~plait.graph.GraphInput` values (``p_<fqn>``
parameters, ``b_<fqn>`` buffers, ``c_<name>`` lifted constants, ``batch_<i>`` tensors of the
batch, dots turned into underscores); each ``call_function`` node becomes an
:class:`~plait.graph.OpNode` with its shapes, arguments, module path, FLOPs and bytes
(:mod:`plait.cost.flops`).

Dropped nodes: ``operator.getitem`` (folded into refs ``"op:i"``), ``aten.alias`` (its readers
read its input) and shape/metadata assertions (no data). Everything else is kept.

Names. Ops are named after their aten op, numbered in graph order: ``linear``, ``linear_1``,
... (:func:`canonical_names`: the scheme torch.fx uses, applied to the final op list, so a full
and a fast capture name every op alike).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from plait.cost.flops import op_bytes, op_flops
from plait.errors import CaptureError
from plait.graph.opgraph import GraphInput, OpNode, Ref, TensorMeta, value_ref
from plait.graph.sites import (
    VALUE_DEPENDENT_FIX,
    is_value_dependent,
    site_of_node,
    value_dependent_error,
)

__all__ = [
    "EXPORT_ASSERTIONS",
    "WRAPPED",
    "Captured",
    "batch_leaves",
    "batch_paths",
    "canonical_names",
    "convert_program",
    "input_name",
]

WRAPPED = "model"  # attribute name of the user's model inside the traced wrapper
# Shape and metadata assertions torch.export leaves in a graph (``x.to(dtype)`` leaves
# ``_assert_tensor_metadata``): checks of the export's own tracing, nothing to compute. The
# capture drops them; run on DTensors (the plan executor, a graph split into pipeline stages)
# they are skipped.
EXPORT_ASSERTIONS = frozenset(
    {
        "aten._assert_tensor_metadata.default",
        "aten._assert_async.default",
        "aten._assert_async.msg",
        "aten._assert_scalar.default",
        "aten.sym_constrain_range.default",
        "aten.sym_constrain_range_for_size.default",
    }
)
_ALIAS = "aten.alias.default"


def batch_paths(obj: Any, path: str = "batch") -> list[tuple[str, Any]]:
    """Leaves of a batch with their paths (``batch[0]``, ``batch['ids']``), in the order
    torch.export lifts them: tuples, lists and dicts (insertion order) are containers;
    everything else, None included, is a leaf."""
    if isinstance(obj, tuple | list):
        return [leaf for i, v in enumerate(obj) for leaf in batch_paths(v, f"{path}[{i}]")]
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in batch_paths(v, f"{path}[{k!r}]")]
    return [(path, obj)]


def batch_leaves(batch: Any) -> list[Any]:
    """The leaves of a batch in the order torch.export lifts them (see :func:`batch_paths`)."""
    return [leaf for _, leaf in batch_paths(batch)]


def _meta(value: object) -> TensorMeta:
    if isinstance(value, torch.Tensor):
        return TensorMeta(
            tuple(int(s) for s in value.shape), str(value.dtype).removeprefix("torch.")
        )
    if isinstance(value, bool):
        return TensorMeta((), "bool")
    if isinstance(value, int):
        return TensorMeta((), "int64")
    if isinstance(value, float):
        return TensorMeta((), "float64")
    return TensorMeta((), "none")  # an optional output that is None


def _output_metas(value: object) -> tuple[TensorMeta, ...]:
    if value is None:
        return ()
    if isinstance(value, tuple | list):
        return tuple(_meta(v) for v in value)
    return (_meta(value),)


def input_name(kind: str, fqn: str) -> str:
    return kind[0] + "_" + re.sub(r"\W", "_", fqn)


def _strip(fqn: str) -> str:
    """A path inside the wrapper -> the same path in the user's model."""
    if fqn == WRAPPED:
        return ""
    return fqn.removeprefix(WRAPPED + ".")


@dataclass(frozen=True, slots=True)
class _Const:
    """A placeholder that stands for a plain value (a non-tensor leaf of the batch)."""

    value: object


@dataclass
class Captured:
    """An OpGraph under construction: op names are still export's (or clone) names."""

    inputs: list[GraphInput]
    ops: list[OpNode]
    outputs: list[str]


class _Converter:
    """Turns one ExportedProgram into graph inputs, ops and outputs."""

    def __init__(self, program: torch.export.ExportedProgram, model: nn.Module, batch: Any) -> None:
        self.program = program
        self.refs: dict[str, str | _Const] = {}
        self.metas: dict[str, TensorMeta] = {}
        # Tied parameters are lifted once per name; every name maps to the first FQN.
        self.canonical: dict[int, str] = {}
        for name, p in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ):
            self.canonical.setdefault(id(p), name)
        self.model = model
        self.batch_targets = [path for path, _ in batch_paths(batch)]
        self.node: torch.fx.Node | None = None  # the node being converted, for errors

    def _fqn(self, target: str) -> str:
        fqn = _strip(target)
        tensor: torch.Tensor
        try:
            tensor = self.model.get_parameter(fqn)
        except (AttributeError, KeyError):
            try:
                tensor = self.model.get_buffer(fqn)
            except (AttributeError, KeyError):
                return fqn
        return self.canonical.get(id(tensor), fqn)

    def _requires_grad(self, fqn: str) -> bool:
        """The model's own flag for parameter ``fqn`` (True when the name does not resolve)."""
        try:
            return bool(self.model.get_parameter(fqn).requires_grad)
        except (AttributeError, KeyError):
            return True

    def inputs(self) -> list[GraphInput]:
        out: list[GraphInput] = []
        names: dict[
            tuple[str, str], str
        ] = {}  # (kind, target) -> name; a tied parameter's second name reads the first
        placeholders = {n.name: n for n in self.program.graph.nodes if n.op == "placeholder"}
        user = 0
        for spec in self.program.graph_signature.input_specs:
            node = placeholders[spec.arg.name]
            val = node.meta.get("val")
            if spec.kind == InputKind.USER_INPUT:
                target = (
                    self.batch_targets[user] if user < len(self.batch_targets) else f"batch[{user}]"
                )
                index, user = user, user + 1
                if not isinstance(val, torch.Tensor):
                    self.refs[node.name] = _Const(val)
                    continue
                kind, name = "input", f"batch_{index}"
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                target = self._fqn(spec.target or "")
                kind = "parameter" if spec.kind == InputKind.PARAMETER else "buffer"
                name = input_name(kind, target)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                target, kind = _strip(spec.target or node.name), "constant"
                name = input_name(kind, target)
            else:
                raise CaptureError(
                    f"capture of {type(self.model).__name__}: input {node.name!r} is a "
                    f"{spec.kind.name}, which plait cannot plan; remove script objects and "
                    "effectful ops from the forward"
                )
            if (kind, target) in names:
                name = names[(kind, target)]
            else:
                while name in names.values():  # two FQNs that differ only in "." vs "_"
                    name += "_"
                names[(kind, target)] = name
                frozen = kind == "parameter" and not self._requires_grad(target)
                out.append(GraphInput(name, kind, _meta(val), target, not frozen))  # type: ignore[arg-type]
            self.refs[node.name] = name
            self.metas[node.name] = _meta(val)
        return out

    def ops(self, inputs: Sequence[GraphInput]) -> list[OpNode]:
        params = {g.name: g.target for g in inputs if g.kind == "parameter"}
        ops: list[OpNode] = []
        for node in self.program.graph.nodes:
            self.node = node
            if node.op != "call_function":
                if node.op in ("placeholder", "output"):
                    continue
                raise CaptureError(
                    f"capture of {type(self.model).__name__}: node {node.name!r} in "
                    f"{site_of_node(node)} is a {node.op!r} node (a higher-order op's "
                    "subgraph or a module call left in the graph), which plait cannot plan; "
                    "write that part of the forward as plain tensor ops"
                )
            if node.target is operator.getitem:
                source, index = node.args
                ref = self.refs[source.name]
                if isinstance(ref, _Const) or ":" in ref:
                    raise CaptureError(
                        f"capture: nested tuple output at {node.name!r} is not supported"
                    )
                self.refs[node.name] = value_ref(ref, int(index))
                self.metas[node.name] = _meta(node.meta.get("val"))
                continue
            target = str(node.target)
            if target in EXPORT_ASSERTIONS:
                continue
            if target == _ALIAS:
                self.refs[node.name] = self.refs[node.args[0].name]
                self.metas[node.name] = _meta(node.meta.get("val"))
                continue
            ops.append(self._op(node, target, params))
        return ops

    def _op(self, node: torch.fx.Node, target: str, params: dict[str, str]) -> OpNode:
        refs: list[str] = []
        metas: list[TensorMeta] = []

        def arg(a: object) -> object:
            if isinstance(a, torch.fx.Node):
                ref = self.refs[a.name]
                if isinstance(ref, _Const):
                    return arg(ref.value)
                refs.append(ref)
                metas.append(self.metas[a.name])
                return Ref(len(refs) - 1)
            if isinstance(a, tuple | list):
                return tuple(arg(x) for x in a)
            if isinstance(a, torch.dtype):
                return str(a).removeprefix("torch.")
            if isinstance(a, torch.device | torch.memory_format | torch.layout):
                return str(a)
            if a is None or isinstance(a, bool | int | float | str):
                return a
            if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
                raise CaptureError(
                    f"capture of {type(self.model).__name__}: a tensor's size depends on "
                    f"tensor values in {site_of_node(node)} (op {target} has the symbolic "
                    f"argument {a!r}); {VALUE_DEPENDENT_FIX}"
                )
            raise CaptureError(
                f"capture: op {node.name!r} ({target}) in {site_of_node(node)} has an argument "
                f"{a!r} of type {type(a).__name__}, which an OpGraph cannot hold"
            )

        args = tuple(arg(a) for a in node.args)
        # where a tensor is made (a device kwarg) is an execution detail, not part of the op:
        # a model captured on meta tensors and on its real device gives the same graph
        kwargs = tuple((k, arg(v)) for k, v in node.kwargs.items() if k != "device")
        outputs = _output_metas(node.meta.get("val"))
        self.refs[node.name] = node.name
        if len(outputs) == 1:
            self.metas[node.name] = outputs[0]
        stack = node.meta.get("nn_module_stack") or {}
        module_path = _strip(next(reversed(stack.values()))[0]) if stack else ""
        op_params = tuple(dict.fromkeys(params[r] for r in refs if r in params))
        return OpNode(
            name=node.name,
            target=target,
            inputs=tuple(refs),
            input_metas=tuple(metas),
            outputs=outputs,
            args=args,
            kwargs=kwargs,
            flops=op_flops(target, metas, outputs, args),
            bytes=op_bytes(target, metas, outputs),
            params=op_params,
            module_path=module_path,
        )

    def outputs(self) -> list[str]:
        output_node = next(n for n in self.program.graph.nodes if n.op == "output")
        values = [v for _, v in batch_paths(output_node.args[0])]
        out: list[str] = []
        for spec, value in zip(self.program.graph_signature.output_specs, values, strict=True):
            if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
                continue  # buffer mutations: the ops that compute them stay in the graph
            if isinstance(value, torch.fx.Node):
                ref = self.refs[value.name]
                if not isinstance(ref, _Const):
                    out.append(ref)
        return out


def convert_program(
    program: torch.export.ExportedProgram, model: nn.Module, batch: Any
) -> Captured:
    conv = _Converter(program, model, batch)
    try:
        inputs = conv.inputs()
        ops = conv.ops(inputs)
        return Captured(inputs, ops, conv.outputs())
    except Exception as e:
        if isinstance(e, CaptureError) or not is_value_dependent(e):
            raise
        # export traced it, but a tensor's size depends on values (boolean-mask indexing,
        # nonzero, unique, routing tokens to experts): plans need every size up front
        site = "an input" if conv.node is None else site_of_node(conv.node)
        raise value_dependent_error(type(model).__name__, site, e) from e


def canonical_names(cap: Captured) -> dict[str, str]:
    """Number ops per aten op name in graph order: linear, linear_1, ... (see module doc).

    Returns the renaming: export's node name -> the op's name in the graph.
    """
    used = {g.name for g in cap.inputs}
    counts: dict[str, int] = {}
    rename: dict[str, str] = {}
    for op in cap.ops:
        base = re.sub(r"_\d+$", "", _packet_name(op.target))
        n = counts.get(base, 0)
        candidate = base if n == 0 else f"{base}_{n}"
        while candidate in used:
            n += 1
            candidate = f"{base}_{n}"
        counts[base] = n + 1
        used.add(candidate)
        rename[op.name] = candidate

    def ref(r: str) -> str:
        op, _, index = r.partition(":")
        return value_ref(rename[op], int(index or 0)) if op in rename else r

    cap.ops[:] = [
        dataclasses.replace(op, name=rename[op.name], inputs=tuple(ref(r) for r in op.inputs))
        for op in cap.ops
    ]
    cap.outputs[:] = [ref(r) for r in cap.outputs]
    return rename


def _packet_name(target: str) -> str:
    parts = target.split(".")
    name = parts[1] if len(parts) == 3 else target
    return re.sub(r"\W", "_", name) or "op"
