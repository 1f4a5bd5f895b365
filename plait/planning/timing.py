"""Where planning time goes: capture, candidates, search, predictions, assembly.

Pass a :class:`PlanTiming` to ``plait.plan(..., timing=t)`` or ``plan_graph(..., timing=t)``
and read it afterwards; the same line is logged on the ``plait.planning`` logger (INFO).
Timings never enter the Plan or its file (a plan file is byte-identical for identical inputs).

Example:
    >>> t = PlanTiming()
    >>> plan = plait.plan(model, cfg, example_batch=batch, loss_fn=loss, timing=t)  # doctest: +SKIP
    >>> print(t.line())  # doctest: +SKIP
    planned in 4.12 s: capture 1.31 s, candidates 0.52 s, search 1.20 s, ...
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

__all__ = ["PlanTiming"]

PHASES = ("capture", "candidates", "search", "estimate", "assemble")


@dataclass
class PlanTiming:
    """Seconds per planning phase, and what the outer planner did with its mesh options.

    Phases: ``capture`` (torch.export to an OpGraph), ``candidates`` (per mesh: strategies of
    every op, costs, constraints), ``search`` (the searcher, once per mesh searched),
    ``estimate`` (predicted time and memory of every (mesh, ZeRO, recompute, micro-batches)
    option from its mesh's shared work), ``assemble`` (the full Plan of the chosen option).

    Counts: ``meshes`` weighed, ``searched`` (searcher run), ``pruned`` (skipped: a lower
    bound on their step time was above the runner-up found), ``options`` (mesh and settings
    predicted), ``reused`` (options predicted from their mesh's shared assembly rather than
    assembled from scratch), ``assembled`` (full Plans built).
    """

    capture_s: float = 0.0
    candidates_s: float = 0.0
    search_s: float = 0.0
    estimate_s: float = 0.0
    assemble_s: float = 0.0
    total_s: float = 0.0
    meshes: int = 0
    searched: int = 0
    pruned: int = 0
    options: int = 0
    reused: int = 0
    assembled: int = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the block to phase ``name`` (one of PHASES)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            attr = f"{name}_s"
            setattr(self, attr, getattr(self, attr) + time.perf_counter() - start)

    def line(self) -> str:
        """One line: total, each phase, and the option counts."""
        parts = ", ".join(f"{p} {getattr(self, f'{p}_s'):.2f} s" for p in PHASES)
        text = f"planned in {self.total_s:.2f} s: {parts}"
        if self.meshes:
            text += (
                f"; meshes {self.meshes} (searched {self.searched}, pruned {self.pruned}), "
                f"options {self.options} (reused {self.reused}), assembled {self.assembled}"
            )
        return text

    def as_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
