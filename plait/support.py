"""What runs where: every setting plait refuses, on which engine, in one table.

A job runs on one engine (:data:`Engine`): the plain data-parallel path, the plan's compiled
per-rank program, pipeline stages, the user's own layout-aware code (hybrid) or one device.
:func:`engine_of` says which a config runs on. Each :class:`Rule` of :data:`RULES` says when a
setting is refused on an engine, why (not built yet, or it would do nothing) and what to do
instead. ``parallelize``, the pipeline job and the planner all ask :func:`check` (or
:func:`refusal`), so a setting is refused by the same words wherever it is met, before any
process waits on another; ``docs/support.md`` holds this table as :func:`markdown`
prints it (a test keeps the two the same).

Pure: imports the config and nothing of torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, cast

from plait.config import SPLIT_BACKWARD, ParallelConfig
from plait.errors import ConfigError, NotBuiltError

__all__ = [
    "BUILT_MODES",
    "RULES",
    "Engine",
    "Rule",
    "Where",
    "check",
    "engine_of",
    "markdown",
    "refusal",
]

Engine = Literal["stand_alone", "plain", "program", "pipeline", "hybrid"]
"""``plain``: data parallel on plain tensors (hook-driven buckets, host modules);
``program``: a plan's compiled per-rank program (semi_auto, auto, plan files, data parallel
with memory passes); ``pipeline``: pipeline stages; ``hybrid``: the user's own code on
DTensors; ``stand_alone``: one device."""

BUILT_MODES = (
    "stand_alone", "data_parallel", "semi_auto", "auto", "hybrid", "parameter_server"
)


@dataclass(frozen=True)
class Where:
    """The engine a job runs on, as far as the rules need it."""

    engine: Engine
    inner: tuple[str, ...] = ()
    """Mesh axes larger than one inside pipeline stages (tensor parallel in a stage)."""
    planned: bool = False
    """The stages run a plan of mode auto or a plan file."""


def engine_of(cfg: ParallelConfig, mesh: Mapping[str, int], *, planned: bool = False) -> Engine:
    """The engine ``cfg`` runs on over ``mesh`` (its axes and sizes): pipeline stages where
    ``pp`` is larger than one; the plain data-parallel path for mode data_parallel whose only
    axis larger than one is ``dp_axis``, with no pass over a program (optimizer parallel,
    recompute, offload, compile) and no per-input dataset strategy; else the program (hybrid
    and stand-alone are their own)."""
    if cfg.pipeline_stages > 1 or mesh.get("pp", 1) > 1:
        return "pipeline"
    if cfg.mode == "stand_alone":
        return "stand_alone"
    if cfg.mode == "hybrid":
        return "hybrid"
    pure = (
        cfg.mode in ("data_parallel", "parameter_server")
        and not planned
        and (not mesh or cfg.dp_axis in mesh)
        and all(size == 1 for axis, size in mesh.items() if axis != cfg.dp_axis)
        and cfg.dataset_strategy in ("data_parallel", "full_batch")
    )
    return "plain" if pure and not _needs_program(cfg) else "program"


def _needs_program(cfg: ParallelConfig) -> bool:
    """Settings that are passes over the compiled per-rank program."""
    return (
        cfg.compile
        or cfg.optimizer_shard is not None
        or cfg.recompute != "none"
        or bool(cfg.recompute_modules)
        or cfg.offload is not None
    )


Kind = Literal["not built", "would do nothing"]


@dataclass(frozen=True)
class Rule:
    """One refusal: ``refused(cfg, where)`` (``where`` None before the engine is known: such a
    rule holds on every engine), what was given, what is refused, and what to do instead."""

    key: str
    scope: str
    """Where the rule holds, in words (the docs' column)."""
    refused: Callable[[ParallelConfig, Where | None], bool]
    given: Callable[[ParallelConfig], str]
    what: str
    fix: str
    kind: Kind = "not built"
    context: Callable[[ParallelConfig], str] | None = None
    """Words after ``ParallelConfig(...)`` naming the rest of the setting (the mode)."""
    planning: bool = False
    """``plait.plan`` refuses it too (it plans what ``parallelize`` would run); the other
    rules concern a run (the planner weighs what-ifs: micro-batches before it picks stages)."""
    on_engine: bool = False
    """The rule holds on some engines only (it reads ``where``); the others hold on every
    engine and are checked once, before the engine is chosen."""
    call: str = ""
    """The job method the rule concerns (``generate``), checked when it is called, never at
    ``parallelize``; empty: a rule of the job itself."""

    def message(self, cfg: ParallelConfig, where: Where | None) -> str:
        on = "" if self.context is None else self.context(cfg)
        if where is not None and where.engine == "pipeline":
            on += f" with pipeline_stages={cfg.pipeline_stages}"
        if self.kind == "would do nothing":
            return (
                f"ParallelConfig({self.given(cfg)}){on}: {self.what} would do nothing; {self.fix}"
            )
        return (
            f"ParallelConfig({self.given(cfg)}){on}: {self.what} is not built in this version "
            f"of plait yet; {self.fix} (docs/support.md: what runs where)"
        )

    def error(self, cfg: ParallelConfig, where: Where | None) -> Exception:
        text = self.message(cfg, where)
        return ConfigError(text) if self.kind == "would do nothing" else NotBuiltError(text)


def _planned(cfg: ParallelConfig) -> bool:
    return cfg.mode == "auto" or cfg.plan is not None


def _on(where: Where | None, *engines: Engine) -> bool:
    return where is not None and where.engine in engines


def _selective(cfg: ParallelConfig) -> bool:
    # validated at construction into sorted (module path, mode) pairs
    pairs = cast("tuple[tuple[str, str], ...]", tuple(cfg.recompute_modules))
    return cfg.recompute == "selective" or any(mode == "selective" for _, mode in pairs)


def _compiled_stages(cfg: ParallelConfig, where: Where | None) -> bool:
    """Pipeline stages that run as compiled per-rank programs
    (:attr:`ParallelConfig.compiled_stages`), with or without axes inside them."""
    return where is not None and cfg.compiled_stages


def _ps_dense(cfg: ParallelConfig) -> str | None:
    """What a parameter-server job asks of its dense part beyond data parallel with optimizer
    parallel (ZeRO 1 to 3; the setting as written), or None."""
    if cfg.mode != "parameter_server":
        return None
    others = {a: n for a, n in cfg.mesh_dict.items() if a != cfg.dp_axis and n > 1}
    checks: tuple[tuple[bool, str], ...] = (
        (bool(others), f"mesh={cfg.mesh_dict!r}"),
        (cfg.pipeline_stages > 1, f"pipeline_stages={cfg.pipeline_stages}"),
        (cfg.recompute != "none", f"recompute={cfg.recompute!r}"),
        (bool(cfg.recompute_modules), f"recompute_modules={cfg.recompute_modules!r}"),
        (cfg.offload is not None, f"offload={cfg.offload!r}"),
        (cfg.compile, "compile=True"),
        (bool(cfg.host_modules), f"host_modules={cfg.host_modules!r}"),
        (cfg.precision == "fp16", "precision='fp16'"),
        (isinstance(cfg.dataset_strategy, tuple), "dataset_strategy=(...)"),
        (cfg.plan is not None, f"plan={cfg.plan!r}"),
    )
    return next((given for refused, given in checks if refused), None)


def _only_data_parallel(cfg: ParallelConfig) -> bool:
    """The config fixes a mesh whose only axis larger than one is the data-parallel one (mode
    data_parallel, or an explicit mesh); mode auto without a mesh is known after planning."""
    if cfg.mode in ("data_parallel", "parameter_server", "stand_alone") and cfg.mesh is None:
        return True
    return cfg.mesh is not None and all(
        size == 1 for axis, size in cfg.mesh_dict.items() if axis != cfg.dp_axis
    )


RULES: tuple[Rule, ...] = (
    Rule(
        "parameter_server",
        "mode parameter_server",
        lambda c, w: _ps_dense(c) is not None,
        lambda c: _ps_dense(c) or "",
        "a parameter-server job's dense part on anything but data parallel (with ZeRO 1-3)",
        "leave it out: the dense layers train data parallel over the workers (optimizer_shard "
        "1 to 3 for ZeRO) beside the servers' tables (docs/parameter_server.md)",
        context=lambda c: " with mode='parameter_server'",
        planning=True,
    ),
    Rule(
        "search",
        "outside mode auto",
        lambda c, w: c.search is not None and not _planned(c),
        lambda c: f"search={c.search!r}",
        "search outside mode 'auto'",
        "leave search out, or use mode='auto'",
    ),
    Rule(
        "micro_batches",
        "without pipeline stages",
        lambda c, w: c.pipeline_stages == 1 and c.micro_batches != 1,
        lambda c: f"micro_batches={c.micro_batches} without pipeline stages",
        "micro-batches outside a pipeline",
        "grad_accumulation=k cuts a step into k micro-batches with one gradient reduction; "
        "or give the mesh a 'pp' axis",
    ),
    Rule(
        "hybrid_optimizer_shard",
        "hybrid",
        lambda c, w: c.optimizer_shard is not None and c.mode == "hybrid",
        lambda c: f"optimizer_shard={c.optimizer_shard}, mode='hybrid'",
        "optimizer parallel for hand-written layouts",
        "modes data_parallel, semi_auto and auto run it",
    ),
    Rule(
        "stand_alone_passes",
        "stand-alone",
        lambda c, w: (
            c.mode == "stand_alone"
            and (c.optimizer_shard is not None or c.recompute != "none" or bool(c.offload))
        ),
        lambda c: "mode='stand_alone' with optimizer_shard, recompute or offload",
        "memory passes on the plain stand-alone path",
        "use mode 'data_parallel' on one process, which runs them",
    ),
    Rule(
        "hybrid_recompute",
        "hybrid",
        lambda c, w: c.recompute != "none" and c.mode == "hybrid",
        lambda c: f"recompute={c.recompute!r}, mode='hybrid'",
        "recompute for hand-written layouts",
        "modes data_parallel, semi_auto and auto run it",
    ),
    Rule(
        "offload_parameters",
        "every engine",
        lambda c, w: c.offload == "parameters",
        lambda c: f"offload={c.offload!r}",
        "offloading parameters",
        "offload='optimizer' and 'activations' are built",
    ),
    Rule(
        "hybrid_offload",
        "hybrid",
        lambda c, w: c.offload is not None and c.mode == "hybrid",
        lambda c: f"offload={c.offload!r}, mode='hybrid'",
        "offload for hand-written layouts",
        "modes data_parallel, semi_auto and auto run it",
    ),
    Rule(
        "hardware",
        "outside mode auto",
        lambda c, w: c.hardware is not None and not _planned(c),
        lambda c: f"hardware={c.hardware!r}",
        "a hardware profile outside mode 'auto'",
        "leave hardware out, or use mode='auto' (plait.plan takes it for any mode)",
    ),
    Rule(
        "memory_limit",
        "outside mode auto and recompute='auto'",
        lambda c, w: c.memory_limit is not None and not _planned(c) and c.recompute != "auto",
        lambda c: f"memory_limit={c.memory_limit}",
        "a memory limit outside mode 'auto' and recompute='auto'",
        "leave memory_limit out, or use mode='auto' or recompute='auto'",
    ),
    Rule(
        "schedule_one_stage",
        "one pipeline stage",
        lambda c, w: (
            c.pipeline_stages == 1
            and c.plan is None
            and not (c.mode == "auto" and c.mesh is None)
            and c.schedule != "1f1b"
        ),
        lambda c: f"schedule={c.schedule!r}",
        "a schedule on a job with one pipeline stage (it orders the micro-batches of "
        "several stages)",
        "add a 'pp' axis to the mesh (e.g. mesh={'pp': 2, 'dp': 2}), or leave schedule out",
        kind="would do nothing",
        planning=True,
    ),
    Rule(
        "host_modules",
        "every engine but plain data parallel",
        lambda c, w: bool(c.host_modules) and w is not None and not _on(w, "plain"),
        lambda c: f"host_modules={c.host_modules!r}",
        "modules on the host beside pipeline stages, tensor parallel, optimizer_shard, "
        "recompute, offload or compile",
        "modules on the host run in mode 'data_parallel' on a dp-only mesh without those "
        "settings (the plain data-parallel path); drop those settings or host_modules",
        context=lambda c: f" with mode={c.mode!r}",
        planning=True,
        on_engine=True,
    ),
    Rule(
        "tp_in_stages_mode",
        "pipeline stages",
        lambda c, w: (
            _on(w, "pipeline")
            and bool(w and w.inner)
            and c.mode != "semi_auto"
            and not (w and w.planned)
        ),
        lambda c: f"mesh {c.mesh_dict}, mode={c.mode!r}",
        "axes inside pipeline stages outside mode 'semi_auto'",
        "tensor parallel in a stage follows plait.shard annotations: use mode='semi_auto' "
        "(or mode='auto', which plans the stages); mode data_parallel runs a mesh of 'pp' "
        "and 'dp'",
        on_engine=True,
    ),
    Rule(
        "zero_bubble_eager_tp",
        "pipeline stages with tp that run op by op",
        lambda c, w: (
            _on(w, "pipeline")
            and bool(w and w.inner)
            and c.schedule in SPLIT_BACKWARD
            and not _compiled_stages(c, w)
        ),
        lambda c: f"schedule={c.schedule!r}, mesh {c.mesh_dict}, stage_programs={c.stage_programs}",
        "a zero-bubble schedule with tensor parallel in stages that run on DTensors (its "
        "separate input- and weight-gradient passes detach DTensor views in place, which "
        "torch refuses)",
        "zero bubble with tp runs on compiled stages: use stage_programs=True (not beside "
        "optimizer_shard in bf16/fp16), or gpipe, 1f1b or interleaved_1f1b",
        on_engine=True,
    ),
    Rule(
        "zero_bubble_zero",
        "pipeline stages",
        lambda c, w: (
            _on(w, "pipeline") and c.optimizer_shard is not None and c.schedule in SPLIT_BACKWARD
        ),
        lambda c: f"optimizer_shard={c.optimizer_shard}, schedule={c.schedule!r}",
        "optimizer parallel with a zero-bubble schedule (FSDP2 reduce-scatters a stage's "
        "gradients before the separate weight-gradient passes have run)",
        "use gpipe, 1f1b or interleaved_1f1b",
        on_engine=True,
    ),
    Rule(
        "stages_mode",
        "pipeline stages",
        lambda c, w: (
            _on(w, "pipeline")
            and c.mode not in ("data_parallel", "semi_auto")
            and not (w and w.planned)
        ),
        lambda c: f"mode={c.mode!r}",
        "pipeline stages in this mode (stages run modes data_parallel and semi_auto, or a "
        "searched plan: mode auto and plan files)",
        "use mode='data_parallel' with a mesh of 'pp' and 'dp', 'semi_auto' with a 'tp' axis "
        "too, or mode='auto'",
        on_engine=True,
    ),
    Rule(
        "offload_selective_eager",
        "pipeline stages that run op by op",
        lambda c, w: (
            _on(w, "pipeline")
            and c.offload == "activations"
            and _selective(c)
            and not _compiled_stages(c, w)
        ),
        lambda c: (
            f"offload='activations', recompute={c.recompute!r}, recompute_modules="
            f"{dict(c.recompute_modules)!r}"
        ),
        "activation offload beside selective recompute on stages that run op by op (torch's "
        "selective checkpoint keeps the products it saves in a cache of its own, which "
        "saved-tensor hooks never see)",
        "use recompute='full' or 'none' (per module too) with offload='activations'; "
        "compiled stages, with tensor parallel inside, run both",
        on_engine=True,
    ),
    Rule(
        "interleave_data_parallel",
        "a mesh of data parallel alone",
        lambda c, w: c.interleave_num != 1 and _only_data_parallel(c),
        lambda c: f"interleave_num={c.interleave_num}",
        "multi-copy parallel on data parallel alone (it runs one copy's tensor-parallel "
        "collectives while another copy computes; the gradient reductions of data parallel "
        "run during backward already)",
        "leave interleave_num out, or give the mesh a 'tp' axis (mode semi_auto or auto)",
        kind="would do nothing",
        context=lambda c: f" with mode={c.mode!r}, mesh={c.mesh_dict or None!r}",
        planning=True,
    ),
    Rule(
        "interleave_hybrid",
        "hybrid",
        lambda c, w: c.interleave_num != 1 and c.mode == "hybrid",
        lambda c: f"interleave_num={c.interleave_num}, mode='hybrid'",
        "multi-copy parallel for hand-written layouts (it is a pass over a plan's program)",
        "modes semi_auto and auto run it",
    ),
    Rule(
        "interleave_stages",
        "pipeline stages",
        lambda c, w: _on(w, "pipeline") and c.interleave_num != 1,
        lambda c: f"interleave_num={c.interleave_num}",
        "multi-copy parallel in pipeline stages",
        "the pipeline's micro-batches already overlap one stage's transfers with another's "
        "compute: leave interleave_num out, or run without a 'pp' axis",
        on_engine=True,
        planning=True,
    ),
    Rule(
        "stages_grad_accumulation",
        "pipeline stages",
        lambda c, w: _on(w, "pipeline") and c.grad_accumulation != 1,
        lambda c: f"grad_accumulation={c.grad_accumulation}",
        "gradient accumulation in a pipeline",
        "the pipeline's micro_batches accumulate already: raise micro_batches instead",
        on_engine=True,
    ),
    Rule(
        "generate_pipeline",
        "pipeline stages",
        lambda c, w: _on(w, "pipeline"),
        lambda c: f"mesh={dict(c.mesh or {})!r}",
        "job.generate and job.model.generate on pipeline stages (each rank holds some layers; "
        "a key/value cache across stages needs the schedule to pass it)",
        "save the trained model with job.save_pretrained(dir), then generate on a job without "
        "a 'pp' axis (or on one device, from_pretrained(dir)) loaded with job.load_pretrained",
        on_engine=True,
        call="generate",
    ),
    Rule(
        "stages_per_input_strategy",
        "pipeline stages",
        lambda c, w: _on(w, "pipeline") and isinstance(c.dataset_strategy, tuple),
        lambda c: f"dataset_strategy={c.dataset_strategy!r}",
        "per-input dataset strategies in pipeline stages (a stage takes each replica's rows whole)",
        "use dataset_strategy='data_parallel' (each rank passes its replica's rows) or "
        "'full_batch' (every rank passes the global batch)",
        on_engine=True,
    ),
)


def refusal(
    cfg: ParallelConfig,
    where: Where | None = None,
    *,
    planning: bool = False,
    engine_only: bool = False,
    call: str = "",
) -> Rule | None:
    """The first rule that refuses ``cfg`` on ``where`` (None: the engine is not known yet,
    only the rules of every engine), or None when it runs. ``planning``: the rules
    ``plait.plan`` applies only; ``engine_only``: the rules of some engines only (those of
    every engine were checked already, on the config as the user gave it); ``call``: the
    rules of that job method only (``generate``, ``save_pretrained``), else the job's own."""
    rules = (
        r
        for r in RULES
        if (r.planning or not planning) and (r.on_engine or not engine_only) and r.call == call
    )
    return next((r for r in rules if r.refused(cfg, where)), None)


def check(
    cfg: ParallelConfig,
    where: Where | None = None,
    *,
    planning: bool = False,
    engine_only: bool = False,
    call: str = "",
) -> None:
    """Raise the first refusal of ``cfg`` on ``where``: NotBuiltError for what is not built,
    ConfigError for a setting that would do nothing."""
    rule = refusal(cfg, where, planning=planning, engine_only=engine_only, call=call)
    if rule is not None:
        raise rule.error(cfg, where)


def markdown() -> str:
    """The table of :data:`RULES` (``docs/support.md``'s)."""
    lines = [
        "| refused | where | why | instead |",
        "|---|---|---|---|",
    ]
    for rule in RULES:
        cells = (rule.what, rule.scope, rule.kind, rule.fix)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
