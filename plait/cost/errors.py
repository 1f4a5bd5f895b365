"""The cost model's error class, :class:`~plait.errors.CostError`, defined in :mod:`plait.errors`.

Re-exported here so that ``from plait.cost.errors import CostError`` keeps working.
"""

from plait.errors import CostError

__all__ = ["CostError"]
