"""``plait completion bash|zsh``: a shell completion script for the ``plait`` command.

The script is written from the parser itself (every subcommand and each one's flags), so it
stays true as commands change; it completes subcommands after ``plait`` (and
``plait checkpoint``'s own), a subcommand's flags after ``-``, and file names elsewhere. Install it once::

    plait completion bash > ~/.local/share/bash-completion/completions/plait
    plait completion zsh > "${fpath[1]}/_plait"     # or: source <(plait completion zsh)
"""

from __future__ import annotations

import argparse

from plait.cli.base import Command

__all__ = ["SHELLS", "completion_command", "completion_script"]

SHELLS = ("bash", "zsh")
"""The shells a script is written for (zsh through its bash-completion emulation)."""


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string a parser takes (``-h`` and ``--help`` included)."""
    return sorted({s for action in parser._actions for s in action.option_strings})


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of ``parser`` by name (argparse keeps them in its subparsers action)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def completion_script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for ``shell`` (one of :data:`SHELLS`) of ``parser``'s command."""
    if shell not in SHELLS:
        raise ValueError(f"plait completion: shell {shell!r} is not one of {list(SHELLS)}")
    commands = _subparsers(parser)
    cases = "\n".join(
        f'        {name}) opts="{" ".join(_flags(sub))}" words="{" ".join(_subparsers(sub))}" ;;'
        for name, sub in commands.items()
    )
    body = f"""_plait() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" command="${{COMP_WORDS[1]}}" opts words
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W "{" ".join(commands)} {" ".join(_flags(parser))}" -- "$cur"))
        return
    fi
    case "$command" in
{cases}
        *) opts="" words="" ;;
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    elif [ "$COMP_CWORD" -eq 2 ] && [ -n "$words" ]; then
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}}
complete -o filenames -F _plait plait
"""
    header = "# plait completion for bash (plait completion bash)\n"
    if shell == "zsh":
        header = (
            "# plait completion for zsh (plait completion zsh), through bash-completion\n"
            "autoload -U +X bashcompinit && bashcompinit\n"
        )
    return header + body


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shell", choices=SHELLS, help="the shell to write the script for")


def _run(args: argparse.Namespace) -> int:
    from plait.cli.base import build_parser

    print(completion_script(args.shell, build_parser()), end="")
    return 0


def completion_command() -> Command:
    """The ``plait completion`` subcommand."""
    return Command(
        name="completion",
        help="print a shell completion script (bash or zsh) for plait",
        add_arguments=_add_arguments,
        handler=_run,
    )
