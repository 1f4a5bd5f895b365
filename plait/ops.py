"""Functional sharded ops for use inside ``forward`` (MindSpore's ``Primitive.shard``).

``plait.ops.matmul(x, w, strategy=((2, 1), (1, 2)))`` lays ``x`` and ``w`` out as the strategy
says (MindSpore's meaning: per input, the number of pieces per dim), multiplies, and reduces
the partial sums of a split contraction dim (all-reduce, or reduce-scatter when
``out_strategy`` adds the summed axes to a dim). Outside a parallel job it is ``torch.matmul``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from plait.comm.dtensor import as_dtensor, is_dtensor, mesh_spec_of, to_layout
from plait.layout import TensorLayout, resolve_strategy
from plait.rules import matmul_signature
from plait.rules.common import resolve_output

if TYPE_CHECKING:
    from plait.comm.dtensor import DTensor

__all__ = ["matmul"]


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    strategy: Sequence[Sequence[int]] | None = None,
    out_strategy: Sequence[int] | TensorLayout | None = None,
    *,
    name: str = "plait.ops.matmul",
) -> torch.Tensor:
    """``x @ w`` with a MindSpore strategy ``((x splits), (w splits))``.

    Args:
        x: ``[..., m, k]``; w: ``[k, n]`` or batched like ``x``.
        strategy: per input, pieces per dim; the shared ``k`` dims must be split alike.
        out_strategy: output splits; may add the summed axes to one dim (reduce-scatter).
        name: how errors name this call.
    """
    dt = x if is_dtensor(x) else w if is_dtensor(w) else None
    if dt is None or strategy is None:
        return torch.matmul(x, w)
    device_mesh = dt.device_mesh
    mesh = mesh_spec_of(device_mesh)
    resolved = resolve_strategy(matmul_signature(x.ndim, w.ndim), strategy, mesh, name)
    for i, t in enumerate((x, w)):
        resolved.inputs[i].check_shape(tuple(t.shape), f"{name} input {i}")
    x = as_dtensor(x, device_mesh, resolved.inputs[0])
    w = as_dtensor(w, device_mesh, resolved.inputs[1])
    y = cast("DTensor", torch.matmul(x, w))  # DTensors in, a DTensor out
    return to_layout(y, resolve_output(resolved.output, out_strategy, name))
