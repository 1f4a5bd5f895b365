"""A link: one device's connection to its peers on one level (the alpha-beta terms).

The bottom of :mod:`plait.cost`: hardware profiles hold two links (intra-node, inter-node)
and the collective costs in :mod:`plait.cost.comm` read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cost.errors import CostError

__all__ = ["Link"]


@dataclass(frozen=True, slots=True)
class Link:
    """One device's connection to its peers on one level (intra-node or across nodes).

    Example:
        >>> Link(bandwidth=300e9, latency=0.6e-6).bandwidth
        300000000000.0
    """

    bandwidth: float
    """Bytes per second per device per direction (NVLink3: 600 GB/s total = 300e9)."""
    latency: float
    """Seconds per algorithm step (per ring hop): the alpha of the alpha-beta model."""
    overhead: float = 0.0
    """Seconds paid once per collective (launch and setup), on top of the per-step latency."""

    def __post_init__(self) -> None:
        if not _is_number(self.bandwidth) or self.bandwidth <= 0:
            raise CostError(
                f"Link.bandwidth={self.bandwidth!r} is not allowed; give bytes per second > 0"
            )
        for name in ("latency", "overhead"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise CostError(f"Link.{name}={value!r} is not allowed; give seconds >= 0")

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth": self.bandwidth, "latency": self.latency, "overhead": self.overhead}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
