"""A server table's lookup as one op of the program: ``plait::ps_lookup`` and its gradient.

Every engine runs a server table the same way (issue 30's one engine): the table module calls
``torch.ops.plait.ps_lookup(ids, anchor, table, dim)``, an op torch sees as a leaf
(``torch.library.custom_op``) - eagerly on the plain data-parallel path, and as a node of the
plan's compiled per-rank program (traced on fake tensors by its fake kernel, run for real each
step). Its real kernel checks the ids, pulls their rows (:meth:`PsClient.pull`: deduplicated,
from the cache or the servers) and gathers them; its backward, ``plait::ps_grad``, hands the
rows' gradient to the client, which sums a step's gradients and pushes them after the last
backward (:meth:`PsClient.flush`).

``anchor`` is the table module's zero-sized scalar parameter: it makes the lookup's output
require a gradient, so autograd (and the program's traced backward) runs ``ps_grad``, whose
result is the anchor's (zero) gradient. ``table`` names the module in this process's
registry (:func:`register`); ``dim`` is the row width the fake kernel needs.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

__all__ = ["Lookup", "register"]


class Lookup(Protocol):
    """What the op asks of a server table module (``plait.ps.worker``'s)."""

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (any shape), shaped ``(*ids.shape, dim)``, on the module's device."""
        ...

    def accumulate(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` (``(*ids.shape, dim)``) to the step's gradients of rows ``ids``."""
        ...


_TABLES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""Table modules by handle (``id`` of the module): the op's int argument names one. Weak, so a
job's tables die with it."""


def register(module: Lookup) -> int:
    """The handle ``module``'s lookups pass the op."""
    handle = id(module)
    _TABLES[handle] = module
    return handle


def _table(handle: int) -> Lookup:
    module = _TABLES.get(handle)
    if module is None:
        raise RuntimeError(
            f"plait::ps_lookup: no server table with handle {handle} in this process (its "
            "job is gone); build the job again with plait.parallelize"
        )
    return module  # type: ignore[no-any-return]


@torch.library.custom_op("plait::ps_lookup", mutates_args=())
def ps_lookup(ids: torch.Tensor, anchor: torch.Tensor, table: int, dim: int) -> torch.Tensor:
    """Rows ``ids`` of server table ``table``: ``(*ids.shape, dim)``."""
    return _table(table).lookup(ids)


@ps_lookup.register_fake
def _lookup_fake(ids: torch.Tensor, anchor: torch.Tensor, table: int, dim: int) -> torch.Tensor:
    return anchor.new_empty((*ids.shape, dim))


@torch.library.custom_op("plait::ps_grad", mutates_args=())
def ps_grad(ids: torch.Tensor, grad: torch.Tensor, anchor: torch.Tensor, table: int) -> torch.Tensor:
    """Hand the gradient of a lookup's rows to table ``table``; the anchor's (zero) gradient."""
    _table(table).accumulate(ids, grad)
    return torch.zeros_like(anchor)


@ps_grad.register_fake
def _grad_fake(
    ids: torch.Tensor, grad: torch.Tensor, anchor: torch.Tensor, table: int
) -> torch.Tensor:
    return torch.empty_like(anchor)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ids, anchor, table, _ = inputs
    ctx.save_for_backward(ids, anchor)
    ctx.table = table


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
    ids, anchor = ctx.saved_tensors
    return None, torch.ops.plait.ps_grad(ids, grad, anchor, ctx.table), None, None


ps_lookup.register_autograd(_backward, setup_context=_setup)
