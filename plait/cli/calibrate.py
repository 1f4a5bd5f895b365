"""``plait calibrate``: measure this machine into the ``local`` hardware profile.

The measurement is :func:`plait.cost.calibrate.calibrate`; this module is its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plait.cli.base import EXIT_USAGE, Command

__all__ = ["calibrate_command"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from plait.cost.hardware import default_profile_path

    parser.add_argument(
        "--out",
        metavar="PATH",
        default=None,
        help=f"where to write the profile (default: {default_profile_path()}; $PLAIT_HOME moves it)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        metavar="N",
        help="processes measuring together, as many as your job runs on this machine: each "
        "figure is what one of them gets while the others run (default 2)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer repetitions (~20 s)"
    )


def _handle(args: argparse.Namespace) -> int:
    from plait.cost.calibrate import calibrate, format_profile
    from plait.cost.hardware import default_profile_path
    from plait.errors import CostError
    from plait.launch.local import run_workers

    try:
        profile = calibrate(run_workers, world_size=args.world_size, out=args.out, quick=args.quick)
    except CostError as e:
        sys.stderr.write(f"plait calibrate: error: {e}\n")
        return EXIT_USAGE
    path = Path(args.out) if args.out else default_profile_path()
    sys.stdout.write(format_profile(profile) + f"\nwrote {path}\n")
    return 0


def calibrate_command() -> Command:
    """The ``plait calibrate`` subcommand."""
    return Command(
        name="calibrate",
        help="measure this machine (matmul, memory, gloo all_reduce) and write the 'local' "
        "hardware profile",
        add_arguments=_add_arguments,
        handler=_handle,
    )
