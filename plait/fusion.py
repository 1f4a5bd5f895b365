"""Gradient bucketing (communication fusion), pure: which parameters share one all-reduce.

MindSpore's ``comm_fusion`` and DDP's buckets pack several gradients into one flat buffer and
reduce it with a single collective. :func:`plan_buckets` decides the grouping from sizes alone,
so the planner (:mod:`plait.planning.assemble`, which lists one collective per bucket) and
the runtime (:mod:`plait.runtime.program.grad_sync`, which runs them) form exactly the same buckets.

* ``mode="size"``: parameters in reverse order (the order backward produces gradients) are
  packed greedily into buckets of at most ``bucket_mb`` megabytes; a parameter larger than that
  gets a bucket of its own.
* ``mode="index"``: cut at the given parameter indices (model order): boundaries ``(2, 5)``
  give buckets ``[0, 1]``, ``[2, 3, 4]``, ``[5, ...]``.

Buckets come in launch order (the last parameters' bucket first); indices inside a
``"size"`` bucket are in reverse model order, inside an ``"index"`` bucket in model order.

:func:`in_bucket` says which gradients a bucket sums, for the plan's list and the
predictor alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from plait.config import CommFusion

__all__ = ["in_bucket", "plan_buckets"]


def plan_buckets(sizes: Sequence[int], fusion: CommFusion) -> list[list[int]]:
    """Group parameter indices ``0..len(sizes)-1`` (sizes in bytes) into buckets, launch order."""
    n = len(sizes)
    buckets: list[list[int]]
    if fusion.mode == "index":
        cuts = [0, *[b for b in fusion.boundaries if b < n], n]
        buckets = [list(range(a, b)) for a, b in itertools.pairwise(cuts) if b > a]
        return buckets[::-1]
    limit = fusion.bucket_mb * 1e6
    buckets = []
    current: list[int] = []
    used = 0
    for i in reversed(range(n)):
        if current and used + sizes[i] > limit:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += sizes[i]
    if current:
        buckets.append(current)
    return buckets


def in_bucket(axes: Sequence[str], dp_axis: str, *, fused: bool, staged: bool) -> bool:
    """Is a gradient pending over ``axes`` summed in a dp bucket? Over dp alone, whenever dp's
    reductions are ``fused`` (a dp axis larger than one); over dp and other axes (its parameter
    replicated there: a sequence-parallel norm's weight), also without pipeline stages
    (``staged`` False): the program and GradSync sum a bucket's such gradients over those
    axes first, together (:mod:`plait.runtime.program.grad_sync`)."""
    if not fused or dp_axis not in axes:
        return False
    return len(axes) == 1 or not staged
