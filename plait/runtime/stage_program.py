"""A pipeline stage as a per-rank program: its forward and backward as FX graphs over local
tensors, the collectives explicit.

A stage with tensor parallel inside it (a mesh with ``pp`` and ``tp`` axes) holds its
parameters as DTensors on the tp sub-mesh and runs on DTensors
(:func:`plait.comm.pipeline.stage_on_submesh`): run as it is, every op of every micro-batch
would go through DTensor's dispatch (about 30 us an op on CPU). :class:`StageProgram` traces
that forward once, on the first training micro-batch, together with its backward (AOTAutograd's
joint graph of forward and backward, on fake tensors), and cuts the joint graph into a forward
and a backward graph (torch's default partitioner: the backward keeps what the forward saved,
nothing recomputed). Below DTensor the graphs are local aten ops with every redistribution an
explicit functional collective (``_c10d_functional.all_reduce`` and its ``wait_tensor``),
the same collectives DTensor issues eagerly, in the same places: DESIGN.md's "one path", the
stage as the per-rank program of its slice. The plan's compiled program
(:mod:`plait.runtime.program`) does the same for a whole step.

At run time a training micro-batch's forward calls the forward graph on the parameters' local
pieces and the stage's inputs, inside one autograd function; its backward calls the backward
graph and adds each parameter's local gradient into the parameter's ``.grad`` (a DTensor laid
out as the traced gradient: a pending sum stays pending, reduced once a step by the job as
before). No DTensor dispatch runs between a micro-batch's inputs and its outputs, in forward
or backward. torch's ``PipelineStage`` and its schedules see a module that takes and returns
plain tensors, as before.

Where it runs (:func:`compiles`): stages with axes inside (tensor parallel), fp32, schedules
``gpipe``, ``1f1b``, ``interleaved_1f1b``. Everything else keeps the stage's eager forward:
optimizer parallel (FSDP2's hooks gather and free parameters around the module's forward and
backward), recompute (torch's checkpoint works through saved-tensor hooks and recomputes
eagerly), activation offload (saved-tensor hooks, which a traced backward never calls), mixed
precision (not traced yet), and evaluation, prediction and a forward without gradients, which
run eagerly in any case. The zero-bubble schedules are refused with tensor parallel in the
stages already; they split a backward into its input- and weight-gradient passes through the
autograd graph, which one autograd function hides.

A stage that draws random numbers (dropout: eager DTensor keeps each piece's random stream
apart, a trace would not), a micro-batch whose inputs differ from the traced one's, parameters
no longer laid out as traced, or a trace that fails run the eager forward (``refused`` says
why, with a warning, when it is for good).

The graphs follow DTensor's propagation from the parameters' layouts (as the eager stage
does), not the plan's per-op strategies: the stage is a program over local tensors, not yet a
slice of the plan's own compiled program.

``ParallelConfig(stage_programs=False)`` keeps every stage eager.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from plait._compat import aot_joint_graph, partition_joint_graph, tree_flatten, tree_unflatten
from plait.comm.dtensor import implicit_replication, is_dtensor
from plait.comm.pipeline import PieceLayout, add_piece_to_grad, layout_of, parameter_from_piece
from plait.config import ParallelConfig

__all__ = ["StageProgram", "compile_stage", "compiles"]

logger = logging.getLogger(__name__)


def compiles(config: ParallelConfig, inner: Sequence[str]) -> bool:
    """Whether a pipeline's stages run as compiled programs: axes inside the stages, fp32, no
    optimizer parallel, recompute or activation offload, not a zero-bubble schedule, and
    ``config.stage_programs`` on."""
    return (
        config.stage_programs
        and bool(inner)
        and config.precision == "fp32"
        and config.optimizer_shard is None
        and config.recompute == "none"
        and not config.recompute_modules
        and config.offload != "activations"
        and config.schedule not in ("zero_bubble", "zero_bubble_v")
    )


def compile_stage(module: nn.Module) -> StageProgram:
    """Run ``module`` (a stage whose forward is already wrapped to take and return plain
    tensors, its parameters DTensors) as a :class:`StageProgram`: its ``forward`` is replaced
    in place."""
    program = StageProgram(module)
    module.forward = program  # type: ignore[method-assign]
    return program


class StageProgram:
    """One stage's training forward and backward as FX graphs over local tensors (see the
    module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.eager: Callable[..., Any] = module.forward
        """The stage's forward on DTensors, which the graphs were traced from."""
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in params]
        self.layouts = [layout_of(p) for _, p in params]
        self.buffers = list(module.named_buffers())
        # where each parameter lives: read again on every call (a load may replace it)
        self._owners = [_owner(module, n) for n in self.names]
        self._seen: list[Any] = [p for _, p in params]
        self.forward: torch.fx.GraphModule | None = None
        """The forward graph: parameters' local pieces, buffers and the stage's inputs in;
        its outputs and what the backward reads out. None until the first training
        micro-batch traces it."""
        self.backward: torch.fx.GraphModule | None = None
        """The backward graph: what the forward saved and the outputs' gradients in; the
        parameters' local gradients and the inputs' gradients out."""
        self.calls = 0
        """Micro-batches the graphs ran (forward and backward)."""
        self.refused: str | None = None
        """Why the stage runs eagerly after all, None while it runs as a program."""
        if any(layout is None for layout in self.layouts):
            self.refused = "a parameter is not a DTensor"
        self._grad_layouts: list[PieceLayout | None] = [None] * len(params)
        self._copied: set[int] = set()
        """Backward outputs that are (views of) its inputs or of another output: a
        parameter's gradient made of one is copied before it is kept and added to."""
        self._outputs = 0
        self._out_spec: Any = None
        self._tracing = False
        self._signature: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        if (
            self._tracing
            or self.refused is not None
            or not torch.is_grad_enabled()
            or not self.module.training
            or not all(isinstance(x, torch.Tensor) and not is_dtensor(x) for x in flat)
        ):
            return self.eager(*args, **kwargs)
        signature = (spec, tuple((x.shape, x.dtype, x.requires_grad) for x in flat))
        if self.forward is None:
            self._signature = signature
            self._trace(flat, spec)
            if self.refused is not None:
                return self.eager(*args, **kwargs)
        params = self._parameters()
        if signature != self._signature or params is None:
            return self.eager(*args, **kwargs)  # not what was traced: run it eagerly
        self.calls += 1
        # the parameters themselves go in (the outputs need gradients even where the inputs
        # need none, as on the first stage); the graphs read their local pieces
        outs = _StageFunction.apply(self, *params, *(b for _, b in self.buffers), *flat)
        return tree_unflatten(list(outs), self._out_spec)

    def _parameters(self) -> list[torch.Tensor] | None:
        """The stage's parameters now; None if one is no longer laid out as traced."""
        params = [owner._parameters[attr] for owner, attr in self._owners]
        if any(p is not q for p, q in zip(params, self._seen, strict=True)):
            if not all(
                p is not None and p.requires_grad and layout_of(p) == layout
                for p, layout in zip(params, self.layouts, strict=True)
            ):
                return None
            self._seen = params
        return params  # type: ignore[return-value]

    # ----------------------------------------------------------------------------- tracing

    def _trace(self, inputs: list[torch.Tensor], in_spec: Any) -> None:
        """The joint forward and backward graph of one micro-batch (AOTAutograd, on fake
        tensors; the stage's DTensor ops desugar into local ops and functional collectives),
        cut into the forward and backward graphs (torch's default partitioner)."""
        n_params, n_buffers = len(self.names), len(self.buffers)
        found = self._grad_layouts

        def record(i: int) -> Callable[[PieceLayout], None]:
            return lambda layout: found.__setitem__(i, layout)

        def joint(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state: dict[str, torch.Tensor] = {
                name: parameter_from_piece(piece, layout, record(i))  # type: ignore[arg-type]
                for i, (name, piece, layout) in enumerate(
                    zip(self.names, flat[:n_params], self.layouts, strict=True)
                )
            }
            for (name, _), b in zip(self.buffers, flat[n_params:], strict=False):
                state[name] = b
            args, kwargs = tree_unflatten(list(flat[n_params + n_buffers :]), in_spec)
            out = torch.func.functional_call(self.module, state, args, kwargs)
            leaves, self._out_spec = tree_flatten(out)
            if not all(isinstance(x, torch.Tensor) and not is_dtensor(x) for x in leaves):
                raise TypeError("a stage's outputs must be plain tensors")
            return tuple(leaves)

        with torch.no_grad():
            pieces = [layout_piece(p) for p in self._parameters() or ()]
        example = (*pieces, *(b for _, b in self.buffers), *inputs)
        graph: Any = None
        self._tracing = True
        try:
            with implicit_replication():  # as around the schedule, backward included
                graph = aot_joint_graph(joint, example)
        except Exception as e:
            self.refused = f"its trace failed: {type(e).__name__}: {e}"
        finally:
            self._tracing = False
        if graph is not None:
            seeded = sorted({str(n.target) for n in graph.graph.nodes if _draws_random(n)})
            if seeded:  # eager DTensor keeps the pieces' random streams apart: not traced yet
                self.refused = f"it draws random numbers ({', '.join(seeded)})"
        if self.refused is not None:
            logger.warning("pipeline: a stage runs eagerly on DTensors: %s", self.refused)
            return
        self._outputs = len(graph.graph.find_nodes(op="output")[0].args[0]) - len(example)
        self.forward, self.backward = partition_joint_graph(graph, example, self._outputs)
        self._copied = _aliasing_outputs(self.backward)
        logger.info(
            "pipeline: stage traced into a program of %d forward and %d backward nodes",
            len(self.forward.graph.nodes),
            len(self.backward.graph.nodes),
        )

    def _accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add each parameter's local gradient into its ``.grad``, laid out as traced."""
        params = [owner._parameters[attr] for owner, attr in self._owners]
        for i, (p, layout, g) in enumerate(zip(params, self._grad_layouts, grads, strict=True)):
            if g is not None and p is not None and layout is not None:
                add_piece_to_grad(p, g, layout, copy=i in self._copied)


def layout_piece(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local piece, as a leaf that needs a gradient (to trace with)."""
    return param.to_local().detach().requires_grad_()  # type: ignore[attr-defined, no-any-return]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds parameter ``name`` of ``module``, and its attribute there."""
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _aliasing_outputs(graph: torch.fx.GraphModule) -> set[int]:
    """The indices of ``graph``'s outputs that are one of its inputs, or a view of one, or
    share their value with another output (following view ops back to what they view)."""

    def viewed(node: Any) -> Any:
        while isinstance(node, torch.fx.Node) and isinstance(node.target, torch._ops.OpOverload):
            returns = node.target._schema.returns
            if not returns or returns[0].alias_info is None or not node.args:
                break
            node = node.args[0]
        return node

    outputs = graph.graph.find_nodes(op="output")[0].args[0]
    roots = [viewed(o) if isinstance(o, torch.fx.Node) else None for o in outputs]
    counts = Counter(r for r in roots if r is not None)
    return {
        i for i, r in enumerate(roots) if r is not None and (r.op == "placeholder" or counts[r] > 1)
    }


def _draws_random(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    )


class _StageFunction(torch.autograd.Function):
    """A micro-batch through a :class:`StageProgram`: its forward graph now, its backward
    graph when autograd gets there."""

    @staticmethod
    def forward(ctx: Any, program: StageProgram, *flat: torch.Tensor) -> Any:
        assert program.forward is not None
        n_params = len(program.names)
        pieces = [p.to_local() for p in flat[:n_params]]  # type: ignore[attr-defined]
        out = program.forward(*pieces, *flat[n_params:])  # no gradient mode: no copies
        n = program._outputs
        ctx.program = program
        ctx.save_for_backward(*out[n:])
        return tuple(out[:n])

    @staticmethod
    def backward(ctx: Any, *tangents: torch.Tensor) -> Any:
        program: StageProgram = ctx.program
        assert program.backward is not None
        tangents = tuple(t.contiguous() for t in tangents)
        grads = program.backward(*ctx.saved_tensors, *tangents)
        n_params, n_buffers = len(program.names), len(program.buffers)
        program._accumulate(grads[:n_params])  # the parameters' gradients: added by hand
        return (None, *([None] * (n_params + n_buffers)), *grads[n_params + n_buffers :])
