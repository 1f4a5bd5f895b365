"""The Plan and its records: what planning decided, as one value that running reads.

A :class:`Plan` holds the mesh, the strategy and layouts chosen for every op of the captured
graph, the layout of every parameter, the collectives those layouts cause, the pipeline stages
and the predicted step time and memory (docs/planner.md). It is pure data: building,
saving and reading one needs no process group, no devices and no model weights.

Plan files are MindSpore's strategy checkpoint files (reference section 25.2) made readable:
versioned JSON (``schema_version``), one entry per op and per parameter, layouts written as
``{"dims": [["dp"], []], "partial": [], "reduce_op": "sum", "tensor_map": [1, -1]}`` (the
mesh is the plan's; ``tensor_map`` is MindSpore's numbering, written for readers who know it
and checked on load). The same plan always gives the same bytes: keys in a fixed order, floats
as Python's ``repr``, no timestamps. The file form of every record comes from its fields
(:mod:`plait.planning.codec`); the readable reports from :mod:`plait.planning.report`.

Conventions: a :class:`PlannedCollective`'s ``nbytes`` and ``seconds`` are those of *one*
occurrence (``nbytes`` per device, the local piece before the collective, as in
:mod:`plait.cost`), and ``count`` is how many times it runs per training step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import cast

from plait.errors import PlaitError, PlanError
from plait.planning import codec, plots, report
from plait.planning.checks import check_shape, check_str, close_matches, few
from plait.planning.entries import (
    FILE_FORMAT,
    Alternative,
    PlanContents,
    PlannedCollective,
    PlannedOp,
    PlannedParameter,
    PlannedServerTable,
    PlanOption,
    Prediction,
)
from plait.planning.timeline import Timeline, plan_timeline

__all__ = [
    "Alternative",
    "Plan",
    "PlanOption",
    "PlannedCollective",
    "PlannedOp",
    "PlannedParameter",
    "PlannedServerTable",
    "Prediction",
]


class Plan(PlanContents):
    """The contract between planning and running: see the module docstring.

    ``mode``, ``precision``, ``optimizer_shard`` and ``recompute`` take
    :class:`~plait.config.ParallelConfig`'s values (``recompute`` also accepts MindSpore's
    bool: True -> "full", False/None -> "none"); ``hardware`` names the cost profile;
    ``stages[s]`` lists the op names or module paths of pipeline stage ``s``; ``options`` are
    the configurations the outer planner weighed; ``memory_limit`` (bytes, optional) is the
    per-device cap the summary compares the prediction with. Construction checks structure
    (unique names, layouts on the plan's mesh, strategies matching layouts, references to
    known ops); :meth:`validate` checks the plan against a model and a world.

    Example:
        >>> plan.save("gpt.plan.json")                       # doctest: +SKIP
        >>> Plan.load("gpt.plan.json") == plan               # doctest: +SKIP
        True
        >>> print(plan.summary()); print(plan.explain("blocks.0.attn.q.weight"))  # doctest: +SKIP
    """

    # ----------------------------------------------------------------------- files

    def to_json(self) -> str:
        """The plan file's text: same plan, same bytes."""
        head = {"schema_version": self.schema_version, "format": FILE_FORMAT}
        return codec.dump({**head, **codec.encode(self)}) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan file's text; PlanError naming the field for anything malformed."""
        try:
            data = json.loads(text, object_pairs_hook=codec.no_duplicate_keys)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"plan file is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                "re-create it with plait.plan(...).save(path)"
            ) from None
        codec.check_header(data, cls.schema_version, FILE_FORMAT)
        reader = codec.Reader(cls.schema_version)
        plan: Plan = codec.decode(cls, data, reader, header=("schema_version", "format"))
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan file (UTF-8 JSON) to ``path``."""
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan file written by :meth:`save`."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise PlanError(f"cannot read plan file {os.fspath(path)!r}: {e.strerror}") from None
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"{os.fspath(path)}: {e}") from None

    # ----------------------------------------------------------------------- for people

    def summary(self) -> str:
        """A readable report: settings, prediction, ops (repeated layers grouped), collectives."""
        return report.summary(self)

    def timeline(self) -> Timeline:
        """The predicted pipeline schedule: passes per stage over time; without stages, with
        ``interleave_num`` above 1, the copies' turns on the device (PlanError otherwise).

        ``plan.timeline().to_png("step.png")`` draws it; ``.to_chrome_trace("step.json")``
        writes it for Perfetto (:mod:`plait.planning.timeline`).
        """
        return plan_timeline(self)

    def plot(self, directory: str | os.PathLike[str], *, limit: int | None = None) -> list[Path]:
        """Write the plan's pictures into ``directory`` and return their paths (needs
        matplotlib: ``pip install 'plait[plot]'``): ``memory.png`` (the predicted memory per
        device by kind), ``options.png`` (mode auto: the options weighed, step time against
        memory, the chosen one starred, the memory limit drawn) and ``timeline.png`` (with
        pipeline stages: the predicted schedule; with copies: their turns). ``limit`` is the memory limit (bytes) the
        options were weighed against: default ``memory_limit``, else a built-in hardware
        profile's device memory (:mod:`plait.planning.plots`)."""
        if limit is None and self.memory_limit is None:
            limit = _profile_memory(self.hardware)
        return plots.plan_pictures(self, directory, limit=limit)

    def explain(self, name: str) -> str:
        """Why an op, a parameter (FQN) or a module path is laid out as it is, and what it costs.

        ``explain("mesh")`` shows the options the outer planner weighed and why the winner won.
        """
        return report.explain(self, name)

    # ----------------------------------------------------------------------- checks

    def validate(self, model_or_params: object, world_size: int | None = None) -> None:
        """Check the plan against a model (or ``{name: shape}``) and, if given, a world size.

        Raises PlanError listing the first problems: a world size other than the mesh's,
        parameters without a planned layout or planned but absent, shapes that differ, layouts
        that do not divide their shape, stages naming unknown ops.
        """
        shapes = _model_shapes(model_or_params)
        problems: list[str] = []
        if world_size is not None and world_size != self.mesh.size:
            problems.append(
                f"the mesh {self.mesh.as_dict()!r} has {self.mesh.size} devices but the world "
                f"has {world_size}: plan again for {world_size} devices or launch {self.mesh.size}"
            )
        problems += self._parameter_problems(shapes)
        problems += self._stage_problems()
        if problems:
            shown = "\n  - ".join(problems[:8])
            more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
            raise PlanError(
                f"plan for {self.model or 'the model'} does not fit ({len(problems)} problem"
                f"{'s' if len(problems) > 1 else ''}):\n  - {shown}{more}"
            )

    def _parameter_problems(self, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
        missing = [n for n in shapes if n not in self._params]
        extra = [n for n in self._params if n not in shapes]
        problems: list[str] = []
        if missing:
            problems.append(
                f"model parameters without a planned layout: {few(missing)}; plan again for "
                "this model (did the model change since the plan was made?)"
            )
        if extra:
            problems.append(
                f"planned parameters the model does not have: {few(extra)}; plan again for "
                "this model, or check that parameter names match (wrappers add prefixes)"
            )
        for p in self.parameters:
            if p.name in shapes and tuple(shapes[p.name]) != p.shape:
                problems.append(
                    f"parameter {p.name!r} has shape {tuple(shapes[p.name])!r} in the model but "
                    f"{p.shape!r} in the plan; plan again for this model"
                )
                continue
            try:
                p.layout.check_shape(p.shape, f"parameter {p.name!r}")
            except PlaitError as e:
                problems.append(str(e))
        return problems

    def _stage_problems(self) -> list[str]:
        modules = set(report.module_paths(self))
        problems = []
        for s, stage in enumerate(self.stages):
            for ref in stage:
                if ref not in self._ops and ref not in modules:
                    problems.append(
                        f"stage {s} names {ref!r}, which is neither an op nor a module path of "
                        f"the plan{close_matches(ref, [*self._ops, *modules])}; fix the stage list"
                    )
        return problems


def _model_shapes(model_or_params: object) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` from an nn.Module (meta tensors work) or a mapping of name to shape."""
    named = getattr(model_or_params, "named_parameters", None)
    if callable(named):
        return {name: tuple(int(s) for s in p.shape) for name, p in named()}
    if isinstance(model_or_params, Mapping):
        out = {}
        for name, value in model_or_params.items():
            # tensors stand for their shapes; check_shape checks what it is given
            shape = cast("Iterable[object]", getattr(value, "shape", value))
            out[check_str("validate: parameter name", name, empty=False)] = check_shape(
                f"{name!r}", shape
            )
        return out
    raise PlanError(
        f"validate({type(model_or_params).__name__}): give an nn.Module or a mapping of "
        "parameter name to shape"
    )


def _profile_memory(hardware: str) -> int | None:
    """A built-in profile's device memory (the outer planner's default limit); None for
    ``local``, whose limit depends on the calibration file the plan was made with."""
    from plait.cost.hardware import builtin_profiles

    profile = builtin_profiles().get(hardware)
    return None if profile is None else profile.memory_bytes
