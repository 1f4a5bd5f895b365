"""The subcommand registry and ``main``: one console script, ``plait``, with subcommands.

Each subcommand is a :class:`Command`: a name, a one-line help, a function that declares its
flags on an ``argparse`` parser, and a handler that returns the exit code. The built-in ones
(:mod:`plait.cli.run`, :mod:`plait.cli.plan`, :mod:`plait.cli.calibrate`) are registered by
:mod:`plait.cli`; handlers import heavy modules lazily so that ``plait --help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["EXIT_USAGE", "Command", "build_parser", "main", "register_command", "version_line"]

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


def build_parser() -> argparse.ArgumentParser:
    """The ``plait`` parser with one subparser per registered :class:`Command`."""
    parser = argparse.ArgumentParser(
        prog="plait", description="Train one PyTorch model on many devices."
    )
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for command in _COMMANDS.values():
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(handler=command.handler)
    return parser


def version_line() -> str:
    """``plait --version``: plait's version and the torch it runs on (read from the installed
    packages' metadata, so printing it imports nothing)."""
    from importlib.metadata import PackageNotFoundError, version

    from plait import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:  # pragma: no cover - torch is a dependency
        torch = "not installed"
    return f"plait {__version__} (torch {torch})"


def main(argv: Sequence[str] | None = None) -> int:
    """Run `plait` with `argv` (default: the process arguments); return the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))
