"""The plan for people: :meth:`Plan.summary` and :meth:`Plan.explain`, and human units.

Nothing here changes a plan or reads a file; every function takes a finished
:class:`~plait.planning.records.Plan` and returns text. Repeated layers that were planned
alike are shown once (one table row stands for all of them without hiding a difference).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

from plait.cost.memory import Schedule, in_flight_micro_batches
from plait.errors import PlaitError, PlanError
from plait.planning.checks import PHASES, Strategy, close_matches, few

if TYPE_CHECKING:  # reads a plan's contents (the Plan below calls this module)
    from plait.planning.entries import PlanContents, PlannedOp, PlannedParameter

__all__ = ["explain", "fmt_bytes", "fmt_flops", "fmt_seconds", "module_paths", "summary"]


def summary(plan: PlanContents) -> str:
    """A readable report: settings, prediction, ops (repeated layers grouped), collectives."""
    return "\n".join(_summary_lines(plan)) + "\n"


def explain(plan: PlanContents, name: str) -> str:
    """Why an op, a parameter (FQN) or a module path is laid out as it is, and what it costs.

    ``explain(plan, "mesh")`` shows the options the outer planner weighed and why the winner won.
    """
    ops = {op.name: op for op in plan.ops}
    params = {p.name: p for p in plan.parameters}
    lines: list[str] | None = None
    if name in ops:
        lines = _explain_op(plan, ops[name])
    elif name in params:
        lines = _explain_param(plan, params[name], ops)
    elif name and name in module_paths(plan):
        lines = _explain_module(plan, name)
    elif name in ("mesh", "options") and (plan.options or plan.notes):
        lines = _explain_options(plan)
    if lines is not None:
        return "\n".join([*lines, *_uncalibrated_lines(plan)]) + "\n"
    known = [*ops, *params, *module_paths(plan), "mesh"]
    raise PlanError(
        f"explain({name!r}): no op, parameter or module of that name in the plan"
        f"{close_matches(name, known)}; give an op name, a parameter FQN or a module path"
    )


# --------------------------------------------------------------------------- human units


def fmt_seconds(s: float) -> str:
    """``0.01234`` -> ``'12.34 ms'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.2f} {unit}"
    return "0 s" if s == 0 else f"{s / 1e-9:.2f} ns"


def fmt_bytes(n: float) -> str:
    """``3 * 2**30`` -> ``'3.00 GiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_flops(n: float) -> str:
    """``1.5e12`` -> ``'1.50 TFLOP'``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} FLOP"


def _short_target(target: str) -> str:
    """``aten.linear.default`` -> ``linear``: the overload and namespace say little to people."""
    name = target.removeprefix("aten.")
    return name.removesuffix(".default")


def _strategy_text(strategy: Strategy) -> str:
    """Python's tuple form, as MindSpore writes strategies: ``((2, 1), (2,))``."""
    return repr(tuple(strategy))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


# --------------------------------------------------------------------------- summary


_LAYER_INDEX = re.compile(r"^(.*?)\.?(\d+)$")


def _layer_prefix(layer: str) -> str:
    """``blocks.3`` -> ``blocks``; a name without a trailing index is its own prefix."""
    match = _LAYER_INDEX.match(layer)
    return match.group(1) if match and match.group(1) else layer


def _layer_groups(plan: PlanContents) -> dict[str, list[str]]:
    """Representative layer -> its identical members (itself first), in graph order.

    Layers are identical when their ops, read in order with module paths relative to the
    layer, have the same targets, labels, strategies, coverage and output layouts: then one
    table row stands for all of them without hiding a difference.
    """
    ops_of: dict[str, list[PlannedOp]] = {}
    for op in plan.ops:
        if op.layer is not None:
            ops_of.setdefault(op.layer, []).append(op)
    groups: dict[tuple[object, ...], list[str]] = {}
    for layer, ops in ops_of.items():
        sig = tuple(
            (
                op.target,
                op.label,
                op.strategy,
                op.covered,
                op.module_path.removeprefix(layer),
                tuple(t.describe() for t in op.outputs),
            )
            for op in ops
        )
        groups.setdefault((_layer_prefix(layer), sig), []).append(layer)
    return {members[0]: members for members in groups.values()}


def _op_rows(plan: PlanContents) -> list[list[str]]:
    groups = _layer_groups(plan)
    rep_of = {m: rep for rep, members in groups.items() for m in members}
    rows: list[list[str]] = []
    headed: set[str] = set()
    for op in plan.ops:
        if op.layer is not None and rep_of[op.layer] != op.layer:
            continue
        if op.layer is not None and op.layer not in headed:
            headed.add(op.layer)
            members = groups[op.layer]
            span = f"{members[0]} .. {members[-1]}" if len(members) > 1 else members[0]
            rows.append([f"[{op.layer}] x{len(members)}", "", span, "", "", ""])
        outs = "; ".join(t.describe() for t in op.outputs)
        label = op.label if op.covered else f"{op.label} (no rule)"
        row = [
            op.name,
            _short_target(op.target),
            op.module_path,
            label,
            _strategy_text(op.strategy),
            outs,
        ]
        rows.append(row)
    return rows


def _header_lines(plan: PlanContents) -> list[str]:
    mesh = " x ".join(f"{a}={s}" for a, s in plan.mesh.as_dict().items())
    zero = "off" if plan.optimizer_shard is None else f"level {plan.optimizer_shard}"
    if plan.optimizer_shard is not None and plan.optimizer_weight_shard_size is not None:
        zero += f" in groups of {plan.optimizer_weight_shard_size}"
    lines = [
        f"plan for {plan.model or 'model'} on mesh {mesh} ({plan.mesh.size} devices)",
        f"  mode {plan.mode}, search {plan.search or '-'}, hardware {plan.hardware}, "
        f"precision {plan.precision}",
        f"  micro-batches {plan.micro_batches}, pipeline stages {plan.pipeline_stages}, "
        f"optimizer shard {zero}, recompute {plan.recompute}"
        + (f", offload {plan.offload} (host)" if plan.offload else ""),
    ]
    if plan.recompute_regions:
        shown = ", ".join(f"{p or '(model)'} {m}" for p, m in plan.recompute_regions[:6])
        more = len(plan.recompute_regions) - 6
        lines.append(
            f"  recomputed in backward: {shown}" + (f" and {more} more" if more > 0 else "")
        )
    if plan.batch:
        per = (
            f" per micro-step, {plan.grad_accumulation} micro-steps (gradient accumulation)"
            if plan.grad_accumulation > 1
            else ""
        )
        if plan.interleave_num > 1:
            per = (
                f" per copy, {plan.interleave_num} copies interleaved (multi-copy: each copy's "
                "collectives run while another copy computes)"
                + (f", {plan.grad_accumulation} micro-steps" if plan.grad_accumulation > 1 else "")
            )
        lines.append("  batch " + ", ".join(str(s) for s in plan.batch) + per)
    return lines


def _prediction_lines(plan: PlanContents) -> list[str]:
    p = plan.predicted
    mem = f"  memory per device: {fmt_bytes(p.memory_bytes)} peak"
    if plan.memory_limit is not None:
        share = 100 * p.memory_bytes / plan.memory_limit
        verdict = "fits" if p.memory_bytes <= plan.memory_limit else "DOES NOT FIT"
        mem += f" of {fmt_bytes(plan.memory_limit)} limit ({share:.0f}%, {verdict})"
    kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in p.memory_by_kind.items())
    return [
        f"predicted on hardware {plan.hardware_label}"
        if plan.hardware_uncalibrated
        else "predicted",
        f"  step time {fmt_seconds(p.step_time_s)}: compute {fmt_seconds(p.compute_s)}, "
        f"communication {fmt_seconds(p.communication_s)}"
        + (f" ({fmt_seconds(p.overlapped_s)} of it beside compute)" if p.overlapped_s else "")
        + f", bubble {fmt_seconds(p.bubble_s)}"
        + (f", optimizer {fmt_seconds(p.optimizer_s)}" if p.optimizer_s else ""),
        *_pipeline_lines(plan),
        mem + (f": {kinds}" if kinds else ""),
        f"  FLOPs per step {fmt_flops(p.flops_per_step)}",
    ]


def _uncalibrated_lines(plan: PlanContents) -> list[str]:
    """explain's last line on a plan made on the uncalibrated ``local`` defaults."""
    if not plan.hardware_uncalibrated:
        return []
    return [f"times above are predicted on hardware {plan.hardware_label}"]


def _pipeline_lines(plan: PlanContents) -> list[str]:
    """The schedule, its chunks a rank, its bubble and the activations it keeps in flight."""
    if plan.pipeline_stages < 2:
        return []
    p, v = plan.pipeline_stages, plan.virtual_stages
    share = (
        100 * plan.predicted.bubble_s / plan.predicted.step_time_s
        if plan.predicted.step_time_s
        else 0
    )
    held = in_flight_micro_batches(0, p, plan.micro_batches, cast(Schedule, plan.schedule), v)
    shown = str(held) if held.denominator == 1 else f"{float(held):.3g}"
    return [
        f"  pipeline schedule {plan.schedule}, {v} chunk{'s' if v > 1 else ''} a rank "
        f"({p * v} model chunks on {p} stages), {plan.micro_batches} micro-batches: bubble "
        f"{fmt_seconds(plan.predicted.bubble_s)} ({share:.0f}% of the step); stage 0 holds "
        f"activations of {shown} micro-batches"
    ]


def _uncovered_lines(plan: PlanContents) -> list[str]:
    by_target: dict[str, list[str]] = {}
    for op in plan.ops:
        if not op.covered:
            by_target.setdefault(op.target, []).append(op.name)
    if not by_target:
        return []
    n = sum(map(len, by_target.values()))
    lines = [f"replicated: no rule ({n} op{'s' if n > 1 else ''})"]
    for target, names in by_target.items():
        lines.append(f"  {target} x{len(names)}: {few(names, 3)}")
    return lines


def _collective_lines(plan: PlanContents) -> list[str]:
    if not plan.collectives:
        return ["collectives: none"]
    totals: dict[tuple[str, str, tuple[str, ...]], list[float]] = {}
    for c in plan.collectives:
        t = totals.setdefault((c.phase, c.kind, c.axes), [0, 0, 0.0])
        t[0] += c.count
        t[1] += c.total_bytes
        t[2] += c.total_seconds
    order = sorted(totals, key=lambda k: (PHASES.index(k[0]), k[1], k[2]))
    rows = []
    for phase, kind, axes in order:
        count, nbytes, seconds = totals[(phase, kind, axes)]
        row = [kind, ",".join(axes) or "-", phase, str(int(count)), fmt_bytes(nbytes)]
        rows.append([*row, fmt_seconds(seconds)])
    return [
        "collectives per step",
        *_table(["kind", "axes", "phase", "count", "bytes", "time"], rows),
    ]


def _extra_lines(plan: PlanContents) -> list[str]:
    lines = []
    if plan.stages:
        lines.append("pipeline stages")
        lines += [f"  {s}: {few(list(stage), 4)}" for s, stage in enumerate(plan.stages)]
    if plan.options:
        copies = any(o.interleave_num > 1 for o in plan.options)  # interleave_num="auto"
        rows = [
            [
                " x ".join(f"{a}={n}" for a, n in o.mesh.items()),
                str(o.micro_batches),
                *([str(o.interleave_num)] if copies else []),
                str(o.optimizer_shard or "-"),
                o.recompute,
                fmt_seconds(o.step_time_s),
                fmt_bytes(o.memory_bytes),
                "yes" if o.feasible else "no",
                o.note,
            ]
            for o in plan.options
        ]
        headers = ["mesh", "micro", *(["copies"] if copies else []), "zero", "recompute"]
        headers += ["step", "memory", "fits", "note"]
        lines += ["options weighed", *_table(headers, rows)]
    if plan.notes:
        lines += ["notes", *(f"  {n}" for n in plan.notes)]
    return lines


def _summary_lines(plan: PlanContents) -> list[str]:
    rows = _op_rows(plan)
    shown = sum(1 for r in rows if not r[0].startswith("["))
    title = f"ops ({len(plan.ops)}"
    title += f", {shown} shown: repeated layers as one)" if shown < len(plan.ops) else ")"
    headers = ["op", "target", "module", "label", "strategy", "output layout"]
    return [
        *_header_lines(plan),
        *_prediction_lines(plan),
        title,
        *_table(headers, rows),
        *_uncovered_lines(plan),
        *_collective_lines(plan),
        *_server_lines(plan),
        *_extra_lines(plan),
    ]


def _server_lines(plan: PlanContents) -> list[str]:
    """Mode parameter_server: each table's servers and what a worker's step moves."""
    if not plan.server_tables:
        return []
    rows = [
        [
            t.name,
            f"{t.rows:,} x {t.dim}",
            f"{t.split}: "
            + ", ".join(f"{n:,}" for n in t.rows_per_server[:4])
            + (" ..." if len(t.rows_per_server) > 4 else ""),
            fmt_bytes(t.server_bytes),
            f"{t.ids_per_step:,}",
            f"{t.pulled_rows:,}" + ("" if t.measured else " (at most)"),
            fmt_bytes(t.pull_bytes),
            fmt_bytes(t.push_bytes),
            fmt_seconds(t.seconds),
        ]
        for t in plan.server_tables
    ]
    headers = ["table", "rows x dim", "rows per server", "server bytes", "ids", "pulled rows",
               "pulled", "pushed", "time"]  # fmt: skip
    return [
        f"parameter servers: {plan.servers} (a worker's step: ids looked up, rows pulled, "
        "bytes pulled and pushed, seconds added)",
        *_table(headers, rows),
    ]


# --------------------------------------------------------------------------- explain


def _collectives_at(plan: PlanContents, names: Iterable[str]) -> list[str]:
    wanted = set(names)
    lines = []
    for c in plan.collectives:
        if c.op in wanted:
            axes = ",".join(c.axes) or "-"
            times = f" x{c.count}" if c.count > 1 else ""
            lines.append(
                f"  {c.phase} {c.kind} over {axes}{times}: {fmt_bytes(c.nbytes)}, "
                f"{fmt_seconds(c.seconds)} each ({c.op}: {c.reason})"
            )
    return lines or ["  none"]


def _explain_options(plan: PlanContents) -> list[str]:
    lines = [f"mesh {plan.mesh.as_dict()!r}: why"]
    lines += [f"  {note}" for note in plan.notes]
    if plan.options:
        lines.append("best options weighed (step time, memory per device, fits)")
        for o in plan.options[:5]:
            zero = "off" if o.optimizer_shard is None else o.optimizer_shard
            copies = f", {o.interleave_num} copies" if o.interleave_num > 1 else ""
            lines.append(
                f"  {o.mesh!r} micro-batches {o.micro_batches}{copies}, optimizer shard {zero}, "
                f"recompute {o.recompute}: {fmt_seconds(o.step_time_s)}, "
                f"{fmt_bytes(o.memory_bytes)}, "
                f"{'fits' if o.feasible else 'does not fit'}{' (' + o.note + ')' if o.note else ''}"
            )
    return lines


def _explain_op(plan: PlanContents, op: PlannedOp) -> list[str]:
    lines = [
        f"op {op.name}: {op.target} in module {op.module_path or '(root)'}"
        + (f", layer {op.layer}" if op.layer else ""),
        f"  strategy {_strategy_text(op.strategy)} ({op.label})"
        + ("" if op.covered else ": no rule in the catalogue, replicated"),
        f"  reason: {op.reason}",
    ]
    lines += [f"  input {i}: {t.describe()}" for i, t in enumerate(op.inputs)]
    lines += [f"  output {i}: {t.describe()}" for i, t in enumerate(op.outputs)]
    params = [p.name for p in plan.parameters if p.op == op.name]
    if params:
        lines.append(f"  parameters read first here: {', '.join(params)}")
    lines.append("alternatives")
    lines += [
        f"  {a.label} {_strategy_text(a.strategy)}: {fmt_seconds(a.cost_s)}"
        + (f" ({a.note})" if a.note else "")
        for a in op.alternatives
    ] or ["  none recorded"]
    return [*lines, "collectives", *_collectives_at(plan, [op.name])]


def _explain_param(plan: PlanContents, p: PlannedParameter, ops: dict[str, PlannedOp]) -> list[str]:
    try:
        local = f", {p.layout.local_shape(p.shape)!r} per device"
    except PlaitError:
        local = ", does not divide evenly (see validate)"
    reduce = ", ".join(p.grad_reduce_axes) or "none (each device owns its piece)"
    lines = [
        f"parameter {p.name}: {p.shape!r} {p.dtype}",
        f"  layout {p.layout.describe()} (tensor_map {p.layout.tensor_map()!r}){local}",
        f"  gradient summed over: {reduce}",
        f"  read first by op {p.op or '(none)'}",
        f"  reason: {p.reason}",
    ]
    if p.op in ops:
        op = ops[p.op]
        lines.append(f"  that op runs {_strategy_text(op.strategy)} ({op.label}): {op.reason}")
        lines += ["alternatives of that op"]
        lines += [
            f"  {a.label} {_strategy_text(a.strategy)}: {fmt_seconds(a.cost_s)}"
            for a in op.alternatives
        ] or ["  none recorded"]
    return [*lines, "collectives", *_collectives_at(plan, [p.name])]


def _explain_module(plan: PlanContents, module: str) -> list[str]:
    ops = _module_ops(plan, module)
    params = [p for p in plan.parameters if _in_module(p.name.rpartition(".")[0], module)]
    lines = [f"module {module}: {len(ops)} ops, {len(params)} parameters"]
    rows = [
        [
            op.name,
            _short_target(op.target),
            op.label if op.covered else "replicate (no rule)",
            _strategy_text(op.strategy),
            "; ".join(t.describe() for t in op.outputs),
            op.reason,
        ]
        for op in ops
    ]
    lines += _table(["op", "target", "label", "strategy", "output layout", "reason"], rows)
    if params:
        lines.append("parameters")
        prow = [
            [p.name, str(p.shape), p.layout.describe(), ",".join(p.grad_reduce_axes) or "-"]
            for p in params
        ]
        lines += _table(["name", "shape", "layout", "grad reduced over"], prow)
    names = [op.name for op in ops] + [p.name for p in params]
    return [*lines, "collectives", *_collectives_at(plan, names)]


# --------------------------------------------------------------------------- module paths


def module_paths(plan: PlanContents) -> list[str]:
    """Every module path of the plan's ops and parameters, with all their prefixes, in order."""
    seen: dict[str, None] = {}
    paths = [op.module_path for op in plan.ops] + [
        p.name.rpartition(".")[0] for p in plan.parameters
    ]
    for path in paths:
        parts = path.split(".") if path else []
        for i in range(1, len(parts) + 1):
            seen.setdefault(".".join(parts[:i]), None)
    return list(seen)


def _in_module(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _module_ops(plan: PlanContents, module: str) -> list[PlannedOp]:
    return [op for op in plan.ops if _in_module(op.module_path, module)]
