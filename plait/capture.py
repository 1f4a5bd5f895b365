"""Capture: model + example batch + loss function -> :class:`plait.graph.OpGraph`.

``torch.export.export(strict=False)`` traces the forward pass and the loss on fake tensors
(a model built on the meta device, or a real one: export reads only shapes, so no parameter
memory is allocated). The graph is kept at the level of torch's training IR (``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention``...): plait's op catalogue is
written against that level, so no decompositions run.

Repeated layers. Sibling modules of an ``nn.ModuleList``/``nn.Sequential`` that are
structurally identical (same class, parameter and buffer names, shapes and dtypes, same
submodule tree and plain hyperparameters) form a :class:`~plait.graph.LayerGroup` when their
captured ops correspond one to one. Tracing costs about 2 ms per op, so a 96-layer model
takes ~9 s; with ``repeat=True`` capture traces a copy whose list keeps only the first two
members of each run longer than two, checks that they correspond, and synthesises members
2..N-1 by cloning member 1's ops with renamed values, parameters and module paths. The result
equals a full capture, op names included (see *Names*). When the shortened model does not
trace, or its members do not chain (ops between members, a member reading anything but its
predecessor and shared values, later ops reading member 0), capture falls back to a full
trace. It cannot see a forward that treats later members differently from member 1 without
showing it in the first two (``for b in blocks[:k]`` with a ``k`` from elsewhere, per-layer
inputs computed before the loop): pass ``repeat=False`` for such models.

Names. Graph inputs are ``p_<fqn>`` (parameters), ``b_<fqn>`` (buffers), ``c_<name>``
(lifted constants) and ``batch_<i>`` (tensors of the batch in flattening order), dots turned
into underscores. Ops are named after their aten op, numbered in graph order: ``linear``,
``linear_1``, ... (the same scheme torch.fx uses, applied to the final op list, so a full and
a fast capture name every op alike).

Frozen parameters. Each parameter input records the model's ``requires_grad``
(:attr:`GraphInput.requires_grad`), so planning lists no gradient work for frozen ones.

Dropped nodes: ``operator.getitem`` (folded into refs ``"op:i"``), ``aten.alias`` (its
readers read its input) and shape/metadata assertions (no data). Everything else is kept.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from plait._compat import simulation_suspended
from plait.errors import CaptureError
from plait.graph import GraphInput, LayerGroup, OpGraph, OpNode, Ref, TensorMeta, value_ref

__all__ = [
    "AUTOCAST_META",
    "GRAD_ENABLED_META",
    "ExecutableCapture",
    "batch_leaves",
    "capture",
    "capture_program",
    "find_repeated_layers",
    "in_mode",
    "op_bytes",
    "op_flops",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]

_WRAPPED = "model"  # attribute name of the user's model inside the traced wrapper
_DROPPED_TARGETS = frozenset(
    {
        "aten._assert_tensor_metadata.default",
        "aten._assert_async.default",
        "aten._assert_async.msg",
        "aten._assert_scalar.default",
        "aten.sym_constrain_range.default",
        "aten.sym_constrain_range_for_size.default",
    }
)
_ALIAS = "aten.alias.default"
# Hyperparameter names that number a member instead of configuring it (HF's layer_idx,
# Megatron's layer_number): they differ between identical layers by design.
_POSITION_ATTR = re.compile(r"(^|_)(idx|index|id|number)$")


# --------------------------------------------------------------------------- FLOPs and bytes

# Ops that only reinterpret memory: no arithmetic and no traffic.
_VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "transpose",
        "t",
        "permute",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "alias",
        "as_strided",
        "detach",
        "diagonal",
        "unflatten",
        "view_as",
        "movedim",
        "_reshape_alias",
    ]
)
# Ops that move or create data without arithmetic.
_NO_FLOPS = _VIEWS | frozenset(
    [
        "reshape",
        "flatten",
        "contiguous",
        "clone",
        "cat",
        "stack",
        "embedding",
        "index_select",
        "gather",
        "index",
        "_to_copy",
        "to",
        "copy",
        "zeros",
        "ones",
        "full",
        "empty",
        "arange",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "scalar_tensor",
        "lift_fresh_copy",
        "repeat",
        "repeat_interleave",
        "pad",
        "constant_pad_nd",
    ]
)
# Normalisations, softmax and losses: a handful of passes per element (mean, variance, scale).
_PER_INPUT_ELEMENT = {
    "layer_norm": 5,
    "rms_norm": 5,
    "batch_norm": 5,
    "group_norm": 5,
    "instance_norm": 5,
    "softmax": 5,
    "_softmax": 5,
    "log_softmax": 5,
    "_log_softmax": 5,
    "cross_entropy_loss": 5,
    "nll_loss": 1,
    "nll_loss_nd": 1,
    "mse_loss": 3,
    "l1_loss": 3,
    "smooth_l1_loss": 4,
    "binary_cross_entropy_with_logits": 5,
    "sum": 1,
    "mean": 1,
    "amax": 1,
    "amin": 1,
    "max": 1,
    "min": 1,
    "var": 3,
    "std": 3,
    "var_mean": 3,
    "norm": 2,
    "linalg_vector_norm": 2,
    "adaptive_avg_pool1d": 1,
    "adaptive_avg_pool2d": 1,
    "adaptive_avg_pool3d": 1,
}


def _packet(target: str) -> str:
    """``"aten.add_.Tensor"`` -> ``"add"``: the op's name without overload or in-place mark."""
    parts = target.split(".")
    name = parts[1] if len(parts) == 3 else target
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def _matmul_flops(a: TensorMeta, out: TensorMeta) -> int:
    k = a.shape[-1] if a.ndim else 1
    return 2 * out.numel * k


def op_flops(
    target: str,
    input_metas: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta],
    args: Sequence[object] = (),
) -> int:
    """Forward FLOPs of one whole (unsharded) op; a multiply-add counts 2.

    matmul-like ops (linear, matmul, mm, bmm, addmm, baddbmm, conv, attention) count
    ``2*M*N*K`` (a linear's bias add is not counted); norms, softmax and cross entropy 5 per
    input element; reductions 1 per input element; views, copies and creation ops 0; any
    other op one per output element.
    """
    name = _packet(target)
    ins, out = input_metas, (outputs[0] if outputs else TensorMeta(()))
    if name in _NO_FLOPS:
        return 0
    if name == "linear":
        x, w = ins[0], ins[1]
        return 2 * (x.numel // max(x.shape[-1], 1)) * w.shape[0] * x.shape[-1]
    if name in ("matmul", "mm", "bmm", "dot", "mv"):
        return _matmul_flops(ins[0], out)
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        return _matmul_flops(ins[1], out)
    if name in ("conv1d", "conv2d", "conv3d", "convolution", "_convolution"):
        transposed = name in ("convolution", "_convolution") and len(args) > 6 and args[6] is True
        base = ins[0] if transposed else out  # a transposed conv scatters from its input
        return 2 * base.numel * math.prod(ins[1].shape[1:])
    if name.startswith("conv_transpose"):
        return 2 * ins[0].numel * math.prod(ins[1].shape[1:])
    if name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention"):
        q, k, v = ins[0], ins[1], ins[2]
        rows = q.numel // max(q.shape[-1], 1)  # batch * heads * query length
        return 2 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])  # QK^T and PV
    if name in ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d"):
        kernel = args[1] if len(args) > 1 and isinstance(args[1], tuple) else ()
        return out.numel * math.prod(int(k) for k in kernel)
    if name in _PER_INPUT_ELEMENT:
        return _PER_INPUT_ELEMENT[name] * (ins[0].numel if ins else out.numel)
    return sum(o.numel for o in outputs)


def _nbytes(meta: TensorMeta) -> int:
    return 0 if meta.dtype == "none" else meta.nbytes


def op_bytes(target: str, input_metas: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> int:
    """Bytes an op reads and writes: every input and output once; 0 for pure views;
    an embedding reads only its gathered rows."""
    name = _packet(target)
    if name in _VIEWS:
        return 0
    if name == "embedding" and len(input_metas) >= 2 and outputs:
        # a gather reads the looked-up rows and the indices, not the whole table
        return _nbytes(input_metas[1]) + 2 * _nbytes(outputs[0])
    return sum(_nbytes(m) for m in input_metas) + sum(_nbytes(m) for m in outputs)


# --------------------------------------------------------------------------- repeated layers


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive structurally identical children of one container module."""

    container: str  # FQN of the ModuleList/Sequential ("" for the root)
    keys: tuple[str, ...]  # the members' keys in the container, in order

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(_join(self.container, k) for k in self.keys)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_plain(value: object) -> bool:
    if isinstance(value, tuple | list):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _hyperparameters(module: nn.Module) -> tuple[tuple[str, object], ...]:
    return tuple(
        (k, tuple(v) if isinstance(v, list) else v)
        for k, v in sorted(vars(module).items())
        if not k.startswith("_")
        and k != "training"
        and not _POSITION_ATTR.search(k)
        and _is_plain(v)
    )


def _signature(module: nn.Module) -> tuple[object, ...]:
    """What two layers must share to be interchangeable in a plan."""
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad)
        for n, p in module.named_parameters(remove_duplicate=False)
    )
    buffers = tuple(
        (n, tuple(b.shape), b.dtype) for n, b in module.named_buffers(remove_duplicate=False)
    )
    tree = tuple(
        (n, type(m), _hyperparameters(m)) for n, m in module.named_modules(remove_duplicate=False)
    )
    return (params, buffers, tree)


def _runs_of(container: str, module: nn.Module) -> list[_Run]:
    children = [(k, m) for k, m in module._modules.items() if m is not None]
    runs: list[_Run] = []
    start = 0
    signatures = [_signature(m) for _, m in children]
    for i in range(1, len(children) + 1):
        if i == len(children) or signatures[i] != signatures[start]:
            has_params = any(True for _ in children[start][1].parameters())
            if i - start >= 2 and has_params:
                runs.append(_Run(container, tuple(k for k, _ in children[start:i])))
            start = i
    return runs


def find_repeated_layers(model: nn.Module) -> list[_Run]:
    """Runs of >= 2 structurally identical, parameter-holding siblings in ModuleLists and
    Sequentials, outermost first (lists inside a run's members are not searched)."""
    runs: list[_Run] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name == m or name.startswith(m + ".") for m in taken):
            continue
        if isinstance(module, nn.ModuleList | nn.Sequential):
            found = _runs_of(name, module)
            runs.extend(found)
            taken.extend(m for run in found for m in run.members)
    return runs


def _member_of(path: str, runs: Sequence[_Run]) -> str | None:
    for run in runs:
        if run.container and not path.startswith(run.container + "."):
            continue
        key = path[len(run.container) + 1 :] if run.container else path
        key = key.split(".", 1)[0]
        if key in run.keys:
            return _join(run.container, key)
    return None


def _corresponds(a: Sequence[OpNode], b: Sequence[OpNode]) -> bool:
    if len(a) != len(b) or not a:
        return False
    return all(
        (x.target, x.input_metas, x.outputs, x.args, x.kwargs)
        == (y.target, y.input_metas, y.outputs, y.args, y.kwargs)
        for x, y in zip(a, b, strict=True)
    )


# --------------------------------------------------------------------------- tracing


class _Traced(nn.Module):
    """The user's model and loss as one module, so one export covers forward and loss."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Any:
        if self.loss_fn is not None:
            return self.loss_fn(self.model, batch)
        if isinstance(batch, dict):
            return self.model(**batch)
        if isinstance(batch, tuple | list):
            return self.model(*batch)
        return self.model(batch)


def _leaves(obj: Any, path: str = "batch") -> list[tuple[str, Any]]:
    """Leaves of a batch with their paths (``batch[0]``, ``batch['ids']``), in the order
    torch.export lifts them: tuples, lists and dicts (insertion order) are containers;
    everything else, None included, is a leaf."""
    if isinstance(obj, tuple | list):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, f"{path}[{i}]")]
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, f"{path}[{k!r}]")]
    return [(path, obj)]


def batch_leaves(batch: Any) -> list[Any]:
    """The leaves of a batch in the order torch.export lifts them (see :func:`_leaves`)."""
    return [leaf for _, leaf in _leaves(batch)]


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_tensors(fn, v) for v in obj]
    if isinstance(obj, tuple):
        items = [_map_tensors(fn, v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(fn, v)) for k, v in obj.items())
    return obj


def _device_of(model: nn.Module) -> torch.device | None:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return None if first is None else first.device


def _batch_for(model: nn.Module, batch: Any) -> Any:
    """The batch on the model's device without touching real memory.

    A meta model gets meta copies of the batch; a real model given a meta batch gets
    uninitialised tensors (export reads only their shapes, and untouched pages are never
    committed).
    """
    device = _device_of(model)

    def move(t: torch.Tensor) -> torch.Tensor:
        if device is None or t.device == device:
            return t
        if device.type == "meta":
            return t.to("meta")
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    return _map_tensors(move, batch)


GRAD_ENABLED_META = "plait_grad_enabled"
"""fx node meta key: False on ops that ran inside a ``torch.no_grad()`` region of the forward."""
AUTOCAST_META = "plait_autocast"
"""fx node meta key: ``(device_type, dtype, enabled, cache_enabled)`` of the ``torch.autocast``
region an op ran in."""

# export's region wrappers -> (meta key, how many leading arguments describe the region)
_REGIONS = {
    "wrap_with_set_grad_enabled": (GRAD_ENABLED_META, 1),
    "wrap_with_autocast": (AUTOCAST_META, 4),
}


def _inline_regions(gm: torch.fx.GraphModule) -> None:
    """Inline export's ``wrap_with_set_grad_enabled`` and ``wrap_with_autocast`` regions (a
    ``@torch.no_grad()`` forward, an ``autocast(enabled=False)`` block, as in Hugging Face's
    rotary embeddings) into the graph, in place, innermost first.

    The regions' ops become ordinary ops of the graph; each carries the region in its meta
    (:data:`GRAD_ENABLED_META`, :data:`AUTOCAST_META`; the innermost region wins), so that an
    executor runs it as the model did.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        region = _REGIONS.get(str(node.target)) if node.op == "call_function" else None
        if region is None:
            continue
        key, lead = region
        setting, holder, operands = node.args[:lead], node.args[lead], node.args[lead + 1 :]
        sub = getattr(gm, holder.target)
        _inline_regions(sub)
        plain = all(n.op in ("placeholder", "call_function", "output") for n in sub.graph.nodes)
        if not plain or any(u.target is not operator.getitem for u in node.users):
            continue  # nested modules or odd outputs: capture reports the region by name
        value = bool(setting[0]) if key == GRAD_ENABLED_META else tuple(setting)
        env: dict[torch.fx.Node, Any] = dict(
            zip([n for n in sub.graph.nodes if n.op == "placeholder"], operands, strict=True)
        )
        outputs: Any = ()
        with graph.inserting_before(node):
            for inner in sub.graph.nodes:
                if inner.op == "output":
                    outputs = inner.args[0]
                elif inner.op == "call_function":
                    copied = graph.node_copy(inner, env.__getitem__)
                    copied.meta.setdefault(key, value)
                    env[inner] = copied
        results = [env.get(o, o) if isinstance(o, torch.fx.Node) else o for o in outputs]
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not holder.users:
            graph.erase_node(holder)
            delattr(gm, holder.target)
    graph.lint()
    gm.recompile()


def _export(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.export.ExportedProgram:
    try:
        # outside a simulated world: some models do not export under LocalTensorMode
        with simulation_suspended():
            program = torch.export.export(_Traced(model, loss_fn), (batch,), strict=False)
        _inline_regions(program.graph_module)
        return program
    except CaptureError:
        raise
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__:
            fix = (
                "the forward or loss branches on tensor values (if x.sum() > 0, .item(), "
                "nonzero); make the branch depend on shapes or config only, or use torch.cond"
            )
        else:
            fix = (
                "check that loss_fn(model, batch) runs under `with torch.device('meta'):` on "
                "meta tensors and that the batch matches what the model expects"
            )
        raise CaptureError(
            f"capture of {type(model).__name__} failed: torch.export raised "
            f"{type(e).__name__}: {text[:500]}; {fix}"
        ) from e


# --------------------------------------------------------------------------- conversion


def _meta(value: object) -> TensorMeta:
    if isinstance(value, torch.Tensor):
        return TensorMeta(
            tuple(int(s) for s in value.shape), str(value.dtype).removeprefix("torch.")
        )
    if isinstance(value, bool):
        return TensorMeta((), "bool")
    if isinstance(value, int):
        return TensorMeta((), "int64")
    if isinstance(value, float):
        return TensorMeta((), "float64")
    return TensorMeta((), "none")  # an optional output that is None


def _output_metas(value: object) -> tuple[TensorMeta, ...]:
    if value is None:
        return ()
    if isinstance(value, tuple | list):
        return tuple(_meta(v) for v in value)
    return (_meta(value),)


def _input_name(kind: str, fqn: str) -> str:
    return kind[0] + "_" + re.sub(r"\W", "_", fqn)


def _strip(fqn: str) -> str:
    """A path inside the wrapper -> the same path in the user's model."""
    if fqn == _WRAPPED:
        return ""
    return fqn.removeprefix(_WRAPPED + ".")


@dataclass(frozen=True, slots=True)
class _Const:
    """A placeholder that stands for a plain value (a non-tensor leaf of the batch)."""

    value: object


@dataclass
class _Captured:
    """An OpGraph under construction: op names are still export's (or clone) names."""

    inputs: list[GraphInput]
    ops: list[OpNode]
    outputs: list[str]


class _Converter:
    """Turns one ExportedProgram into graph inputs, ops and outputs."""

    def __init__(self, program: torch.export.ExportedProgram, model: nn.Module, batch: Any) -> None:
        self.program = program
        self.refs: dict[str, str | _Const] = {}
        self.metas: dict[str, TensorMeta] = {}
        # Tied parameters are lifted once per name; every name maps to the first FQN.
        self.canonical: dict[int, str] = {}
        for name, p in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ):
            self.canonical.setdefault(id(p), name)
        self.model = model
        self.batch_targets = [path for path, _ in _leaves(batch)]

    def _fqn(self, target: str) -> str:
        fqn = _strip(target)
        try:
            tensor = self.model.get_parameter(fqn)
        except (AttributeError, KeyError):
            try:
                tensor = self.model.get_buffer(fqn)
            except (AttributeError, KeyError):
                return fqn
        return self.canonical.get(id(tensor), fqn)

    def _requires_grad(self, fqn: str) -> bool:
        """The model's own flag for parameter ``fqn`` (True when the name does not resolve)."""
        try:
            return bool(self.model.get_parameter(fqn).requires_grad)
        except (AttributeError, KeyError):
            return True

    def inputs(self) -> list[GraphInput]:
        out: list[GraphInput] = []
        names: dict[
            tuple[str, str], str
        ] = {}  # (kind, target) -> name; a tied parameter's second name reads the first
        placeholders = {n.name: n for n in self.program.graph.nodes if n.op == "placeholder"}
        user = 0
        for spec in self.program.graph_signature.input_specs:
            node = placeholders[spec.arg.name]
            val = node.meta.get("val")
            if spec.kind == InputKind.USER_INPUT:
                target = (
                    self.batch_targets[user] if user < len(self.batch_targets) else f"batch[{user}]"
                )
                index, user = user, user + 1
                if not isinstance(val, torch.Tensor):
                    self.refs[node.name] = _Const(val)
                    continue
                kind, name = "input", f"batch_{index}"
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                target = self._fqn(spec.target or "")
                kind = "parameter" if spec.kind == InputKind.PARAMETER else "buffer"
                name = _input_name(kind, target)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                target, kind = _strip(spec.target or node.name), "constant"
                name = _input_name(kind, target)
            else:
                raise CaptureError(
                    f"capture of {type(self.model).__name__}: input {node.name!r} is a "
                    f"{spec.kind.name}, which plait cannot plan; remove script objects and "
                    "effectful ops from the forward"
                )
            if (kind, target) in names:
                name = names[(kind, target)]
            else:
                while name in names.values():  # two FQNs that differ only in "." vs "_"
                    name += "_"
                names[(kind, target)] = name
                frozen = kind == "parameter" and not self._requires_grad(target)
                out.append(GraphInput(name, kind, _meta(val), target, not frozen))  # type: ignore[arg-type]
            self.refs[node.name] = name
            self.metas[node.name] = _meta(val)
        return out

    def ops(self, inputs: Sequence[GraphInput]) -> list[OpNode]:
        params = {g.name: g.target for g in inputs if g.kind == "parameter"}
        ops: list[OpNode] = []
        for node in self.program.graph.nodes:
            if node.op != "call_function":
                if node.op in ("placeholder", "output"):
                    continue
                raise CaptureError(
                    f"capture of {type(self.model).__name__}: node {node.name!r} is a "
                    f"{node.op!r} node, which plait cannot plan; remove higher-order ops "
                    "(torch.cond, checkpoint wrappers) from the forward"
                )
            if node.target is operator.getitem:
                source, index = node.args
                ref = self.refs[source.name]
                if isinstance(ref, _Const) or ":" in ref:
                    raise CaptureError(
                        f"capture: nested tuple output at {node.name!r} is not supported"
                    )
                self.refs[node.name] = value_ref(ref, int(index))
                self.metas[node.name] = _meta(node.meta.get("val"))
                continue
            target = str(node.target)
            if target in _DROPPED_TARGETS:
                continue
            if target == _ALIAS:
                self.refs[node.name] = self.refs[node.args[0].name]
                self.metas[node.name] = _meta(node.meta.get("val"))
                continue
            ops.append(self._op(node, target, params))
        return ops

    def _op(self, node: torch.fx.Node, target: str, params: dict[str, str]) -> OpNode:
        refs: list[str] = []
        metas: list[TensorMeta] = []

        def arg(a: object) -> object:
            if isinstance(a, torch.fx.Node):
                ref = self.refs[a.name]
                if isinstance(ref, _Const):
                    return arg(ref.value)
                refs.append(ref)
                metas.append(self.metas[a.name])
                return Ref(len(refs) - 1)
            if isinstance(a, tuple | list):
                return tuple(arg(x) for x in a)
            if isinstance(a, torch.dtype):
                return str(a).removeprefix("torch.")
            if isinstance(a, torch.device | torch.memory_format | torch.layout):
                return str(a)
            if a is None or isinstance(a, bool | int | float | str):
                return a
            raise CaptureError(
                f"capture: op {node.name!r} ({target}) has an argument {a!r} of type "
                f"{type(a).__name__}, which an OpGraph cannot hold; shapes must be static "
                "(no SymInts): capture with concrete example sizes"
            )

        args = tuple(arg(a) for a in node.args)
        kwargs = tuple((k, arg(v)) for k, v in node.kwargs.items())
        outputs = _output_metas(node.meta.get("val"))
        self.refs[node.name] = node.name
        if len(outputs) == 1:
            self.metas[node.name] = outputs[0]
        stack = node.meta.get("nn_module_stack") or {}
        module_path = _strip(next(reversed(stack.values()))[0]) if stack else ""
        op_params = tuple(dict.fromkeys(params[r] for r in refs if r in params))
        return OpNode(
            name=node.name,
            target=target,
            inputs=tuple(refs),
            input_metas=tuple(metas),
            outputs=outputs,
            args=args,
            kwargs=kwargs,
            flops=op_flops(target, metas, outputs, args),
            bytes=op_bytes(target, metas, outputs),
            params=op_params,
            module_path=module_path,
        )

    def outputs(self) -> list[str]:
        output_node = next(n for n in self.program.graph.nodes if n.op == "output")
        values = [v for _, v in _leaves(output_node.args[0])]
        out: list[str] = []
        for spec, value in zip(self.program.graph_signature.output_specs, values, strict=True):
            if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
                continue  # buffer mutations: the ops that compute them stay in the graph
            if isinstance(value, torch.fx.Node):
                ref = self.refs[value.name]
                if not isinstance(ref, _Const):
                    out.append(ref)
        return out


def _convert(program: torch.export.ExportedProgram, model: nn.Module, batch: Any) -> _Captured:
    try:
        conv = _Converter(program, model, batch)
        inputs = conv.inputs()
        ops = conv.ops(inputs)
        return _Captured(inputs, ops, conv.outputs())
    except Exception as e:
        if "GuardOnDataDependent" not in type(e).__name__ and "data-dependent" not in str(e):
            raise
        # export traced it, but a tensor's size depends on values (boolean-mask indexing,
        # nonzero, unique): plans need every size up front
        raise CaptureError(
            f"capture of {type(model).__name__}: a tensor's size depends on tensor values "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}); plans need static "
            "sizes: replace boolean-mask indexing, nonzero or unique with masking (torch.where, "
            "multiplying by the mask) that keeps the shape"
        ) from e


# --------------------------------------------------------------------------- fast path


class _NotRepeatable(Exception):
    """The shortened capture cannot stand for the full model: trace it whole instead."""


def _shortened(model: nn.Module, runs: Iterable[_Run]) -> nn.Module:
    """A shallow copy of ``model`` whose long runs keep only their first two members.

    Only the modules on the path to each container are copied; parameters are shared and
    the user's model is untouched. Kept keys stay as they were, so FQNs are the real ones.
    """
    root = model
    for run in runs:
        drop = set(run.keys[2:])
        path = run.container.split(".") if run.container else []
        root = _replace(root, path, drop)
    return root


def _replace(module: nn.Module, path: list[str], drop: set[str]) -> nn.Module:
    clone = copy.copy(module)
    if not path:
        clone._modules = type(module._modules)(
            (k, v) for k, v in module._modules.items() if k not in drop
        )
        return clone
    clone._modules = type(module._modules)(module._modules)
    child = module._modules[path[0]]
    assert child is not None
    clone._modules[path[0]] = _replace(child, path[1:], drop)
    return clone


def _rename_path(path: str, old: str, new: str) -> str:
    if path == old:
        return new
    return new + path[len(old) :] if path.startswith(old + ".") else path


def _owned(g: GraphInput, member: str) -> bool:
    """Whether graph input ``g`` is a parameter, buffer or constant of ``member``."""
    return g.kind != "input" and (g.target == member or g.target.startswith(member + "."))


class _Expansion:
    """Synthesises members 2..N-1 of a run from members 0 and 1 of a shortened capture.

    Member ``j`` is member 1 with its values renamed: what member 1 reads from member 0 it
    reads from member ``j-1``; what it reads from before the run (shared tables, the batch)
    it reads unchanged. Ops after the run read the last member instead of member 1.
    """

    def __init__(self, cap: _Captured, run: _Run) -> None:
        self.cap, self.members = cap, run.members
        first = [i for i, op in enumerate(cap.ops) if op.layer == self.members[0]]
        second = [i for i, op in enumerate(cap.ops) if op.layer == self.members[1]]
        if not first or first != list(range(first[0], first[0] + len(first))):
            raise _NotRepeatable
        if second != list(range(first[-1] + 1, first[-1] + 1 + len(second))):
            raise _NotRepeatable  # other ops run between or inside the members
        self.end = second[-1] + 1
        self.template = [cap.ops[i] for i in second]
        if not _corresponds([cap.ops[i] for i in first], self.template):
            raise _NotRepeatable
        self.inputs = {g.name: g for g in cap.inputs}
        reads = (r for i in range(first[0], self.end) for r in cap.ops[i].inputs)
        if any(r in self.inputs and self.inputs[r].kind == "constant" for r in reads):
            raise _NotRepeatable  # export numbers lifted constants per use: trace whole
        self.position0 = {cap.ops[i].name: p for p, i in enumerate(first)}
        self.names = [[cap.ops[i].name for i in first], [op.name for op in self.template]]

    def _input(self, ref: str, old: str, new: str) -> str:
        g = self.inputs[ref]
        return _input_name(g.kind, _rename_path(g.target, old, new))

    def _remap(self, ref: str, j: int, local: dict[str, str]) -> str:
        op, _, index = ref.partition(":")
        if op in local:
            return value_ref(local[op], int(index or 0))
        if op in self.position0:  # member 1 reads member 0: member j reads member j-1
            return value_ref(self.names[j - 1][self.position0[op]], int(index or 0))
        g = self.inputs.get(ref)
        if g is not None and _owned(g, self.members[1]):
            return self._input(ref, self.members[1], self.members[j])
        if g is not None and _owned(g, self.members[0]):
            return self._input(ref, self.members[0], self.members[j - 1])
        return ref

    def _clone(self, j: int) -> list[OpNode]:
        old, new = self.members[1], self.members[j]
        local = {t.name: f"{t.name}@{j}" for t in self.template}
        self.names.append([local[t.name] for t in self.template])
        return [
            dataclasses.replace(
                t,
                name=local[t.name],
                inputs=tuple(self._remap(r, j, local) for r in t.inputs),
                params=tuple(_rename_path(p, old, new) for p in t.params),
                module_path=_rename_path(t.module_path, old, new),
                layer=new,
            )
            for t in self.template
        ]

    def _relink(self, ref: str, last: dict[str, str]) -> str:
        op, _, index = ref.partition(":")
        if op in self.position0:
            raise _NotRepeatable  # a later op reads member 0: the model is not a chain
        if op in last:
            return value_ref(last[op], int(index or 0))
        g = self.inputs.get(ref)
        if g is not None and _owned(g, self.members[1]):
            return self._input(ref, self.members[1], self.members[-1])
        return ref

    def apply(self) -> None:
        cap = self.cap
        clones = [op for j in range(2, len(self.members)) for op in self._clone(j)]
        last = dict(zip(self.names[1], self.names[-1], strict=True))
        after = [
            dataclasses.replace(op, inputs=tuple(self._relink(r, last) for r in op.inputs))
            for op in cap.ops[self.end :]
        ]
        cap.ops[self.end :] = [*clones, *after]
        cap.outputs[:] = [self._relink(r, last) for r in cap.outputs]
        cap.inputs[:] = _expand_inputs(cap.inputs, self.members)


def _expand_inputs(inputs: Sequence[GraphInput], members: Sequence[str]) -> list[GraphInput]:
    """Insert members 2..N-1's parameters and buffers after each run of member 1's, which
    is where export lifts them for the whole model (module order)."""
    out: list[GraphInput] = []
    pending: list[GraphInput] = []

    def flush() -> None:
        for j in range(2, len(members)):
            for g in pending:
                target = _rename_path(g.target, members[1], members[j])
                # requires_grad is copied from member 1: members of a run have equal flags
                # (requires_grad is part of the structural signature, _signature).
                out.append(dataclasses.replace(g, name=_input_name(g.kind, target), target=target))
        pending.clear()

    for g in inputs:
        if _owned(g, members[1]) and (not pending or pending[-1].kind == g.kind):
            pending.append(g)
        else:
            flush()
            if _owned(g, members[1]):
                pending.append(g)
        out.append(g)
    flush()
    return out


# --------------------------------------------------------------------------- finishing


def _tag_layers(cap: _Captured, runs: Sequence[_Run]) -> None:
    if runs:
        cap.ops[:] = [
            dataclasses.replace(op, layer=_member_of(op.module_path, runs)) for op in cap.ops
        ]


def _verified_groups(cap: _Captured, runs: Sequence[_Run]) -> list[LayerGroup]:
    """Groups whose members' ops correspond; ops of the others lose their layer tag."""
    by_member: dict[str, list[OpNode]] = {}
    for op in cap.ops:
        if op.layer is not None:
            by_member.setdefault(op.layer, []).append(op)
    groups: list[LayerGroup] = []
    rejected: set[str] = set()
    for run in runs:
        first = by_member.get(run.members[0], [])
        if all(_corresponds(first, by_member.get(m, [])) for m in run.members[1:]):
            groups.append(LayerGroup(run.container, run.members))
        else:
            rejected.update(run.members)
    if rejected:
        cap.ops[:] = [
            dataclasses.replace(op, layer=None) if op.layer in rejected else op for op in cap.ops
        ]
    return groups


def _canonical_names(cap: _Captured) -> dict[str, str]:
    """Number ops per aten op name in graph order: linear, linear_1, ... (see module doc).

    Returns the renaming: export's node name -> the op's name in the graph.
    """
    used = {g.name for g in cap.inputs}
    counts: dict[str, int] = {}
    rename: dict[str, str] = {}
    for op in cap.ops:
        base = re.sub(r"_\d+$", "", _packet_name(op.target))
        n = counts.get(base, 0)
        candidate = base if n == 0 else f"{base}_{n}"
        while candidate in used:
            n += 1
            candidate = f"{base}_{n}"
        counts[base] = n + 1
        used.add(candidate)
        rename[op.name] = candidate

    def ref(r: str) -> str:
        op, _, index = r.partition(":")
        return value_ref(rename[op], int(index or 0)) if op in rename else r

    cap.ops[:] = [
        dataclasses.replace(op, name=rename[op.name], inputs=tuple(ref(r) for r in op.inputs))
        for op in cap.ops
    ]
    cap.outputs[:] = [ref(r) for r in cap.outputs]
    return rename


def _packet_name(target: str) -> str:
    parts = target.split(".")
    name = parts[1] if len(parts) == 3 else target
    return re.sub(r"\W", "_", name) or "op"


def _finish(cap: _Captured, runs: Sequence[_Run], names: dict[str, str] | None = None) -> OpGraph:
    """The finished graph; ``names`` (if given) receives export's node name -> op name."""
    groups = _verified_groups(cap, runs)
    rename = _canonical_names(cap)
    if names is not None:
        names.update(rename)
    graph = OpGraph(tuple(cap.inputs), tuple(cap.ops), tuple(cap.outputs), tuple(groups))
    graph.validate()
    return graph


def _check_loss(graph: OpGraph, model: nn.Module, loss_fn: LossFn | None) -> None:
    if loss_fn is None or not graph.outputs:
        return
    meta = graph.meta(graph.outputs[0])
    if meta.ndim != 0:
        raise CaptureError(
            f"capture of {type(model).__name__}: loss_fn returned a tensor of shape "
            f"{meta.shape}, not a scalar; reduce it in loss_fn (e.g. .mean())"
        )


# --------------------------------------------------------------------------- entry point


@contextlib.contextmanager
def in_mode(model: nn.Module, *, training: bool) -> Iterator[nn.Module]:
    """Every module of ``model`` in training (or eval) mode inside the block, as
    ``model.train(training)`` sets it; each module's own mode is restored after.

    Plans are for training steps and the runtime's steps run under ``model.train()``: the
    programs planned and run are exported so, whatever mode the user's model was left in.
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train(training)
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


def capture(
    model: nn.Module,
    example_batch: Any,
    loss_fn: LossFn | None = None,
    *,
    repeat: bool = True,
) -> OpGraph:
    """Trace ``loss_fn(model, example_batch)`` (or ``model(*example_batch)``) into an OpGraph.

    ``model`` may live on the meta device or hold real weights: only shapes are read.
    ``example_batch`` is a tensor, a tuple/list or a dict of tensors; without ``loss_fn`` it
    is unpacked into the model's arguments. ``repeat=True`` traces only two members of long
    runs of identical layers and synthesises the rest (see the module doc); ``repeat=False``
    traces every layer. Both record the same layer groups and give equal graphs.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(
            f"capture: model is a {type(model).__name__}, not a torch.nn.Module; pass the module"
        )
    batch = _batch_for(model, example_batch)
    runs = find_repeated_layers(model)
    long_runs = [r for r in runs if len(r.keys) > 2]
    graph: OpGraph | None = None
    if repeat and long_runs:
        graph = _capture_shortened(model, batch, loss_fn, runs, long_runs)
    if graph is None:
        cap = _convert(_export(model, batch, loss_fn), model, batch)
        _tag_layers(cap, runs)
        graph = _finish(cap, runs)
    _check_loss(graph, model, loss_fn)
    return graph


def _capture_shortened(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    runs: Sequence[_Run],
    long_runs: Sequence[_Run],
) -> OpGraph | None:
    short = _shortened(model, long_runs)
    try:
        program = torch.export.export(_Traced(short, loss_fn), (batch,), strict=False)
        _inline_regions(program.graph_module)
    except Exception:
        return None  # e.g. the forward indexes members 2..N-1: the full trace reports errors
    cap = _convert(program, model, batch)
    _tag_layers(cap, runs)
    try:
        for run in long_runs:
            _Expansion(cap, run).apply()
    except _NotRepeatable:
        return None
    graph = _finish(cap, runs)
    if not {r.members for r in long_runs} <= {g.members for g in graph.layers}:
        return None  # a synthesised group did not verify: trust only a full trace
    return graph


# --------------------------------------------------------------------------- for execution


@dataclass(frozen=True)
class ExecutableCapture:
    """A full trace kept for running: the exported program, its OpGraph, and how they match.

    ``op_of_node`` maps each fx node name of ``program.graph`` that became an op of ``graph``
    to that op's name (the names a Plan uses); nodes capture folds away (getitem, alias,
    assertions) are absent.
    """

    program: torch.export.ExportedProgram
    graph: OpGraph
    op_of_node: dict[str, str]


def capture_program(
    model: nn.Module, example_batch: Any, loss_fn: LossFn | None = None
) -> ExecutableCapture:
    """Trace every layer (no repeated-layer fast path) and keep the program for execution.

    The graph equals :func:`capture`'s (op names included); only shapes are read, so a model
    with real weights is not copied.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(
            f"capture: model is a {type(model).__name__}, not a torch.nn.Module; pass the module"
        )
    batch = _batch_for(model, example_batch)
    runs = find_repeated_layers(model)
    program = _export(model, batch, loss_fn)
    cap = _convert(program, model, batch)
    _tag_layers(cap, runs)
    names: dict[str, str] = {}
    graph = _finish(cap, runs, names)
    _check_loss(graph, model, loss_fn)
    return ExecutableCapture(program, graph, names)
