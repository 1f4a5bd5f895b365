"""`plait plan`: plan a built-in model or your own, print the summary, write the plan file.

    plait plan --model gpt --layers 96 --hidden 12288 --heads 96 --seq 2048 --batch 1536 \\
        --devices 1024 --mesh dp=128,tp=8 --hardware a100-80g --json gpt3.json

Models are built on the meta device: no parameter memory, no process group. Every
``ParallelConfig`` field is a flag (``--mode``, ``--mesh``, ``--optimizer-shard``, ...).
With pipeline stages, ``--timeline FILE.png`` draws the predicted schedule and ``--trace
FILE.json`` writes it as a Chrome trace. ``--plot DIR`` writes the plan's pictures (memory by
kind, the planner's options, the pipeline timeline: ``Plan.plot``); pictures need matplotlib
(``pip install 'plait[plot]'``).

Exit status: 0 with a plan that fits device memory, 2 for bad input, 3 when the plan printed
does not fit (nothing the planner weighed fits ``--memory-limit`` or the profile's device
memory): scripts see the failure, and the summary still says what was closest.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, cast, get_args

from plait.cli.base import EXIT_USAGE, Command
from plait.config import (
    DatasetStrategy,
    Hardware,
    Mode,
    Offload,
    Precision,
    Recompute,
    Schedule,
    Search,
)
from plait.errors import ConfigError, PlaitError, PlanError

__all__ = [
    "EXIT_DOES_NOT_FIT",
    "add_plan_arguments",
    "config_from_args",
    "memory_verdict",
    "plan_command",
    "run_plan",
]

EXIT_DOES_NOT_FIT = 3
"""`plait plan`'s exit status when the plan it prints does not fit device memory."""

MODELS = ("gpt", "llama", "mlp", "bert", "cnn")


def _interleave_num(text: str) -> int | str:
    """``--interleave-num``: a count or ``auto`` (ParallelConfig validates the value)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--interleave-num {text!r}: give a count (1 = off) or 'auto'"
        ) from None


def _recompute_modules(text: str) -> tuple[tuple[str, str], ...]:
    """``blocks.0=full,blocks.1=selective`` -> (("blocks.0", "full"), ...)."""
    out = []
    for part in text.split(","):
        path, eq, mode = part.partition("=")
        if not eq or mode.strip() not in ("full", "selective"):
            raise argparse.ArgumentTypeError(
                f"--recompute-modules {text!r}: {part!r} is not PATH=full|selective; write e.g. "
                "--recompute-modules blocks.0=full"
            )
        out.append((path.strip(), mode.strip()))
    return tuple(out)


def _bytes_or_int(text: str | int) -> str | int:
    return int(text) if isinstance(text, str) and text.strip().isdigit() else text


def _mesh(text: str) -> dict[str, int]:
    """``dp=32,tp=8,pp=1`` -> {"dp": 32, "tp": 8, "pp": 1} (outermost first)."""
    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not name.strip() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"--mesh {text!r}: {part!r} is not NAME=SIZE; write e.g. --mesh dp=32,tp=8,pp=1"
            )
        mesh[name.strip()] = int(size)
    return mesh


def _comm_fusion(text: str) -> dict[str, Any]:
    """``size:25`` or ``index:4,8``."""
    mode, _, rest = text.partition(":")
    if mode == "size" and rest:
        return {"mode": "size", "bucket_mb": float(rest)}
    if mode == "index" and rest:
        return {"mode": "index", "boundaries": tuple(int(x) for x in rest.split(","))}
    raise argparse.ArgumentTypeError(
        f"--comm-fusion {text!r}: write size:MB (e.g. size:25) or index:I,J (e.g. index:4,8)"
    )


def _optimizer_shard(text: str) -> int | None:
    if text in ("none", "off", "0"):
        return None
    if text in ("1", "2", "3"):
        return int(text)
    raise argparse.ArgumentTypeError(f"--optimizer-shard {text!r}: use 1, 2, 3 or none")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", choices=MODELS, default="gpt", help="built-in model (default gpt)"
    )
    model.add_argument(
        "--factory",
        metavar="MODULE:FUNCTION",
        help="your model: FUNCTION() returns (model, example_batch, loss_fn); built under "
        "torch.device('meta') so no memory is allocated",
    )
    model.add_argument("--layers", type=int, help="transformer blocks / MLP layers")
    model.add_argument("--hidden", type=int, help="model width")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--kv-heads", type=int, help="key/value heads (llama, grouped-query)")
    model.add_argument("--seq", type=int, help="sequence length")
    model.add_argument("--vocab", type=int, help="vocabulary size")
    model.add_argument("--batch", type=int, help="global batch (sequences or samples)")
    model.add_argument(
        "--megatron",
        action="store_true",
        help="annotate the GPT with Megatron tensor parallel on the 'tp' axis (plait.shard)",
    )
    cfg = parser.add_argument_group("ParallelConfig")
    cfg.add_argument("--mode", choices=get_args(Mode), default="auto")
    cfg.add_argument("--search", choices=get_args(Search))
    cfg.add_argument("--devices", type=int)
    cfg.add_argument("--mesh", type=_mesh, help="named axes, outermost first: dp=32,tp=8,pp=1")
    cfg.add_argument("--dp-axis", default="dp")
    cfg.add_argument("--pipeline-stages", type=int, default=1)
    cfg.add_argument("--micro-batches", type=int, default=1)
    cfg.add_argument("--schedule", choices=get_args(Schedule), default="1f1b")
    cfg.add_argument(
        "--virtual-stages",
        type=int,
        help="model chunks a pipeline rank runs (default 1 for gpipe and 1f1b, else 2)",
    )
    cfg.add_argument("--optimizer-shard", type=_optimizer_shard, help="1, 2, 3 or none")
    cfg.add_argument(
        "--optimizer-shard-threshold",
        default=64 * 1024,
        help="parameters whose piece is smaller stay whole under --optimizer-shard (e.g. 64KiB)",
    )
    cfg.add_argument(
        "--optimizer-shard-exclude",
        type=lambda text: tuple(n.strip() for n in text.split(",") if n.strip()),
        default=(),
        help="parameters optimizer parallel keeps whole, comma-separated",
    )
    cfg.add_argument(
        "--optimizer-weight-shard-size",
        type=int,
        help="ranks a parameter's shards spread over (HSDP shard groups; default: the dp axis)",
    )
    cfg.add_argument("--recompute", choices=get_args(Recompute), default="none")
    cfg.add_argument(
        "--recompute-modules",
        type=_recompute_modules,
        default=(),
        help="per-module recompute: PATH=full|selective, comma-separated (blocks.0=full)",
    )
    cfg.add_argument("--grad-accumulation", type=int, default=1)
    cfg.add_argument(
        "--interleave-num",
        type=_interleave_num,
        default=1,
        help="multi-copy parallel: each micro-batch run as N copies, or 'auto' (mode auto "
        "weighs 1 and 2) (ParallelConfig.interleave_num)",
    )
    cfg.add_argument("--comm-fusion", type=_comm_fusion, help="size:MB or index:I,J")
    cfg.add_argument("--offload", choices=get_args(Offload))
    cfg.add_argument(
        "--host-modules",
        type=lambda text: tuple(n.strip() for n in text.split(",") if n.strip()),
        default=(),
        help="modules kept and computed on the host, comma-separated (mode data_parallel)",
    )
    cfg.add_argument("--precision", choices=get_args(Precision), default="fp32")
    cfg.add_argument("--hardware", choices=get_args(Hardware))
    cfg.add_argument("--memory-limit", help="per-device cap, e.g. 80GiB")
    cfg.add_argument(
        "--dataset-strategy", choices=get_args(DatasetStrategy), default="data_parallel"
    )
    ps = parser.add_argument_group("parameter server (--mode parameter_server)")
    ps.add_argument(
        "--server-num", type=int, metavar="S",
        help="server ranks beside the --devices workers (plait run --server-num S)",
    )  # fmt: skip
    ps.add_argument(
        "--server-modules", nargs="+", default=(), metavar="PATH",
        help="embedding tables on the servers (module paths); plait.on_server marks count too",
    )  # fmt: skip
    ps.add_argument("--ps-mode", choices=("sync", "async"), default="sync")
    ps.add_argument("--max-staleness", type=int, default=0)
    ps.add_argument(
        "--server-optimizer", choices=("sgd", "adagrad", "adam"), default="adam",
        help="the servers' sparse optimizer (its states are on the servers)",
    )  # fmt: skip
    ps.add_argument("--vocab-cache-size", type=int, default=0)
    ps.add_argument("--ps-split", choices=("range", "hash"), default="range")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the plan file here")
    out.add_argument(
        "--explain",
        metavar="NAME",
        action="append",
        default=[],
        help="explain an op, parameter or module",
    )
    out.add_argument("--hardware-file", help="a `plait calibrate` profile to use for 'local'")
    out.add_argument(
        "--timeline",
        metavar="FILE.png",
        help="draw the predicted pipeline schedule (stages x time) as a PNG; needs pipeline stages",
    )
    out.add_argument(
        "--plot",
        metavar="DIR",
        help="write the plan's pictures into DIR: memory.png, options.png (mode auto), "
        "timeline.png (pipeline stages); needs matplotlib (pip install 'plait[plot]')",
    )
    out.add_argument(
        "--trace",
        metavar="FILE.json",
        help="write the predicted pipeline schedule as a Chrome trace (Perfetto, chrome://tracing)",
    )


def config_from_args(args: argparse.Namespace):  # -> ParallelConfig
    from plait.config import ParallelConfig

    return ParallelConfig(
        mode=args.mode,
        search=args.search,
        devices=args.devices,
        mesh=args.mesh,
        dp_axis=args.dp_axis,
        pipeline_stages=args.pipeline_stages,
        micro_batches=args.micro_batches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        optimizer_shard=args.optimizer_shard,
        optimizer_shard_threshold=_bytes_or_int(args.optimizer_shard_threshold),
        optimizer_shard_exclude=args.optimizer_shard_exclude,
        optimizer_weight_shard_size=args.optimizer_weight_shard_size,
        recompute=args.recompute,
        recompute_modules=args.recompute_modules,
        grad_accumulation=args.grad_accumulation,
        interleave_num=args.interleave_num,
        comm_fusion=args.comm_fusion,
        offload=args.offload,
        host_modules=args.host_modules,
        precision=args.precision,
        hardware=args.hardware,
        memory_limit=args.memory_limit,
        dataset_strategy=args.dataset_strategy,
        **_server_fields(args),
    )


def _server_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The parameter-server fields given (those left at their defaults are not passed, so
    another mode sees none of them)."""
    from plait.config import SparseOptimizer

    given = {
        "server_modules": tuple(args.server_modules),
        "ps_mode": args.ps_mode,
        "max_staleness": args.max_staleness,
        "server_optimizer": SparseOptimizer(kind=args.server_optimizer),
        "vocab_cache_size": args.vocab_cache_size,
        "ps_split": args.ps_split,
    }
    if args.mode == "parameter_server":
        return given
    from plait.config import parameter_server_defaults

    defaults = parameter_server_defaults()
    return {k: v for k, v in given.items() if v != defaults[k]}


def _build_model(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import torch

    if args.factory:
        module_name, _, function = args.factory.partition(":")
        if not module_name or not function:
            raise ConfigError(
                f"--factory {args.factory!r}: write MODULE:FUNCTION, e.g. mypkg.models:build"
            )
        try:
            factory = getattr(importlib.import_module(module_name), function)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"--factory {args.factory!r}: cannot load it ({e})") from None
        with torch.device("meta"):
            built = factory()
        if not (isinstance(built, tuple) and len(built) == 3):
            raise ConfigError(
                f"--factory {args.factory!r} returned {type(built).__name__}; it must return "
                "(model, example_batch, loss_fn)"
            )
        return built
    from plait.models import ModelSpec, TinyGPT, annotate_megatron, build

    fields = {
        k: getattr(args, k)
        for k in ("layers", "hidden", "heads", "kv_heads", "seq", "vocab", "batch")
        if getattr(args, k) is not None
    }
    spec = ModelSpec(kind=args.model, **fields)
    with torch.device("meta"):
        model, batch, loss_fn = build(spec)
    if args.megatron:
        if args.model != "gpt":
            raise ConfigError(
                f"--megatron annotates the built-in gpt only, not --model {args.model}"
            )
        annotate_megatron(cast(TinyGPT, model), tp=(args.mesh or {}).get("tp", 1))
    return model, batch, loss_fn


def run_plan(args: argparse.Namespace) -> str:
    """Handler of `plait plan`: never starts a process group; returns the text to print."""
    return run_plan_with(args)[0]


def run_plan_with(args: argparse.Namespace) -> tuple[str, Any]:
    """`plait plan`'s text and the plan it made."""
    import plait

    cfg = config_from_args(args)
    model, batch, loss_fn = _build_model(args)
    plan = plait.plan(
        model,
        cfg,
        example_batch=batch,
        loss_fn=loss_fn,
        hardware_file=args.hardware_file,
        servers=args.server_num,
    )
    parts = [plan.summary()]
    parts += [plan.explain(name) for name in args.explain]
    if args.json:
        plan.save(args.json)
        parts.append(f"plan written to {args.json}")
    parts += _timeline_files(plan, args)
    if args.plot:
        limit = plan.memory_limit or _device_memory(args)
        written = plan.plot(args.plot, limit=limit)
        parts.append("pictures written: " + ", ".join(map(str, written)))
    return "\n\n".join(parts), plan


def _device_memory(args: argparse.Namespace) -> int | None:
    """The device memory of the profile planned on: the outer planner's limit by default."""
    from plait.cost.hardware import get_profile

    try:
        return get_profile(args.hardware, args.hardware_file).memory_bytes
    except (PlaitError, OSError):  # the plan itself read it: only a race can land here
        return None


def _timeline_files(plan: Any, args: argparse.Namespace) -> list[str]:
    """``--timeline`` and ``--trace``: the predicted pipeline schedule (or, without stages and
    with ``--interleave-num`` above 1, the copies' turns) as a PNG and a trace."""
    if not (args.timeline or args.trace):
        return []
    try:
        timeline = plan.timeline()
    except PlaitError as e:
        flag = "--timeline" if args.timeline else "--trace"
        raise PlanError(f"{flag}: {e}") from None
    out = []
    what = "pipeline" if plan.pipeline_stages > 1 else "copies"
    if args.timeline:
        width, height = timeline.to_png(args.timeline)
        out.append(f"{what} timeline drawn to {args.timeline} ({width} x {height} pixels)")
    if args.trace:
        timeline.to_chrome_trace(args.trace)
        out.append(f"{what} trace written to {args.trace} (open in Perfetto or chrome://tracing)")
    return out


def memory_verdict(plan: Any) -> str | None:
    """Why the plan does not fit device memory, or None when it fits: the outer planner's
    winner is marked infeasible (nothing it weighed fits its limit: ``memory_limit`` or the
    profile's device memory), or the predicted peak is over the given ``memory_limit``."""
    from plait.planning import fmt_bytes  # the planner loads when a plan is made, not for --help

    peak = plan.predicted.memory_bytes
    if plan.options and not plan.options[0].feasible:
        return (
            f"none of the {len(plan.options)} options weighed fits device memory; the "
            f"smallest shown needs {fmt_bytes(peak)} per device"
        )
    if plan.memory_limit is not None and peak > plan.memory_limit:
        return (
            f"the plan needs {fmt_bytes(peak)} per device, over memory_limit "
            f"{fmt_bytes(plan.memory_limit)}"
        )
    return None


def _plan(args: argparse.Namespace) -> int:
    try:
        text, plan = run_plan_with(args)
    except PlaitError as e:
        print(f"plait plan: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    verdict = memory_verdict(plan)
    if verdict is None:
        return 0
    print(
        f"plait plan: does not fit: {verdict}; the summary's notes say what else could "
        "(more devices, optimizer_shard=3, recompute='full', offload)",
        file=sys.stderr,
    )
    return EXIT_DOES_NOT_FIT


def plan_command() -> Command:
    """The ``plait plan`` subcommand."""
    return Command(
        name="plan",
        help="plan a model on N devices (no process group): summary and plan file",
        add_arguments=add_plan_arguments,
        handler=_plan,
    )
