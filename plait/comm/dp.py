"""Communication for plain-tensor data parallelism: per-rank pieces and bucket all-reduces.

When no parameter is split (pure data parallelism) plait keeps parameters, activations and
gradients as ordinary tensors and talks to other ranks only to sum gradient buckets and the loss
value. This module holds the few places where that path touches ``torch.distributed`` or the
simulated world:

* under :func:`plait.testing.simulate` a "plain" tensor must still hold one private value per
  rank, so parameters become per-rank copies and a global batch becomes per-rank slices
  (``LocalTensor``); in a real process these are the tensor itself and this rank's slice;
* a sum all-reduce of a flat buffer over the data-parallel group, started asynchronously and
  waited for later. It is one ``_c10d_functional.all_reduce`` (the collective that
  ``CommDebugMode`` and plait's ``CollectiveLog`` both count), issued through DTensor's public
  redistribution so that plait imports no private collective API.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from plait._compat import LocalTensor, own_per_rank, simulated_ranks
from plait.comm.dtensor import start_all_reduce, wait_for

__all__ = [
    "gather_pieces",
    "gloo_axis_mesh",
    "host_group_mesh",
    "own_copy",
    "rank_slice",
    "start_sum",
    "wait_sum",
]


def own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` for this rank: itself in a real process, private per-rank copies if simulated.

    Simulated ranks must not share storage: an in-place optimizer update on a shared tensor
    would land once per rank.
    """
    ranks = simulated_ranks()
    return tensor if ranks is None else own_per_rank(tensor.detach(), ranks)


def rank_slice(tensor: torch.Tensor, parts: int, index: int | None) -> torch.Tensor:
    """Piece ``index`` of ``parts`` equal pieces of ``tensor`` along dim 0.

    ``index=None`` means "each rank its own": under simulation the piece of simulated rank
    ``r`` is piece ``r`` (the caller guarantees the data-parallel coordinate equals the rank),
    so the result is a ``LocalTensor``. Dim 0 must divide by ``parts`` (checked by the caller).
    """
    pieces = tensor.chunk(parts)
    if index is not None:
        return pieces[index]
    ranks = simulated_ranks()
    assert ranks is not None, "index=None is for simulated worlds only"
    return LocalTensor({r: pieces[r] for r in ranks})


def start_sum(flat: torch.Tensor, group_mesh: DeviceMesh) -> torch.Tensor:
    """Start summing the 1-D buffer ``flat`` over the 1-D mesh ``group_mesh``; async result.

    The returned tensor is a new buffer (``flat`` is left as it was); read it through
    :func:`wait_sum`, which blocks until the collective is done.
    """
    return start_all_reduce(flat, group_mesh)


def wait_sum(result: torch.Tensor) -> torch.Tensor:
    """The finished sum of a :func:`start_sum`."""
    return wait_for(result)


def gather_pieces(local: torch.Tensor, group_mesh: DeviceMesh) -> torch.Tensor:
    """The whole tensor from each rank's piece along dim 0 (rank order), on every rank.

    One all-gather over the 1-D mesh ``group_mesh``; a 0-d value (a loss a model returns) is
    averaged over the ranks instead (one all-reduce). Exact under simulated ranks too.
    """
    if local.ndim == 0:
        return wait_sum(start_sum(local.reshape(1), group_mesh)).reshape(()) / group_mesh.size()
    local = local.contiguous()
    shape = torch.Size((local.shape[0] * group_mesh.size(), *local.shape[1:]))
    # A contiguous tensor's strides do not depend on its dim 0: the local ones are the global's.
    piece = DTensor.from_local(
        local, group_mesh, [Shard(0)], run_check=False, shape=shape, stride=local.stride()
    )
    return piece.full_tensor()


def host_group_mesh(group_mesh: DeviceMesh, device_mesh: DeviceMesh, axis: str) -> DeviceMesh:
    """The 1-D mesh that sums host tensors over the ranks of ``group_mesh`` (host modules'
    gradients, :mod:`plait.runtime.engine.host`): ``group_mesh`` itself when the world's collectives
    run on CPU tensors (gloo, simulated ranks), else :func:`gloo_axis_mesh` (NCCL moves device
    memory only)."""
    if group_mesh.device_type == "cpu":
        return group_mesh
    return gloo_axis_mesh(device_mesh, axis)


def gloo_axis_mesh(device_mesh: DeviceMesh, axis: str) -> DeviceMesh:
    """A CPU mesh over this rank's ``axis`` group of ``device_mesh``, on a new gloo group.

    Every rank makes the gloo group of every ``axis`` group, in the same order, as
    ``torch.distributed.new_group`` requires (a collective call of the whole world).
    """
    names = list(device_mesh.mesh_dim_names or ())
    index = names.index(axis)
    grid = device_mesh.mesh
    rows = grid.movedim(index, -1).reshape(-1, grid.shape[index]).tolist()
    me = dist.get_rank()
    mine = None
    for row in rows:
        group = dist.new_group(row, backend="gloo")
        if me in row:
            mine = group
    assert mine is not None, f"rank {me} is in no {axis!r} group of {device_mesh}"
    return DeviceMesh.from_group(mine, "cpu", mesh_dim_names=(axis,))
