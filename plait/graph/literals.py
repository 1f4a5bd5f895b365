"""Tensor literals in an exported training graph, as ops every executor runs.

``torch.tensor(...)`` (or ``torch.as_tensor`` of a Python value) in a forward is exported as
a lifted constant (an input ``c_...`` of the program) read by ``aten.lift_fresh_copy``, often
followed by an in-place ``aten.detach_``. DTensor has no strategy for either, nor for the
``Tensor`` overloads of ``fill``/``masked_fill`` such literals feed (``x[..., 0] =
torch.tensor(3)``, T5's ``_shift_right``). :func:`plain_literals` rewrites them in place:

- ``lift_fresh_copy(c)`` -> ``clone(c)`` (the same fresh copy);
- ``detach_(x)`` -> ``detach(x)``; later readers of ``x`` read the detached value instead, as
  they would see the detached tensor;
- ``fill``/``fill_``/``masked_fill``/``masked_fill_`` with a 0-d literal value -> the
  ``Scalar`` overload with the literal's number (same result and gradient: the value is a
  constant, so nothing flows into it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind

__all__ = ["plain_literals"]

_aten = torch.ops.aten
# Tensor overload -> Scalar overload taking the value at the same position
_SCALAR_FORM = {
    _aten.fill.Tensor: _aten.fill.Scalar,
    _aten.fill_.Tensor: _aten.fill_.Scalar,
    _aten.masked_fill.Tensor: _aten.masked_fill.Scalar,
    _aten.masked_fill_.Tensor: _aten.masked_fill_.Scalar,
}
_COPIES = (_aten.lift_fresh_copy.default, _aten.clone.default, _aten.detach.default)


def plain_literals(program: torch.export.ExportedProgram) -> None:
    """Rewrite ``program``'s tensor literals in place (see the module doc)."""
    graph = program.graph_module.graph
    changed = _copies_made_plain(graph)
    changed |= _scalar_fills(graph, _literal_values(program))
    if changed:
        graph.lint()
        program.graph_module.recompile()


def _copies_made_plain(graph: torch.fx.Graph) -> bool:
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _aten.lift_fresh_copy.default:
            node.target = _aten.clone.default
            changed = True
        elif node.target is _aten.detach_.default:
            node.target = _aten.detach.default
            source = node.args[0]
            for user in list(source.users):
                if order[user] > order[node]:
                    user.replace_input_with(source, node)
            changed = True
    return changed


def _literal_values(program: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Placeholder name -> value of each lifted constant tensor with a known value."""
    out: dict[str, torch.Tensor] = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.CONSTANT_TENSOR or spec.target is None:
            continue
        value = program.constants.get(spec.target)
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            out[spec.arg.name] = value
    return out


def _number(node: Any, literals: dict[str, torch.Tensor]) -> float | int | bool | None:
    """The Python number a 0-d literal ``node`` holds (through copies), else None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target not in _COPIES:
            return None
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.name not in literals:
        return None
    value = literals[node.name]
    if value.ndim != 0 or type(value).__name__ == "FakeTensor":
        return None
    return value.item()


def _scalar_fills(graph: torch.fx.Graph, literals: dict[str, torch.Tensor]) -> bool:
    changed = False
    for node in graph.nodes:
        scalar_form = _SCALAR_FORM.get(node.target) if node.op == "call_function" else None
        if scalar_form is None or len(node.args) < 2:
            continue
        value = node.args[-1]
        number = _number(value, literals)
        if number is None:
            continue
        node.target = scalar_form
        node.args = (*node.args[:-1], number)
        _erase_unread_copies(graph, value)
        changed = True
    return changed


def _erase_unread_copies(graph: torch.fx.Graph, node: Any) -> None:
    """The copies of a literal nothing reads any more (the constant input itself stays)."""
    while isinstance(node, torch.fx.Node) and node.target in _COPIES and not node.users:
        source = node.args[0]
        graph.erase_node(node)
        node = source
