"""Fused, overlapped gradient reduction over the data-parallel axis (communication fusion).

Gradients of parameters replicated over the data-parallel axis arrive as pending sums over it.
They are reduced in *buckets*: each bucket's gradients are packed into one flat buffer and
all-reduced with one collective, started from a post-accumulate-grad hook as soon as the
bucket's last gradient is ready, so communication overlaps the rest of backward (MindSpore's
``comm_fusion``, DDP's buckets). ``finish()`` waits for every bucket and unpacks.

Bucketing is :func:`plait.fusion.plan_buckets` (pure, re-exported here), the same function
the planner uses to list one all-reduce per bucket in a plan.

A gradient that arrives in another layout than expected (e.g. also pending over a
tensor-parallel axis) is reduced on its own, to stay correct.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.comm.dtensor import (
    is_pending_sum_over,
    start_all_reduce,
    sync_grad,
    wait_for,
    with_local,
)
from plait.config import CommFusion
from plait.fusion import plan_buckets

__all__ = ["GradSync", "plan_buckets"]

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: int = 0
    result: torch.Tensor | None = None
    members: list[nn.Parameter] = field(default_factory=list)


def _same_device_runs(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` cut where the device changes: one flat buffer holds one device's gradients
    (host modules keep theirs in host memory, :mod:`plait.runtime.host`)."""
    runs: list[list[nn.Parameter]] = []
    for p in params:
        if runs and runs[-1][-1].device == p.device:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


class _BucketedSync:
    """Bucket bookkeeping shared by both kinds of gradients: hooks, readiness, waiting.

    Subclasses say how a bucket's gradients become one flat local buffer and its all-reduce
    (``_start``), and how the reduced buffer's pieces go back into ``param.grad`` (``_put``).
    """

    def __init__(self, params: Sequence[nn.Parameter], sizes: Sequence[int], fusion: CommFusion):
        self._all = list(params)
        self.buckets = [
            _Bucket(run)
            for b in plan_buckets(sizes, fusion)
            for run in _same_device_runs([self._all[i] for i in b])
        ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.enabled = True
        """False while gradients are still being accumulated (no communication then)."""
        self.launched_in_backward = 0
        """Buckets started from backward's hooks in the last step (the overlapped ones)."""
        for p in self._all:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
            self.launched_in_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        raise NotImplementedError

    def _put(self, param: nn.Parameter, piece: torch.Tensor) -> None:
        raise NotImplementedError

    def _local_grad(self, param: nn.Parameter) -> torch.Tensor:
        raise NotImplementedError

    def _wait(self, result: torch.Tensor) -> torch.Tensor:
        return wait_for(result)

    def finish(self) -> None:
        """Launch what backward did not (unused parameters), wait for all, unpack; reset."""
        for bucket in self.buckets:
            if bucket.result is None and bucket.ready < len(bucket.params):
                self._launch(bucket)
            if bucket.result is not None:
                result = self._wait(bucket.result)
                offset = 0
                for p in bucket.members:
                    local = self._local_grad(p)
                    piece = result[offset : offset + local.numel()].view_as(local)
                    self._put(p, piece)
                    offset += local.numel()
            bucket.ready, bucket.result, bucket.members = 0, None, []


class GradSync(_BucketedSync):
    """Reduce gradients of DTensor ``params`` over mesh axis ``axis`` in fused, overlapped buckets."""

    def __init__(
        self, params: Sequence[nn.Parameter], device_mesh: Any, axis: str, fusion: CommFusion
    ) -> None:
        names = tuple(device_mesh.mesh_dim_names or ())
        self._axis_index = names.index(axis)
        self._group_mesh = device_mesh[axis]
        sizes = [p.to_local().numel() * p.element_size() for p in params]  # type: ignore[attr-defined]
        super().__init__(params, sizes, fusion)
        self.skip: set[int] = set()
        """``id`` of parameters whose gradients another reduction owns (optimizer parallel's
        reduce-scatter): left as they are."""

    def _launch(self, bucket: _Bucket) -> None:
        members = [
            p
            for p in bucket.params
            if p.grad is not None
            and id(p) not in self.skip
            and is_pending_sum_over(p.grad, p, self._axis_index)
        ]
        chosen = {id(p) for p in members} | self.skip
        for p in bucket.params:
            if p.grad is not None and id(p) not in chosen:
                sync_grad(p)  # unexpected layout: reduce it alone
        bucket.members = members
        if members:
            flat = torch.cat([p.grad.to_local().reshape(-1) for p in members])  # type: ignore[union-attr]
            bucket.result = start_all_reduce(flat, self._group_mesh)

    def _local_grad(self, param: nn.Parameter) -> torch.Tensor:
        return param.grad.to_local()  # type: ignore[union-attr]

    def _put(self, param: nn.Parameter, piece: torch.Tensor) -> None:
        param.grad = with_local(param, piece)  # type: ignore[arg-type]

    def finish(self) -> None:
        super().finish()
        for p in self._all:
            if id(p) not in self.skip:
                sync_grad(p)
