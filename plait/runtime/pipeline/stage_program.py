"""A pipeline stage as a per-rank program: its forward and backward as FX graphs over local
tensors, the collectives explicit.

A stage with tensor parallel inside it (a mesh with ``pp`` and ``tp`` axes) holds its
parameters as DTensors on the tp sub-mesh and runs on DTensors
(:func:`plait.comm.pipeline.stage_on_submesh`): run as it is, every op of every micro-batch
would go through DTensor's dispatch (about 30 us an op on CPU). A stage without (pp x dp)
holds plain parameters: the same program is its own ops, and its recompute the graph pass
below instead of torch's checkpoint (:attr:`StageProgram.plain`). :class:`StageProgram` traces
that forward once, on the first training micro-batch, together with its backward (AOTAutograd's
joint graph of forward and backward, on fake tensors), and cuts the joint graph into a forward
and a backward graph (torch's default partitioner: the backward keeps what the forward saved,
nothing recomputed). Below DTensor the graphs are local aten ops with every redistribution an
explicit functional collective (``_c10d_functional.all_reduce`` and its ``wait_tensor``),
the same collectives DTensor issues eagerly, in the same places: the one path of
docs/architecture.md, the stage as the per-rank program of its slice. The plan's compiled program
(:mod:`plait.runtime.program.compile`) does the same for a whole step.

At run time a training micro-batch's forward calls the forward graph on the parameters' local
pieces and the stage's inputs, inside one autograd function; its backward calls the backward
graph and adds each parameter's local gradient into the parameter's ``.grad`` (a DTensor laid
out as the traced gradient: a pending sum stays pending, reduced once a step by the job as
before). No DTensor dispatch runs between a micro-batch's inputs and its outputs, in forward
or backward. torch's ``PipelineStage`` and its schedules see a module that takes and returns
plain tensors, as before.

Zero bubble (``weight_pass=True``, the schedules ``zero_bubble`` and ``zero_bubble_v``): the
schedule runs a micro-batch's backward in two passes, its input gradients (B) first and its
weight gradients (W) later, where they fill the bubble. torch finds the two passes by walking
the autograd graph, which one autograd function hides (and whose in-place detach of the stage's
outputs DTensor views refuse), so the traced backward graph is cut in two instead
(:func:`split_backward`): an input-gradient graph, every node the inputs' gradients need, which
also hands out the values the weight gradients read from it (each layer's output gradient,
which the weight gradient multiplies by the saved input), and a weight-gradient graph, the
nodes only the parameters' gradients need. The autograd function's backward runs the first and
keeps what the second reads; torch's stage calls :meth:`StageProgram.weight_pass` (its
``dw_builder``) right after that backward, and the runner it returns, when the schedule's W
action comes, runs the weight-gradient graph and adds the gradients into ``.grad``. So the
weight pass is deferred as the schedule intends (the micro-batch's output gradients and saved
activations that it reads are held until it runs, as in torch's own split).

Where it runs (:func:`compiles`): every stage, axes inside (tensor parallel) or not, every
schedule, fp32 or mixed precision. Under ``precision="bf16"`` or ``"fp16"`` the stage's autocast
(:func:`plait.runtime.pipeline.stage_wrappers.autocast_stage`) is active when the first micro-batch is
traced, so the graphs hold autocast's casts as explicit ops (the products in bf16, the
norms and the softmax in fp32, as eager autocast runs them) and the backward graph their
casts back. Activation offload (``offload="activations"``) enters its saved-tensor hooks
around the call of the program's autograd function (:attr:`StageProgram.saving`), so what
the forward graph hands the backward graph moves to the host; the trace runs outside them.
Optimizer parallel (FSDP2 on the stage module) keeps its hooks on the module: the pre-forward
hook gathers the parameters before the program's call, ZeRO-3's pre-backward hook gathers them
again before the backward graph runs, and the gradients the program adds to the unsharded
parameters are reduce-scattered by FSDP2's post-backward; the trace calls the stage's own
forward with the traced parameters in place, not the module (whose hooks would put FSDP2's
back). Everything else keeps the stage's eager forward: optimizer parallel beside mixed
precision (FSDP2's bf16 gathers under autocast do not trace yet). Evaluation, prediction
and any forward without gradients run a forward graph of their own (:meth:`StageProgram._forward_only`:
the stage's forward alone, traced once per input signature and mode; eager where that trace
fails or draws random numbers). With tensor
parallel in the stages the zero-bubble schedules run on compiled stages only
(:func:`plait.runtime.pipeline.job.check_pipeline_config` refuses the rest).

A stage on DTensors that draws random numbers (dropout: eager DTensor keeps each piece's
random stream apart, a trace would not; a plain stage's draws trace as they run), a micro-batch whose inputs differ from the traced one's, parameters
no longer laid out as traced, or a trace that fails run the eager forward (``refused`` says
why, with a warning, when it is for good; a recompute asked of it then runs as torch's
checkpoint there, :attr:`StageProgram.on_eager`).

Where a plan holds the stages, the stage's module has had its planned ops' inputs laid out as
the plan says (:mod:`plait.runtime.pipeline.planned_stage`) before it is traced, so the graphs
hold the plan's layouts and collectives; elsewhere they follow DTensor's propagation from the
parameters' layouts (as the eager stage does). The stage is a program over local tensors, not
yet a slice of the plan's own compiled program.

Recompute, of the whole stage (``recompute="full"`` or ``"selective"``) or of named modules
(``recompute_modules``), is a pass over the traced joint graph before it is cut
(:func:`recompute_in_backward`: the per-rank program's
:func:`plait.runtime.program.remat.rematerialize`, the stage one region and each named module one,
collectives' results kept), so the partitioner saves only what the rewritten backward still
reads.

``ParallelConfig(stage_programs=False)`` keeps every stage eager.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
import torch.fx
from torch import nn

from plait._compat import (
    aot_forward_graph,
    aot_joint_graph,
    partition_joint_graph,
    reparametrized,
    tree_flatten,
    tree_unflatten,
)
from plait.comm.dtensor import implicit_replication, is_dtensor
from plait.comm.lower import collective_kind
from plait.comm.pipeline import PieceLayout, add_piece_to_grad, layout_of, parameter_from_piece
from plait.config import ParallelConfig
from plait.runtime.program.remat import (
    draws_random,
    is_collective,
    recompute_policy,
    regions,
    rematerialize,
    saved_bytes,
)

__all__ = ["StageProgram", "compile_stage", "compiles"]

logger = logging.getLogger(__name__)


def compiles(config: ParallelConfig) -> bool:
    """Whether a pipeline's stages run as compiled programs:
    :attr:`~plait.config.ParallelConfig.compiled_stages`, with or without axes inside the
    stages (any schedule: the zero-bubble ones split the traced backward, see the module
    docstring)."""
    return config.compiled_stages


def compile_stage(
    module: nn.Module, *, weight_pass: bool = False, recompute: str = "none"
) -> StageProgram:
    """Run ``module`` (a stage whose forward is already wrapped to take and return plain
    tensors, its parameters DTensors) as a :class:`StageProgram`: its ``forward`` is replaced
    in place. ``weight_pass``: a zero-bubble schedule's stage, its backward split into an
    input-gradient and a deferred weight-gradient pass (:meth:`StageProgram.weight_pass` is
    the stage's ``dw_builder``). ``recompute``: ``"full"`` or ``"selective"`` recompute the
    stage's forward in its backward graph (``"none"``: keep what backward reads)."""
    program = StageProgram(module, weight_pass=weight_pass, recompute=recompute)
    module.forward = program  # type: ignore[method-assign]
    return program


class StageProgram:
    """One stage's training forward and backward as FX graphs over local tensors (see the
    module docstring)."""

    def __init__(
        self, module: nn.Module, *, weight_pass: bool = False, recompute: str = "none"
    ) -> None:
        if recompute not in ("none", "full", "selective"):
            raise ValueError(f"StageProgram(recompute={recompute!r}): use none, full or selective")
        self.module = module
        self.splits = weight_pass
        """Whether the backward runs as two passes (zero bubble: :meth:`weight_pass`)."""
        self.recompute = recompute
        """What the backward graph recomputes of the forward (:func:`recompute_in_backward`)."""
        self.recompute_modules: tuple[tuple[str, str], ...] = ()
        """(module path in the stage, "full" | "selective"): modules recomputed as regions
        of the same pass (``recompute_modules``); set before the first training call."""
        self.saving: Callable[[Any, nn.Module], Any] | None = None
        """Activation offload's saved-tensor hooks for one call (``offload="activations"``:
        :meth:`plait.runtime.pipeline.stage_wrappers.SavedOnHost.saving`), given the call's inputs and the
        stage: what the program's autograd function saves for backward goes through them.
        Entered around the function's call only (a trace on fake tensors must not meet
        them)."""
        self.on_eager: Callable[[], None] | None = None
        """Called once if the trace is refused and the stage runs eagerly for good: what the
        graphs would have done that the eager forward must do otherwise (recompute under
        torch's checkpoint: :func:`plait.runtime.pipeline.stage_wrappers.recompute_eagerly`)."""
        self.saved_bytes: tuple[int, int] = (0, 0)
        """Bytes of forward values one micro-batch's backward reads, before and after
        recompute (equal without it); set by the trace."""
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
        self.backward_input: torch.fx.GraphModule | None = None
        """Zero bubble: the backward graph's input-gradient part (the backward's inputs in;
        the stage inputs' gradients and the values the weight pass reads out). None without
        the split."""
        self.backward_weight: torch.fx.GraphModule | None = None
        """Zero bubble: the backward graph's weight-gradient part (the values it reads from
        the input pass and from the backward's inputs in; the parameters' local gradients
        out). None without the split."""
        self._weight_reads: list[int] = []
        """The backward's inputs (saved values, output gradients) the weight pass reads."""
        self._handed = 0
        """Values the input pass hands the weight pass (its last outputs)."""
        self._pending: list[tuple[torch.Tensor, ...]] = []
        """Input passes run whose weight pass :meth:`weight_pass` has not handed out yet."""
        self.calls = 0
        """Micro-batches the graphs ran (forward and backward)."""
        self.weight_calls = 0
        """Micro-batches whose deferred weight pass ran (zero bubble)."""
        self.refused: str | None = None
        """Why the stage runs eagerly after all, None while it runs as a program."""
        self.plain = all(layout is None for layout in self.layouts)
        """No parameter is a DTensor (no axis inside the stage): the graphs are the stage's
        own ops, and random draws (dropout) trace as they run eagerly, from the one
        generator."""
        self._grad_layouts: list[PieceLayout | None] = [None] * len(params)
        self._copied: set[int] = set()
        """Backward outputs that are (views of) its inputs or of another output: a
        parameter's gradient made of one is copied before it is kept and added to."""
        self._outputs = 0
        self._differentiable: tuple[bool, ...] = ()
        """Per forward output: whether it carries a gradient (the backward graph takes the
        gradients of those only)."""
        self._out_spec: Any = None
        self._tracing = False
        self._signature: Any = None
        self._forwards: dict[Any, tuple[torch.fx.GraphModule, Any] | None] = {}
        """Forwards without gradients (evaluation, prediction), by the call's input signature
        and mode: the traced graph and its output spec; None where its trace was refused."""
        self.forward_calls = 0
        """Micro-batches run by a forward graph without gradients (evaluation, prediction)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        if (
            self._tracing
            or self.refused is not None
            or not all(isinstance(x, torch.Tensor) and not is_dtensor(x) for x in flat)
        ):
            return self.eager(*args, **kwargs)
        if not torch.is_grad_enabled() or not self.module.training:
            return self._forward_only(args, kwargs, flat, spec)
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
        args = (self, *params, *(b for _, b in self.buffers), *flat)
        if self.saving is None:
            outs = _StageFunction.apply(*args)
        else:  # autograd packs what the function saved when it returns: hooks around it
            with self.saving(flat, self.module):
                outs = _StageFunction.apply(*args)
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

    def _forward_only(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], spec: Any
    ) -> Any:
        """A call without gradients (evaluation, prediction: no autograd graph wanted) by the
        forward graph traced for its inputs and mode, once; eager where that is refused."""
        params = self._parameters()
        key = (spec, tuple((x.shape, x.dtype) for x in flat), self.module.training)
        if key not in self._forwards and params is not None:
            self._forwards[key] = self._trace_forward(flat, spec)
        found = self._forwards.get(key)
        if found is None or params is None:
            return self.eager(*args, **kwargs)
        graph, out_spec = found
        self.forward_calls += 1
        with torch.no_grad():
            outs = graph(
                *(layout_piece(p).detach() for p in params),
                *(b for _, b in self.buffers),
                *flat,
            )
        return tree_unflatten(list(outs), out_spec)

    def _trace_forward(
        self, inputs: list[torch.Tensor], in_spec: Any
    ) -> tuple[torch.fx.GraphModule, Any] | None:
        """The stage's forward alone on local pieces (no backward: evaluation, prediction),
        its DTensor ops desugared into local ops and functional collectives; None (with a
        warning) where it cannot be traced or draws random numbers."""
        n_params, n_buffers = len(self.names), len(self.buffers)
        out_spec: list[Any] = [None]

        def forward(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state: dict[str, torch.Tensor] = {
                name: piece if layout is None else layout.dtensor(piece)
                for name, piece, layout in zip(
                    self.names, flat[:n_params], self.layouts, strict=True
                )
            }
            for (name, _), b in zip(self.buffers, flat[n_params:], strict=False):
                state[name] = b
            args, kwargs = tree_unflatten(list(flat[n_params + n_buffers :]), in_spec)
            with reparametrized(self.module, state):
                out = self.eager(*args, **kwargs)
            leaves, out_spec[0] = tree_flatten(out)
            if not all(isinstance(x, torch.Tensor) and not is_dtensor(x) for x in leaves):
                raise TypeError("a stage's outputs must be plain tensors")
            return tuple(x.clone() for x in leaves)  # never an alias of an input

        with torch.no_grad():
            pieces = [layout_piece(p).detach() for p in self._parameters() or ()]
        example = (*pieces, *(b for _, b in self.buffers), *inputs)
        why = None
        graph: Any = None
        self._tracing = True
        try:
            with implicit_replication():
                graph = aot_forward_graph(forward, example)
        except Exception as e:
            why = f"its trace failed: {type(e).__name__}: {e}"
        finally:
            self._tracing = False
        if graph is not None:
            seeded = sorted({str(n.target) for n in graph.graph.nodes if draws_random(n)})
            if seeded:
                why = f"it draws random numbers ({', '.join(seeded)})"
        if why is not None:
            logger.warning("pipeline: a stage's forward without gradients runs eagerly: %s", why)
            return None
        return graph, out_spec[0]

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
                name: piece if layout is None else parameter_from_piece(piece, layout, record(i))
                for i, (name, piece, layout) in enumerate(
                    zip(self.names, flat[:n_params], self.layouts, strict=True)
                )
            }
            for (name, _), b in zip(self.buffers, flat[n_params:], strict=False):
                state[name] = b
            args, kwargs = tree_unflatten(list(flat[n_params + n_buffers :]), in_spec)
            # the stage's own forward with the traced parameters in place: not through the
            # module's __call__, whose hooks (FSDP2's gathers under optimizer_shard) ran
            # already for this call and would put their own parameters back
            with reparametrized(self.module, state):
                out = self.eager(*args, **kwargs)
            leaves, self._out_spec = tree_flatten(out)
            if not all(isinstance(x, torch.Tensor) and not is_dtensor(x) for x in leaves):
                raise TypeError("a stage's outputs must be plain tensors")
            # Outputs without gradients are often buffers passed on (a rotary table sliced for
            # the next stage): a graph output may not alias a graph input, so they leave as
            # copies (small; the outputs that carry gradients are computed values anyway).
            self._differentiable = tuple(x.requires_grad for x in leaves)
            return tuple(x if x.requires_grad else x.clone() for x in leaves)

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
        if graph is not None and not self.plain:
            seeded = sorted({str(n.target) for n in graph.graph.nodes if draws_random(n)})
            if seeded:  # eager DTensor keeps the pieces' random streams apart: not traced yet
                self.refused = f"it draws random numbers ({', '.join(seeded)})"
        if self.refused is not None:
            logger.warning("pipeline: a stage runs eagerly: %s", self.refused)
            if self.on_eager is not None:
                self.on_eager()
            return
        self._outputs = len(graph.graph.find_nodes(op="output")[0].args[0]) - len(example)
        self.saved_bytes = recompute_in_backward(graph, self.recompute, self.recompute_modules)
        self.forward, self.backward = partition_joint_graph(graph, example, self._outputs)
        self._copied = _aliasing_outputs(self.backward)
        if self.splits:
            self.backward_input, self.backward_weight, self._weight_reads = split_backward(
                self.backward, n_params, n_params + n_buffers
            )
            self._handed = len(self.backward_weight.graph.find_nodes(op="placeholder")) - len(
                self._weight_reads
            )
            self._copied = _aliasing_outputs(self.backward_weight)
        logger.info(
            "pipeline: stage traced into a program of %d forward and %d backward nodes%s",
            len(self.forward.graph.nodes),
            len(self.backward.graph.nodes),
            ""
            if self.backward_weight is None
            else f" (weight pass: {len(self.backward_weight.graph.nodes)} of them)",
        )

    def collectives(self) -> dict[tuple[str, str], int]:
        """The functional collectives the traced graphs issue a micro-batch, by (phase, kind):
        ``("forward", "all_reduce")`` and so on ({} before the trace)."""
        counts: Counter[tuple[str, str]] = Counter()
        graphs = (("forward", self.forward), ("backward", self.backward))
        for phase, graph in graphs:
            for node in graph.graph.nodes if graph is not None else ():
                kind = collective_kind(node)
                if kind is not None:
                    counts[(phase, kind)] += 1
        return dict(counts)

    def weight_pass(self) -> Callable[[], None]:
        """torch's ``dw_builder`` for this stage (zero bubble): called right after a
        micro-batch's backward (its input pass), it returns the runner of that micro-batch's
        weight pass, which the schedule calls at its W action (or at once, for a full
        backward). A backward that ran eagerly left nothing: its runner does nothing (eager
        autograd filled the weights' gradients already)."""
        pending, self._pending = self._pending, []

        def run() -> None:
            assert self.backward_weight is not None or not pending
            while pending:
                reads = pending.pop(0)
                # a graph of backward ops: nothing of it is differentiated again (run with
                # autograd on, its ops would record a graph and save what they read)
                with torch.no_grad():
                    grads = self.backward_weight(*reads)  # type: ignore[misc]
                self._accumulate(grads)
                self.weight_calls += 1

        return run

    def _accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add each parameter's local gradient into its ``.grad``, laid out as traced."""
        params = [owner._parameters[attr] for owner, attr in self._owners]
        for i, (p, layout, g) in enumerate(zip(params, self._grad_layouts, grads, strict=True)):
            if g is None or p is None:
                continue
            if self.layouts[i] is None:  # a plain parameter: its gradient as autograd adds it
                add_plain_grad(p, g, copy=i in self._copied)
            elif layout is not None:
                add_piece_to_grad(p, g, layout, copy=i in self._copied)


def planned_stage_collectives(
    plan: Any, stage: int, axes: Sequence[str]
) -> dict[tuple[str, str], int]:
    """The collectives over ``axes`` (the axes inside a stage) that ``plan`` lists for the ops
    of its stage ``stage``, a micro-batch's worth, by (phase, kind), as
    :meth:`StageProgram.collectives` counts what runs."""
    ops = set(plan.stages[stage]) if stage < len(plan.stages) else set()
    inside = set(axes)
    counts: Counter[tuple[str, str]] = Counter()
    moved: set[tuple[str, str, tuple[str, ...]]] = set()
    for c in plan.collectives:
        if c.op in ops and c.axes and set(c.axes) <= inside:
            if c.value:
                # One value moved for two readers whose layouts differ only outside the
                # stage (over dp) is one move inside it (the stage moves it once).
                if (c.value, c.kind, c.axes) in moved:
                    continue
                moved.add((c.value, c.kind, c.axes))
            counts[(c.phase, c.kind)] += c.count
    return dict(counts)


def recompute_in_backward(
    graph: torch.fx.GraphModule, mode: str, modules: Sequence[tuple[str, str]] = ()
) -> tuple[int, int]:
    """Recompute (``"full"`` or ``"selective"``) over a stage's joint graph, in place, before
    it is cut into forward and backward: the plan's recompute pass
    (:func:`plait.runtime.program.remat.rematerialize`) with the whole stage as one region, and each
    of ``modules`` ((path, mode) pairs: the nodes traced inside that module of the model,
    :func:`_exported_module`) as a region of its own, so the backward reads clones of forward
    values computed again from what it keeps, and the partitioner saves only those. Collectives' results are kept, never issued again (as the
    per-rank program's recompute: MindSpore's ``mp_comm_recompute=False``), and the stage's
    outputs are kept (the region's outputs). ``"full"``: everything else is recomputed
    (MindSpore's ``Cell.recompute()``); ``"selective"``: the results of matrix products and
    other matmul-like ops are kept too (Megatron's selective recompute). Returns the bytes
    backward reads from forward before and after (equal for ``"none"``)."""
    start = _first_backward_node(graph)
    if start is None:
        return (0, 0)
    before = saved_bytes(graph, start)
    if mode == "none" and not modules:
        return (before, before)
    pairs: list[tuple[str, Callable[[torch.fx.Node], str | None]]] = []
    if mode != "none":
        pairs.append((mode, lambda node: ""))  # the whole stage, one region
    for kind in sorted({k for _, k in modules}):
        paths = [path for path, k in modules if k == kind]
        pairs.append((kind, regions(paths, traced_in=_exported_module)))
    policies = [
        recompute_policy(cast(Literal["full", "selective"], kind), region_of, backward_start=start)
        for kind, region_of in pairs
    ]
    original = set(graph.graph.nodes)
    rematerialize(
        graph,
        backward_start=start,
        recompute=lambda node: not is_collective(node) and any(p(node) for p in policies),
    )
    # A clone copies its forward node's meta, the partitioner's forward tag too: tagged so,
    # it would pull the backward before it into the forward graph. Clones are backward.
    clones = [n for n in graph.graph.nodes if n not in original]
    for node in clones:
        if _PARTITIONER_TAG in node.meta:
            node.meta[_PARTITIONER_TAG] = "is_backward"
    first = next(n for n in graph.graph.nodes if n is start or n in clones)  # placed before
    return (before, saved_bytes(graph, first))


_PARTITIONER_TAG = "partitioner_tag"
"""Where AOTAutograd marks a joint graph's nodes ``is_forward`` or ``is_backward``."""


def _exported_module(node: torch.fx.Node) -> str | None:
    """The innermost module of the model a stage's node was traced in: torch's pipeline split
    runs the stage's exported graph node by node, and the trace copies each node's module
    stack (``nn_module_stack``, model paths) onto the nodes its ops make."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else None


def _first_backward_node(graph: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first node of a joint graph that reads an output gradient (a ``tangents``
    placeholder; in topological order the first node to depend on one reads it directly):
    AOTAutograd traces the whole forward first, so every node before it is forward."""
    placeholders = graph.graph.find_nodes(op="placeholder")
    tangents = {n for n in placeholders if n.name.startswith("tangents")}
    for node in graph.graph.nodes:
        if node.op == "call_function" and any(a in tangents for a in node.all_input_nodes):
            return node
    return None


def layout_piece(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local piece (a plain parameter itself), as a leaf that needs a gradient
    (to trace with)."""
    return local_of(param).detach().requires_grad_()


def local_of(param: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece; a plain tensor itself."""
    return param.to_local() if is_dtensor(param) else param  # type: ignore[attr-defined, no-any-return]


def add_plain_grad(param: torch.Tensor, grad: torch.Tensor, *, copy: bool = False) -> None:
    """Add ``grad`` into a plain parameter's ``.grad`` as autograd's accumulation does: a
    first gradient kept (copied where it may alias another value or its strides are not the
    parameter's), later ones added in place."""
    if param.grad is None:
        with torch.no_grad():
            if copy or grad.stride() != param.stride():
                grad = torch.empty_like(param).copy_(grad)
        param.grad = grad
    else:
        param.grad.add_(grad)


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


def split_backward(
    backward: torch.fx.GraphModule, params: int, inputs_from: int
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, list[int]]:
    """A stage's backward graph cut into zero bubble's two passes.

    ``backward`` returns the parameters' gradients (its first ``params`` outputs), then
    others (buffers'), then from ``inputs_from`` on the stage inputs' gradients. The
    input-gradient graph keeps every node those input gradients need (and any other node
    the weight-gradient graph does not take, so nothing with an effect is lost) and takes
    the backward's inputs; it returns the inputs' gradients and then the values it computed
    that the weight-gradient graph reads. The weight-gradient graph holds the nodes only the
    parameters' gradients need: it takes those values, then the backward's own inputs it
    reads (their indices are returned third), and returns the parameters' gradients (None
    where the backward's is). Nothing is computed twice: a node the input gradients need is
    in the first graph only."""
    graph = backward.graph
    output = graph.find_nodes(op="output")[0]
    outs = list(output.args[0])
    placeholders = list(graph.find_nodes(op="placeholder"))

    def needed(roots: Sequence[Any]) -> set[torch.fx.Node]:
        seen: set[torch.fx.Node] = set()
        stack = [r for r in roots if isinstance(r, torch.fx.Node)]
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(node.all_input_nodes)
        return seen

    for_inputs = needed(outs[inputs_from:])
    weight_only = {
        n for n in needed(outs[:params]) - for_inputs if n.op not in ("placeholder", "output")
    }
    for node in graph.nodes:  # a tuple-valued op stays whole: its items go where it is
        if node.target is operator.getitem and node.args[0] not in weight_only:
            weight_only.discard(node)
    weight_grads = [o for o in outs[:params] if isinstance(o, torch.fx.Node)]
    read = {a for n in weight_only for a in n.all_input_nodes if a not in weight_only}
    read |= {o for o in weight_grads if o not in weight_only}
    handed = [n for n in graph.nodes if n in read and n.op != "placeholder"]  # graph order
    reads = [i for i, p in enumerate(placeholders) if p in read]

    first = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op != "output" and node not in weight_only:
            env[node] = first.node_copy(node, env.__getitem__)
    grads = [env[o] if isinstance(o, torch.fx.Node) else o for o in outs[inputs_from:]]
    first.output((*grads, *(env[n] for n in handed)))
    first.eliminate_dead_code()  # nodes neither pass needs (none after the partitioner)

    second = torch.fx.Graph()
    env = {}
    for node in [*handed, *(placeholders[i] for i in reads)]:
        env[node] = second.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in graph.nodes:
        if node in weight_only:
            env[node] = second.node_copy(node, env.__getitem__)
    second.output(tuple(env[o] if isinstance(o, torch.fx.Node) else o for o in outs[:params]))
    return torch.fx.GraphModule(backward, first), torch.fx.GraphModule(backward, second), reads


class _StageFunction(torch.autograd.Function):
    """A micro-batch through a :class:`StageProgram`: its forward graph now, its backward
    graph when autograd gets there."""

    @staticmethod
    def forward(ctx: Any, program: StageProgram, *flat: torch.Tensor) -> Any:
        assert program.forward is not None
        n_params = len(program.names)
        pieces = [local_of(p) for p in flat[:n_params]]
        out = program.forward(*pieces, *flat[n_params:])  # no gradient mode: no copies
        n = program._outputs
        ctx.program = program
        ctx.save_for_backward(*out[n:])
        outs = tuple(out[:n])
        ctx.mark_non_differentiable(
            *(o for o, d in zip(outs, program._differentiable, strict=True) if not d)
        )
        return outs

    @staticmethod
    def backward(ctx: Any, *tangents: torch.Tensor) -> Any:
        program: StageProgram = ctx.program
        assert program.backward is not None
        tangents = tuple(
            t.contiguous() for t, d in zip(tangents, program._differentiable, strict=True) if d
        )
        n_params, n_buffers = len(program.names), len(program.buffers)
        none = (None, *([None] * (n_params + n_buffers)))  # the program, parameters, buffers
        if program.backward_input is not None:  # zero bubble: the weight pass comes later
            args = (*ctx.saved_tensors, *tangents)
            outs = program.backward_input(*args)
            n_inputs = len(outs) - program._handed
            program._pending.append((*outs[n_inputs:], *(args[i] for i in program._weight_reads)))
            return (*none, *outs[:n_inputs])
        grads = program.backward(*ctx.saved_tensors, *tangents)
        program._accumulate(grads[:n_params])  # the parameters' gradients: added by hand
        return (*none, *grads[n_params + n_buffers :])
