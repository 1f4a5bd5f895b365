"""The cost model's error class.

Lives here until ``plait/errors.py`` (owned by the lead) takes it; it is a
:class:`~plait.errors.PlaitError` like every other plait input error.
"""

from __future__ import annotations

from plait.errors import PlaitError

__all__ = ["CostError"]


class CostError(PlaitError):
    """A hardware profile, profile file or cost-model argument is invalid."""
