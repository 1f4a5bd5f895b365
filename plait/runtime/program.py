"""The per-rank program: a Plan compiled into one FX graph over local tensors.

This is the "compile" step of the one path (DESIGN.md, "One path for every mode"; MindSpore's
``step_parallel`` rewrites its graph the same way). The plan's operator executor
(:class:`~plait.runtime.plan_exec.PlanExecutor`) knows, per op, the planned layouts and the
redistributions between them, and runs them on DTensors. Running it once per rank under
``make_fx`` on fake tensors records what that costs *below* DTensor: the local aten ops of the
forward *and* the backward pass, with every redistribution as an explicit functional collective
(``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
``all_to_all_single`` and its ``wait_tensor``). The result is the program one rank runs:

    inputs   grad scale (0-d), then the exported program's inputs as local pieces
             (parameters, buffers, constants, batch leaves; Python batch values are baked in)
    outputs  the loss's local piece, each trained parameter's local gradient (pending sums
             left for the Job's fused reduction), the new local value of each buffer the
             forward updates

A training step is one call of that graph: no DTensor dispatch, no interpreter, no hooks on
the hot path. Parameters stay DTensors for the optimizer, state dicts and checkpoints; the
program reads and the optimizer writes their local pieces.

Simulated worlds (:func:`plait.testing.simulate`) trace every rank's program (a rank's
coordinate on the mesh can enter it as a constant: which chunk it keeps, the vocabulary offset
of a split embedding) and run them in lock step on LocalTensors: a node whose arguments are
the same on every rank runs once for all ranks; a node whose constants differ runs rank by
rank. Collectives run on LocalTensors as functional collectives, so the collective logs of
tests see exactly what real processes issue.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Replicate
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.proxy_tensor import make_fx

from plait._compat import (
    join_rank_pieces,
    rank_pieces,
    simulated_ranks,
    simulation_suspended,
    traced_as_rank,
)
from plait.errors import PlanError, ShardingError

__all__ = ["Program", "ProgramCollective", "compile_program"]

logger = logging.getLogger(__name__)

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
    """One collective of the per-rank program: its node, kind, mesh axis and input bytes."""

    node: str
    kind: str
    axis: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Input:
    """How one exported input enters the traced step (None placements: a baked constant)."""

    kind: InputKind
    target: str | None
    placements: tuple[Any, ...] | None
    shape: torch.Size | None
    stride: tuple[int, ...] | None
    trained: bool
    constant: Any = None


class Program:
    """The compiled per-rank program of a plan (see the module docstring).

    ``str(program)`` (``job.program``) prints this rank's graph with every collective named by
    its mesh axis; :meth:`collectives` lists them.
    """

    def __init__(
        self,
        graphs: dict[int, torch.fx.GraphModule],
        *,
        inputs: Sequence[_Input],
        trained: Sequence[str],
        grad_placements: Sequence[tuple[Any, ...]],
        loss_placements: tuple[Any, ...],
        buffers: Sequence[str],
        axis_of_group: dict[str, str],
        device_mesh: Any,
        rank: int,
        trace_seconds: float,
    ) -> None:
        self.graphs = graphs
        self.inputs = tuple(inputs)
        self.trained = tuple(trained)
        """Parameter names whose local gradients the program returns, in output order."""
        self.grad_placements = tuple(grad_placements)
        """DTensor placements of each returned gradient (pending sums still pending)."""
        self.loss_placements = loss_placements
        self.buffers = tuple(buffers)
        """Buffers the forward updates, in output order."""
        self.axis_of_group = axis_of_group
        self.device_mesh = device_mesh
        self.rank = rank
        self.trace_seconds = trace_seconds
        ranks = sorted(graphs)
        first = graphs[ranks[0]].code
        self._same_code = all(graphs[r].code == first for r in ranks[1:])
        self._ranks = tuple(ranks)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """This rank's program (rank 0's in a simulated world)."""
        return self.graphs[self.rank]

    def collectives(self) -> list[ProgramCollective]:
        """Every collective this rank's program issues, in program order."""
        out: list[ProgramCollective] = []
        for n in self.graph_module.graph.nodes:
            kind = _collective_kind(n)
            if kind is None:
                continue
            value = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            nbytes = 0 if value is None else value.numel() * value.element_size()
            group = n.args[-1] if isinstance(n.args[-1], str) else n.kwargs.get("group_name")
            out.append(ProgramCollective(n.name, kind, self.axis_of_group.get(group, group), nbytes))
        return out

    def __str__(self) -> str:
        collectives = {c.node: c for c in self.collectives()}
        lines = [
            f"# per-rank program (rank {self.rank}): {len(self.graph_module.graph.nodes)} nodes, "
            f"{len(collectives)} collectives, traced in {self.trace_seconds:.2f} s",
            f"# outputs: loss, {len(self.trained)} gradients, {len(self.buffers)} buffers",
        ]
        for line in self.graph_module.code.splitlines():
            name = line.strip().split(" = ", 1)[0]
            c = collectives.get(name)
            if c is not None:
                line += f"  # {c.kind} over {c.axis!r}, {c.nbytes} bytes"
            if line.strip():
                lines.append(line)
        return "\n".join(lines)

    __repr__ = __str__

    # ------------------------------------------------------------------ running

    def run(self, scale: torch.Tensor, flat: Sequence[Any]) -> list[torch.Tensor]:
        """One step of the program on local pieces: [loss, *gradients, *buffers]."""
        args = [scale, *(x for x, spec in zip(flat, self.inputs, strict=True) if spec.placements)]
        if len(self._ranks) == 1:
            return list(self.graphs[self._ranks[0]](*args))
        if self._same_code:  # every rank runs the same code: once, on LocalTensors
            return list(self.graphs[self._ranks[0]](*args))
        return _run_lockstep([self.graphs[r] for r in self._ranks], self._ranks, args)


def _collective_kind(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    target = node.target
    if getattr(target, "namespace", None) != "_c10d_functional":
        return None
    return _KINDS.get(getattr(target, "_opname", ""))


def _run_lockstep(
    graphs: list[torch.fx.GraphModule], ranks: tuple[int, ...], args: list[Any]
) -> list[torch.Tensor]:
    """Run per-rank graphs that differ only in constants, node by node, on LocalTensors."""
    node_lists = [list(g.graph.nodes) for g in graphs]
    count = len(node_lists[0])
    if any(len(nodes) != count for nodes in node_lists):
        raise PlanError(
            "the per-rank programs of this plan differ in length between simulated ranks "
            f"({[len(n) for n in node_lists]} nodes); simulation runs ranks in lock step, which "
            "needs every rank to run the same ops: use shapes that split evenly over the mesh"
        )
    env: dict[str, Any] = {}
    position = 0
    for index in range(count):
        nodes = [nodes[index] for nodes in node_lists]
        first = nodes[0]
        if first.op == "placeholder":
            env[first.name] = args[position]
            position += 1
        elif first.op == "output":
            return list(torch.fx.node.map_arg(first.args[0], lambda n: env[n.name]))
        elif first.op == "get_attr":
            env[first.name] = _join(
                {r: getattr(g, n.target) for r, g, n in zip(ranks, graphs, nodes, strict=True)}  # type: ignore[arg-type]
            )
        else:
            env[first.name] = _run_node(nodes, ranks, env)
    raise PlanError("per-rank program has no output node")


def _run_node(nodes: list[torch.fx.Node], ranks: tuple[int, ...], env: dict[str, Any]) -> Any:
    first = nodes[0]
    shape = [(n.target, repr(n.args), repr(n.kwargs)) for n in nodes]
    if any(s[0] != shape[0][0] for s in shape):
        raise PlanError(
            f"simulated ranks run different ops at {first.name!r}: "
            f"{sorted({str(s[0]) for s in shape})}"
        )
    load = lambda n: env[n.name]  # noqa: E731
    if all(s == shape[0] for s in shape[1:]):  # same call on every rank: once, on LocalTensors
        args = torch.fx.node.map_arg(first.args, load)
        kwargs = torch.fx.node.map_arg(first.kwargs, load)
        return first.target(*args, **kwargs)  # type: ignore[operator]
    outs: dict[int, Any] = {}
    with simulation_suspended():
        for r, n in zip(ranks, nodes, strict=True):
            piece = lambda n: _piece(env[n.name], r, ranks)  # noqa: E731
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
        return type(first)(
            _join({r: o[i] for r, o in outs.items()}) for i in range(len(first))
        )
    if any(o != first for o in outs.values()):
        raise PlanError(f"simulated ranks computed different values {sorted(set(outs.values()))}")
    return first


# --------------------------------------------------------------------------- compiling


def compile_program(
    executor: Any,
    model: torch.nn.Module,
    flat: Sequence[Any],
    *,
    trained: Sequence[str],
    contexts: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Program:
    """Trace ``executor`` (a :class:`~plait.runtime.plan_exec.PlanExecutor`) into a Program.

    ``flat`` are the exported program's inputs as the executor would receive them (DTensor
    parameters, buffers, constants and batch leaves, laid out as planned); only their
    placements, shapes and strides are read. ``trained`` names the parameters that take
    gradients. ``contexts`` enters what the step runs under (autocast, DTensor settings).
    """
    device_mesh = executor.device_mesh
    inputs = _input_specs(executor, flat, set(trained))
    ranks = simulated_ranks()
    own = 0 if ranks is not None else int(torch.distributed.get_rank())
    traced: dict[int, torch.fx.GraphModule] = {}
    record: dict[str, Any] = {}
    started = time.perf_counter()
    for rank in ranks if ranks is not None else (own,):
        with _as_rank(device_mesh, rank, simulated=ranks is not None):
            step = _traced_step(executor, model, inputs, contexts, record)
            locals_ = [torch.zeros((), dtype=torch.float32)] + [
                _local_example(x) for x, spec in zip(flat, inputs, strict=True) if spec.placements
            ]
            graph_module = make_fx(step, tracing_mode="fake")(*locals_)
            # DTensor's first sharding propagation of an op runs it on fake tensors, which the
            # trace records although nothing reads the result: later traces hit its cache.
            graph_module.graph.eliminate_dead_code()
            graph_module.recompile()
            traced[rank] = graph_module
    seconds = time.perf_counter() - started
    names = tuple(device_mesh.mesh_dim_names or ())
    axis_of_group = {device_mesh.get_group(a).group_name: a for a in names}
    program = Program(
        traced,
        inputs=inputs,
        trained=record["trained"],
        grad_placements=record["grad_placements"],
        loss_placements=record["loss_placements"],
        buffers=record["buffers"],
        axis_of_group=axis_of_group,
        device_mesh=device_mesh,
        rank=own,
        trace_seconds=seconds,
    )
    logger.info(
        "compiled per-rank program: %d nodes, %d collectives (%.2f s, %d rank(s) traced)",
        len(program.graph_module.graph.nodes),
        len(program.collectives()),
        seconds,
        len(traced),
    )
    return program


@contextlib.contextmanager
def _as_rank(device_mesh: Any, rank: int, *, simulated: bool) -> Iterator[None]:
    if not simulated:
        yield
        return
    with simulation_suspended(), traced_as_rank(device_mesh, rank):
        yield


def _local_example(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of this rank's local shape (only its metadata is traced)."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    return torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device=local.device)


def _input_specs(executor: Any, flat: Sequence[Any], trained: set[str]) -> list[_Input]:
    out: list[_Input] = []
    for (kind, target), value in zip(executor._sources, flat, strict=True):
        if not isinstance(value, torch.Tensor):
            out.append(_Input(kind, target, None, None, None, False, value))
            continue
        if not isinstance(value, DTensor):
            raise PlanError(f"exported input {target or 'of the batch'} is not laid out")
        out.append(
            _Input(
                kind,
                target,
                tuple(value.placements),
                value.shape,
                tuple(value.stride()),
                kind == InputKind.PARAMETER and target in trained,
            )
        )
    return out


def _traced_step(
    executor: Any,
    model: torch.nn.Module,
    inputs: Sequence[_Input],
    contexts: Callable[[], contextlib.AbstractContextManager[Any]],
    record: dict[str, Any],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The function make_fx traces: local pieces in, local loss, gradients and buffers out."""
    mesh = executor.device_mesh
    signature = executor.captured.program.graph_signature

    def step(scale: torch.Tensor, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pieces = iter(local)
        values: list[Any] = []
        leaves: list[tuple[str, DTensor]] = []
        for spec in inputs:
            if spec.placements is None:
                values.append(spec.constant)
                continue
            value = DTensor.from_local(
                next(pieces),
                mesh,
                spec.placements,
                run_check=False,
                shape=spec.shape,
                stride=spec.stride,
            )
            if spec.trained:
                value = value.detach().requires_grad_(True)
                assert spec.target is not None
                leaves.append((spec.target, value))
            values.append(value)
        with contexts():
            outputs = executor.run_flat(values)
        loss: Any = None
        buffers: list[tuple[str, torch.Tensor]] = []
        for out_spec, value in zip(signature.output_specs, outputs, strict=True):
            if out_spec.kind == OutputKind.BUFFER_MUTATION:
                buffers.append((_strip(out_spec.target), value))
            elif loss is None and out_spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
                loss = value
        _check_loss(loss)
        one = DTensor.from_local(scale, mesh, [Replicate()] * mesh.ndim, run_check=False)
        with contexts():
            grads = torch.autograd.grad(loss * one, [v for _, v in leaves], allow_unused=True)
        kept = [(name, g) for (name, _), g in zip(leaves, grads, strict=True) if g is not None]
        record["trained"] = tuple(name for name, _ in kept)
        record["grad_placements"] = tuple(tuple(g.placements) for _, g in kept)
        record["loss_placements"] = tuple(loss.placements)
        record["buffers"] = tuple(name for name, _ in buffers)
        new_buffers = [_buffer_local(model, name, value) for name, value in buffers]
        return (
            loss.to_local(),
            *(g.to_local() for _, g in kept),
            *new_buffers,
        )

    return step


def _strip(target: str | None) -> str:
    """A path inside capture's wrapper module -> the path in the user's model."""
    target = target or ""
    return target.removeprefix("model.") if target != "model" else ""


def _buffer_local(model: torch.nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """The local piece of a buffer's new value, in the buffer's own layout."""
    buffer = model.get_buffer(name)
    if isinstance(buffer, DTensor):
        if not isinstance(value, DTensor):
            raise PlanError(f"buffer {name!r}: the program computed a plain new value")
        return value.redistribute(buffer.device_mesh, buffer.placements).to_local()
    return value.full_tensor() if isinstance(value, DTensor) else value


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, DTensor):
        raise ShardingError(
            f"loss_fn returned a plain {type(loss).__name__}, not a tensor computed from the "
            "model's output; return the loss tensor itself (no .item() or .detach())"
        )
    if loss.numel() != 1:
        raise ShardingError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; return a scalar loss"
        )
