"""The ``plait`` command: one console script with subcommands.

    plait run [options] script.py [script args]    start a job (docs/launch.md)
    plait plan --model gpt --devices 8 ...         plan a model, print the summary (docs/planner.md)
    plait calibrate [--quick]                      measure this machine into the 'local' profile
    plait checkpoint inspect|merge PATH ...        look into a checkpoint, merge it to safetensors
    plait completion bash|zsh                      a shell completion script
    plait --version                                plait's and torch's versions

One module per subcommand (:mod:`~plait.cli.run`, :mod:`~plait.cli.plan`,
:mod:`~plait.cli.calibrate`, :mod:`~plait.cli.checkpoint`); :mod:`~plait.cli.base` holds
:class:`Command`, the registry and :func:`main`. Adding one is one :func:`register_command`
call. This package is the only part of plait that prints; library code logs.
"""

from plait.cli.base import EXIT_USAGE, Command, build_parser, main, register_command
from plait.cli.calibrate import calibrate_command
from plait.cli.checkpoint import checkpoint_command
from plait.cli.completion import completion_command
from plait.cli.plan import plan_command
from plait.cli.run import run_command

__all__ = ["EXIT_USAGE", "Command", "build_parser", "main", "register_command"]

for _command in (
    plan_command(),
    calibrate_command(),
    run_command(),
    checkpoint_command(),
    completion_command(),
):
    register_command(_command)
