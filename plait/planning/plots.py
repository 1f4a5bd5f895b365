"""Pictures of plans and runs, drawn with matplotlib (the optional extra ``plait[plot]``).

Four pictures (docs/planner.md, "Pictures"):

* :func:`timeline_figure`: pipeline timelines (:class:`~plait.planning.timeline.Timeline`),
  predicted and measured one above the other: a row per pipeline rank, time across, a colour
  per kind of pass, later chunks of a rank darker, communication under its rank's passes and
  the idle bubble hatched;
* :func:`memory_figure`: memory per rank by kind (parameters, gradients, optimizer states,
  activations) as stacked bars, the prediction beside the measurement where one exists, each
  column's peak a black tick;
* :func:`options_figure`: the options the outer planner weighed, predicted step time against
  memory, the chosen one marked and the memory limit drawn;
* :func:`loss_figure`: a training curve, loss per step (and evaluations).

matplotlib is imported inside the functions, never by ``import plait``; figures are made as
:class:`matplotlib.figure.Figure` objects and written by the Agg canvas, so pyplot's global
state and the user's display backend are left alone. Without matplotlib each function refuses
by name with the command that installs it (:func:`require_matplotlib`).

This room sits at the bottom of ``plait.planning``: it reads plans, options and timelines by
their attributes (the types are named for the checker only), so every room above may call it.
"""

from __future__ import annotations

import importlib
import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from plait.errors import MissingExtraError, PlanError

if TYPE_CHECKING:  # read by attribute; the checker alone needs the names
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from plait.planning.entries import PlanContents, PlanOption

__all__ = [
    "DPI",
    "PLOT_EXTRA",
    "MemoryColumn",
    "loss_figure",
    "memory_figure",
    "options_figure",
    "plan_pictures",
    "png_bytes",
    "require_matplotlib",
    "timeline_figure",
    "write_png",
]

PLOT_EXTRA = "pip install 'plait[plot]'"
"""The command that installs the plotting library."""
DPI = 100
"""Pixels per inch of every picture: a figure ``w`` inches wide is ``100 w`` pixels."""

# One colour per kind of work or memory, the same in every picture (matplotlib's tab10).
KIND_COLOURS = {
    "forward": "#1f77b4",
    "backward": "#ff7f0e",
    "weight": "#2ca02c",
    "communication": "#9467bd",
    "parameters": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer": "#2ca02c",
    "activations": "#d62728",
}
_OTHER_COLOURS = ("#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
KIND_NAMES = {
    "forward": "forward",
    "backward": "backward",
    "weight": "weight gradient",
    "communication": "communication",
}
IDLE_LABEL = "idle (bubble)"
CHOSEN_LABEL = "chosen"


def require_matplotlib(what: str) -> None:
    """Raise :class:`~plait.errors.MissingExtraError` when matplotlib cannot be imported."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise MissingExtraError(
            f"{what} draws with matplotlib, which is not installed; install the plotting "
            f"extra: {PLOT_EXTRA}"
        ) from None


def _figure(width_px: int, height_px: int, what: str) -> Figure:
    require_matplotlib(what)
    from matplotlib.figure import Figure

    return Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, layout="constrained")


def write_png(figure: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``figure`` as a PNG (through the Agg canvas, at :data:`DPI`); returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)  # attaches itself: no pyplot, no display
    out = Path(path)
    figure.savefig(out, format="png", dpi=DPI)
    return out


def png_bytes(figure: Figure) -> bytes:
    """``figure`` as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


class Timeline(Protocol):
    """What a picture reads of a :class:`plait.planning.timeline.Timeline` (named here, not
    imported: the timeline draws itself through this room)."""

    @property
    def events(self) -> Sequence[Any]: ...

    @property
    def labels(self) -> Sequence[str]: ...

    @property
    def title(self) -> str: ...

    @property
    def measured(self) -> bool: ...

    @property
    def ranks(self) -> int: ...

    @property
    def span_s(self) -> float: ...

    @property
    def bubble_s(self) -> float: ...

    @property
    def bubble_fraction(self) -> float: ...

    def compute(self, rank: int) -> Sequence[Any]: ...

    def idle(self, rank: int) -> Sequence[tuple[float, float]]: ...


# --------------------------------------------------------------------------- timelines


def _time_unit(span: float) -> tuple[str, float]:
    for unit, per in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if span >= per:
            return unit, per
    return "ns", 1e-9


def _fmt_time(s: float) -> str:
    unit, per = _time_unit(s) if s > 0 else ("s", 1.0)
    return f"{s / per:.3g} {unit}"


def timeline_title(timeline: Timeline) -> str:
    """The title of a timeline's panel: what it is and its bubble."""
    what = "measured" if timeline.measured else "predicted"
    head = timeline.title or f"{what} pipeline step"
    bubble = f"bubble {_fmt_time(timeline.bubble_s)} ({100 * timeline.bubble_fraction:.0f}%)"
    return f"{head}: {bubble}"


def _shade(colour: str, darker: float) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return r * (1 - darker), g * (1 - darker), b * (1 - darker)


def timeline_figure(*timelines: Timeline, width: int = 1200) -> Figure:
    """The timelines one above the other (e.g. predicted, then measured), each on its own time
    axis; ``width`` pixels wide. Each kind of pass is one ``barh`` call (one bar container
    labelled with the kind), the idle gaps another (hatched, :data:`IDLE_LABEL`)."""
    if not timelines:
        raise PlanError("timeline_figure: give at least one Timeline")
    if not isinstance(width, int) or isinstance(width, bool) or width < 480:
        raise PlanError(f"timeline picture width={width!r}; give at least 480 pixels")
    rows = sum(t.ranks for t in timelines)
    height = 60 + 70 * len(timelines) + 42 * rows
    fig = _figure(width, height, "the pipeline timeline")
    axes = fig.subplots(len(timelines), 1, squeeze=False)[:, 0]
    for ax, timeline in zip(axes, timelines, strict=True):
        _draw_timeline(ax, timeline)
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(
        list(handles.values()), list(handles), loc="outside lower center",
        ncol=min(len(handles), 6), frameon=False, fontsize=9,
    )  # fmt: skip
    return fig


def _draw_timeline(ax: Axes, timeline: Timeline) -> None:
    span = timeline.span_s or 1e-9
    unit, per = _time_unit(span)
    kinds = {e.kind for e in timeline.events}
    split = "weight" in kinds
    for kind in ("forward", "backward", "weight"):
        bars = [e for e in timeline.events if e.kind == kind]
        if not bars:
            continue
        chunks = {r: sorted({e.stage for e in timeline.compute(r)}) for r in range(timeline.ranks)}
        colours = [
            # later chunks of a rank (virtual stages) darker, as Megatron's figures draw them
            _shade(KIND_COLOURS[kind], 0.4 * _chunk_index(chunks[e.rank], e.stage))
            for e in bars
        ]
        name = "backward (input gradient)" if kind == "backward" and split else KIND_NAMES[kind]
        ax.barh(
            [e.rank for e in bars], [e.seconds / per for e in bars], height=0.62,
            left=[e.start_s / per for e in bars], color=colours, edgecolor="white",
            linewidth=0.6, label=name,
        )  # fmt: skip
        for e in bars:  # the micro-batch in the bar, where it fits
            if e.micro_batch >= 0 and e.seconds / span > 0.018:
                ax.text(
                    (e.start_s + e.seconds / 2) / per, e.rank, str(e.micro_batch),
                    ha="center", va="center", color="white", fontsize=7,
                )  # fmt: skip
    comm = [e for e in timeline.events if e.kind == "communication"]
    if comm:
        ax.barh(
            [e.rank + 0.42 for e in comm], [e.seconds / per for e in comm], height=0.16,
            left=[e.start_s / per for e in comm], color=KIND_COLOURS["communication"],
            label=KIND_NAMES["communication"],
        )  # fmt: skip
    idle = [(r, a, b) for r in range(timeline.ranks) for a, b in timeline.idle(r)]
    if idle:
        ax.barh(
            [r for r, _, _ in idle], [(b - a) / per for _, a, b in idle], height=0.62,
            left=[a / per for _, a, _ in idle], color="none", edgecolor="#b0b0b0",
            hatch="///", linewidth=0, label=IDLE_LABEL,
        )  # fmt: skip
    ax.set_yticks(range(timeline.ranks), list(timeline.labels))
    ax.set_ylim(timeline.ranks - 0.4, -0.6)  # rank 0 on top
    ax.set_xlim(0, span / per)
    chunked = any(len({e.stage for e in timeline.compute(r)}) > 1 for r in range(timeline.ranks))
    ax.set_xlabel(f"time ({unit})" + ("; darker: a rank's later model chunk" if chunked else ""))
    ax.set_title(timeline_title(timeline), fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _chunk_index(chunks: list[int], stage: int) -> float:
    if len(chunks) < 2 or stage not in chunks:
        return 0.0
    return chunks.index(stage) / (len(chunks) - 1)


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryColumn:
    """One bar of :func:`memory_figure`: ``rank``'s memory by kind, ``source`` "predicted"
    or "measured"; ``peak`` (bytes, optional) is drawn as a tick over the stack."""

    rank: str
    source: str
    by_kind: Mapping[str, int] = field(hash=False)
    peak: int | None = None

    def __post_init__(self) -> None:
        if self.source not in ("predicted", "measured"):
            raise PlanError(f"MemoryColumn.source={self.source!r}; use 'predicted' or 'measured'")
        for kind, value in self.by_kind.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PlanError(f"MemoryColumn.by_kind[{kind!r}]={value!r}; give bytes >= 0")


def _bytes_unit(largest: float) -> tuple[str, float]:
    for unit, per in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if largest >= per:
            return unit, per
    return "bytes", 1.0


def memory_figure(
    columns: Sequence[MemoryColumn], *, limit: int | None = None, title: str = ""
) -> Figure:
    """Stacked bars, one per column, grouped by rank (prediction and measurement side by
    side); one ``bar`` call (one container labelled with the kind) per kind of memory, the
    ``limit`` (bytes) a dashed line."""
    if not columns:
        raise PlanError("memory_figure: nothing to draw; give at least one MemoryColumn")
    ranks = list(dict.fromkeys(c.rank for c in columns))
    kinds = list(dict.fromkeys(k for c in columns for k in c.by_kind))
    largest = max(
        [sum(c.by_kind.values()) for c in columns] + [c.peak or 0 for c in columns] + [limit or 0]
    )
    unit, per = _bytes_unit(largest)
    fig = _figure(max(480, 160 + 110 * len(columns)), 420, "the memory picture")
    ax = fig.subplots()
    xs, names = _column_positions(columns, ranks)
    bottoms = [0.0] * len(columns)
    for i, kind in enumerate(kinds):
        heights = [c.by_kind.get(kind, 0) / per for c in columns]
        colour = KIND_COLOURS.get(kind, _OTHER_COLOURS[i % len(_OTHER_COLOURS)])
        ax.bar(xs, heights, width=0.38, bottom=bottoms, color=colour, label=kind)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    peaks = [(x, c.peak / per) for x, c in zip(xs, columns, strict=True) if c.peak is not None]
    if peaks:
        ax.scatter(
            [x for x, _ in peaks], [p for _, p in peaks], marker="_", s=900, color="black",
            linewidths=2, label="peak", zorder=3,
        )  # fmt: skip
    if limit is not None:
        ax.axhline(limit / per, color="#d62728", linestyle="--", linewidth=1, label="memory limit")
    ax.set_xticks(xs, names, fontsize=8)
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_title(title or "memory per rank by kind", fontsize=10, loc="left")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(
        fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, markerscale=0.3
    )
    return fig


def _column_positions(
    columns: Sequence[MemoryColumn], ranks: list[str]
) -> tuple[list[float], list[str]]:
    """x of each column: a rank's columns side by side around its index."""
    xs, names = [], []
    for c in columns:
        mine = [d for d in columns if d.rank == c.rank]
        at = mine.index(c) - (len(mine) - 1) / 2
        xs.append(ranks.index(c.rank) + 0.42 * at)
        names.append(f"{c.rank}\n{c.source}")
    return xs, names


def plan_memory_columns(plan: PlanContents) -> list[MemoryColumn]:
    """The plan's prediction as one column: every rank's peak is predicted as the busiest
    device's (``plan.predicted``)."""
    kinds = {k: int(v) for k, v in plan.predicted.memory_by_kind.items()}
    return [MemoryColumn("per device", "predicted", kinds, int(plan.predicted.memory_bytes))]


# --------------------------------------------------------------------------- options


def option_label(option: PlanOption) -> str:
    """``dp=2 x tp=2, ZeRO-1, recompute full, m=4``: what distinguishes an option."""
    parts = [" x ".join(f"{k}={v}" for k, v in option.mesh.items())]
    if option.optimizer_shard:
        parts.append(f"ZeRO-{option.optimizer_shard}")
    if option.recompute != "none":
        parts.append(f"recompute {option.recompute}")
    if option.micro_batches > 1:
        parts.append(f"m={option.micro_batches}")
    return ", ".join(parts)


def options_figure(plan: PlanContents, *, limit: int | None = None) -> Figure:
    """The options the plan keeps of those the outer planner weighed (``plan.options``, the
    chosen one first): predicted memory across, step time up. Options that fit are one
    ``scatter`` call, those over the limit another; the chosen one is marked by a star at the
    plan's own prediction (:data:`CHOSEN_LABEL`); ``limit`` (bytes; default the plan's
    ``memory_limit``) is a dashed line."""
    options = list(plan.options)
    if not options:
        raise PlanError(
            f"plan for {plan.model or 'the model'} weighed no options (mode {plan.mode!r}): "
            "only mode 'auto' weighs meshes, ZeRO levels, recompute and micro-batches; plan "
            "with --mode auto"
        )
    limit = plan.memory_limit if limit is None else limit
    chosen = (int(plan.predicted.memory_bytes), float(plan.predicted.step_time_s))
    largest = max([o.memory_bytes for o in options] + [limit or 0, chosen[0]])
    unit, per = _bytes_unit(largest)
    t_unit, t_per = _time_unit(max(o.step_time_s for o in options))
    fig = _figure(900, 520, "the planner's options")
    ax = fig.subplots()
    for fits, marker in ((True, "o"), (False, "x")):
        group = [o for o in options if o.feasible == fits]
        if group:
            ax.scatter(
                [o.memory_bytes / per for o in group], [o.step_time_s / t_per for o in group],
                color="#1f77b4" if fits else "#7f7f7f",
                label="fits" if fits else "over the memory limit", zorder=2, marker=marker,
            )  # fmt: skip
    # options drawn at about one point (within 1% of the axes: ZeRO levels that change little
    # here) share one label, written once
    slowest = max(o.step_time_s for o in options)
    at: dict[tuple[int, int], list[PlanOption]] = {}
    for o in options:
        key = (round(100 * o.memory_bytes / largest), round(100 * o.step_time_s / slowest))
        at.setdefault(key, []).append(o)
    for group in at.values():
        ax.annotate(
            "; ".join(map(option_label, group)),
            (group[0].memory_bytes / per, group[0].step_time_s / t_per), fontsize=7,
            xytext=(4, 3), textcoords="offset points", color="#444444",
        )  # fmt: skip
    ax.scatter(
        [chosen[0] / per], [chosen[1] / t_per], marker="*", s=320, color="#d62728",
        edgecolor="black", zorder=3, label=f"{CHOSEN_LABEL}: {option_label(options[0])}",
    )  # fmt: skip
    if limit is not None:
        ax.axvline(limit / per, color="#d62728", linestyle="--", linewidth=1, label="memory limit")
    ax.set_xlabel(f"predicted memory per device ({unit})")
    ax.set_ylabel(f"predicted step time ({t_unit})")
    ax.set_title(
        f"the planner's options for {plan.model or 'the model'} "
        f"({len(options)} kept, the chosen one starred)", fontsize=10, loc="left",
    )  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    return fig


# --------------------------------------------------------------------------- training


def loss_figure(
    losses: Sequence[float],
    *,
    first_step: int = 1,
    eval_losses: Sequence[tuple[int, float]] = (),
    title: str = "",
) -> Figure:
    """The training loss per step (a line from ``first_step``), the evaluations as points."""
    values = [float(v) for v in losses]
    if not values or not all(math.isfinite(v) for v in values):
        raise PlanError(
            f"loss_figure: {len(values)} losses, "
            f"{sum(not math.isfinite(v) for v in values)} of them not finite; give the finite "
            "losses of at least one step"
        )
    fig = _figure(800, 420, "the training curve")
    ax = fig.subplots()
    steps = range(first_step, first_step + len(values))
    ax.plot(steps, values, color="#1f77b4", linewidth=1, label="train loss")
    if eval_losses:
        ax.plot(
            [s for s, _ in eval_losses], [v for _, v in eval_losses], "o-", color="#d62728",
            markersize=4, linewidth=1, label="eval loss",
        )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training curve", fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    return fig


# --------------------------------------------------------------------------- a plan's pictures


def plan_pictures(
    plan: Any, directory: str | os.PathLike[str], *, limit: int | None = None
) -> list[Path]:
    """Write ``plan``'s pictures into ``directory`` (made if missing) and return their paths:
    ``memory.png`` always, ``options.png`` when the outer planner weighed options (mode
    auto; ``limit``: the memory limit it planned against), ``timeline.png`` with pipeline
    stages or copies (``plan.timeline()``)."""
    require_matplotlib("plan.plot")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        write_png(
            memory_figure(
                plan_memory_columns(plan), limit=plan.memory_limit,
                title=f"predicted memory per device by kind ({plan.model or 'the model'})",
            ),
            out / "memory.png",
        )
    ]  # fmt: skip
    if plan.options:
        written.append(write_png(options_figure(plan, limit=limit), out / "options.png"))
    if plan.pipeline_stages > 1 or plan.interleave_num > 1:
        written.append(write_png(timeline_figure(plan.timeline()), out / "timeline.png"))
    return written
