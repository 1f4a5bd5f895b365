"""`plait checkpoint`: look into a checkpoint, or merge its model into one safetensors file.

    plait checkpoint inspect runs/gpt                      the latest step-* checkpoint in brief
    plait checkpoint inspect runs/gpt/step-00000040 --verify --all
    plait checkpoint merge runs/gpt hf/model.safetensors --dtype bf16

Both run on one process with no process group (:mod:`plait.checkpoint.offline`). Exit codes:
0 fine, 1 a damaged checkpoint (a file that no longer matches the manifest, a part that cannot
be read), 2 bad input (no such path, not a checkpoint, a bad flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from plait.cli.base import EXIT_USAGE, Command
from plait.errors import PlaitError

__all__ = ["add_checkpoint_arguments", "checkpoint_command", "format_report"]

EXIT_DAMAGED = 1
_TOP = 10  # largest tensors shown without --all


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    inspect = actions.add_parser(
        "inspect",
        help="what a checkpoint holds: step, world, plan, tensors, files (--verify: checksums)",
        description="Report a checkpoint: manifest, plan, tensors by kind and the largest, "
        "files with their checksums (XXH3-64; CRC-32 in older checkpoints). PATH is a "
        "checkpoint or a directory of step-* checkpoints (the "
        "latest is read).",
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="recompute every file's checksum; exit 1 when one does not match the manifest",
    )
    inspect.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON (listing the same tensors as the text)",
    )
    inspect.add_argument("--all", action="store_true", help="list every tensor")
    inspect.add_argument(
        "--top",
        type=int,
        default=_TOP,
        metavar="N",
        help=f"list the N largest tensors (default {_TOP})",
    )
    inspect.add_argument("--plan", action="store_true", help="print the plan's full summary")
    merge = actions.add_parser(
        "merge",
        help="the model as one safetensors file (model.state_dict() names, no optimizer states)",
        description="Write the checkpoint's model parameters and buffers as one safetensors "
        "file, loadable by model.load_state_dict(safetensors.torch.load_file(OUT)) and, as "
        "DIR/model.safetensors beside a config.json, by transformers' from_pretrained(DIR). "
        "Checksums are verified first.",
    )
    merge.add_argument("path", metavar="PATH")
    merge.add_argument("out", metavar="OUT.safetensors")
    merge.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        help="cast floating-point tensors (default: keep the saved dtypes)",
    )
    merge.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checksums (one read of every file fewer; a damaged file goes unnoticed)",
    )


# ---------------------------------------------------------------------------------- the report


def _bytes(n: int) -> str:
    from plait.planning import fmt_bytes

    return fmt_bytes(n)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: set[int]) -> list[str]:
    """Aligned columns, two-space indent; columns in ``right`` are right-aligned (numbers)."""
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        return ("  " + "  ".join(parts)).rstrip()

    rule = ["-" * w for w in widths]
    return [line(cells[0]), line(rule), *(line(r) for r in cells[1:])]


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _mesh(mesh: Any) -> str:
    if not mesh:
        return "none"
    if isinstance(mesh, dict):
        return ",".join(f"{k}={v}" for k, v in mesh.items())
    return str(mesh)


def _group(group: dict[str, Any]) -> str:
    """An optimizer param group's headline hyperparameters."""
    keys = ("lr", "weight_decay", "betas", "momentum", "eps")
    return ", ".join(f"{k} {group[k]}" for k in keys if k in group)


def _header(report: dict[str, Any]) -> list[str]:
    shard = report["optimizer_shard"]
    lines = [
        f"checkpoint {report['path']}",
        f"  step {report['step']}, world size {report['world_size']}, mesh "
        f"{_mesh(report['mesh'])}, mode {report['mode']}, optimizer shard "
        f"{'off' if shard is None else shard}",
        f"  model {report['model']}, optimizer {report['optimizer']}",
        f"  written by torch {report['torch']} at {report['created']}",
    ]
    extras = report["extras"]
    if extras is not None:
        for i, group in enumerate(extras["optimizer_groups"]):
            lines.append(f"  optimizer group {i}: {_group(group)}")
        saved = [k for k in ("loader", "loss_scaler") if extras[k]] + extras["objects"]
        lines.append(f"  also saved: {', '.join(saved) if saved else 'RNG streams only'}")
    return lines


def _plan_lines(plan: dict[str, Any] | None, full: bool) -> list[str]:
    if plan is None:
        return ["plan: none (the job ran no plan: stand_alone or one device)"]
    if "error" in plan:
        return [f"plan: {plan['file']} cannot be read: {plan['error']}"]
    lines = [
        f"plan: {plan['model'] or 'model'} on mesh {_mesh(plan['mesh'])}, mode {plan['mode']} "
        f"({plan['search']}), precision {plan['precision']}, hardware {plan['hardware']}",
        f"  micro-batches {plan['micro_batches']}, pipeline stages {plan['pipeline_stages']}, "
        f"optimizer shard {plan['optimizer_shard'] or 'off'}, recompute {plan['recompute']}, "
        f"grad accumulation {plan['grad_accumulation']}",
        f"  predicted step {plan['predicted_step_time']}, memory per device "
        f"{plan['predicted_memory_per_device']} (--plan for the full summary)",
    ]
    if full:
        lines += ["", plan["summary"].rstrip()]
    return lines


def _tensor_lines(report: dict[str, Any], shown: list[dict[str, Any]]) -> list[str]:
    tensors, totals = report["tensors"], report["totals"]
    rows = [
        [kind, t["tensors"], f"{t['elements']:,}", _bytes(t["bytes"])] for kind, t in totals.items()
    ]
    rows.append(
        [
            "total",
            sum(t["tensors"] for t in totals.values()),
            f"{sum(t['elements'] for t in totals.values()):,}",
            _bytes(sum(t["bytes"] for t in totals.values())),
        ]
    )
    lines = [
        f"tensors ({len(tensors)})",
        *_table(("kind", "tensors", "elements", "bytes"), rows, {1, 2, 3}),
    ]
    if not shown:
        return lines
    title = (
        "every tensor"
        if len(shown) == len(tensors)
        else f"largest {len(shown)} (--all for every tensor)"
    )
    rows = [
        [t["name"], _shape(t["shape"]), t["dtype"], t["pieces"], _bytes(t["bytes"])] for t in shown
    ]
    return [*lines, title, *_table(("name", "shape", "dtype", "pieces", "bytes"), rows, {3, 4})]


def _file_lines(report: dict[str, Any]) -> list[str]:
    listed = report["files"]
    rows = [
        [f["name"], f"{f['bytes']:,}", _bytes(f["bytes"]), _checksum(f["algorithm"], f["checksum"])]
        for f in listed
    ]
    total = sum(f["bytes"] for f in listed)
    lines = [
        f"files ({len(listed)}, {_bytes(total)})",
        *_table(("name", "bytes", "", "checksum"), rows, {1, 2}),
    ]
    if report["unlisted"]:
        lines.append(f"  not in the manifest (ignored by a load): {', '.join(report['unlisted'])}")
    return lines


def _checksum(algorithm: str | None, digest: str | None) -> str:
    """``xxh3_64 1f0c...``: a file's checksum with its algorithm (``-`` when it has none)."""
    return "-" if algorithm is None else f"{algorithm} {digest}"


def _status_lines(report: dict[str, Any]) -> list[str]:
    found = report["problems"]
    if found:
        return [f"DAMAGED: {len(found)} problem(s)", *(f"  {p}" for p in found)]
    if report["verified"]:
        return [f"checksums OK: {len(report['files'])} files match the manifest"]
    return ["checksums not checked (--verify reads every file)"]


def _shown(report: dict[str, Any], everything: bool, top: int) -> list[dict[str, Any]]:
    """The tensors listed one by one: every one, or the ``top`` largest (largest first)."""
    tensors = report["tensors"]
    if everything:
        return tensors
    return sorted(tensors, key=lambda t: (-t["bytes"], t["name"]))[: max(top, 0)]


def format_report(
    report: dict[str, Any], *, everything: bool = False, top: int = _TOP, full_plan: bool = False
) -> str:
    """The text of ``plait checkpoint inspect`` for a report of :func:`plait.checkpoint.offline.inspect`."""
    sections = [
        _header(report),
        _plan_lines(report["plan"], full_plan),
        _tensor_lines(report, _shown(report, everything, top)),
        _file_lines(report),
        _status_lines(report),
    ]
    return "\n\n".join("\n".join(s) for s in sections)


def _json_report(report: dict[str, Any], everything: bool, top: int, full_plan: bool) -> str:
    """The same report as JSON: the same tensors listed (the largest, or --all), totals always."""
    out = dict(report, tensors=_shown(report, everything, top))
    if out["plan"] is not None and not full_plan:
        out["plan"] = {k: v for k, v in out["plan"].items() if k != "summary"}
    return json.dumps(out, indent=1)


# ------------------------------------------------------------------------------------ handlers


def _inspect(args: argparse.Namespace) -> int:
    from plait.checkpoint import offline

    report = offline.inspect(args.path, verify=args.verify)
    if args.json:
        print(_json_report(report, args.all, args.top, args.plan))
    else:
        print(format_report(report, everything=args.all, top=args.top, full_plan=args.plan))
    return EXIT_DAMAGED if report["problems"] else 0


def _merge(args: argparse.Namespace) -> int:
    from plait.checkpoint import offline

    if not args.no_verify:
        # Checked here rather than by merge() so that damage exits 1 and bad input 2.
        found = offline.problems(args.path)
        if found:
            print(
                f"plait checkpoint merge: checkpoint {args.path!r} is damaged, nothing was "
                f"written: {'; '.join(found)}",
                file=sys.stderr,
            )
            return EXIT_DAMAGED
    names = offline.merge(args.path, args.out, args.dtype, verify=False)
    print(f"{len(names)} tensors written to {args.out}")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    handler = {"inspect": _inspect, "merge": _merge}[args.action]
    try:
        return handler(args)
    except PlaitError as e:
        print(f"plait checkpoint {args.action}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # an unwritable OUT, a disk that filled up
        print(f"plait checkpoint {args.action}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def checkpoint_command() -> Command:
    """The ``plait checkpoint`` subcommand (``inspect``, ``merge``)."""
    return Command(
        name="checkpoint",
        help="inspect a checkpoint, or merge its model into one safetensors file",
        add_arguments=add_checkpoint_arguments,
        handler=_checkpoint,
    )
