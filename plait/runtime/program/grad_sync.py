"""Fused, overlapped gradient reduction over the data-parallel axis (communication fusion).

Gradients of parameters replicated over the data-parallel axis arrive as pending sums over it.
They are reduced in *buckets*: each bucket's gradients are packed into one flat buffer and
all-reduced with one collective, started from a post-accumulate-grad hook as soon as the
bucket's last gradient is ready, so communication overlaps the rest of backward (MindSpore's
``comm_fusion``, DDP's buckets). ``finish()`` waits for every bucket and unpacks.

Bucketing is :func:`plait.fusion.plan_buckets` (pure, re-exported here), the same function
the planner uses to list one all-reduce per bucket in a plan.

A gradient also pending over another axis where its parameter is replicated (a
sequence-parallel norm's weight: summed over the sequence's slices on tp and over dp) joins
its bucket too: a bucket's such gradients are first summed over that axis in one collective
for them all, then with the rest over dp (the planner lists the same,
:func:`plait.planning.assemble._fused_reductions`). A gradient in any other unexpected layout is
reduced on its own, to stay correct.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx
from torch import nn

from plait.comm.dtensor import (
    DeviceMesh,
    is_pending_sum_over,
    pending_beside,
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
    (host modules keep theirs in host memory, :mod:`plait.runtime.engine.host`)."""
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
        self, params: Sequence[nn.Parameter], device_mesh: DeviceMesh, axis: str, fusion: CommFusion
    ) -> None:
        names = tuple(device_mesh.mesh_dim_names or ())
        self._axis_index = names.index(axis)
        self._group_mesh = device_mesh[axis]
        self._mesh = device_mesh
        sizes = [p.to_local().numel() * p.element_size() for p in params]  # type: ignore[attr-defined]
        super().__init__(params, sizes, fusion)
        self.skip: set[int] = set()
        """``id`` of parameters whose gradients another reduction owns (optimizer parallel's
        reduce-scatter): left as they are."""

    def _launch(self, bucket: _Bucket) -> None:
        """The bucket's gradients pending over the axis alone, then those pending over other
        axes too (their parameter replicated there: a sequence-parallel norm's weight), which
        are first summed over those axes, one collective an axis for them all (as the program's
        pass does, :func:`write_buckets_in_place`); then one sum over the axis, started."""
        names = tuple(self._mesh.mesh_dim_names or ())
        alone: list[nn.Parameter] = []
        runs: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for p in bucket.params:
            if p.grad is None or id(p) in self.skip:
                continue
            if is_pending_sum_over(p.grad, p, self._axis_index):
                alone.append(p)
                continue
            beside = pending_beside(p.grad.placements, p.placements, self._axis_index)  # type: ignore[attr-defined]
            if beside is None:
                sync_grad(p)  # unexpected layout: reduce it alone
            else:
                runs.setdefault(beside, []).append(p)
        pieces = [p.grad.to_local().reshape(-1) for p in alone]  # type: ignore[union-attr]
        for beside, run in runs.items():
            flat = torch.cat([p.grad.to_local().reshape(-1) for p in run])  # type: ignore[union-attr]
            for k in beside:
                flat = wait_for(start_all_reduce(flat, self._mesh[names[k]]))
            pieces.append(flat)
        bucket.members = alone + [p for run in runs.values() for p in run]
        if pieces:
            bucket.result = start_all_reduce(torch.cat(pieces), self._group_mesh)

    def _local_grad(self, param: nn.Parameter) -> torch.Tensor:
        return param.grad.to_local()  # type: ignore[union-attr]

    def _put(self, param: nn.Parameter, piece: torch.Tensor) -> None:
        param.grad = with_local(param, piece)  # type: ignore[arg-type]

    def finish(self) -> None:
        super().finish()
        for p in self._all:
            if id(p) not in self.skip:
                sync_grad(p)


# --------------------------------------------------------------------------- inside a program

_A = torch.ops.aten
_F = torch.ops._c10d_functional
_CONTIGUOUS_VIEWS = frozenset({_A.view.default, _A._unsafe_view.default})
"""Views that keep a contiguous tensor's elements in the same order (a reshape that views)."""


@dataclass(frozen=True, slots=True)
class _Writer:
    """How one gradient lands in its bucket's flat buffer: its producing node ``node`` computes
    straight into the buffer (``out``: the op's ``out=`` overload), or the gradient is copied
    in right after it is computed (``out`` None)."""

    node: torch.fx.Node
    out: Any = None
    chain: tuple[torch.fx.Node, ...] = ()
    """The views from ``node`` up to the gradient output (dropped once outputs read the buffer)."""


PreSums = Mapping[tuple[str, ...], Sequence[int]]
"""A bucket's gradients pending over more axes than the bucket's: the groups (by name) each run
of them is summed over, one after the other, before the bucket's own sum (positions in the
output tuple, a run of the bucket's positions)."""


def write_buckets_in_place(
    graph_module: torch.fx.GraphModule,
    buckets: Sequence[Sequence[int]],
    group_name: str,
    *,
    in_place: bool = True,
    pre: Sequence[PreSums] = (),
) -> list[list[int]]:
    """A pass: each bucket's gradient outputs computed straight into one flat buffer, summed
    over ``group_name`` by one all-reduce started after the bucket's last gradient.

    DDP copies each gradient into its bucket and the sum back out; packing by ``cat`` copies
    once and the functional all-reduce copies again into its result. Here the op that
    computes a gradient (a matrix product, a bias's sum) writes its result into the bucket
    through its ``out=`` overload, so the gradient is never copied; one that cannot (an op
    without such an overload, a value something else reads too) is copied in once, right
    after it is computed. With ``in_place`` the all-reduce sums the buffer itself
    (``all_reduce_``) instead of a fresh copy of it. The outputs become views of the summed
    buffer, waited on just before the program returns, so the sum overlaps the rest of
    backward. Numerics are unchanged: the same kernels compute the same values.

    ``buckets`` hold positions in the output tuple. ``pre`` (one per bucket, or none): runs of
    a bucket's gradients that are pending over other axes too (:data:`PreSums`), each summed
    in place over those axes' groups right after its last gradient, before the bucket's sum
    starts: one collective a group for the run, not one a gradient. Returns the buckets left
    for the caller (their gradients of mixed dtypes or devices, or one output given twice).
    """
    graph = graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    left: list[list[int]] = []
    for k, bucket in enumerate(buckets):
        values = [outs[i] for i in bucket]
        if not _bucketable(values, outs):
            left.append(list(bucket))
            continue
        writers = [_writer_of(v, output) for v in values]
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((w.node for w in writers), key=order.__getitem__)
        # the buffer is made from a tensor the first writer reads (under simulated ranks a
        # LocalTensor, so the buffer is one too)
        ref = next((a for a in first.all_input_nodes if _val(a) is not None), None)
        if ref is None:
            left.append(list(bucket))
            continue
        runs = _runs(bucket, pre[k] if pre else {})
        views = _write_bucket(
            graph, values, writers, first, ref, (group_name, runs), in_place, output
        )
        for i, view in zip(bucket, views, strict=True):
            outs[i] = view
        output.args = (tuple(outs),)
        for writer in writers:  # the old views up to the outputs, read by nothing now
            for node in writer.chain:
                graph.erase_node(node)
    graph.lint()
    graph_module.recompile()
    return left


def _bucketable(values: Sequence[Any], outs: Sequence[Any]) -> bool:
    """Tensors of one dtype and device, each output once."""
    metas = [_val(v) for v in values]
    if any(m is None for m in metas) or not metas:
        return False
    first = cast(torch.Tensor, metas[0])
    same = all(m.dtype == first.dtype and m.device == first.device for m in metas)  # type: ignore[union-attr]
    return same and all(sum(o is v for o in outs) == 1 for v in values)


def _runs(bucket: Sequence[int], pre: PreSums) -> list[tuple[tuple[str, ...], int, int]]:
    """``pre``'s runs as (groups, first index in the bucket, count)."""
    out = []
    for groups, positions in pre.items():
        start = list(bucket).index(positions[0])
        if list(bucket[start : start + len(positions)]) != list(positions):
            raise ValueError(f"pre-sum run {list(positions)} is not a run of bucket {list(bucket)}")
        out.append((groups, start, len(positions)))
    return out


def _write_bucket(
    graph: torch.fx.Graph,
    values: Sequence[torch.fx.Node],
    writers: Sequence[_Writer],
    first: torch.fx.Node,
    ref: torch.fx.Node,
    groups: tuple[str, list[tuple[tuple[str, ...], int, int]]],
    in_place: bool,
    output: torch.fx.Node,
) -> list[torch.fx.Node]:
    """Rewrites one bucket (see :func:`write_buckets_in_place`); returns its new outputs.
    ``groups``: the bucket's group and its pre-summed runs (:func:`_runs`)."""
    group_name, runs = groups
    metas = [cast(torch.Tensor, _val(v)) for v in values]
    sizes = [m.numel() for m in metas]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    dtype = metas[0].dtype
    with graph.inserting_before(first):
        buffer = _node(
            graph,
            _A.new_empty.default,
            (ref, [sum(sizes)]),
            first,
            dtype=dtype,
            device=metas[0].device,
        )
        buffer.meta["val"] = torch.empty(sum(sizes), dtype=dtype, device="meta")
    written: list[torch.fx.Node] = []
    for writer, meta, offset in zip(writers, metas, offsets, strict=True):
        written.append(_write(graph, writer, buffer, offset, meta))
    for names, start, count in runs:
        run = written[start : start + count]
        size = sum(sizes[start : start + count])
        piece = torch.empty(size, dtype=dtype, device="meta")
        written.append(_sum_run(graph, buffer, offsets[start], piece, run, names, in_place))
    last = max(written, key=lambda n: _position(graph, n))
    reduce = _F.all_reduce_.default if in_place else _F.all_reduce.default
    with graph.inserting_after(last):
        started = _node(graph, reduce, (buffer, "sum", group_name), last)
        started.meta["val"] = buffer.meta["val"]
    with graph.inserting_before(output):
        done = graph.call_function(_F.wait_tensor.default, (started,))
        done.meta["val"] = buffer.meta["val"]
        return [_slice_view(graph, done, o, m) for o, m in zip(offsets, metas, strict=True)]


def _sum_run(
    graph: torch.fx.Graph,
    buffer: torch.fx.Node,
    offset: int,
    piece: torch.Tensor,
    run: Sequence[torch.fx.Node],
    names: Sequence[str],
    in_place: bool,
) -> torch.fx.Node:
    """Sum ``buffer[offset : offset + piece.numel()]`` (a run of gradients written by ``run``)
    over each group of ``names`` in turn, right after the run's last write; each sum waited
    before the next. Returns the last node, after which the bucket's own sum may start."""
    last = max(run, key=lambda n: _position(graph, n))
    at = last
    for name in names:
        with graph.inserting_after(at):
            view = _slice_view(graph, buffer, offset, piece, like=last)
        reduce = _F.all_reduce_.default if in_place else _F.all_reduce.default
        with graph.inserting_after(view):
            started = _node(graph, reduce, (view, "sum", name), last)
            started.meta["val"] = view.meta["val"]
        with graph.inserting_after(started):
            done = _node(graph, _F.wait_tensor.default, (started,), last)
            done.meta["val"] = view.meta["val"]
        at = done
        if not in_place:  # a simulated rank's sum is a copy: written back into the buffer
            with graph.inserting_after(done):
                at = _node(graph, _A.copy_.default, (view, done), last)
                at.meta["val"] = view.meta["val"]
    return at


def _writer_of(value: torch.fx.Node, output: torch.fx.Node) -> _Writer:
    """Where ``value`` (a gradient output) can be computed into a buffer: its producer, up a
    chain of order-keeping views each read only by the next, when the producer has an
    ``out=`` overload and computes a contiguous tensor; otherwise ``value`` itself (a copy)."""
    chain: list[torch.fx.Node] = []
    node = value
    readers: set[torch.fx.Node] = {output}
    while True:
        if set(node.users) != readers:
            return _Writer(value)
        if node.op != "call_function" or node.target not in _CONTIGUOUS_VIEWS:
            break
        chain.append(node)
        parent = node.args[0]
        if not isinstance(parent, torch.fx.Node):
            return _Writer(value)
        readers, node = {node}, parent
    meta = _val(node)
    out = _out_overload(node.target)
    if out is None or meta is None or not meta.is_contiguous() or meta.numel() != _numel(value):
        return _Writer(value)
    return _Writer(node, out, tuple(chain))


def _write(
    graph: torch.fx.Graph,
    writer: _Writer,
    buffer: torch.fx.Node,
    offset: int,
    meta: torch.Tensor,
) -> torch.fx.Node:
    """Emits one gradient's write into ``buffer``; returns the node that writes."""
    node = writer.node
    if writer.out is None:  # copied in right after it is computed
        with graph.inserting_before(node.next):
            target = _slice_view(graph, buffer, offset, meta, like=node)
            copy = _node(graph, _A.copy_.default, (target, node), node)
            copy.meta["val"] = target.meta["val"]
        return copy
    produced = cast(torch.Tensor, _val(node))
    with graph.inserting_before(node):
        target = _slice_view(graph, buffer, offset, produced, like=node)
        kwargs = {**node.kwargs, "out": target}
        new = graph.call_function(writer.out, tuple(node.args), kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _slice_view(
    graph: torch.fx.Graph,
    flat: torch.fx.Node,
    offset: int,
    meta: torch.Tensor,
    like: torch.fx.Node | None = None,
) -> torch.fx.Node:
    """``flat[offset : offset + numel].view(shape)``, a contiguous piece of a flat buffer, as
    one ``as_strided`` (one op call a step instead of a slice and a view)."""
    stride = torch.empty(meta.shape, device="meta").stride()
    view = _node(graph, _A.as_strided.default, (flat, list(meta.shape), list(stride), offset), like)
    view.meta["val"] = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    return view


def _node(
    graph: torch.fx.Graph,
    target: Any,
    args: tuple[Any, ...],
    like: torch.fx.Node | None,
    **kwargs: Any,
) -> torch.fx.Node:
    """A new call, tagged as ``like`` is (the phase tags the recompute pass reads)."""
    node = graph.call_function(target, args, kwargs)
    if like is not None and "custom" in like.meta:
        node.meta["custom"] = dict(like.meta["custom"])
    return node


def _out_overload(target: Any) -> Any:
    """The ``out=`` overload of an aten op overload: the same arguments plus one keyword-only
    ``out`` tensor it returns (``mm`` -> ``mm.out``, ``sum.dim_IntList`` ->
    ``sum.IntList_out``); None when the op has none."""
    schema = getattr(target, "_schema", None)
    packet = getattr(target, "overloadpacket", None)
    if schema is None or packet is None or schema.is_mutable or len(schema.returns) != 1:
        return None
    want = [(a.name, str(a.type)) for a in schema.arguments]
    for name in packet.overloads():
        candidate = getattr(packet, name)
        args = candidate._schema.arguments
        if (
            [(a.name, str(a.type)) for a in args[:-1]] == want
            and args
            and args[-1].name == "out"
            and args[-1].kwarg_only
            and len(candidate._schema.returns) == 1
        ):
            return candidate
    return None


def _position(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n is node)


def _val(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _numel(node: torch.fx.Node) -> int:
    value = _val(node)
    return -1 if value is None else value.numel()
