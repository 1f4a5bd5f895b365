"""Strategy search: one module per searcher, all on one :class:`SearchProblem`.

Every searcher has the signature of :func:`sharding_propagation`::

    search(problem, allowed, configured) -> dict[op name, Decision]

``allowed`` restricts an op to the candidates that fit the user's annotations or the mode;
``configured`` lists the ops whose strategy the user fixed. Every searcher is deterministic,
honours both, and minimises :meth:`SearchProblem.evaluate` (the same objective for all).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence

from plait.errors import NotBuiltError
from plait.search.problem import CostModel, Edge, SearchProblem
from plait.search.propagation import Decision, sharding_propagation

__all__ = ["CostModel", "Decision", "Edge", "SearchProblem", "get_searcher", "sharding_propagation"]

Searcher = Callable[
    [SearchProblem, Mapping[str, Sequence[int]], Mapping[str, str]], dict[str, Decision]
]

# search name -> (module, function); modules are imported on use
SEARCHERS: Mapping[str, tuple[str, str]] = {
    "sharding_propagation": ("plait.search.propagation", "sharding_propagation"),
    "recursive_programming": ("plait.search.recursive", "recursive_programming"),
    "dynamic_programming": ("plait.search.dynamic", "dynamic_programming"),
    "ilp": ("plait.search.ilp", "ilp"),
}


def get_searcher(name: str) -> Searcher:
    """The searcher called ``name`` (a ``ParallelConfig.search`` value)."""
    module_name, function = SEARCHERS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise NotBuiltError(
            f"ParallelConfig.search={name!r} is not built yet (issue 6); use "
            "search='sharding_propagation'"
        ) from None
    return getattr(module, function)
