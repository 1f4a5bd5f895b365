"""The `plait` command: one console script with subcommands.

    plait run [options] script.py [script args]    start a job (docs/launch.md)

Each subcommand is a `Command`: a name, a one-line help, a function that declares its flags
on an `argparse` parser, and a handler that returns the exit code. Adding one (`plan`,
`calibrate`, `info`, ...) is one `register_command(...)` call at the bottom of this file; the
handler may import heavy modules lazily so that `plait --help` stays fast.

This is the only module of plait that prints; library code logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Command", "main", "register_command"]

EXIT_USAGE = 2
"""Exit code for bad flags or input (argparse's convention)."""


@dataclass(frozen=True, slots=True)
class Command:
    """One `plait <name>` subcommand."""

    name: str
    """Word after `plait`."""
    help: str
    """One line for `plait --help`."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Declares the subcommand's flags."""
    handler: Callable[[argparse.Namespace], int]
    """Runs it; returns the process exit code."""


_COMMANDS: dict[str, Command] = {}


def register_command(command: Command) -> None:
    """Add a subcommand; a second command with the same name is an error."""
    if command.name in _COMMANDS:
        raise ValueError(
            f"plait subcommand {command.name!r} is registered twice ({_COMMANDS[command.name]}"
            f" and {command}). Pick another name."
        )
    _COMMANDS[command.name] = command


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait", description="Train one PyTorch model on many devices."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for command in _COMMANDS.values():
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(handler=command.handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `plait` with `argv` (default: the process arguments); return the exit code."""
    args = _build_parser().parse_args(argv)
    return int(args.handler(args))


# ---------------------------------------------------------------------------------- plait run


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from plait.launch.command import add_run_arguments

    add_run_arguments(parser)


def _run(args: argparse.Namespace) -> int:
    from plait.launch import LaunchError
    from plait.launch import command as run_command

    try:
        config = run_command.config_from_args(args)
        if args.emit:
            return _emit(config, run_command.emit_options_from_args(args), args.output)
        config.check_program_exists()
        config = run_command.with_log_dir(config)
        if args.dry_run:
            return _dry_run(config)
        return _launch(config)
    except LaunchError as e:
        print(f"plait run: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _emit(config, options, output: str | None) -> int:
    from plait.launch.emit import emit

    text = emit(config, options)
    if output:
        Path(output).write_text(text)
        print(f"plait run: wrote {options.target} file {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _dry_run(config) -> int:
    from plait.launch.runner import effective_node_rank, preview_worker_envs

    node = effective_node_rank(config)
    print(
        f"# plait run --dry-run: {config.worker_num} workers on {config.num_nodes} node(s),"
        f" {config.local_worker_num} here (node rank {'auto' if node is None else node});"
        f" rendezvous c10d at {config.rendezvous_endpoint}, timeout {config.cluster_timeout:g} s;"
        f" max restarts {config.max_restarts}"
    )
    for preview in preview_worker_envs(config):
        print(f"\n[worker local_rank={preview.local_rank}]")
        print(f"# command: {' '.join(preview.command)}")
        print(f"# log: {preview.log_file}")
        for key, value in preview.env.items():
            print(f"{key}={value}")
    return 0


def _launch(config) -> int:
    from plait.launch.runner import format_failure, run_job

    assert config.log_dir is not None, "with_log_dir sets it"
    _configure_logging(Path(config.log_dir) / "launcher.log")
    print(f"plait run: logs in {config.log_dir}", file=sys.stderr)
    result = run_job(config)
    if result.exit_code != 0:
        print(format_failure(result), file=sys.stderr)
    return result.exit_code


def _configure_logging(launcher_log: Path) -> None:
    # The application (this CLI), not the library, owns handlers: launcher.log gets plait's
    # and torch elastic's records at INFO; the console gets plait's warnings. torch elastic
    # pins its loggers to WARNING (or $LOGLEVEL) one by one and torch adds its own console
    # handler; reset the levels and, unless PLAIT_DEBUG is set, keep them off the console.
    debug = int(os.environ.get("PLAIT_DEBUG", "0") or 0)
    file_handler = logging.FileHandler(launcher_log)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic.", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.NOTSET)
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.setLevel(logging.INFO)
    elastic.addHandler(file_handler)
    elastic.propagate = debug >= 1
    plait_logger = logging.getLogger("plait")
    plait_logger.setLevel(logging.DEBUG if debug >= 2 else logging.INFO)
    plait_logger.addHandler(file_handler)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING if debug == 0 else logging.DEBUG)
    console.setFormatter(logging.Formatter("plait run: %(levelname)s %(message)s"))
    plait_logger.addHandler(console)


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from plait.plan_cli import add_plan_arguments

    add_plan_arguments(parser)


def _plan(args: argparse.Namespace) -> int:
    from plait.errors import PlaitError
    from plait.plan_cli import run_plan

    try:
        print(run_plan(args))
        return 0
    except PlaitError as e:
        print(f"plait plan: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    from plait.cost.calibrate import calibrate_command

    calibrate_command().add_arguments(parser)


def _calibrate(args: argparse.Namespace) -> int:
    from plait.cost.calibrate import calibrate_command

    return calibrate_command().handler(args)


register_command(
    Command(
        name="plan",
        help="plan a model on N devices (no process group): summary and plan file",
        add_arguments=_add_plan_arguments,
        handler=_plan,
    )
)
register_command(
    Command(
        name="calibrate",
        help="measure this machine (matmul, memory, gloo collectives) into the 'local' profile",
        add_arguments=_add_calibrate_arguments,
        handler=_calibrate,
    )
)
register_command(
    Command(
        name="run",
        help="start a distributed job: one command per node (like msrun and torchrun)",
        add_arguments=_add_run_arguments,
        handler=_run,
    )
)
