"""Communication cost: links, which mesh axes cross nodes, and alpha-beta collective times.

The model (nccl-tests ``doc/PERFORMANCE.md`` bandwidth terms, plus a per-step latency as in
alpha-beta planners: Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", 2005)::

    seconds = link.overhead + steps * link.latency + wire_bytes / link.bandwidth

**Byte convention** (the one the redistribution planner and the Plan use): ``nbytes`` is the
size of ONE device's local piece BEFORE the collective. With ``p`` the group size:

    kind            nbytes is              full array S   wire_bytes per device   steps
    all_reduce      the buffer             nbytes         2 (p-1)/p * nbytes      2 (p-1)
    all_gather      the input shard        p * nbytes     (p-1) * nbytes          p-1
    reduce_scatter  the full input         nbytes         (p-1)/p * nbytes        p-1
    all_to_all      the local buffer       -              (p-1)/p * nbytes        p-1
    broadcast       the root's buffer      nbytes         nbytes (pipelined)      p-1
    reduce          each rank's buffer     nbytes         nbytes (pipelined)      p-1
    send_recv       the message            -              nbytes                  1
    slice           (local, no traffic)    -              0                       0
    partition       (local, no traffic)    -              0                       0

``slice`` and ``partition`` are the redistribution planner's local steps (take a chunk; turn
a replicated value into a pending sum); they cost nothing here.

A group of one device costs 0 s for every kind. Ring algorithms are assumed (NCCL's default
for large messages; gloo's ring all-reduce); tree and in-network reductions are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from plait.cost.errors import CostError
from plait.cost.hardware import HardwareProfile
from plait.cost.link import Link
from plait.mesh import MeshSpec

__all__ = ["CollectiveKind", "Link", "Topology", "collective_seconds", "wire_bytes"]

CollectiveKind = Literal[
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "send_recv",
    "slice",
    "partition",
]
_KINDS: tuple[str, ...] = get_args(CollectiveKind)


def _steps_and_wire(kind: str, p: int) -> tuple[int, float]:
    """Ring steps, and wire bytes per byte of ``nbytes`` (the convention in the module doc)."""
    # Plain floats and an if-chain: search calls this millions of times.
    if kind == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    if kind == "all_gather":
        return p - 1, float(p - 1)
    if kind in ("reduce_scatter", "all_to_all"):
        return p - 1, (p - 1) / p
    if kind in ("broadcast", "reduce"):
        return p - 1, 1.0
    if kind == "send_recv":
        return 1, 1.0
    return 0, 0.0  # slice, partition: local


def _check_args(kind: str, nbytes: int, group_size: int) -> None:
    if kind not in _KINDS:
        raise CostError(
            f"collective kind {kind!r} is unknown to the cost model; use one of {list(_KINDS)}"
        )
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise CostError(
            f"{kind}: nbytes={nbytes!r} is not allowed; give the bytes of one device's local "
            "piece before the collective as an integer >= 0"
        )
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise CostError(
            f"{kind}: group_size={group_size!r} is not allowed; give the number of devices in "
            "the group, an integer >= 1"
        )


def wire_bytes(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes one device sends over its link for the collective (0 for a group of one)."""
    _check_args(kind, nbytes, group_size)
    if group_size == 1:
        return 0.0
    return _steps_and_wire(kind, group_size)[1] * nbytes


def collective_seconds(kind: str, nbytes: int, group_size: int, link: Link) -> float:
    """Seconds for one collective over ``link`` (alpha-beta ring model; see the module doc).

    Example:
        >>> link = Link(bandwidth=1e9, latency=1e-6)
        >>> round(collective_seconds("all_reduce", 4_000_000, 4, link), 9)  # 6 steps, 6 MB
        0.006006
    """
    _check_args(kind, nbytes, group_size)
    if group_size == 1 or kind in ("slice", "partition"):
        return 0.0
    steps, per_byte = _steps_and_wire(kind, group_size)
    return link.overhead + steps * link.latency + per_byte * nbytes / link.bandwidth


AxisSeconds = Callable[[str, str, int], float]
"""``fn(kind, axis, nbytes) -> seconds``: the cost hook the redistribution planner takes."""


@dataclass(frozen=True)
class Topology:
    """A mesh placed on hardware: which axes stay inside a node and which cross nodes.

    Ranks fill nodes in order (rank ``r`` lives on node ``r // devices_per_node``) and the mesh
    is row-major, so the innermost axes are the ones that stay inside a node: an axis is
    intra-node when the product of its size and the sizes of all axes inside it is at most
    ``devices_per_node``. Every other axis has groups that span nodes; a ring over such a
    group is paced by its slowest hop, the inter-node link.

        mesh {"dp": 4, "tp": 4}, 8 devices per node:
        axis  inner product  link
        tp    4              intra_node
        dp    16             inter_node   (dp group {0, 4, 8, 12} spans nodes 0 and 1)

    Example:
        >>> from plait.cost.hardware import get_profile
        >>> topo = Topology(MeshSpec.from_dict({"dp": 4, "tp": 8}), get_profile("h100"))
        >>> topo.intra_node_axes, topo.inter_node_axes
        (('tp',), ('dp',))
    """

    mesh: MeshSpec
    hardware: HardwareProfile
    devices_per_node: int | None = None
    """Overrides ``hardware.devices_per_node`` (e.g. fewer workers per node than devices)."""

    _axes: dict[str, tuple[int, Link]] = field(init=False, repr=False, compare=False)
    _intra: Link = field(init=False, repr=False, compare=False)
    """The intra-node link as a step's transfers see it: the profile's, each transfer paying
    its ``wait_latency`` once (see :meth:`axis_seconds`)."""

    def __post_init__(self) -> None:
        dpn = self.devices_per_node
        if dpn is not None and (not isinstance(dpn, int) or isinstance(dpn, bool) or dpn < 1):
            raise CostError(
                f"Topology.devices_per_node={dpn!r} is not allowed; give an integer >= 1 or None "
                "to use the hardware profile's"
            )
        intra, wait = self.hardware.intra_node, self.hardware.wait_latency
        if wait > 0:
            intra = Link(intra.bandwidth, intra.latency, intra.overhead + wait)
        object.__setattr__(self, "_intra", intra)
        axes = {
            axis: (size, self._link_of(axis))
            for axis, size in zip(self.mesh.axis_names, self.mesh.shape, strict=True)
        }
        object.__setattr__(self, "_axes", axes)

    @property
    def node_size(self) -> int:
        """Devices per node in effect."""
        return self.devices_per_node or self.hardware.devices_per_node

    def is_intra_node(self, axis: str) -> bool:
        """Whether every group of ``axis`` lies inside one node."""
        index = self.mesh.axis_index(axis)
        inner = 1
        for size in self.mesh.shape[index:]:
            inner *= size
        return inner <= self.node_size

    @property
    def intra_node_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.mesh.axis_names if self.is_intra_node(a))

    @property
    def inter_node_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.mesh.axis_names if not self.is_intra_node(a))

    def _link_of(self, axis: str) -> Link:
        return self._intra if self.is_intra_node(axis) else self.hardware.inter_node

    def link(self, axis: str) -> Link:
        """The link that paces collectives over ``axis``."""
        if axis not in self._axes:
            self.mesh.axis_index(axis)  # raises LayoutError naming the mesh's axes
        return self._axes[axis][1]

    def axis_seconds(self, kind: str, axis: str, nbytes: int) -> float:
        """Seconds for one ``kind`` collective over mesh axis ``axis`` (an :data:`AxisSeconds`).

        Fits ``Redistribution.seconds(fn)``: pass ``topology.axis_seconds``. Inside a node
        every transfer (a collective, a pipeline's send) also waits the profile's
        ``wait_latency`` once: in a step its ranks arrive at different times, and the ones
        that blocked may have to wait for a core the others compute on.
        """
        if axis not in self._axes:
            self.mesh.axis_index(axis)  # raises LayoutError naming the mesh's axes
        size, link = self._axes[axis]
        return collective_seconds(kind, nbytes, size, link)

    def subgroup_seconds(
        self, kind: str, axis: str, nbytes: int, *, size: int, stride: int = 1
    ) -> float:
        """One collective over a group of ``size`` ranks of ``axis``, ``stride`` apart in its
        coordinates: optimizer parallel's shard groups (HSDP: consecutive ranks, stride 1) and
        the groups across them (stride the shard size).

        The group stays inside a node when the ranks it spans fit one (ranks fill nodes in
        order, as for whole axes); otherwise the inter-node link paces it. With ``size`` the
        axis size and ``stride`` 1 this is :meth:`axis_seconds`.
        """
        index = self.mesh.axis_index(axis)  # raises LayoutError naming the mesh's axes
        inner = math.prod(self.mesh.shape[index + 1 :])
        intra = size * stride * inner <= self.node_size
        link = self._intra if intra else self.hardware.inter_node
        return collective_seconds(kind, nbytes, size, link)

    def group_seconds(self, kind: str, axes: tuple[str, ...], nbytes: int) -> float:
        """One collective over the group spanned by several axes (e.g. dp x tp flattened).

        The group is paced by the slowest link among the axes.
        """
        if not axes:
            return collective_seconds(kind, nbytes, 1, self._intra)
        size = 1
        for axis in axes:
            size *= self.mesh.axis_size(axis)
        crosses = any(not self.is_intra_node(a) for a in axes)
        link = self.hardware.inter_node if crosses else self._intra
        return collective_seconds(kind, nbytes, size, link)
