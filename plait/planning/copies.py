"""Mode auto weighing multi-copy parallel: ``ParallelConfig(interleave_num="auto")``.

A plan for ``k`` copies is made on one copy's batch (1/k of a micro-batch: its shapes, its
ops' costs and collectives differ from the whole micro-batch's), so each copy count is its own
capture and its own search: :func:`weigh_copies` plans once per count in :data:`COPY_COUNTS`,
each over the meshes where copies run (:func:`runs_copies`), and keeps the fastest plan that
fits the memory limit (the smallest when none fits), its options beside the others', with a
note saying what each count predicted. The caller says how to capture and plan one count (the
planner on the example batch, ``parallelize`` on each rank's device), so both take the same
choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from plait import support
from plait.config import ParallelConfig
from plait.errors import PlaitError
from plait.planning.records import Plan
from plait.planning.report import fmt_bytes, fmt_seconds

__all__ = ["COPY_COUNTS", "runs_copies", "weigh_copies"]

COPY_COUNTS = (1, 2)
"""The copy counts ``interleave_num="auto"`` weighs (MindSpore's ``MicroBatchInterleaved``
uses 2; more copies cut each copy's matrix products thinner and add each copy's latency)."""

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Planned(Generic[T]):
    copies: int
    plan: Plan
    made: T


def runs_copies(cfg: ParallelConfig, mesh: Mapping[str, int]) -> bool:
    """Whether ``cfg``'s copies (``interleave_num`` above 1) run on ``mesh``: no multi-copy
    rule of the support table refuses them there (:data:`plait.support.RULES`: on data
    parallel alone they would do nothing, in pipeline stages they are not built)."""
    on = dataclasses.replace(cfg, mesh=dict(mesh), devices=None, pipeline_stages=mesh.get("pp", 1))
    where = support.Where(support.engine_of(on, mesh, planned=True), planned=True)
    rules = (r for r in support.RULES if r.key.startswith("interleave_"))
    return not any(r.refused(on, where) for r in rules)


def weigh_copies(
    config: ParallelConfig, plan_one: Callable[[ParallelConfig], tuple[Plan, T]]
) -> tuple[Plan, T]:
    """The faster of ``plan_one(config with interleave_num=k)`` for each k in
    :data:`COPY_COUNTS` (module doc). ``plan_one`` captures one copy's batch and plans it;
    a count whose batch does not divide, or with no mesh that runs copies, is left out and
    named in the note (one copy is always planned: its errors are the caller's)."""
    tried: list[_Planned[T]] = []
    left_out: list[str] = []
    for k in COPY_COUNTS:
        cfg = dataclasses.replace(config, interleave_num=k)
        try:
            plan, made = plan_one(cfg)
        except PlaitError as e:
            if k == 1:
                raise
            left_out.append(f"{k} copies not weighed ({_first_line(e)})")
            continue
        if k > 1 and not runs_copies(cfg, plan.mesh.as_dict()):
            left_out.append(f"{k} copies not weighed (no mesh that runs copies was planned)")
            continue
        tried.append(_Planned(k, plan, made))
    best = min(tried, key=lambda t: _rank(t.plan))
    options = sorted(
        (o for t in tried for o in t.plan.options),
        key=lambda o: (not o.feasible, o.step_time_s, o.memory_bytes),
    )
    note = _note(best, tried, left_out)
    plan = dataclasses.replace(
        best.plan,
        options=tuple(options),
        notes=(*best.plan.notes, note),
    )
    return plan, best.made


def _rank(plan: Plan) -> tuple[bool, float, int]:
    """Fitting the memory limit first (the outer planner's verdict on its winner), then the
    predicted step time, then memory."""
    fits = plan.options[0].feasible if plan.options else True
    return (not fits, plan.predicted.step_time_s, plan.predicted.memory_bytes)


def _note(best: _Planned[T], tried: list[_Planned[T]], left_out: list[str]) -> str:
    said = ", ".join(
        f"{t.copies} {'copy' if t.copies == 1 else 'copies'}: "
        f"{fmt_seconds(t.plan.predicted.step_time_s)} per step, "
        f"{fmt_bytes(t.plan.predicted.memory_bytes)} per device"
        for t in tried
    )
    chose = (
        f"interleave_num='auto' chose {best.copies} "
        f"{'copy (multi-copy off)' if best.copies == 1 else 'copies'}"
    )
    return "; ".join([f"{chose}; weighed {said}", *left_out])


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
