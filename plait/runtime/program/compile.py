"""The per-rank program: a Plan compiled into one FX graph over local tensors.

This is the "compile" step of the one path (docs/architecture.md, "Running"; MindSpore's
``step_parallel`` rewrites its graph the same way). The plan's operator executor
(:class:`~plait.runtime.engine.plan_exec.PlanExecutor`) knows, per op, the planned layouts and the
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
import dataclasses
import functools
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind

from plait._compat import annotated, node_meta_preserved, node_tags
from plait.comm.dtensor import (
    DeviceMesh,
    axis_names_of,
    dtensor_from_local,
    is_dtensor,
    local_piece,
    pending_beside,
    replicate_placement,
)
from plait.comm.lower import (
    ProgramCollective,
    collective_kind,
    collectives_of,
    fuse_output_reductions,
    run_lockstep,
    trace_per_rank,
    traced_ranks,
)
from plait.comm.redistribute import replicated_from_local
from plait.errors import ConfigError, PlanError, ShardingError
from plait.runtime.program.grad_sync import write_buckets_in_place
from plait.runtime.program.interleave import COPY_TAG, interleave_copies
from plait.runtime.program.offload import offload_saved
from plait.runtime.program.remat import is_collective, recompute_policy, rematerialize, saved_bytes
from plait.runtime.program.remat import regions as region_map
from plait.runtime.program.zero import (
    ShardedParameter,
    ShardGroups,
    gather_inputs,
    parameter_derived,
    prefetch_regathers,
    reduce_scatter_outputs,
)

if TYPE_CHECKING:
    from plait.comm.dtensor import DTensor

__all__ = ["Program", "ProgramCollective", "check_loss", "compile_program", "strip_wrapper"]

logger = logging.getLogger(__name__)


def _recomputed(
    derived: set[torch.fx.Node],
    policies: Sequence[Callable[[torch.fx.Node], bool]],
    node: torch.fx.Node,
) -> bool:
    """Whether backward recomputes ``node``: a ZeRO-3 regather's result, or a node a recompute
    policy picks that is not a collective (their results are kept)."""
    return node in derived or (not is_collective(node) and any(p(node) for p in policies))


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
        device_mesh: DeviceMesh,
        rank: int,
        trace_seconds: float,
        simulated: bool = False,
        outputs: Sequence[Any] = (),
        copies: int = 1,
    ) -> None:
        self.graphs = graphs
        self.inputs = tuple(inputs)
        """How each exported input enters (a batch input's shape: one copy's)."""
        self.copies = copies
        """Copies of the executor's batch one call runs (multi-copy parallel; 1: off)."""
        self.trained = tuple(trained)
        """Parameter names whose local gradients the program returns, in output order."""
        self.grad_placements = tuple(grad_placements)
        """DTensor placements of each returned gradient (pending sums still pending)."""
        self.grad_meshes: dict[int, Any] = {}
        """Position -> the mesh of a returned gradient not on :attr:`device_mesh` (HSDP's
        shards: their placements are on the mesh with dp cut into replicate and shard dims)."""
        self.loss_placements = loss_placements
        self.outputs = tuple(outputs)
        """A forward program's (``job.predict``'s) outputs, in the model's flat output order:
        each an :class:`OutputSpec` of a tensor the program returns a local piece of, or a
        constant; empty for a training or evaluation program (its output is the loss)."""
        self.buffers = tuple(buffers)
        """Buffers the forward updates, in output order."""
        self.device_mesh = device_mesh
        self.rank = rank
        self.simulated = simulated
        """Traced for a simulated world (several ranks in this process, LocalTensors)."""
        self.trace_seconds = trace_seconds
        ranks = sorted(graphs)
        first = graphs[ranks[0]].code
        self._same_code = all(graphs[r].code == first for r in ranks[1:])
        self._ranks = tuple(ranks)
        self.fused_buckets = 0
        """Gradient buckets all-reduced inside the program (:meth:`fuse_gradient_reduction`)."""
        self._regather: dict[int, set[torch.fx.Node]] = {}
        self.offloaded_bytes = 0
        """Bytes of forward values this rank's program keeps on the host for backward."""
        self.saved_bytes: tuple[int, int] | None = None
        """Bytes of forward values backward reads, before and after :meth:`rematerialize`."""
        self.compiled = False
        """Whether steps run the program through ``torch.compile`` (:meth:`compile`)."""
        self._compiled_fn: Callable[..., Any] | None = None

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """This rank's program (rank 0's in a simulated world)."""
        return self.graphs[self.rank]

    def collectives(self) -> list[ProgramCollective]:
        """Every collective this rank's program issues, in program order (the gradient
        buckets' in-place all-reduces, :meth:`fuse_gradient_reduction`, included)."""
        listed = {c.node: c for c in collectives_of(self.graph_module, self.device_mesh)}
        names = tuple(self.device_mesh.mesh_dim_names or ())
        axis_of = {str(self.device_mesh.get_group(a).group_name): a for a in names}
        out: list[ProgramCollective] = []
        for node in self.graph_module.graph.nodes:
            if node.name in listed:
                out.append(listed[node.name])
            elif node.op == "call_function" and node.target is _F.all_reduce_.default:
                value = _fake(node.args[0])
                nbytes = 0 if value is None else value.numel() * value.element_size()
                group = str(node.args[2])
                out.append(
                    ProgramCollective(node.name, "all_reduce", axis_of.get(group, group), nbytes)
                )
        return out

    def fuse_gradient_reduction(
        self,
        buckets: Sequence[Sequence[int]],
        placements: Sequence[tuple[Any, ...]],
        axis: str,
        *,
        into_buffers: bool = True,
    ) -> None:
        """A pass: all-reduce buckets of gradients over ``axis`` inside the program.

        ``buckets`` hold positions in :attr:`trained`; ``placements`` are the parameters'
        own placements, which those gradients have once reduced. Only gradients pending over
        ``axis`` alone (their parameter's layout but for a pending sum there) join a bucket;
        any other stays for the Job to reduce. The sums start as soon as a bucket's last
        gradient is computed and overlap the rest of backward.

        ``into_buffers``: the ops computing a bucket's gradients write straight into its flat
        buffer, summed in place (:func:`plait.runtime.program.grad_sync.write_buckets_in_place`);
        otherwise they are packed by a copy (``cat``), which torch.compile takes (inductor
        computes a ``cat``'s inputs into its buffer itself; fake tensors lack some ``out=``
        overloads).
        """
        names = tuple(self.device_mesh.mesh_dim_names or ())
        index = names.index(axis)
        chosen, pre = self._bucket_members(buckets, placements, index)
        if not chosen:
            return
        group = self.device_mesh.get_group(axis).group_name
        # Simulated ranks sum a copy of the bucket (the functional all_reduce): torch's
        # CommDebugMode, which tests hold plait's collective log against, does not see an
        # in-place functional collective run on LocalTensors. The sums are the same.
        in_place = not self.simulated
        for graph_module in self.graphs.values():
            outputs = [[1 + i for i in b] for b in chosen]
            sums = [
                {g: [1 + i for i in run] for g, run in by_groups.items()} for by_groups in pre
            ]
            left = outputs
            if into_buffers:
                left = write_buckets_in_place(
                    graph_module, outputs, group, in_place=in_place, pre=sums
                )
            if left:  # gradients of mixed dtypes or devices: packed by a copy
                left_sums = [sums[outputs.index(b)] for b in left]
                fuse_output_reductions(graph_module, left, group, pre=left_sums)
        grad_placements = list(self.grad_placements)
        for bucket in chosen:
            for i in bucket:
                grad_placements[i] = tuple(placements[i])
        self.grad_placements = tuple(grad_placements)
        self.fused_buckets = len(chosen)
        first = self.graphs[self._ranks[0]].code
        self._same_code = all(self.graphs[r].code == first for r in self._ranks[1:])

    def _bucket_members(
        self,
        buckets: Sequence[Sequence[int]],
        placements: Sequence[tuple[Any, ...]],
        index: int,
    ) -> tuple[list[list[int]], list[dict[tuple[str, ...], list[int]]]]:
        """Per non-empty bucket, its members in buffer order (those pending over mesh dim
        ``index`` alone, then runs of those pending over other dims too, where their parameter
        is replicated: a sequence-parallel norm's weight) and those runs by the groups each is
        summed over first (:data:`~plait.runtime.program.grad_sync.PreSums`)."""
        chosen: list[list[int]] = []
        pre: list[dict[tuple[str, ...], list[int]]] = []
        names = tuple(self.device_mesh.mesh_dim_names or ())
        for bucket in buckets:
            alone = [
                i for i in bucket if _pending_only_over(self.grad_placements[i], placements[i], index)
            ]
            runs: dict[tuple[str, ...], list[int]] = {}
            for i in bucket:
                beside = pending_beside(self.grad_placements[i], placements[i], index)
                if beside is not None:
                    groups = tuple(self.device_mesh.get_group(names[k]).group_name for k in beside)
                    runs.setdefault(groups, []).append(i)
            members = alone + [i for run in runs.values() for i in run]
            if members:
                chosen.append(members)
                pre.append(runs)
        return chosen, pre

    def reduce_scatter_gradients(
        self,
        buckets: Sequence[Sequence[ShardedParameter]],
        axis: str,
        groups: ShardGroups | None = None,
    ) -> None:
        """A pass (optimizer parallel, levels 2 and 3): the gradients of each bucket's split
        parameters are reduce-scattered inside the program (within HSDP's shard groups, then
        summed across them, when ``groups`` has them); the program returns this rank's shards
        (:func:`plait.runtime.program.zero.reduce_scatter_outputs`), on ``groups.mesh``
        (:attr:`grad_meshes`)."""
        n, group = self._axis(axis)
        replicate = None
        if groups is not None:
            n, group, replicate = groups.n, groups.group, groups.replicate
        index = list(axis_names_of(self.device_mesh)).index(axis)
        grad_placements = list(self.grad_placements)
        for bucket in buckets:
            for m in bucket:
                have = grad_placements[m.position]
                if not _pending_only_over(have, m.whole_placements or m.placements, index):
                    raise PlanError(
                        f"optimizer_shard: the plan reduces the gradient of {m.name} over "
                        f"{axis!r} alone, but the program computes it as {have}; plan again"
                    )
                grad_placements[m.position] = m.placements
                if m.mesh is not None and m.mesh is not self.device_mesh:
                    self.grad_meshes[m.position] = m.mesh
        for graph_module in self.graphs.values():
            reduce_scatter_outputs(graph_module, buckets, n, group, replicate)
        self.grad_placements = tuple(grad_placements)
        self.fused_buckets += len(buckets)
        self._recheck_code()

    def gather_parameters(
        self,
        buckets: Sequence[Sequence[ShardedParameter]],
        axis: str,
        groups: ShardGroups | None = None,
    ) -> None:
        """A pass (optimizer parallel level 3): the program takes the split parameters' shards
        and all-gathers them (within HSDP's shard groups when ``groups`` has them) before
        forward reads them; :meth:`rematerialize` then has backward gather them again, so no
        whole parameter is kept between the two."""
        n, group = self._axis(axis) if groups is None else (groups.n, groups.group)
        names = {m.name for b in buckets for m in b}
        for rank, graph_module in self.graphs.items():
            placeholders = self._placeholders(graph_module)
            missing = names - set(placeholders)
            if missing:
                raise PlanError(
                    f"optimizer_shard=3: the program has no input for {sorted(missing)}"
                )
            gathered = gather_inputs(graph_module, buckets, placeholders, n, group)
            if not self.trained:  # an evaluation program: no backward to gather them again
                continue
            start = first_backward_node(graph_module)
            self._regather[rank] = parameter_derived(graph_module, gathered, start)
        by_name = {m.name: m for b in buckets for m in b}
        self.inputs = tuple(
            dataclasses.replace(spec, placements=by_name[strip_wrapper(spec.target)].placements)
            if spec.placements is not None and strip_wrapper(spec.target) in by_name
            else spec
            for spec in self.inputs
        )
        self._recheck_code()

    def rematerialize(self, regions: Sequence[tuple[str, ...]] = ()) -> int:
        """The last pass: backward recomputes what it would otherwise keep from forward.

        ``regions`` are (module path, "full" | "selective") pairs, the plan's recompute
        regions (:mod:`plait.runtime.program.remat`); their collectives' results are kept, not issued
        again (MindSpore's ``mp_comm_recompute=False``: the plan's collectives are what runs).
        ZeRO-3's parameter gathers are recomputed (:meth:`gather_parameters`). One rematerialization per rank's graph, so the two never
        keep each other's values alive. Returns the nodes cloned into this rank's backward.
        """
        cloned = 0
        for rank, graph_module in self.graphs.items():
            start = first_backward_node(graph_module)
            before = saved_bytes(graph_module, start) if rank == self.rank else 0
            derived = self._regather.get(rank, set())
            policies = [
                recompute_policy(
                    cast(Literal["full", "selective"], mode),  # the plan's regions hold only these
                    region_map([p for p, m in regions if m == mode]),
                    backward_start=start,
                )
                for mode in sorted({m for _, m in regions})
            ]
            count = rematerialize(
                graph_module,
                backward_start=start,
                recompute=functools.partial(_recomputed, derived, policies),
            )
            if derived:
                prefetch_regathers(graph_module, derived)
            if rank == self.rank:
                cloned = count
                self.saved_bytes = (before, saved_bytes(graph_module, start))
        self._recheck_code()
        return cloned

    def offload_activations(self, *, min_bytes: int = 1 << 20, side_stream: bool = True) -> int:
        """A pass (``offload="activations"``): large forward values backward reads wait in
        host memory in between (:mod:`plait.runtime.program.offload`). Returns this rank's bytes moved
        per step."""
        device = torch.device(self.device_mesh.device_type)
        moved = 0
        for rank, graph_module in self.graphs.items():
            count = offload_saved(
                graph_module,
                first_backward_node(graph_module),
                device=device,
                min_bytes=min_bytes,
                side_stream=side_stream,
            )
            if rank == self.rank:
                moved = count
        self.offloaded_bytes = moved
        self._recheck_code()
        return moved

    def reduce_loss_early(self) -> bool:
        """A pass: the loss's pending mean (or sum) over one mesh axis is all-reduced inside
        the program, started as soon as forward has computed it and waited on just before
        the program returns, so it runs while backward computes; the Job then reads a
        replicated loss and issues no collective of its own after the program (DDP's step
        has none either). The same collective DTensor would issue (same op, group and
        tensor), moved. A loss pending over several axes (reduced one axis at a time, as
        the plan lists them) or by another rule stays for the Job. Returns whether it moved.
        """
        partial = [i for i, p in enumerate(self.loss_placements) if p.is_partial()]
        if len(partial) != 1:
            return False
        dim = partial[0]
        placement = self.loss_placements[dim]
        op = getattr(placement, "reduce_op", None)
        # exactly DTensor's Partial: its subclasses (a masked partial) reduce by other rules
        if type(placement).__name__ != "Partial" or op not in ("sum", "avg"):
            return False
        group = self.device_mesh.get_group(dim).group_name
        for graph_module in self.graphs.values():
            _all_reduce_output(graph_module, 0, cast(str, op), group)
        self.loss_placements = tuple(
            replicate_placement() if i == dim else p for i, p in enumerate(self.loss_placements)
        )
        self._recheck_code()
        return True

    def issue_batch_collectives_early(self) -> int:
        """A pass: collectives computed from the batch alone (the global count of targets a
        mean loss divides by) start at the top of the program, before the forward, and are
        waited on where their result is first needed, so they run while the forward computes
        instead of stopping it midway. Collectives that read parameters or activations stay
        where they are (hoisting ZeRO-3's gathers would hold every parameter whole).
        Returns how many this rank's program moved."""
        batch = {
            i
            for i, spec in enumerate(s for s in self.inputs if s.placements is not None)
            if spec.kind == InputKind.USER_INPUT
        }
        moved = 0
        for rank, graph_module in self.graphs.items():
            count = issue_early(graph_module, batch)
            if rank == self.rank:
                moved = count
        self._recheck_code()
        return moved

    def _axis(self, axis: str) -> tuple[int, str]:
        index = list(axis_names_of(self.device_mesh)).index(axis)
        return int(self.device_mesh.size(index)), self.device_mesh.get_group(axis).group_name

    def _placeholders(self, graph_module: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
        """Parameter name -> its placeholder (the first placeholder is the loss scale)."""
        nodes = [n for n in graph_module.graph.nodes if n.op == "placeholder"][1:]
        laid_out = [spec for spec in self.inputs if spec.placements is not None]
        return {
            strip_wrapper(spec.target): node
            for spec, node in zip(laid_out, nodes, strict=True)
            if spec.kind == InputKind.PARAMETER
        }

    def _recheck_code(self) -> None:
        first = self.graphs[self._ranks[0]].code
        self._same_code = all(self.graphs[r].code == first for r in self._ranks[1:])

    def compile(self) -> None:
        """Run this rank's program through ``torch.compile`` (inductor) from the next step.

        Real processes only: simulated ranks run LocalTensors, which torch.compile does not
        take. The first step pays the compilation; the graph is static (one batch shape).
        """
        if self.simulated:
            raise ConfigError(
                "ParallelConfig(compile=True) runs on real processes (plait run, torchrun); "
                "simulated ranks run the per-rank programs uncompiled: leave compile False "
                "under plait.testing.simulate"
            )
        self._compiled_fn = torch.compile(self.graph_module, fullgraph=True, dynamic=False)
        self.compiled = True

    def __str__(self) -> str:
        collectives = {c.node: c for c in self.collectives()}
        lines = [
            f"# per-rank program (rank {self.rank}): {len(self.graph_module.graph.nodes)} nodes, "
            f"{len(collectives)} collectives, traced in {self.trace_seconds:.2f} s",
            f"# outputs: loss, {len(self.trained)} gradients, {len(self.buffers)} buffers",
        ]
        if self.offloaded_bytes:
            lines.append(f"# kept on the host for backward: {self.offloaded_bytes} bytes")
        if self.saved_bytes is not None:
            lines.append(
                "# kept from forward for backward: "
                f"{self.saved_bytes[1]} bytes ({self.saved_bytes[0]} before recompute)"
            )
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
        if self._compiled_fn is not None:
            return list(self._compiled_fn(*args))
        if len(self._ranks) == 1:
            return list(self.graphs[self._ranks[0]](*args))
        if self._same_code:  # every rank runs the same code: once, on LocalTensors
            return list(self.graphs[self._ranks[0]](*args))
        return run_lockstep([self.graphs[r] for r in self._ranks], self._ranks, args)


# --------------------------------------------------------------------------- compiling


def compile_program(
    executor: Any,
    model: torch.nn.Module,
    flat: Sequence[Any],
    *,
    trained: Sequence[str],
    contexts: Callable[[], contextlib.AbstractContextManager[Any]],
    outputs: bool = False,
    copies: int = 1,
) -> Program:
    """Trace ``executor`` (a :class:`~plait.runtime.engine.plan_exec.PlanExecutor`) into a Program.

    ``flat`` are the exported program's inputs as the executor would receive them (DTensor
    parameters, buffers, constants and batch leaves, laid out as planned); only their
    placements, shapes and strides are read. ``trained`` names the parameters that take
    gradients; none: an evaluation program, the forward alone (its outputs the loss and any
    buffers it updates). ``contexts`` enters what the step runs under (autocast, DTensor
    settings). ``outputs``: a forward program of a model without its loss (``job.predict``):
    it returns the local pieces of the model's tensor outputs (:attr:`Program.outputs` says
    how each is laid out) and nothing is trained. ``copies`` (a training program): multi-copy
    parallel (``ParallelConfig.interleave_num``): the program's batch inputs hold that many
    of the executor's batches along dim 0, each run through the executor, their losses
    averaged, and the graph ordered so the copies take turns at their collectives
    (:mod:`plait.runtime.program.interleave`).
    """
    device_mesh = executor.device_mesh
    inputs = _input_specs(executor, flat, set(trained))
    _, own, simulated = traced_ranks()
    record: dict[str, Any] = {}
    started = time.perf_counter()
    examples = [torch.zeros((), dtype=torch.float32)] + [
        _copies_of(local_piece(x), copies) if spec.kind == InputKind.USER_INPUT else local_piece(x)
        for x, spec in zip(flat, inputs, strict=True)
        if spec.placements
    ]
    traced_fn = (
        functools.partial(_traced_forward, executor, model, inputs, contexts, record)
        if outputs
        else functools.partial(_traced_step, executor, model, inputs, contexts, record, copies)
    )
    traced = trace_per_rank(traced_fn, examples, device_mesh)
    seconds = time.perf_counter() - started
    for graph_module in traced.values():
        drop_aliases(graph_module)
        if copies > 1:
            interleave_copies(graph_module, copies, first_backward_node(graph_module))
        _tag_planned_reasons(graph_module, executor.plan)
    program = Program(
        traced,
        inputs=inputs,
        trained=record["trained"],
        grad_placements=record["grad_placements"],
        loss_placements=record["loss_placements"],
        buffers=record["buffers"],
        device_mesh=device_mesh,
        rank=own,
        trace_seconds=seconds,
        simulated=simulated,
        outputs=record.get("outputs", ()),
        copies=copies,
    )
    logger.info(
        "compiled per-rank program: %d nodes, %d collectives (%.2f s, %d rank(s) traced)",
        len(program.graph_module.graph.nodes),
        len(program.collectives()),
        seconds,
        len(traced),
    )
    return program


def _tag_planned_reasons(graph_module: torch.fx.GraphModule, plan: Any) -> None:
    """Tag each collective node with the plan's reason for it (``plait_reason``), found by the
    plan op its node was traced from and its kind, so a hang report can say why the program
    waits there (:mod:`plait.launch.hang`)."""
    reasons: dict[tuple[str, str], str] = {}
    for planned in plan.collectives:
        reasons.setdefault((planned.op, planned.kind), planned.reason)
    for node in graph_module.graph.nodes:
        kind = collective_kind(node)
        tags = node_tags(node)
        op = tags.get("plait_op")
        if kind is None or not isinstance(op, str) or (op, kind) not in reasons:
            continue
        node.meta["custom"] = {**tags, "plait_reason": reasons[(op, kind)]}


def _input_specs(executor: Any, flat: Sequence[Any], trained: set[str]) -> list[_Input]:
    out: list[_Input] = []
    for (kind, target), value in zip(executor._sources, flat, strict=True):
        if not isinstance(value, torch.Tensor):
            out.append(_Input(kind, target, None, None, None, False, value))
            continue
        if not is_dtensor(value):
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


def _copies_of(piece: torch.Tensor, copies: int) -> torch.Tensor:
    """An example batch input holding ``copies`` of ``piece`` along dim 0 (shapes only)."""
    return piece if copies == 1 else torch.cat([piece] * copies)


def _traced_step(
    executor: Any,
    model: torch.nn.Module,
    inputs: Sequence[_Input],
    contexts: Callable[[], contextlib.AbstractContextManager[Any]],
    record: dict[str, Any],
    copies: int = 1,
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The function make_fx traces: local pieces in, local loss, gradients and buffers out;
    with ``copies``, the executor run on each copy of the batch, the losses averaged."""
    mesh = executor.device_mesh
    signature = executor.captured.program.graph_signature

    def step(scale: torch.Tensor, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves: list[tuple[str, torch.Tensor]] = []
        runs = _copy_inputs(inputs, local, mesh, copies)
        for i, spec in enumerate(inputs):
            if spec.trained:  # one leaf, read by every copy: autograd sums their gradients
                leaf = runs[0][i].detach().requires_grad_(True)
                for run in runs:
                    run[i] = leaf
                assert spec.target is not None
                leaves.append((spec.target, leaf))
        losses: list[Any] = []
        buffers: list[tuple[str, torch.Tensor]] = []
        for run in runs:
            with node_meta_preserved(), contexts():
                outputs = executor.run_flat(run)
            loss: Any = None
            for out_spec, value in zip(signature.output_specs, outputs, strict=True):
                if out_spec.kind == OutputKind.BUFFER_MUTATION:
                    buffers.append((strip_wrapper(out_spec.target), value))
                elif loss is None and out_spec.kind in (
                    OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT
                ):  # fmt: skip
                    loss = value
            check_loss(loss)
            losses.append(loss)
        if copies > 1:
            _refuse_buffer_updates(buffers, copies)
            with node_meta_preserved(), contexts():
                loss = functools.reduce(operator.add, losses) / copies
        grads: Sequence[torch.Tensor | None] = ()
        if leaves:  # an evaluation program (nothing trained) is its forward alone
            with node_meta_preserved(), annotated({"plait_phase": "backward"}), contexts():
                # The seed is what ``loss.backward()`` would use (DTensor's ones_like of the
                # loss), times the loss scale: fp16 scaling must act inside backward.
                seed = torch.ones_like(loss) * replicated_from_local(scale.to(loss.dtype), mesh)
                grads = torch.autograd.grad(
                    loss, [v for _, v in leaves], grad_outputs=seed, allow_unused=True
                )
        # the leaves are DTensors, so are their gradients
        kept = [
            (name, cast("DTensor", g))
            for (name, _), g in zip(leaves, grads, strict=True)
            if g is not None
        ]
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


@dataclasses.dataclass(frozen=True, slots=True)
class OutputSpec:
    """One output of a forward program: a tensor, returned as its local piece, laid out by
    ``placements`` with global ``shape`` and ``stride``; or a ``constant`` (a Python value)."""

    placements: tuple[Any, ...] | None
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    constant: Any = None


def _copy_inputs(
    inputs: Sequence[_Input], local: Sequence[torch.Tensor], mesh: DeviceMesh, copies: int
) -> list[list[Any]]:
    """The executor's inputs for each copy: parameters, buffers and constants shared, each
    batch input's local piece cut into ``copies`` along dim 0 (this rank's part of each copy:
    its rows of the batch, whatever their layout, cut alike on every rank), the cut tagged
    with its copy for :func:`~plait.runtime.program.interleave.interleave_copies`."""
    if copies == 1:
        return [_laid_out_inputs(inputs, local, mesh)]
    runs: list[list[Any]] = [[] for _ in range(copies)]
    pieces = iter(local)
    for spec in inputs:
        if spec.placements is None:
            for run in runs:
                run.append(spec.constant)
            continue
        assert spec.shape is not None and spec.stride is not None
        piece = next(pieces)
        if spec.kind != InputKind.USER_INPUT:
            value = dtensor_from_local(piece, mesh, spec.placements, spec.shape, spec.stride)
            for run in runs:
                run.append(value)
            continue
        rows = piece.shape[0] // copies
        for j, run in enumerate(runs):
            with node_meta_preserved(), annotated({COPY_TAG: j}):
                part = piece.narrow(0, j * rows, rows)
            run.append(dtensor_from_local(part, mesh, spec.placements, spec.shape, spec.stride))
    return runs


def _refuse_buffer_updates(buffers: Sequence[tuple[str, torch.Tensor]], copies: int) -> None:
    """Copies run side by side: a buffer the exported forward returns updated (an output, not
    an in-place update, which each copy applies after the one before, as BatchNorm's running
    statistics are) would be computed by each copy from the same old value, and all but one
    copy's update lost."""
    if buffers:
        names = sorted({name for name, _ in buffers})
        raise ConfigError(
            f"ParallelConfig(interleave_num={copies}): the model's forward returns updated "
            f"buffers ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}), which copies "
            "run side by side cannot: each would compute them from the same old value; leave "
            "interleave_num out for this model, or update the buffers in place"
        )


def _laid_out_inputs(
    inputs: Sequence[_Input], local: Sequence[torch.Tensor], mesh: DeviceMesh
) -> list[Any]:
    """The executor's inputs from the program's local pieces (constants as they are)."""
    pieces = iter(local)
    values: list[Any] = []
    for spec in inputs:
        if spec.placements is None:
            values.append(spec.constant)
            continue
        assert spec.shape is not None and spec.stride is not None
        values.append(
            dtensor_from_local(next(pieces), mesh, spec.placements, spec.shape, spec.stride)
        )
    return values


def _traced_forward(
    executor: Any,
    model: torch.nn.Module,
    inputs: Sequence[_Input],
    contexts: Callable[[], contextlib.AbstractContextManager[Any]],
    record: dict[str, Any],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """What make_fx traces for a forward program: local pieces in; the local pieces of the
    model's tensor outputs and of the buffers it updates out."""
    mesh = executor.device_mesh
    signature = executor.captured.program.graph_signature

    def forward(scale: torch.Tensor, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        del scale  # the programs' common first input: nothing is scaled without a backward
        values = _laid_out_inputs(inputs, local, mesh)
        with node_meta_preserved(), contexts():
            outputs = executor.run_flat(values)
        specs: list[OutputSpec] = []
        pieces: list[torch.Tensor] = []
        buffers: list[tuple[str, torch.Tensor]] = []
        for out_spec, value in zip(signature.output_specs, outputs, strict=True):
            if out_spec.kind == OutputKind.BUFFER_MUTATION:
                buffers.append((strip_wrapper(out_spec.target), value))
            elif out_spec.kind != OutputKind.USER_OUTPUT:
                continue
            elif isinstance(value, torch.Tensor) and is_dtensor(value):
                dt = cast("DTensor", value)
                specs.append(OutputSpec(tuple(dt.placements), tuple(dt.shape), dt.stride()))
                pieces.append(dt.to_local())
            else:
                specs.append(OutputSpec(None, constant=value))
        record["trained"] = record["grad_placements"] = ()
        record["loss_placements"] = ()
        record["outputs"] = tuple(specs)
        record["buffers"] = tuple(name for name, _ in buffers)
        new_buffers = [_buffer_local(model, name, value) for name, value in buffers]
        return (*pieces, *new_buffers)

    return forward


def forward_outputs(program: Program, out: Sequence[torch.Tensor]) -> list[Any]:
    """A forward program's results as the model's flat outputs: DTensors laid out as traced,
    constants as they were."""
    pieces = iter(out)
    values: list[Any] = []
    for spec in program.outputs:
        if spec.placements is None:
            values.append(spec.constant)
        else:
            piece = next(pieces)
            values.append(
                dtensor_from_local(
                    piece, program.device_mesh, spec.placements, spec.shape, spec.stride
                )
            )
    return values


_A = torch.ops.aten
_F = torch.ops._c10d_functional
_VIEWS = frozenset(
    {
        _A.detach.default,
        _A.alias.default,
        _A.view.default,
        _A._unsafe_view.default,
        _A.t.default,
        _A.transpose.int,
        _A.permute.default,
        _A.expand.default,
    }
)
"""Ops that never copy: a result with its source's shape, strides and storage offset is its
source (the program runs without autograd, so ``detach`` is a view too). Not ``reshape``,
which copies when it cannot view: a copy can have an ancestor's geometry and other values."""


def drop_aliases(graph_module: torch.fx.GraphModule) -> int:
    """Drops the program's no-op views: a view taken again of the same tensor with the same
    arguments is the first one, and a view (``detach``, ``view``, ``t``, ``transpose``, ...)
    whose fake value has the shape, strides and storage offset of a tensor up its chain of
    views is that tensor (``t(t(w))`` is ``w``), and ``view(view(x, a), b)`` is ``view(x, b)``
    where that gives the same strides.
    Tracing through DTensor leaves hundreds of them: a two-layer GPT's dp program drops from
    726 nodes to about 400, each a Python call saved per step. Returns the nodes dropped."""
    graph = graph_module.graph
    before = len(graph.nodes)
    seen: dict[tuple[Any, ...], torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _VIEWS:
            continue
        head = _same_ancestor(node)
        if head is not None:
            node.replace_all_uses_with(head)
            graph.erase_node(node)
            continue
        _skip_inner_view(graph, node)
        key = (node.target, _hashable(node.args), _hashable(sorted(node.kwargs.items())))
        try:
            same = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument: leave the node alone
            continue
        if same is not node:  # the same view of the same tensor, taken again
            node.replace_all_uses_with(same)
            graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    graph_module.recompile()
    return before - len(graph.nodes)


def issue_early(graph_module: torch.fx.GraphModule, batch: set[int], *, max_nodes: int = 16) -> int:
    """Moves each functional collective whose inputs come from the batch placeholders alone
    (``batch``: positions among the laid-out inputs, after the grad-scale input), through at
    most ``max_nodes`` ops, to the top of the program with those ops; its ``wait_tensor``
    moves down to just before the first node that reads the result. Returns how many moved."""
    graph = graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    allowed = {placeholders[1 + i] for i in batch if 1 + i < len(placeholders)}
    moved = 0
    for node in list(graph.nodes):
        if not _is_collective_start(node):
            continue
        cone = _batch_cone(node, allowed, max_nodes)
        if cone is None:
            continue
        inside = set(cone)
        anchor = next(n for n in graph.nodes if n.op != "placeholder" and n not in inside)
        for n in cone:
            anchor.prepend(n)
        moved += 1
    # waits only move down, before a reader: the other nodes keep their order
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _F.wait_tensor.default and node.users:
            first = min(node.users, key=order.__getitem__)
            if first is not node.next:
                first.prepend(node)
    graph.lint()
    graph_module.recompile()
    return moved


def _all_reduce_output(
    graph_module: torch.fx.GraphModule, index: int, op: str, group_name: str
) -> None:
    """Output ``index`` (computed by forward) all-reduced (``op``: "sum" or "avg") over
    ``group_name``: started where backward starts, waited on just before the program
    returns.

    The collective is tagged as backward's first node: its result is then no forward value
    backward reads, which the recompute and offload passes would keep, move or copy before
    it is waited on."""
    graph = graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    value = outs[index]
    order = {n: i for i, n in enumerate(graph.nodes)}
    start = next((n for n in graph.nodes if node_tags(n).get("plait_phase") == "backward"), None)
    if start is None or order[start] < order[value]:
        start = value.next
    with graph.inserting_before(start):
        started = graph.call_function(_F.all_reduce.default, (value, op, group_name))
    started.meta["val"] = value.meta.get("val")
    if "custom" in start.meta:
        started.meta["custom"] = dict(start.meta["custom"])
    with graph.inserting_before(output):
        done = graph.call_function(_F.wait_tensor.default, (started,))
    done.meta["val"] = value.meta.get("val")
    outs[index] = done
    output.args = (tuple(outs),)
    graph.lint()
    graph_module.recompile()


def _is_collective_start(node: torch.fx.Node) -> bool:
    """A functional collective (not the wait on one)."""
    return is_collective(node) and node.target is not _F.wait_tensor.default


def _batch_cone(
    start: torch.fx.Node, allowed: set[torch.fx.Node], max_nodes: int
) -> list[torch.fx.Node] | None:
    """``start`` and the ops it depends on, inputs first, if they read only ``allowed``
    placeholders and number at most ``max_nodes``; None otherwise."""
    out: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()

    def visit(node: torch.fx.Node) -> bool:
        if node in seen:
            return True
        seen.add(node)
        if node.op == "placeholder":
            return node in allowed
        if node.op != "call_function" or len(out) >= max_nodes:
            return False
        if not all(visit(i) for i in node.all_input_nodes):
            return False
        out.append(node)
        return True

    return out if visit(start) else None


_RESHAPES = frozenset({_A.view.default, _A._unsafe_view.default})


def _skip_inner_view(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """``view(view(x, a), b)`` becomes ``view(x, b)`` when only it reads the inner view and
    ``x`` views straight to ``b`` with the same strides."""
    inner = node.args[0]
    if (
        node.target not in _RESHAPES
        or not isinstance(inner, torch.fx.Node)
        or inner.op != "call_function"
        or inner.target not in _RESHAPES
        or len(inner.users) != 1
        or not isinstance(inner.args[0], torch.fx.Node)
    ):
        return
    base, want = _fake(inner.args[0]), _fake(node)
    if base is None or want is None:
        return
    probe = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device="meta")
    try:
        direct = probe.view(want.shape)
    except RuntimeError:
        return
    if direct.stride() == want.stride() and base.storage_offset() == want.storage_offset():
        node.args = (inner.args[0], *node.args[1:])
        graph.erase_node(inner)


def _hashable(value: Any) -> Any:
    """Lists (an FX node's shape arguments) as tuples, so arguments can key a dict."""
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    return value


def _same_ancestor(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor up ``node``'s chain of views with its shape, strides and offset, if any."""
    want = _fake(node)
    if want is None:
        return None
    src = node.args[0]
    while isinstance(src, torch.fx.Node):
        have = _fake(src)
        if have is None:
            return None
        if (
            have.shape == want.shape
            and have.stride() == want.stride()
            and have.storage_offset() == want.storage_offset()
        ):
            return src
        if src.op != "call_function" or src.target not in _VIEWS:
            return None
        src = src.args[0]
    return None


def _fake(node: torch.fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def first_backward_node(graph_module: torch.fx.GraphModule) -> torch.fx.Node:
    """The first node of the program's backward part (tagged when traced)."""
    for node in graph_module.graph.nodes:
        if node_tags(node).get("plait_phase") == "backward":
            return node
    raise PlanError("the per-rank program has no backward part to recompute for")


def _pending_only_over(have: tuple[Any, ...], own: tuple[Any, ...], index: int) -> bool:
    """``have`` is ``own`` but for a pending sum on mesh dim ``index``."""
    if len(have) != len(own) or not have[index].is_partial():
        return False
    if getattr(have[index], "reduce_op", "sum") != "sum":
        return False
    return all(h == o for k, (h, o) in enumerate(zip(have, own, strict=True)) if k != index)


def strip_wrapper(target: str | None) -> str:
    """A path inside capture's wrapper module -> the path in the user's model."""
    target = target or ""
    return target.removeprefix("model.") if target != "model" else ""


def _buffer_local(model: torch.nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """The local piece of a buffer's new value, in the buffer's own layout."""
    buffer = model.get_buffer(name)
    if is_dtensor(buffer):
        if not is_dtensor(value):
            raise PlanError(f"buffer {name!r}: the program computed a plain new value")
        return value.redistribute(buffer.device_mesh, buffer.placements).to_local()
    return value.full_tensor() if is_dtensor(value) else value


def check_loss(loss: Any) -> None:
    """A loss function's result must be a scalar computed from the model (a DTensor here)."""
    if not is_dtensor(loss):
        raise ShardingError(
            f"loss_fn returned a plain {type(loss).__name__}, not a tensor computed from the "
            "model's output; return the loss tensor itself (no .item() or .detach())"
        )
    if loss.numel() != 1:
        raise ShardingError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; return a scalar loss"
        )
