"""Optimizer parallel (ZeRO 1/2/3) on the per-rank program.

The plan says which parameters optimizer parallel splits and along which dim of their local
piece (``PlannedParameter.optimizer_shard_dim``, one rule with the planner:
:mod:`plait.layout.optimizer_shard`); the gradient buckets are the plan's. This module carries
that out with MindSpore's levels (``ParallelConfig.optimizer_shard``):

* **1**: gradients are all-reduced whole (in the plan's fused buckets); each rank's optimizer
  holds and updates only its shard of each split parameter (its states are 1/dp); the updated
  shards are all-gathered, one collective per bucket, into the whole parameters.
* **2**: as 1, but the gradients of split parameters are reduce-scattered, one collective per
  bucket, started inside the program as soon as the bucket's last gradient is computed (the
  ranks never hold the whole summed gradient).
* **3**: as 2, and the parameters themselves are kept split (a DTensor whose piece's dim is
  split over dp too): the program all-gathers each bucket before its first use in forward,
  frees the whole values after forward, and gathers again before backward needs them (a
  rematerialization pass, :mod:`plait.runtime.program.remat`). The optimizer updates the shards in place.

With shard groups (``ParallelConfig.optimizer_weight_shard_size``, MindSpore's HSDP) the
shards spread over a group of ``k`` consecutive ranks of the dp axis instead of all of it, and
each of the dp/k groups holds a whole copy (:class:`ShardGroups`): the reduce-scatter and the
gathers run inside the group, and at levels 2 and 3 each reduced shard is then all-reduced
across the groups (over the ranks holding the same shard). ``k`` = dp is the plain case.

A bucket's tensors travel in one flat buffer laid out rank by rank: each parameter's piece is
cut into ``k`` chunks along its dim, and chunk ``r`` of every parameter sits in rank ``r``'s
segment, so one all-gather or reduce-scatter serves the whole bucket and each rank's result is
exactly its shards. The packing and unpacking is written once (:func:`pack_chunks`,
:func:`unpack_chunks`...) against an ``apply(op, *args)`` callback: run eagerly (gradient
accumulation's one reduction per step, the gathers after the update) or emitted as nodes of the
per-rank program (the in-program passes), the same ops either way.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from plait._compat import simulation_suspended
from plait.comm.dtensor import (
    DeviceMesh,
    axis_names_of,
    dtensor_from_local,
    local_piece,
    replicate_placement,
)
from plait.errors import ConfigError
from plait.runtime.program.local_optim import is_elementwise

__all__ = [
    "Apply",
    "ShardGroups",
    "ShardedParameter",
    "ZeroOptimizer",
    "check_elementwise",
    "eager",
    "emit_into",
    "finish_gather",
    "finish_reduce_scatter",
    "gather_inputs",
    "gathered_onto",
    "parameter_derived",
    "prefetch_regathers",
    "reduce_scatter_accumulated",
    "reduce_scatter_outputs",
    "reshard_to_groups",
    "shard_gradient",
    "shard_groups",
    "sharded_parameters",
    "split_buckets",
    "start_gather",
    "start_reduce_scatter",
]

Apply = Callable[..., Any]
"""``apply(op, *args)``: run ``op`` (an aten or functional-collective op, or operator.getitem)."""

_F = torch.ops._c10d_functional
_A = torch.ops.aten


@dataclass(frozen=True, slots=True)
class ShardedParameter:
    """One parameter optimizer parallel splits: where its chunk is, and its layouts."""

    name: str
    position: int
    """Its place in the program's trained parameters (its gradient's output index - 1)."""
    dim: int
    """The dim of its local piece split over the data-parallel axis."""
    piece_shape: tuple[int, ...]
    """Its whole local piece's shape (after tensor parallel, before ZeRO)."""
    placements: tuple[Any, ...]
    """Its DTensor placements with that dim also split over the shard group, on
    :attr:`ShardGroups.mesh` (ZeRO-3 keeps it so)."""
    whole_placements: tuple[Any, ...]
    """Its own placements on the job's mesh (whole over dp, as the plan lays it out)."""
    mesh: DeviceMesh
    """The mesh :attr:`placements` are on: the job's, or HSDP's with dp cut in two."""
    mesh_dim: int
    """The dim of :attr:`mesh` the shards split over."""

    def replicated(self, piece: torch.Tensor, like: Any) -> Any:
        """A whole local piece (of the parameter or its reduced gradient, ``like``) as a
        DTensor on :attr:`mesh`, replicated over the shard group: redistributing it to
        :attr:`placements` takes this rank's shard as a slice, with nothing sent."""
        whole = list(self.placements)
        whole[self.mesh_dim] = replicate_placement()
        return dtensor_from_local(piece, self.mesh, tuple(whole), like.shape, like.stride())

    def shard_shape(self, n: int) -> tuple[int, ...]:
        shape = list(self.piece_shape)
        shape[self.dim] //= n
        return tuple(shape)

    def shard_numel(self, n: int) -> int:
        return math.prod(self.piece_shape) // n


@dataclass(frozen=True, slots=True)
class ShardGroups:
    """Where optimizer parallel's shards spread: the whole dp axis, or (HSDP) groups of ``n``
    consecutive ranks of it, with a group across them for each position."""

    n: int
    """Ranks one parameter's shards spread over (the dp size without HSDP)."""
    group: str
    """Their process group (the functional collectives' group name)."""
    replicate: str | None
    """HSDP: the group of the ranks holding the same shard, one in each shard group, that
    sums the reduced shards; None without HSDP."""
    mesh: DeviceMesh
    """The mesh the shards' placements are on: the job's, or the job's with the dp axis cut
    into (replicate, shard) dims (DTensor splits over one mesh dim, so a group within dp needs
    its own dim)."""
    axis: str
    """The dim of :attr:`mesh` the shards split over."""

    def split(
        self, placements: Sequence[Any], dp_index: int, dim_placement: Any
    ) -> tuple[Any, ...]:
        """Placements on :attr:`mesh` from ``placements`` on the job's mesh, with the dp entry
        (``dp_index``) replaced by ``dim_placement`` over the shard dim (and replicated over
        the groups across, under HSDP)."""
        if self.replicate is None:
            return (*placements[:dp_index], dim_placement, *placements[dp_index + 1 :])
        rest = placements[dp_index + 1 :]
        return (*placements[:dp_index], replicate_placement(), dim_placement, *rest)


def shard_groups(device_mesh: DeviceMesh, axis: str, shard_size: int | None) -> ShardGroups:
    """The shard groups of ``axis`` (``shard_size`` consecutive ranks each; None or the axis
    size: the whole axis, as without HSDP). Every rank calls it: HSDP builds process groups."""
    names = list(device_mesh.mesh_dim_names or ())
    if axis not in names:
        return ShardGroups(1, "", None, device_mesh, axis)
    size = int(device_mesh.size(names.index(axis)))
    if shard_size is None or shard_size == size:
        return ShardGroups(size, device_mesh.get_group(axis).group_name, None, device_mesh, axis)
    from plait._compat import unflatten_mesh_dim

    across, within = f"{axis}_replicate", f"{axis}_shard"
    cut = unflatten_mesh_dim(device_mesh, axis, (size // shard_size, shard_size), (across, within))
    return ShardGroups(
        shard_size,
        cut.get_group(within).group_name,
        cut.get_group(across).group_name,
        cut,
        within,
    )


def eager(op: Any, *args: Any) -> Any:
    """``apply`` that runs the op now."""
    return op(*args)


def emit_into(graph: torch.fx.Graph) -> Apply:
    """``apply`` that appends the op to ``graph`` (at its insertion point) as a node.

    Each node's ``meta["val"]`` is the op run on meta tensors, so later passes and
    :func:`~plait.comm.lower.collectives_of` read shapes and bytes as they do for traced nodes.
    """

    def apply(op: Any, *args: Any) -> Any:
        node = graph.call_function(op, args)
        with simulation_suspended():  # plain meta tensors, not one per simulated rank
            node.meta["val"] = op(*torch.fx.node.map_arg(args, _meta_of))
        return node

    return apply


def _meta_of(node: torch.fx.Node) -> Any:
    value = node.meta["val"]
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, tuple | list):
        return type(value)(
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") for v in value
        )
    return value


# --------------------------------------------------------------------------- bucket collectives


def start_gather(apply: Apply, shards: Sequence[Any], n: int, group: str) -> Any:
    """Start one all-gather of a bucket's shards (flat, concatenated); finish_gather unpacks."""
    flat = [apply(_A.reshape.default, s, [-1]) for s in shards]
    packed = apply(_A.cat.default, flat) if len(flat) > 1 else flat[0]
    return apply(_F.all_gather_into_tensor.default, packed, n, group)


def finish_gather(
    apply: Apply, started: Any, members: Sequence[ShardedParameter], n: int
) -> list[Any]:
    """Wait for :func:`start_gather` and return each member's whole local piece."""
    done = apply(_F.wait_tensor.default, started)
    total = sum(m.shard_numel(n) for m in members)
    rows = apply(_A.view.default, done, [n, total])
    sizes = [m.shard_numel(n) for m in members]
    parts = apply(_A.split_with_sizes.default, rows, sizes, 1)
    out = []
    for k, m in enumerate(members):
        part = apply(operator.getitem, parts, k)  # (n, shard numel): row r is rank r's chunk
        chunks = apply(_A.reshape.default, part, [n, *m.shard_shape(n)])
        if m.dim:
            chunks = apply(_A.movedim.int, chunks, 0, m.dim)
        out.append(apply(_A.reshape.default, chunks, list(m.piece_shape)))
    return out


def start_reduce_scatter(
    apply: Apply, grads: Sequence[Any], members: Sequence[ShardedParameter], n: int, group: str
) -> Any:
    """Start one sum reduce-scatter of a bucket's whole local gradients."""
    rows = []
    for g, m in zip(grads, members, strict=True):
        shape = list(m.piece_shape)
        split = [*shape[: m.dim], n, shape[m.dim] // n, *shape[m.dim + 1 :]]
        chunks = apply(_A.reshape.default, g, split)
        if m.dim:
            chunks = apply(_A.movedim.int, chunks, m.dim, 0)
        rows.append(apply(_A.reshape.default, chunks, [n, -1]))
    packed = apply(_A.cat.default, rows, 1) if len(rows) > 1 else rows[0]
    flat = apply(_A.reshape.default, packed, [-1])
    return apply(_F.reduce_scatter_tensor.default, flat, "sum", n, group)


def finish_reduce_scatter(
    apply: Apply,
    started: Any,
    members: Sequence[ShardedParameter],
    n: int,
    replicate: str | None = None,
) -> list[Any]:
    """Wait for :func:`start_reduce_scatter` and return each member's gradient shard; under
    HSDP (``replicate``: the group across the shard groups) the shards, summed within their
    group, are then summed across the groups, one all-reduce per bucket."""
    done = apply(_F.wait_tensor.default, started)
    if replicate is not None:
        done = apply(_F.wait_tensor.default, apply(_F.all_reduce.default, done, "sum", replicate))
    sizes = [m.shard_numel(n) for m in members]
    parts = apply(_A.split_with_sizes.default, done, sizes)
    return [
        apply(_A.view.default, apply(operator.getitem, parts, k), list(m.shard_shape(n)))
        for k, m in enumerate(members)
    ]


# --------------------------------------------------------------------------- the optimizer side


def check_elementwise(optimizer: torch.optim.Optimizer, level: int | None) -> None:
    """Optimizer parallel and offload update pieces apart: the update must be elementwise."""
    if is_elementwise(optimizer):
        return
    given = f"optimizer_shard={level}" if level is not None else "offload='optimizer'"
    raise ConfigError(
        f"ParallelConfig({given}) with optimizer {type(optimizer).__name__}: each rank then "
        "updates its own pieces of the parameters (its shards, on the host for offload), which "
        "is exact only for optimizers whose update of an element reads that element alone "
        "(SGD, Adam, AdamW, Adagrad, Adamax, RMSprop, NAdam, RAdam); use one of them or leave "
        f"{given.split('=')[0]} at its default"
    )


class ZeroOptimizer:
    """The local pieces the user's optimizer updates under optimizer parallel or offload.

    Every DTensor parameter gets a plain "shadow" parameter for the optimizer: the local
    piece itself (sharing storage) for a parameter kept whole and for a ZeRO-3 parameter
    (whose piece is its shard); a copy of this rank's shard for a split parameter at level
    1 or 2 (whose piece stays whole), written back by :meth:`after_step`.

    ``host=True`` (``offload="optimizer"``, ZeRO-Offload's semantics): the shadows, so the
    optimizer's states and its step, live in host memory; gradients are copied to the host
    before the step and the updated values back to the device after it. On a CPU device the
    host is the device: the shadows are the pieces themselves, as without offload.
    """

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter]],
        sharded: Sequence[ShardedParameter],
        *,
        level: int | None,
        buckets: Sequence[Sequence[ShardedParameter]],
        device_mesh: DeviceMesh,
        axis: str,
        host: bool = False,
        groups: ShardGroups | None = None,
    ) -> None:
        self.level = level
        self.device_mesh = device_mesh
        self.axis = axis
        self.groups = groups if groups is not None else shard_groups(device_mesh, axis, None)
        self.n = self.groups.n
        self.group = self.groups.group
        self.replicate = self.groups.replicate
        self._coordinate = _coordinate_on(self.groups.mesh, self.groups.axis)
        self.by_name = {s.name: s for s in sharded}
        self.buckets = [list(b) for b in buckets]
        self.pairs: list[tuple[nn.Parameter, nn.Parameter, ShardedParameter | None]] = []
        self._copied: set[int] = set()
        """``id`` of shadows that are host copies of whole pieces or ZeRO-3 shards."""
        for name, p in params:
            spec = self.by_name.get(name)
            split_copy = spec is not None and level in (1, 2)
            if split_copy:
                assert spec is not None
                piece = self._own_shard(local_piece(p).detach(), spec, p).clone()
            else:
                piece = local_piece(p).detach()
            if host and piece.device.type != "cpu":
                piece = _to_host(piece)
                if not split_copy:
                    self._copied.add(len(self.pairs))
            self.pairs.append((p, nn.Parameter(piece, requires_grad=p.requires_grad), spec))
        self._shadow_of = {s.name: sh for _, sh, s in self.pairs if s is not None}
        self.params = {s.name: p for p, _, s in self.pairs if s is not None}
        """Each split parameter by name."""

    @property
    def shadows(self) -> list[nn.Parameter]:
        return [s for _, s, _ in self.pairs]

    def load_grads(self) -> None:
        """Point each shadow's gradient at its parameter's local gradient (or shard of it)."""
        to_host = False
        for p, shadow, spec in self.pairs:
            grad = p.grad
            if grad is None:
                shadow.grad = None
                continue
            if spec is not None and self.level == 1:  # whole reduced gradient: take the chunk
                local = self._own_shard(local_piece(grad), spec, grad)
            else:
                local = local_piece(grad)
            to_host |= local.device.type == "cuda" and shadow.device.type == "cpu"
            shadow.grad = local.to(shadow.device, non_blocking=True)
        if to_host:
            # A device-to-host copy with non_blocking returns before the bytes arrive; the
            # host optimizer reads them next, so the copies are waited for (once, for all).
            torch.cuda.current_stream().synchronize()

    def _own_shard(self, piece: torch.Tensor, spec: ShardedParameter, like: Any) -> torch.Tensor:
        """This rank's shard of a whole local piece (of a parameter or its reduced gradient,
        ``like``) along the split dim: a plain slice on a real process; a simulated world (one
        LocalTensor for every rank, each with its own shard) takes it through DTensor, from
        the piece replicated over the shard groups' mesh (a slice: nothing is sent)."""
        if self._coordinate is not None:
            size = spec.piece_shape[spec.dim] // self.n
            return piece.narrow(spec.dim, self._coordinate * size, size)
        return spec.replicated(piece, like).redistribute(spec.mesh, spec.placements).to_local()

    @torch.no_grad()
    def reload_from_parameters(self) -> None:
        """Refresh the shadows that are copies (level 1/2 shards, host copies) from the
        parameters, after the parameters were overwritten (a checkpoint load)."""
        for k, (p, shadow, spec) in enumerate(self.pairs):
            if spec is not None and self.level in (1, 2):
                shadow.detach().copy_(self._own_shard(local_piece(p).detach(), spec, p))
            elif k in self._copied:
                shadow.detach().copy_(local_piece(p))

    @torch.no_grad()
    def after_step(self) -> None:
        """Put the updated values where forward reads them: host copies back on the device;
        levels 1 and 2 all-gather each bucket's updated shards into the whole pieces."""
        for k in self._copied:
            p, shadow, _ = self.pairs[k]
            local_piece(p).copy_(shadow.detach(), non_blocking=True)
        if self.level not in (1, 2):
            return
        params = self.params
        for bucket in self.buckets:
            device = local_piece(params[bucket[0].name]).device
            shards = [self._shadow_of[m.name].detach().to(device) for m in bucket]
            started = start_gather(eager, shards, self.n, self.group)
            for m, whole in zip(bucket, finish_gather(eager, started, bucket, self.n), strict=True):
                local_piece(params[m.name]).copy_(whole)


def _coordinate_on(device_mesh: DeviceMesh, axis: str) -> int | None:
    """This process's coordinate on ``axis`` (None in a simulated world, or without it)."""
    from plait._compat import simulated_ranks

    names = list(device_mesh.mesh_dim_names or ())
    if axis not in names or simulated_ranks() is not None:
        return None
    coordinate = device_mesh.get_coordinate()
    return None if coordinate is None else int(coordinate[names.index(axis)])


def _to_host(piece: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, pinned so copies both ways can overlap compute."""
    host = torch.empty(piece.shape, dtype=piece.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(piece)


def shard_gradient(grad: torch.Tensor, spec: ShardedParameter, param: Any) -> Any:
    """A DTensor gradient from its local shard (dim ``spec.dim`` split over the shard group;
    on HSDP's mesh, not the parameter's, at levels 1 and 2)."""
    mesh = spec.mesh if spec.mesh is not None else param.device_mesh
    return dtensor_from_local(grad, mesh, spec.placements, param.shape, param.stride())


# --------------------------------------------------------------------------- program passes


def reduce_scatter_outputs(
    graph_module: torch.fx.GraphModule,
    buckets: Sequence[Sequence[ShardedParameter]],
    n: int,
    group: str,
    replicate: str | None = None,
) -> None:
    """A pass: each bucket's gradient outputs reduce-scattered inside the program, in place.

    The collective starts right after the bucket's last gradient is computed (it overlaps
    the rest of backward); the wait and unpacking (under HSDP with the all-reduce across the
    shard groups, ``replicate``) come just before the program returns, and the outputs become
    this rank's gradient shards.
    """
    graph = graph_module.graph
    output = next(node for node in graph.nodes if node.op == "output")
    outs = list(output.args[0])
    order = {node: i for i, node in enumerate(graph.nodes)}
    apply = emit_into(graph)
    for bucket in buckets:
        values = [outs[1 + m.position] for m in bucket]
        last = max(values, key=lambda v: order[v])
        with graph.inserting_before(last.next):
            started = start_reduce_scatter(apply, values, bucket, n, group)
        with graph.inserting_before(output):
            shards = finish_reduce_scatter(apply, started, bucket, n, replicate)
        for m, shard in zip(bucket, shards, strict=True):
            outs[1 + m.position] = shard
    output.args = (tuple(outs),)
    graph.lint()
    graph_module.recompile()


def gather_inputs(
    graph_module: torch.fx.GraphModule,
    buckets: Sequence[Sequence[ShardedParameter]],
    placeholders: dict[str, torch.fx.Node],
    n: int,
    group: str,
) -> set[torch.fx.Node]:
    """A pass (ZeRO-3): parameter inputs become shards, all-gathered before their first use.

    Buckets are gathered in the order forward first reads them; each bucket's all-gather is
    issued when the previous bucket is first read (a prefetch, so it overlaps that bucket's
    compute) and waited for just before its own first reader. Returns the nodes that compute
    the whole parameters from the shards (for the backward re-gather, :func:`regather`).
    """
    graph = graph_module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    first_use: list[tuple[int, list[ShardedParameter]]] = []
    for bucket in buckets:
        readers = [u for m in bucket for u in placeholders[m.name].users]
        if readers:
            first_use.append((min(order[u] for u in readers), list(bucket)))
    first_use.sort(key=lambda item: item[0])
    nodes = list(graph.nodes)
    apply = emit_into(graph)
    started_of: list[Any] = []
    for j, (_, bucket) in enumerate(first_use):
        for m in bucket:  # the program now receives this rank's shard
            ph = placeholders[m.name]
            val = ph.meta["val"]
            ph.meta["val"] = torch.empty(m.shard_shape(n), dtype=val.dtype, device="meta")
        issue_at = nodes[first_use[j - 1][0] if j else first_use[j][0]]
        with graph.inserting_before(issue_at):
            shards = [placeholders[m.name] for m in bucket]
            started_of.append(start_gather(apply, shards, n, group))
    wholes_of: list[tuple[list[ShardedParameter], list[Any]]] = []
    for (at, bucket), started in zip(first_use, started_of, strict=True):
        with graph.inserting_before(nodes[at]):
            wholes_of.append((bucket, finish_gather(apply, started, bucket, n)))
    made = {node for node in graph.nodes if node not in order}
    for bucket, wholes in wholes_of:
        for m, whole in zip(bucket, wholes, strict=True):
            # every reader but the gather's own packing now reads the whole value
            placeholders[m.name].replace_all_uses_with(
                whole, delete_user_cb=lambda u: u not in made
            )
    graph.lint()
    graph_module.recompile()
    return made


def parameter_derived(
    graph_module: torch.fx.GraphModule, gathered: set[torch.fx.Node], backward_start: torch.fx.Node
) -> set[torch.fx.Node]:
    """ZeRO-3: the forward values computed from the gathered parameters alone (the gathers
    themselves, and views, transposes or casts of the whole parameters).

    Backward recomputes them before its first reader (:func:`plait.runtime.program.remat.rematerialize`,
    run by :meth:`~plait.runtime.program.compile.Program.rematerialize`): it gathers the parameters
    again instead of keeping them, so they are freed once forward is done with them.
    """
    derived = set(gathered)
    for node in graph_module.graph.nodes:
        if node is backward_start:
            break
        if node in derived or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if inputs and all(i in derived for i in inputs) and not _random(node):
            derived.add(node)
    return derived


def _random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


# --------------------------------------------------------------------------- from the plan


def sharded_parameters(
    parameters: Sequence[Any],
    model: nn.Module,
    trained: Sequence[str],
    device_mesh: DeviceMesh,
    axis: str,
    groups: ShardGroups | None = None,
) -> dict[int, ShardedParameter]:
    """The plan's split parameters (``PlannedParameter.optimizer_shard_dim`` set), keyed by
    ``id`` of the model's parameter; ``trained`` are the program's gradient outputs' names;
    ``groups``: where the shards spread (default: the whole ``axis``)."""
    from plait.comm.dtensor import to_dtensor_placements
    from plait.layout import optimizer_shard_layout

    groups = groups if groups is not None else shard_groups(device_mesh, axis, None)
    index = list(device_mesh.mesh_dim_names or ()).index(axis)
    position = {id(model.get_parameter(name)): i for i, name in enumerate(trained)}
    out: dict[int, ShardedParameter] = {}
    for planned in parameters:
        if planned.optimizer_shard_dim is None:
            continue
        p = model.get_parameter(planned.name)
        if id(p) not in position:
            continue  # no gradient in the program: nothing to update
        split = optimizer_shard_layout(planned.layout, planned.optimizer_shard_dim, axis)
        whole = tuple(to_dtensor_placements(planned.layout))
        out[id(p)] = ShardedParameter(
            planned.name,
            position[id(p)],
            planned.optimizer_shard_dim,
            planned.layout.local_shape(planned.shape),
            groups.split(whole, index, to_dtensor_placements(split)[index]),
            whole,
            groups.mesh,
            list(groups.mesh.mesh_dim_names or ()).index(groups.axis),
        )
    return out


def split_buckets(
    buckets: Sequence[Sequence[nn.Parameter]], sharded: dict[int, ShardedParameter]
) -> tuple[list[list[nn.Parameter]], list[list[ShardedParameter]]]:
    """The plan's gradient buckets -> (whole members per bucket, split members per bucket)."""
    whole = [[p for p in b if id(p) not in sharded] for b in buckets]
    split = [[sharded[id(p)] for p in b if id(p) in sharded] for b in buckets]
    return [b for b in whole if b], [b for b in split if b]


def reduce_scatter_accumulated(zero: ZeroOptimizer) -> None:
    """Levels 2 and 3 with gradient accumulation: one reduce-scatter per bucket after the last
    micro-batch (the program leaves the summed gradients pending), eagerly."""
    if zero.level == 1:
        return
    params = zero.params
    for bucket in zero.buckets:
        grads = []
        for m in bucket:
            p = params[m.name]
            grads.append(
                torch.zeros(m.piece_shape, dtype=p.dtype) if p.grad is None else local_piece(p.grad)
            )
        started = start_reduce_scatter(eager, grads, bucket, zero.n, zero.group)
        shards = finish_reduce_scatter(eager, started, bucket, zero.n, zero.replicate)
        for m, shard in zip(bucket, shards, strict=True):
            params[m.name].grad = shard_gradient(shard, m, params[m.name])


def reshard_to_groups(model: nn.Module, buckets: Sequence[Sequence[ShardedParameter]]) -> None:
    """ZeRO-3 under HSDP: each split parameter becomes a DTensor on the shard groups' mesh
    holding this rank's shard (in place; a tied parameter once).

    The plan's mesh has no dim for a group within dp, so these parameters live on HSDP's mesh
    (dp cut into replicate and shard dims): the piece is replicated over dp, so this rank's
    shard is a slice of it, taken without communication.
    """
    by_name = {m.name: m for b in buckets for m in b}
    names = {id(p): n for n, p in model.named_parameters()}
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            spec = by_name.get(names.get(id(p), "")) if p is not None else None
            if spec is None or p is None:
                continue
            if id(p) not in done:
                dt = spec.replicated(local_piece(p).detach(), p)
                done[id(p)] = nn.Parameter(
                    dt.redistribute(spec.mesh, spec.placements), p.requires_grad
                )
            module._parameters[attr] = done[id(p)]


def gathered_onto(value: Any, device_mesh: DeviceMesh) -> Any:
    """A ZeRO-3 shard under HSDP (a DTensor on the shard groups' mesh) as a DTensor on the
    job's mesh, gathered within its group: what evaluation and prediction, which run the plan
    op by op on the job's mesh, read for the parameter."""
    cut = list(axis_names_of(value.device_mesh))
    names = list(axis_names_of(device_mesh))
    whole = tuple(
        p if n in names else replicate_placement()
        for n, p in zip(cut, value.placements, strict=True)
    )
    local = value.redistribute(value.device_mesh, whole).to_local()
    by_name = dict(zip(cut, whole, strict=True))
    placements = tuple(by_name.get(n, replicate_placement()) for n in names)
    return dtensor_from_local(local, device_mesh, placements, value.shape, value.stride())


def prefetch_regathers(graph_module: torch.fx.GraphModule, gathered: set[torch.fx.Node]) -> int:
    """A pass (ZeRO-3, after the rematerialization): backward's bucket re-gathers start one
    bucket early.

    The re-gather clones sit just before their first backward reader, the collective right
    before its wait. This moves each one's collective (with the packing of its shards, which
    reads only graph inputs) to just before the previous re-gather's wait, so it runs while
    the previous bucket's backward computes, as forward's gathers do. Returns how many moved.
    """
    graph = graph_module.graph
    names = {n.name for n in gathered}
    starts = [
        n
        for n in graph.nodes
        if n.meta.get("recomputed_from") in names and n.target is _F.all_gather_into_tensor.default
    ]
    moved = 0
    for previous, start in itertools.pairwise(starts):
        wait = next(iter(u for u in previous.users if u.target is _F.wait_tensor.default), None)
        if wait is None:
            continue
        for node in _packing(start):  # inputs first: each lands before the wait, in order
            wait.prepend(node)
        moved += 1
    graph.lint()
    graph_module.recompile()
    return moved


def _packing(start: torch.fx.Node) -> list[torch.fx.Node]:
    """The collective and the nodes packing its input, inputs first (graph inputs excluded)."""
    out: list[torch.fx.Node] = []

    def visit(node: torch.fx.Node) -> None:
        if node.op == "placeholder" or node in out:
            return
        for i in node.all_input_nodes:
            visit(i)
        out.append(node)

    visit(start)
    return out
