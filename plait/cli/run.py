"""``plait run``: start a distributed job, one command per node (like msrun and torchrun).

    plait run [options] script.py [script args]

The flags and their meaning live in :mod:`plait.launch.command` (docs/launch.md); this module
turns them into a launch, a ``--dry-run`` preview or an ``--emit`` file, and owns the
launcher's logging handlers (the application, not the library, configures logging).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from plait.cli.base import EXIT_USAGE, Command

__all__ = ["run_command"]


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from plait.launch.command import add_run_arguments

    add_run_arguments(parser)


def _run(args: argparse.Namespace) -> int:
    from plait.errors import LaunchError
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
        f"# plait run --dry-run: {'up to ' if config.elastic else ''}{config.worker_num} workers"
        f" on {config.nnodes_text} node(s),"
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
    _configure_logging(Path(config.log_dir) / config.launcher_log_name)
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


def run_command() -> Command:
    """The ``plait run`` subcommand."""
    return Command(
        name="run",
        help="start a distributed job: one command per node (like msrun and torchrun)",
        add_arguments=_add_run_arguments,
        handler=_run,
    )
