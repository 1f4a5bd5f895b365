"""The launcher's one exception type.

Every bad input the launcher sees (flags, environment variables, rank tables) raises
`LaunchError` before any worker process starts, with a message that names what was given,
where, the rule it broke and how to fix it.
"""

from __future__ import annotations

from plait.errors import PlaitError

__all__ = ["LaunchError"]


class LaunchError(PlaitError):
    """A launch cannot start: bad flags, environment, rank table or rendezvous.

    A `PlaitError`, hence a `ValueError`: it is raised for bad user input.
    """
