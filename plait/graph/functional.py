"""In-place updates of views, made functional before planning.

``x[:, 0] = 3`` or ``x[..., 1:] = y`` in a forward is exported (training IR) as a view op
(``select``, ``slice``) followed by an in-place op on the view (``fill_``, ``copy_``): the
write reaches ``x`` only because the view shares its memory. A plan runs op by op and may
move a value to another layout between the two (a new tensor): the write would then miss
``x``. When a program writes into a view, :func:`functional_views` runs torch's
functionalization over it (``run_decompositions`` with an empty table: ops are kept, only
mutations become out-of-place ops and scatters such as ``select_scatter``), so every value
is written once and no op relies on aliasing. Programs without such writes are left as
exported (batch norm's running statistics, an in-place ``add_`` on a fresh tensor).

Functionalizing also decomposes ``reshape`` into ``view`` wherever the strides export saw
allow one: ``h.transpose(1, 2).contiguous().reshape(b, t, -1)`` after CPU's
``scaled_dot_product_attention`` (whose kernel lays its output out so that the transpose is
already contiguous: ``contiguous`` is a no-op and ``reshape`` a ``view``; T5's attention under
transformers 5). A plan's executor may produce the same values with other strides (DTensor
gives such an output a fresh contiguous layout, so the transpose is not contiguous) and that
view fails. :func:`stride_free_views` makes every ``view`` that relied on export's strides a
``reshape`` again (a copy where the strides need one; the same values and gradient).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx

from plait._compat import dispatch_modes_suspended

__all__ = ["fills_as_copies", "functional_views", "stride_free_views", "writes_into_a_view"]


def _is_view(node: Any) -> bool:
    """Whether ``node`` is the output of a view op (its result aliases an input, read-only)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def writes_into_a_view(graph: torch.fx.Graph) -> bool:
    """Whether an op of ``graph`` updates in place a tensor that is a view of another."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args, strict=False):
            written = argument.alias_info is not None and argument.alias_info.is_write
            if written and _is_view(value):
                return True
    return False


def functional_views(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` functionalized if it writes into a view, else ``program`` itself."""
    if not writes_into_a_view(program.graph):
        return program
    with warnings.catch_warnings(), dispatch_modes_suspended():
        # torch 2.13's own pytree deprecation, raised inside run_decompositions
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return program.run_decompositions({})


def stride_free_views(graph: torch.fx.Graph) -> bool:
    """Make each ``aten.view`` that relied on export's strides an ``aten.reshape``, in place
    (see the module doc); whether any changed.

    A view relies on strides when its input, or a tensor it is a view of (back to the op that
    made the memory), was not contiguous at export: that op's kernel chose the layout, and
    the executor's may choose another. Only values matter after :func:`functional_views`: a
    program that writes into a view is functionalized, and the others never write through
    one, so no view's aliasing is lost.
    """
    changed = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.view.default:
            continue
        if _strided(node.args[0]):
            node.target = torch.ops.aten.reshape.default
            changed = True
    return changed


def _strided(node: Any) -> bool:
    """Whether ``node`` or a tensor it is a view of was not contiguous at export."""
    while isinstance(node, torch.fx.Node):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and not value.is_contiguous():
            return True
        if not _is_view(node):
            return False
        node = node.args[0]
    return False


def fills_as_copies(graph: torch.fx.Graph) -> bool:
    """Make each ``x.fill_(v)`` with a tensor ``v`` (0-d: ``x.fill_(h.mean())``) the
    ``x.copy_(v)`` it equals, in place; whether any changed.

    The two write the same values (``v`` broadcast, cast to ``x``'s dtype) and give ``v`` the
    same gradient (the sum of ``x``'s), but torch 2.13's DTensor has no sharding strategy for
    ``fill_.Tensor`` (a plan running one crashed) and runs ``copy_`` as a pointwise op.
    """
    changed = False
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.fill_.Tensor:
            node.target = torch.ops.aten.copy_.default
            changed = True
    return changed
