"""Pure data parallelism on plain tensors (no DTensor), the way DDP runs it.

When the mesh has no model-parallel axis every parameter is replicated, and DTensor buys
nothing: its per-op dispatch in forward, backward and the update only costs time. On this path
parameters stay ordinary tensors, each rank runs forward and backward on its own slice of the
batch, and ranks talk twice per step:

* gradient buckets (:class:`PlainGradSync`): a post-accumulate-grad hook packs a bucket's
  gradients into one flat buffer and starts its sum all-reduce as soon as the bucket's last
  gradient is ready, so communication overlaps the rest of backward; ``finish()`` waits and
  points every ``param.grad`` at its piece of the summed buffer (a view, no copy back);
* the loss value ``Job.step`` returns (one scalar all-reduce, started before backward).

Averaging over ranks is folded into the backward: the loss is scaled by ``1 / dp`` before
``backward()`` (one multiplication of a scalar), so the summed gradients are already the mean.
This is the data-parallel rule of DDP and of MindSpore's ``gradients_mean``: the gradient is
the mean of the ranks' gradients of their own losses. It equals single-device training on the
global batch for losses that average over equal-sized per-rank slices (``mean`` reductions);
a loss whose per-rank normaliser differs (e.g. cross-entropy with ``ignore_index`` tokens
unevenly spread) gets the mean of per-rank means instead of the global mean.

Under :func:`plait.testing.simulate` the same code runs with ``LocalTensor`` values (one private
tensor per simulated rank), so the numerics tests cover the path that real runs take.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait._compat import tree_map
from plait.comm.dp import own_copy, rank_slice, start_sum, wait_sum
from plait.comm.dtensor import DeviceMesh, full_value
from plait.config import CommFusion
from plait.errors import ShardingError
from plait.runtime.program.grad_sync import _Bucket, _BucketedSync

__all__ = ["PlainDataParallel", "PlainGradSync", "fresh_parameters"]


class PlainGradSync(_BucketedSync):
    """Sum the plain gradients of ``params`` over the 1-D mesh ``group_mesh`` in fused buckets
    (those of host modules over ``host_mesh``).

    One collective per bucket, started from backward's hooks (see the module docstring).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group_mesh: DeviceMesh,
        fusion: CommFusion,
        host_mesh: DeviceMesh | None = None,
    ) -> None:
        self._group_mesh = group_mesh
        self._host_mesh = host_mesh
        """The mesh host gradients are summed over (host modules; None: ``group_mesh``)."""
        self._buffers: dict[int, torch.Tensor] = {}
        super().__init__(params, [p.numel() * p.element_size() for p in params], fusion)

    def _launch(self, bucket: _Bucket) -> None:
        # A parameter without a gradient (unused in this step) is left out on every rank alike.
        bucket.members = [p for p in bucket.params if p.grad is not None]
        if not bucket.members:
            return
        grads = [p.grad.reshape(-1) for p in bucket.members]  # type: ignore[union-attr]
        if len(grads) == 1:
            flat = grads[0]
        else:
            # Pack into a buffer kept across steps: a fresh 4 MB tensor every step costs page
            # faults comparable to the copy itself.
            numel = sum(g.numel() for g in grads)
            dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
            buffer = self._buffers.get(id(bucket))
            if buffer is None or buffer.numel() != numel or buffer.dtype != dtype:
                buffer = self._buffers[id(bucket)] = grads[0].new_empty(numel, dtype=dtype)
            flat = torch.cat(grads, out=buffer)
        host = self._host_mesh
        mesh = host if host is not None and flat.device.type == "cpu" else self._group_mesh
        bucket.result = start_sum(flat, mesh)

    def _wait(self, result: torch.Tensor) -> torch.Tensor:
        return wait_sum(result)

    def _local_grad(self, param: nn.Parameter) -> torch.Tensor:
        return param.grad  # type: ignore[return-value]

    def _put(self, param: nn.Parameter, piece: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        # torch.cat promotes mixed dtypes; the sum comes back in the gradient's own dtype.
        param.grad = piece if piece.dtype == grad.dtype else piece.to(grad.dtype)


def fresh_parameters(model: nn.Module) -> None:
    """Replace every parameter by a new ``nn.Parameter`` over the same values.

    In a real process the new parameter shares the old one's storage (no copy); it only drops
    hooks a previous ``parallelize`` of the same model installed, which would otherwise start
    that job's collectives too. Under simulated ranks each rank gets a private copy of every
    parameter and buffer. Shared (tied) parameters stay shared.
    """
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(own_copy(p.detach()), p.requires_grad)
            module._parameters[name] = done[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = own_copy(b)


@dataclass(frozen=True, slots=True)
class PlainDataParallel:
    """Where this process stands in a pure data-parallel job, and its batch and loss helpers."""

    group_mesh: DeviceMesh
    """The 1-D device mesh of the data-parallel axis (the group the sums run over)."""
    axis: str
    """Name of the data-parallel mesh axis (for messages)."""
    size: int
    """Number of data-parallel ranks."""
    rank: int | None
    """This process's data-parallel coordinate; None under simulation (each rank its own)."""
    slice_inputs: bool
    """True when ``step`` gets global batches (simulation, ``full_batch``); False when each
    process already holds its own slice (``dataset_strategy="data_parallel"``)."""
    device: torch.device

    def __post_init__(self) -> None:
        if self.size < 1 or (self.rank is not None and not 0 <= self.rank < self.size):
            raise ShardingError(
                f"PlainDataParallel(size={self.size}, rank={self.rank}): the rank must lie in "
                f"0..size-1; this is a plait bug, please report it"
            )

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of ``batch``: dim 0 of every tensor cut into ``size`` pieces."""
        return tree_map(self._local_input, batch)

    def _local_input(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.device != self.device:
            x = x.to(self.device, non_blocking=True)
        if not self.slice_inputs or x.ndim == 0 or self.size == 1:
            return x
        if x.shape[0] % self.size:
            raise ShardingError(
                f"batch tensor of shape {tuple(x.shape)}: dim 0 ({x.shape[0]}) does not divide "
                f"into {self.size} data-parallel pieces (mesh axis {self.axis!r}); use a global "
                f"batch size divisible by {self.size}"
            )
        return rank_slice(x, self.size, self.rank)

    def start_loss_sum(self, loss: torch.Tensor) -> torch.Tensor:
        """Start summing a scalar over the data-parallel ranks (async; see :meth:`mean_of`)."""
        flat = loss.detach().reshape(1)
        return flat if self.size == 1 else start_sum(flat, self.group_mesh)

    def mean_of(self, started: torch.Tensor) -> float:
        """The mean over ranks of a scalar whose sum :meth:`start_loss_sum` started."""
        return float(full_value(wait_sum(started)).item()) / self.size
