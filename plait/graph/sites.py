"""Where in the user's model capture failed, and what to do about value-dependent shapes.

A capture error is only useful when it names the module and the line of the user's code that
caused it. Two places know that: the traceback of an error torch.export raised while running
the forward (the frames whose ``self`` is one of the model's modules), and the ``nn_module_stack``
and ``stack_trace`` export records on each node of the graph it produced.

Value-dependent shapes (boolean-mask indexing, ``nonzero``, ``unique``, mixture-of-experts
routing that gathers each expert's tokens, a Python ``if`` on a tensor's value) cannot be
planned: a plan fixes every op's shape and layout before training. :func:`value_dependent_error`
says so, with the site and the ways out.
"""

from __future__ import annotations

import linecache
import os
import re
from collections.abc import Iterator
from types import FrameType, TracebackType

import torch
import torch.fx
from torch import nn

from plait.errors import CaptureError

__all__ = [
    "VALUE_DEPENDENT_FIX",
    "is_value_dependent",
    "site_of_exception",
    "site_of_node",
    "value_dependent_error",
]

VALUE_DEPENDENT_FIX = (
    "plans fix every size and branch before training: keep shapes static with masking "
    "(torch.where(mask, x, 0), multiplying by the mask) instead of boolean-mask indexing, "
    "nonzero or unique, and make Python branches depend on shapes or config (torch.where or "
    "torch.cond for a choice by value); mixture-of-experts routing that gathers each expert's "
    "tokens cannot be planned (compute every expert densely, weighted by the router); or train "
    "this model with mode='data_parallel', which runs the model as written and captures nothing"
)
_TORCH_DIR = os.path.dirname(torch.__file__)
_WRAPPED = "model."  # the user's model inside capture's wrapper (plait.graph.convert.WRAPPED)


def is_value_dependent(error: BaseException) -> bool:
    """Whether ``error`` (or an error it came from) is a guard on a tensor's value."""
    return any(
        "GuardOnDataDependent" in type(e).__name__ or "data-dependent" in str(e)
        for e in _chain(error)
    )


def value_dependent_error(model: str, site: str, error: BaseException) -> CaptureError:
    """The CaptureError for a value-dependent size or branch at ``site``."""
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return CaptureError(
        f"capture of {model}: a tensor's size depends on tensor values (or a Python branch "
        f"does) in {site} ({type(error).__name__}: {first}); {VALUE_DEPENDENT_FIX}"
    )


# --------------------------------------------------------------------------- from a traceback


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend([e.__cause__, e.__context__])


def _frames(tb: TracebackType | None) -> Iterator[FrameType]:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _owner(frame: FrameType) -> object:
    """The frame's first argument (``self`` of a method, whatever its name), else None."""
    code = frame.f_code
    return frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None


def _code_at(frame: FrameType) -> str:
    path, line = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(path, line).strip()
    where = f"{os.path.basename(path)}:{line}"
    return f"{where}: `{code}`" if code else where


def site_of_exception(error: BaseException, model: nn.Module) -> str | None:
    """``module 'a.b' (Class) at file.py:N: `code``` for the innermost of the model's modules
    running when ``error`` was raised (its own code preferred to torch's), else None."""
    names = {id(m): name for name, m in model.named_modules()}
    found: tuple[str, FrameType] | None = None
    for e in _chain(error):
        for frame in _frames(e.__traceback__):
            owner = _owner(frame)
            if id(owner) not in names:
                continue
            own_code = not frame.f_code.co_filename.startswith(_TORCH_DIR)
            if found is None or own_code:
                found = (names[id(owner)], frame)
    if found is None:
        return None
    name, frame = found
    kind = type(_owner(frame)).__name__
    return f"module {name or '<top level>'!r} ({kind}) at {_code_at(frame)}"


# --------------------------------------------------------------------------- from a node


def site_of_node(node: torch.fx.Node) -> str:
    """``module 'a.b' (Class) at file.py:N: `code``` from what export recorded on ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, kind = next(reversed(stack.values()))
        name = path.removeprefix(_WRAPPED) if path != _WRAPPED.rstrip(".") else ""
        cls = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
        site = f"module {name or '<top level>'!r} ({cls})"
    else:
        site = "the loss function"
    calls = re.findall(
        r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', node.meta.get("stack_trace") or ""
    )
    if calls:
        path, line, code = calls[-1]
        site += f" at {os.path.basename(path)}:{line}: `{code.strip()}`"
    return site
