"""Value checks and vocabulary shared by the plan records: the bottom of ``plait.planning``.

Every check raises :class:`~plait.errors.PlanError` naming the field, the value, the rule and
a fix; values that have one canonical form (tuples, floats) are returned in it so the records
can store them and the file always writes them the same way.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from typing import Any, get_args

from plait.config import Recompute
from plait.errors import PlanError
from plait.layout import TensorLayout
from plait.mesh import MeshSpec

__all__ = [
    "COLLECTIVE_KINDS",
    "MEMORY_KINDS",
    "PHASES",
    "Strategy",
]

Strategy = tuple[tuple[int, ...], ...]
"""MindSpore's strategy tuple: pieces per dim of each input, e.g. ``((2, 1), (1, 2))``."""

COLLECTIVE_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "broadcast",
)
PHASES = ("forward", "backward", "optimizer")
# Memory kinds in the order people read them; other kinds follow, sorted by name.
MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations")


def fail(where: str, value: object, rule: str, fix: str) -> PlanError:
    return PlanError(f"{where}={value!r}: {rule}; {fix}")


def check_str(where: str, value: object, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        rule = "must be a string" if empty else "must be a non-empty string"
        raise fail(where, value, rule, "give a name")
    return value


def check_int(where: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise fail(where, value, f"must be an integer >= {minimum}", "give a whole number")
    return value


def check_bool(where: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise fail(where, value, "must be True or False", "give a bool")
    return value


def check_seconds(where: str, value: object) -> float:
    """Non-negative finite number, stored as float so the file always writes it the same way."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise fail(where, value, "must be a finite number >= 0", "give seconds as a float")
    return float(value)


def check_choice(where: str, value: object, allowed: Iterable[object]) -> Any:
    allowed = tuple(allowed)
    if value not in allowed or isinstance(value, bool):
        raise fail(where, value, "is not allowed", f"use one of {', '.join(map(repr, allowed))}")
    return value


def check_names(where: str, value: Iterable[object]) -> tuple[str, ...]:
    return tuple(check_str(f"{where}[{i}]", v, empty=False) for i, v in enumerate(value))


def check_shape(where: str, value: Iterable[object]) -> tuple[int, ...]:
    return tuple(check_int(f"{where}[{i}]", v) for i, v in enumerate(value))


def check_strategy(where: str, value: Iterable[Iterable[object]]) -> Strategy:
    return tuple(
        tuple(check_int(f"{where}[{i}][{j}]", c, 1) for j, c in enumerate(cuts))
        for i, cuts in enumerate(value)
    )


def check_recompute(where: str, value: object) -> str:
    """ParallelConfig's recompute values; MindSpore's bool form is accepted and normalised."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    return check_choice(f"{where}.recompute", value, get_args(Recompute))


def check_layout(where: str, layout: object) -> TensorLayout:
    if not isinstance(layout, TensorLayout):
        raise fail(where, layout, "must be a TensorLayout", "build it with plait.Layout(...)")
    return layout


def check_on_mesh(where: str, layout: object, mesh: MeshSpec) -> None:
    checked = check_layout(where, layout)
    if checked.mesh != mesh:
        raise PlanError(
            f"{where} is laid out on mesh {checked.mesh.as_dict()!r} but the plan's mesh is "
            f"{mesh.as_dict()!r}; build every layout on the plan's mesh"
        )


def check_unique(where: str, names: Iterable[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise PlanError(f"{where} names {name!r} twice; every name in a plan is unique")
        seen.add(name)


def close_matches(name: str, known: Iterable[str]) -> str:
    """`` (close matches: 'a', 'b')`` for an error message, or ``""``."""
    matches = difflib.get_close_matches(name, list(known), n=5, cutoff=0.6)
    return f" (close matches: {', '.join(map(repr, matches))})" if matches else ""


def few(names: Sequence[str], n: int = 6) -> str:
    """The first ``n`` names quoted, and how many more there are."""
    text = ", ".join(map(repr, names[:n]))
    return text + (f" and {len(names) - n} more" if len(names) > n else "")
