"""What the user and the mode fix before search: batch layouts and per-op allowed strategies.

- The batch: ``dataset_strategy`` fixes each input's layout (``"data_parallel"`` splits dim 0
  over the data-parallel axis, ``"full_batch"`` replicates, a tuple gives per-input strategies).
- ``plait.shard`` annotations: a module's ``parameter_strategy`` fixes the layout of those
  parameters for every op that reads them; ``in_strategy``/``out_strategy`` fix the layout of
  the values entering or leaving the module.
- The mode: ``data_parallel`` and ``stand_alone`` keep every parameter whole; ``semi_auto``
  keeps the parameters of unannotated ops whole (MindSpore: unannotated ops are data
  parallel) and lets parameter-free ops follow their inputs, as DTensor does at run time.
- A running job's parameters (``fixed``): when a job plans again for a batch of a new shape,
  each parameter keeps the layout its first plan gave it (its first reader reads it so), as
  the parameters and the optimizer states already live there.

Pure: reads annotations from the model's modules, never touches devices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from plait.annotate import ShardSpec, get_shard_spec
from plait.errors import ShardingError
from plait.graph import OpGraph, OpNode
from plait.layout import TensorLayout, resolve_tensor_strategy
from plait.mesh import MeshSpec
from plait.rules.common import to_mesh
from plait.rules.registry import OpStrategy

__all__ = ["Constraints", "batch_layouts", "collect_constraints", "with_orders"]

Check = Callable[[OpStrategy], bool]


@dataclass
class Constraints:
    """Per op: the checks a candidate must pass, why, and which ops the user configured."""

    checks: dict[str, list[tuple[Check, str]]] = field(default_factory=dict)
    annotated: dict[str, str] = field(default_factory=dict)  # op -> "annotated on <module>"
    param_sources: dict[str, tuple[TensorLayout, str]] = field(default_factory=dict)
    explicit_in: set[tuple[str, int]] = field(default_factory=set)  # (op, input) from in_strategy
    explicit_out: set[tuple[str, int]] = field(
        default_factory=set
    )  # (op, output) from out_strategy
    orders: set[tuple[str, ...]] = field(default_factory=set)
    """Axis orders the annotations split a dim in other than mesh order (``("mp", "sp")`` on
    a mesh ``(dp, sp, mp)``): the catalogue lists mesh order only, so each op's candidates
    get these orders too (:func:`with_orders`)."""

    def add(self, op: str, check: Check, why: str, annotated: str | None = None) -> None:
        self.checks.setdefault(op, []).append((check, why))
        if annotated:
            self.annotated.setdefault(op, annotated)

    def name_orders(self, layout: TensorLayout) -> TensorLayout:
        """Note the dims ``layout`` splits over several axes out of mesh order; ``layout``."""
        mesh = layout.mesh
        for axes in layout.dims:
            if list(axes) != sorted(axes, key=mesh.axis_index):
                self.orders.add(tuple(axes))
        return layout


def _layout_of(strategy: object, mesh: MeshSpec, shape: Sequence[int], where: str) -> TensorLayout:
    if isinstance(strategy, TensorLayout):
        layout = to_mesh(strategy, mesh, where)
        layout.check_shape(tuple(shape), where)
        return layout
    return resolve_tensor_strategy(tuple(strategy), mesh, where, tuple(shape))  # type: ignore[arg-type]


def batch_layouts(
    graph: OpGraph, mesh: MeshSpec, dp_axis: str, dataset_strategy: object
) -> dict[str, TensorLayout]:
    """Layouts of the batch's tensors inside a step, from ``ParallelConfig.dataset_strategy``.

    ``"data_parallel"`` and ``"full_batch"`` both give dim 0 split over ``dp_axis``: with
    ``full_batch`` every rank loads the global batch and the Job keeps its own slice, for free
    (``Job.shard_batch``), before any op runs.
    """
    inputs = [g for g in graph.inputs if g.kind == "input"]
    layouts: dict[str, TensorLayout] = {}
    if isinstance(dataset_strategy, tuple):
        if len(dataset_strategy) != len(inputs):
            raise ShardingError(
                f"dataset_strategy has {len(dataset_strategy)} per-input strategies but the batch "
                f"has {len(inputs)} tensors ({', '.join(g.target for g in inputs)}); give one per tensor"
            )
        for g, strategy in zip(inputs, dataset_strategy, strict=True):
            layouts[g.name] = _layout_of(
                strategy, mesh, g.meta.shape, f"dataset_strategy for {g.target}"
            )
        return layouts
    for g in inputs:
        dims: list[tuple[str, ...]] = [()] * g.meta.ndim
        split = dataset_strategy in ("data_parallel", "full_batch")
        if split and g.meta.ndim and dp_axis in mesh.axis_names:
            size = mesh.axis_size(dp_axis)
            if g.meta.shape[0] % size:
                raise ShardingError(
                    f"{g.target}: batch dim of size {g.meta.shape[0]} does not divide over the "
                    f"{size} ranks of mesh axis {dp_axis!r} (dataset_strategy="
                    f"{dataset_strategy!r}); use a global batch that is a multiple of {size}, "
                    "or a per-input dataset_strategy tuple that leaves dim 0 whole"
                )
            dims[0] = (dp_axis,)
        layouts[g.name] = TensorLayout(mesh, tuple(dims))
    return layouts


def _ops_by_module(graph: OpGraph) -> dict[str, list[OpNode]]:
    """Module path -> the ops run inside it or its submodules, in graph order."""
    index: dict[str, list[OpNode]] = {}
    for op in graph.ops:
        parts = op.module_path.split(".") if op.module_path else []
        index.setdefault("", []).append(op)
        for n in range(1, len(parts) + 1):
            index.setdefault(".".join(parts[:n]), []).append(op)
    return index


def _is_outside(graph: OpGraph, ref: str, path: str) -> bool:
    """True if ``ref`` is made outside module ``path`` (batch or an op of another module)."""
    node, _ = graph.producer(ref)
    if not isinstance(node, OpNode):
        return node.kind == "input"
    return not (node.module_path == path or node.module_path.startswith(path + "."))


def collect_constraints(
    model: nn.Module,
    graph: OpGraph,
    mesh: MeshSpec,
    mode: str,
    fixed: Mapping[str, TensorLayout] | None = None,
    dp_axis: str = "dp",
) -> Constraints:
    """Turn annotations, the mode and ``fixed`` parameter layouts (by FQN) into per-op checks
    (see the module doc). ``dp_axis``: the axis a ``split_sequence`` mark keeps the batch
    dim on."""
    found = Constraints()
    params = graph.parameters()
    by_fqn = {g.target: g.name for g in params.values()}
    annotated_params: dict[str, tuple[TensorLayout, str]] = {}
    by_module: dict[str, list[OpNode]] | None = None
    for path, module in model.named_modules():
        spec = get_shard_spec(module)
        if spec is None:
            continue
        where = path or type(module).__name__
        for pname, strategy in spec.parameter_strategy.items():
            fqn = f"{path}.{pname}" if path else pname
            if fqn not in by_fqn:
                continue  # not read by the captured forward: nothing to place
            layout = found.name_orders(_layout_of(strategy, mesh, params[fqn].meta.shape, fqn))
            _record_param(annotated_params, by_fqn[fqn], fqn, layout, where)
        if spec.in_strategy or spec.out_strategy or spec.sequence_split:
            by_module = by_module or _ops_by_module(graph)
            _module_io(found, graph, by_module.get(path, []), mesh, path, where, spec, dp_axis)
        # a Linear's bias follows its weight's output dim
        if (
            isinstance(module, nn.Linear)
            and module.bias is not None
            and "weight" in spec.parameter_strategy
        ):
            w = annotated_params.get(by_fqn.get(f"{path}.weight" if path else "weight", ""))
            bias_ref = by_fqn.get(f"{path}.bias" if path else "bias")
            if w is not None and bias_ref is not None:
                annotated_params[bias_ref] = (TensorLayout(mesh, (w[0].dims[0],)), where)
    found.param_sources = annotated_params
    for op in graph.ops:
        for i, ref in enumerate(op.inputs):
            if ref in annotated_params:
                layout, where = annotated_params[ref]
                found.add(
                    op.name,
                    _input_is(i, layout),
                    f"{params_name(graph, ref)} annotated {layout.describe()} on {where}",
                    annotated=f"annotated with plait.shard on {where}",
                )
            elif _is_parameter(graph, ref) and mode in (
                "data_parallel",
                "stand_alone",
                "semi_auto",
            ):
                found.add(
                    op.name,
                    _input_whole(i),
                    f"{params_name(graph, ref)} is not annotated: {mode} keeps it whole",
                )
    _fix_parameters(found, graph, fixed or {}, set(annotated_params))
    return found


def _fix_parameters(
    found: Constraints, graph: OpGraph, fixed: Mapping[str, TensorLayout], annotated: set[str]
) -> None:
    """Each parameter's first reader reads it in its ``fixed`` layout: the plan lays a
    parameter out as its first reader reads it (``assemble``), so that pins the layout and
    leaves later readers free (they redistribute, as before)."""
    if not fixed:
        return
    first: dict[str, tuple[OpNode, int]] = {}
    for op in graph.ops:
        for i, ref in enumerate(op.inputs):
            if ref not in first and _is_parameter(graph, ref):
                first[ref] = (op, i)
    for ref, (op, i) in first.items():
        name = params_name(graph, ref)
        layout = fixed.get(name)
        if layout is None or ref in annotated:
            continue  # annotated: the annotation pins every reader already
        found.add(
            op.name,
            _input_is(i, layout),
            f"{name} stays {layout.describe()}: the job's parameters keep the layouts of its "
            "first plan",
        )


def _input_is(i: int, layout: TensorLayout) -> Check:
    """A candidate reads its input ``i`` in ``layout``."""
    return lambda s: s.inputs[i] == layout


def _input_whole(i: int) -> Check:
    """A candidate reads its input ``i`` whole (no split, no pending sum)."""
    return lambda s: not any(s.inputs[i].dims) and not s.inputs[i].partial


def _output_reaches(k: int, layout: TensorLayout) -> Check:
    """A candidate's output ``k`` becomes ``layout`` by reducing its pending sums."""
    return lambda s: _reaches(s.outputs[k], layout)


def _record_param(
    found: dict[str, tuple[TensorLayout, str]], ref: str, fqn: str, layout: TensorLayout, where: str
) -> None:
    prev = found.get(ref)
    if prev is not None and prev[0] != layout:
        raise ShardingError(
            f"conflicting annotations: parameter {fqn} is annotated {prev[0].describe()} on "
            f"{prev[1]} and {layout.describe()} on {where}; a shared parameter has one layout: "
            "make the two annotations agree"
        )
    found[ref] = (layout, where)


def _is_parameter(graph: OpGraph, ref: str) -> bool:
    source = graph.graph_input(ref)
    return source is not None and source.kind == "parameter"


def params_name(graph: OpGraph, ref: str) -> str:
    source = graph.graph_input(ref)
    return source.target if source is not None else ref


def _module_io(
    found: Constraints,
    graph: OpGraph,
    ops: list[OpNode],
    mesh: MeshSpec,
    path: str,
    where: str,
    spec: ShardSpec,
    dp_axis: str,
) -> None:
    """A module's ``in_strategy``, ``out_strategy`` and ``split_sequence`` marks."""
    if not ops:
        return
    if spec.in_strategy:
        _module_inputs(found, graph, mesh, ops, path, where, spec.in_strategy)
    if spec.out_strategy:
        _module_outputs(found, graph, ops, where, _given_layouts(mesh, spec.out_strategy, where))
    if spec.sequence_split is not None:
        axis, dim = spec.sequence_split
        _module_outputs(
            found, graph, ops, where, _sequence_layouts(mesh, axis, dim, dp_axis, where)
        )


def _module_inputs(
    found: Constraints,
    graph: OpGraph,
    mesh: MeshSpec,
    ops: list[OpNode],
    path: str,
    where: str,
    ins: tuple[object, ...],
) -> None:
    """``in_strategy``: the values entering the module, in order of first use."""
    entering: list[tuple[OpNode, int, str]] = []
    for op in ops:
        for i, ref in enumerate(op.inputs):
            node = graph.graph_input(ref)
            if node is not None and node.kind in ("parameter", "buffer", "constant"):
                continue
            if _is_outside(graph, ref, path):
                entering.append((op, i, ref))
    refs = list(dict.fromkeys(ref for _, _, ref in entering))
    for k, ref in enumerate(refs[: len(ins)]):
        if ins[k] is None:
            continue
        layout = _layout_of(ins[k], mesh, graph.meta(ref).shape, f"{where} in_strategy[{k}]")
        found.name_orders(layout)
        for op, i, r in entering:
            if r != ref:
                continue
            found.explicit_in.add((op.name, i))
            found.add(
                op.name,
                _input_is(i, layout),
                f"input {k} of {where} annotated {layout.describe()}",
                annotated=f"annotated with plait.shard on {where}",
            )


OutLayout = Callable[[int, OpNode, int], TensorLayout | None]
"""The layout the ``n``-th value leaving a module (output ``k`` of ``op``) is fixed to, or
None to leave it free."""


def _given_layouts(mesh: MeshSpec, outs: tuple[object, ...], where: str) -> OutLayout:
    """``out_strategy``: one strategy per value leaving the module, in order."""

    def layout(n: int, op: OpNode, k: int) -> TensorLayout | None:
        if n >= len(outs) or outs[n] is None:
            return None
        return _layout_of(outs[n], mesh, op.outputs[k].shape, f"{where} out_strategy[{n}]")

    return layout


def _sequence_layouts(mesh: MeshSpec, axis: str, dim: int, dp_axis: str, where: str) -> OutLayout:
    """``split_sequence``: every value leaving the module split along ``dim`` over ``axis``,
    dim 0 over the data-parallel axis where the mesh has it larger than one."""
    mark = f"plait.annotate.split_sequence on {where} (axis {axis!r}, dim {dim})"
    if axis not in mesh.axis_names:
        raise ShardingError(
            f"{mark}: the job's mesh {mesh.as_dict()!r} has no axis {axis!r}; name the "
            f"tensor-parallel axis of the mesh (megatron(..., axis=...)) or add {axis!r} to it"
        )

    def layout(n: int, op: OpNode, k: int) -> TensorLayout:
        shape = tuple(op.outputs[k].shape)
        if len(shape) <= dim:
            raise ShardingError(
                f"{mark}: output {n} of the module has shape {shape}, with no dim {dim} to "
                "split; mark only modules whose outputs are [batch, sequence, ...]"
            )
        dims: list[tuple[str, ...]] = [()] * len(shape)
        if dp_axis in mesh.axis_names and dp_axis != axis and mesh.axis_size(dp_axis) > 1:
            dims[0] = (dp_axis,)
        dims[dim] = (axis,)
        out = TensorLayout(mesh, tuple(dims))
        out.check_shape(shape, f"{mark}: output {n}")
        return out

    return layout


def _module_outputs(
    found: Constraints,
    graph: OpGraph,
    ops: list[OpNode],
    where: str,
    layout_of: OutLayout,
) -> None:
    """``out_strategy`` or ``split_sequence``: the values leaving the module (used outside it
    or graph outputs) in the layouts ``layout_of`` gives."""
    inside = {op.name for op in ops}
    leaving: list[tuple[OpNode, int]] = []
    for op in ops:
        for k in range(len(op.outputs)):
            ref = op.name if k == 0 else f"{op.name}:{k}"
            users = graph.consumers(ref)
            if ref in graph.outputs or any(c.name not in inside for c, _ in users):
                leaving.append((op, k))
    for n, (op, k) in enumerate(leaving):
        layout = layout_of(n, op, k)
        if layout is None:
            continue
        found.name_orders(layout)
        found.explicit_out.add((op.name, k))
        found.add(
            op.name,
            _output_reaches(k, layout),
            f"output {n} of {where} annotated {layout.describe()}",
            annotated=f"annotated with plait.shard on {where}",
        )
        # The value leaves the module in the annotated layout: readers outside take it so,
        # and a pending sum is reduced into it (MindSpore: a row-parallel output annotated
        # split is reduce-scattered instead of all-reduced).
        ref = op.name if k == 0 else f"{op.name}:{k}"
        for reader, i in graph.consumers(ref):
            if reader.name in inside:
                continue
            found.add(
                reader.name,
                _input_is(i, layout),
                f"input {i} is output {n} of {where}, annotated {layout.describe()}",
            )


def _reaches(out: TensorLayout, want: TensorLayout) -> bool:
    """Whether an op output in ``out`` becomes ``want`` by reducing its pending sums (an
    all-reduce, or a reduce-scatter onto the axes ``want`` adds to a dim)."""
    if out.dims == want.dims:
        return True
    added: list[str] = []
    for have, wanted in zip(out.dims, want.dims, strict=True):
        if tuple(wanted[: len(have)]) != tuple(have):
            return False
        added.extend(wanted[len(have) :])
    return set(added) <= set(out.partial)


def allowed_indices(
    graph: OpGraph,
    candidates: Mapping[str, Sequence[OpStrategy]],
    constraints: Constraints,
    dp_axis: str,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Per constrained op, the candidate indices that pass; and the configured ops.

    An annotated op whose annotations leave several candidates prefers those that split its
    first input's batch dim over ``dp_axis`` (what the runtime does with an annotated Linear);
    when exactly one remains it is configured (a seed of propagation).
    """
    allowed: dict[str, list[int]] = {}
    configured: dict[str, str] = {}
    for op in graph.ops:
        checks = constraints.checks.get(op.name)
        if not checks:
            continue
        cands = candidates[op.name]
        fit = [i for i, s in enumerate(cands) if all(check(s) for check, _ in checks)]
        if not fit:
            rules = "; ".join(why for _, why in checks)
            valid = ", ".join(repr(s.cuts()) for s in cands[:8])
            raise ShardingError(
                f"op {op.name} ({op.target}, module {op.module_path or '<root>'}): no strategy "
                f"satisfies {rules}. Strategies this op has on the mesh: {valid}"
                f"{' ...' if len(cands) > 8 else ''}; change the annotation to one of them"
            )
        allowed[op.name] = fit
        if op.name in constraints.annotated:
            batch = [
                i for i in fit if cands[i].inputs and _splits_batch(cands[i].inputs[0], dp_axis)
            ]
            pick = batch if len(batch) >= 1 and len(fit) > 1 else fit
            if len(pick) == 1:
                allowed[op.name] = pick
                configured[op.name] = constraints.annotated[op.name]
    _check_conflicts(graph, candidates, allowed, constraints)
    return allowed, configured


def with_orders(
    candidates: Mapping[str, Sequence[OpStrategy]], orders: set[tuple[str, ...]]
) -> dict[str, Sequence[OpStrategy]]:
    """``candidates`` with, after each op's own, their variants splitting over the axes of
    each of ``orders`` in that order instead of mesh order (the annotations name them).

    The catalogue enumerates a dim split over several axes in mesh order only (outer axis
    first). Reordering one axis set wherever a strategy splits a dim over exactly those axes,
    on every input and output alike, keeps the strategy valid: each device's pieces of the
    dims that share a letter are still the same block of it (numbered in the new order), so
    the local op computes the same piece of the output. Ops with no such split keep their
    lists (the same objects: prices kept per list carry over)."""
    if not orders:
        return dict(candidates)
    made: dict[TensorLayout, TensorLayout] = {}  # one object per layout (prices by identity)

    def reordered(layout: TensorLayout, order: tuple[str, ...]) -> TensorLayout:
        mesh = layout.mesh
        plain = tuple(sorted(order, key=mesh.axis_index))
        if plain not in layout.dims:
            return layout
        dims = tuple(order if axes == plain else axes for axes in layout.dims)
        new = TensorLayout(mesh, dims, layout.partial, layout.reduce_op)
        return made.setdefault(new, new)

    def extended(cands: Sequence[OpStrategy]) -> Sequence[OpStrategy]:
        extra: list[OpStrategy] = []
        for order in sorted(orders):
            for s in cands:
                ins = tuple(reordered(x, order) for x in s.inputs)
                outs = tuple(reordered(x, order) for x in s.outputs)
                if ins != s.inputs or outs != s.outputs:
                    extra.append(OpStrategy(ins, outs, f"{s.label} ({', '.join(order)})"))
        return [*cands, *extra] if extra else cands

    # ops with equal signatures share one list: extended once, and still shared
    done: dict[int, Sequence[OpStrategy]] = {}
    return {
        op: done[id(cands)] if id(cands) in done else done.setdefault(id(cands), extended(cands))
        for op, cands in candidates.items()
    }


def _splits_batch(layout: TensorLayout, dp_axis: str) -> bool:
    return bool(layout.dims) and dp_axis in layout.dims[0]


def _check_conflicts(
    graph: OpGraph,
    candidates: Mapping[str, Sequence[OpStrategy]],
    allowed: Mapping[str, list[int]],
    constraints: Constraints,
) -> None:
    """An annotated output feeding an annotated input with another layout: a conflict."""
    for op in graph.ops:
        for i, ref in enumerate(op.inputs):
            if (op.name, i) not in constraints.explicit_in:
                continue
            node, k = graph.producer(ref)
            if not isinstance(node, OpNode) or (node.name, k) not in constraints.explicit_out:
                continue
            given = candidates[node.name][allowed[node.name][0]].outputs[k]
            need = candidates[op.name][allowed[op.name][0]].inputs[i]
            if given.dims != need.dims:
                raise ShardingError(
                    f"conflicting annotations: op {node.name} ({constraints.annotated[node.name]}) "
                    f"gives {given.describe()} but op {op.name} ({constraints.annotated[op.name]}) "
                    f"needs {need.describe()} for the same tensor; make the out_strategy of the "
                    "first agree with the in_strategy of the second, or drop one of them"
                )
