"""The launcher's one exception type.

Every bad input the launcher sees (flags, environment variables, rank tables) raises
`LaunchError` before any worker process starts, with a message that names what was given,
where, the rule it broke and how to fix it.
"""

from __future__ import annotations

__all__ = ["LaunchError"]


class LaunchError(ValueError):
    """A launch cannot start: bad flags, environment, rank table or rendezvous.

    It subclasses `ValueError` because it is raised for bad user input.
    """
