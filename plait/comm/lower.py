"""Lowering DTensor code to per-rank programs over local tensors, and running them.

A function written on DTensors, traced by ``make_fx`` on fake local tensors, becomes the
program one rank runs: DTensor's sharding propagation happens once, at trace time, and what is
recorded are local aten ops and explicit functional collectives
(``_c10d_functional.all_reduce`` and friends, each followed by ``wait_tensor``). This is the
door :mod:`plait.runtime.program.compile` goes through to compile a plan.

In a simulated world (one process, :func:`plait.testing.simulate`) every rank's program is
traced with that rank's mesh coordinate (which chunk it keeps, the vocabulary offset of a split
embedding may enter as constants), and :func:`run_lockstep` runs them together on LocalTensors:
a node whose arguments are the same on every rank runs once for all ranks (collectives
included, so collective logs see them as real processes issue them); a node whose constants
differ runs rank by rank.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from plait._compat import (
    group_ranks,
    join_rank_pieces,
    rank_pieces,
    simulated_ranks,
    simulation_suspended,
    traced_as_rank,
)
from plait.comm.dtensor import DeviceMesh
from plait.errors import PlanError

__all__ = [
    "ProgramCollective",
    "collective_kind",
    "collectives_of",
    "fuse_output_reductions",
    "run_lockstep",
    "trace_per_rank",
    "traced_ranks",
]

# Functional collective op name -> the kind plans and collective logs use.
_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


@dataclass(frozen=True, slots=True)
class ProgramCollective:
    """One collective of a per-rank program: its node, kind, mesh axis and input bytes."""

    node: str
    kind: str
    axis: str
    nbytes: int


def traced_ranks() -> tuple[tuple[int, ...], int, bool]:
    """(ranks to trace, this process's rank, simulated): every rank when simulated."""
    ranks = simulated_ranks()
    if ranks is not None:
        return ranks, 0, True
    own = int(dist.get_rank())
    return (own,), own, False


def trace_per_rank(
    make_step: Callable[[], Callable[..., Any]],
    examples: Sequence[torch.Tensor],
    device_mesh: DeviceMesh,
) -> dict[int, torch.fx.GraphModule]:
    """``make_step()`` traced by make_fx on fake tensors shaped like ``examples`` (local
    pieces), per rank: ``{rank: program}``, or ``{first rank: program}`` alone when every
    simulated rank runs the same code.

    A rank's coordinate enters its program only as constants that grow with it (the chunk it
    keeps, a vocabulary offset, the size of an uneven last piece), so the first and the last
    rank, which differ on every mesh axis, run the same code only if all ranks do: then the
    others are not traced (each trace costs seconds).
    """
    ranks, _, simulated = traced_ranks()
    traced: dict[int, torch.fx.GraphModule] = {}

    def trace(rank: int) -> torch.fx.GraphModule:
        with _as_rank(device_mesh, rank, simulated=simulated):
            plain = [_plain_example(x) for x in examples]
            graph_module = make_fx(make_step(), tracing_mode="fake")(*plain)
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
        return graph_module

    # The first trace is a warm-up, thrown away: DTensor's first sharding propagation of an
    # op runs it on fake tensors (recorded though unused, mutations included) and may take
    # another decomposition than its cached later calls; every kept trace sees warm caches.
    trace(ranks[0])
    traced[ranks[0]] = trace(ranks[0])
    if len(ranks) == 1:
        return traced
    last = trace(ranks[-1])
    if last.code == traced[ranks[0]].code:
        return traced
    for rank in ranks[1:-1]:
        traced[rank] = trace(rank)
    traced[ranks[-1]] = last
    return traced


def _plain_example(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor with ``value``'s local metadata (a simulated rank's LocalTensor has the
    same shape on every rank when shapes split evenly); only metadata is traced."""
    return torch.empty_strided(
        value.shape, value.stride(), dtype=value.dtype, device=value.device.type
    )


@contextlib.contextmanager
def _as_rank(device_mesh: DeviceMesh, rank: int, *, simulated: bool) -> Iterator[None]:
    if not simulated:
        yield
        return
    with simulation_suspended(), traced_as_rank(device_mesh, rank):
        yield


def collectives_of(
    graph_module: torch.fx.GraphModule, device_mesh: DeviceMesh
) -> list[ProgramCollective]:
    """Every functional collective of a traced program, in program order, by mesh axis."""
    names = tuple(device_mesh.mesh_dim_names or ())
    axis_of_group: dict[str, str] = {str(device_mesh.get_group(a).group_name): a for a in names}
    out: list[ProgramCollective] = []

    def axis_of(group: str) -> str:
        if group not in axis_of_group:
            axis_of_group[group] = _axes_spanned(device_mesh, group)
        return axis_of_group[group]

    for n in graph_module.graph.nodes:
        kind = collective_kind(n)
        if kind is None:
            continue
        value = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        nbytes = 0 if value is None else value.numel() * value.element_size()
        group = n.args[-1] if isinstance(n.args[-1], str) else n.kwargs.get("group_name")
        out.append(ProgramCollective(n.name, kind, axis_of(str(group)), nbytes))
    return out


def collective_kind(node: torch.fx.Node) -> str | None:
    """The kind of a functional collective node (``all_reduce``, ``all_gather``...), as plans
    name them; None for any other node (its ``wait_tensor`` included)."""
    if node.op != "call_function":
        return None
    target = node.target
    if getattr(target, "namespace", None) != "_c10d_functional":
        return None
    return _KINDS.get(getattr(target, "_opname", ""))


def _axes_spanned(device_mesh: DeviceMesh, group: str) -> str:
    """The mesh axes a process group spans, joined by "+" (DTensor flattens several axes into
    one group for a dim split over them); the group's name when it is not on the mesh."""
    try:
        ranks = group_ranks(group)
    except Exception:  # not a registered group: name it as given
        return group
    grid = device_mesh.mesh
    coords = [(grid == r).nonzero().tolist() for r in ranks]
    if any(len(c) != 1 for c in coords):
        return group
    names = tuple(device_mesh.mesh_dim_names or ())
    varying = [names[d] for d in range(grid.ndim) if len({c[0][d] for c in coords}) > 1]
    return "+".join(varying) if varying else group


def run_lockstep(
    graphs: list[torch.fx.GraphModule], ranks: tuple[int, ...], args: list[Any]
) -> list[torch.Tensor]:
    """Run per-rank graphs that differ only in constants, node by node, on LocalTensors.

    Values are kept by node position (node names may differ between ranks' graphs).
    """
    node_lists = [list(g.graph.nodes) for g in graphs]
    count = len(node_lists[0])
    if any(len(nodes) != count for nodes in node_lists):
        raise PlanError(
            "the per-rank programs of this plan differ in length between simulated ranks "
            f"({[len(n) for n in node_lists]} nodes); simulation runs ranks in lock step, which "
            "needs every rank to run the same ops: use shapes that split evenly over the mesh"
        )
    positions = [{n: i for i, n in enumerate(nodes)} for nodes in node_lists]
    env: list[Any] = [None] * count
    position = 0
    for index in range(count):
        nodes = [nodes[index] for nodes in node_lists]
        first = nodes[0]
        if first.op == "placeholder":
            env[index] = args[position]
            position += 1
        elif first.op == "output":
            return list(torch.fx.node.map_arg(first.args[0], lambda n: env[positions[0][n]]))
        elif first.op == "get_attr":
            env[index] = _join(
                {r: getattr(g, n.target) for r, g, n in zip(ranks, graphs, nodes, strict=True)}  # type: ignore[arg-type]
            )
        else:
            env[index] = _run_node(nodes, ranks, env, positions)
    raise PlanError("per-rank program has no output node")


def _run_node(
    nodes: list[torch.fx.Node],
    ranks: tuple[int, ...],
    env: list[Any],
    positions: list[dict[torch.fx.Node, int]],
) -> Any:
    first = nodes[0]
    calls = [
        (
            n.target,
            repr(torch.fx.node.map_arg(n.args, p.__getitem__)),
            repr(torch.fx.node.map_arg(n.kwargs, p.__getitem__)),
        )
        for n, p in zip(nodes, positions, strict=True)
    ]
    if any(c[0] != calls[0][0] for c in calls):
        raise PlanError(
            f"simulated ranks run different ops at {first.name!r}: "
            f"{sorted({str(c[0]) for c in calls})}"
        )
    if all(c == calls[0] for c in calls[1:]):  # same call on every rank: once, on LocalTensors
        load = lambda a: env[positions[0][a]]  # noqa: E731
        args = torch.fx.node.map_arg(first.args, load)
        kwargs = torch.fx.node.map_arg(first.kwargs, load)
        return first.target(*args, **kwargs)  # type: ignore[operator]
    outs: dict[int, Any] = {}
    with simulation_suspended():
        for r, n, p in zip(ranks, nodes, positions, strict=True):

            def piece(arg: torch.fx.Node, r: int = r, p: dict[torch.fx.Node, int] = p) -> Any:
                return _piece(env[p[arg]], r, ranks)

            outs[r] = n.target(  # type: ignore[operator]
                *torch.fx.node.map_arg(n.args, piece), **torch.fx.node.map_arg(n.kwargs, piece)
            )
    return _join(outs)


def _piece(value: Any, rank: int, ranks: tuple[int, ...]) -> Any:
    if isinstance(value, torch.Tensor):
        return rank_pieces(value, ranks)[rank]
    if isinstance(value, tuple | list):
        return type(value)(_piece(v, rank, ranks) for v in value)
    return value


def _join(outs: dict[int, Any]) -> Any:
    first = next(iter(outs.values()))
    if isinstance(first, torch.Tensor):
        return join_rank_pieces(outs)
    if isinstance(first, tuple | list):
        return type(first)(_join({r: o[i] for r, o in outs.items()}) for i in range(len(first)))
    if any(o != first for o in outs.values()):
        raise PlanError(f"simulated ranks computed different values {sorted(set(outs.values()))}")
    return first


def fuse_output_reductions(
    graph_module: torch.fx.GraphModule,
    buckets: Sequence[Sequence[int]],
    group_name: str,
    *,
    pre: Sequence[Mapping[tuple[str, ...], Sequence[int]]] = (),
) -> None:
    """A pass: sum-all-reduce groups of a program's outputs inside the program, in place.

    Each bucket (positions in the output tuple) is flattened into one buffer and all-reduced
    over ``group_name`` right after the last of its values is computed, so the collective
    runs while the rest of the program (the rest of backward) computes; the waits come just
    before the program returns, where the reduced values replace the outputs (DDP's overlapped
    buckets, MindSpore's ``comm_fusion``, as functional collectives in the graph).

    ``pre`` (one per bucket, or none): groups of a bucket's positions pending over other
    axes too, each packed and summed over those groups (by name, one after the other) right
    after its last value, before it joins the bucket
    (:data:`plait.runtime.program.grad_sync.PreSums`).
    """
    graph = graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    functional = torch.ops._c10d_functional
    for k, bucket in enumerate(buckets):
        for names, positions in (pre[k] if pre else {}).items():
            summed = _summed_over(graph, [outs[i] for i in positions], names)
            for i, value in zip(positions, summed, strict=True):
                outs[i] = value
        order = {n: i for i, n in enumerate(graph.nodes)}
        values = [outs[i] for i in bucket]
        metas = [v.meta["val"] for v in values]
        last = max(values, key=lambda v: order[v])
        with graph.inserting_before(last.next):
            flat = [graph.call_function(torch.ops.aten.reshape.default, (v, [-1])) for v in values]
            cat = graph.call_function(torch.ops.aten.cat.default, (flat,))
            total = sum(m.numel() for m in metas)
            cat.meta["val"] = torch.empty(total, dtype=metas[0].dtype, device="meta")
            reduced = graph.call_function(functional.all_reduce.default, (cat, "sum", group_name))
        with graph.inserting_before(output):
            done = graph.call_function(functional.wait_tensor.default, (reduced,))
            sizes = [m.numel() for m in metas]
            pieces = graph.call_function(torch.ops.aten.split_with_sizes.default, (done, sizes))
            for k, (i, m) in enumerate(zip(bucket, metas, strict=True)):
                piece = graph.call_function(operator.getitem, (pieces, k))
                outs[i] = graph.call_function(torch.ops.aten.view.default, (piece, list(m.shape)))
    output.args = (tuple(outs),)
    graph.lint()
    graph_module.recompile()


def _summed_over(
    graph: torch.fx.Graph, values: Sequence[torch.fx.Node], names: Sequence[str]
) -> list[torch.fx.Node]:
    """``values`` packed into one buffer and summed over each group of ``names`` in turn
    (each waited before the next), right after the last of them; their summed views."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    metas = [v.meta["val"] for v in values]
    functional = torch.ops._c10d_functional
    at = max(values, key=lambda v: order[v])
    flat = []
    for v in values:
        with graph.inserting_after(at):
            at = graph.call_function(torch.ops.aten.reshape.default, (v, [-1]))
        flat.append(at)
    with graph.inserting_after(at):
        node = graph.call_function(torch.ops.aten.cat.default, (flat,))
    node.meta["val"] = torch.empty(sum(m.numel() for m in metas), dtype=metas[0].dtype, device="meta")
    for name in names:
        with graph.inserting_after(node):
            started = graph.call_function(functional.all_reduce.default, (node, "sum", name))
        with graph.inserting_after(started):
            done = graph.call_function(functional.wait_tensor.default, (started,))
        started.meta["val"] = done.meta["val"] = node.meta["val"]
        node = done
    with graph.inserting_after(node):
        pieces = graph.call_function(
            torch.ops.aten.split_with_sizes.default, (node, [m.numel() for m in metas])
        )
    out, at = [], pieces
    for k, m in enumerate(metas):
        with graph.inserting_after(at):
            piece = graph.call_function(operator.getitem, (pieces, k))
        with graph.inserting_after(piece):
            at = graph.call_function(torch.ops.aten.view.default, (piece, list(m.shape)))
        at.meta["val"] = m
        out.append(at)
    return out
