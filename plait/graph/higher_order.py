"""Higher-order ops in an exported training graph, made plain before conversion.

``torch.export`` (non-strict, training IR) keeps some of what a forward does as calls that
are not aten ops: a ``torch.vmap`` (Hugging Face's causal-mask builder in transformers 4.x)
becomes functorch's own bookkeeping calls around batched aten ops, ``torch.cond`` a
``higher_order.cond`` node over two subgraphs, a reentrant activation checkpoint a ``no_grad``
region. plait's op catalogue and executor read aten ops, so capture rewrites these into aten
ops of the same graph, in place:

- **vmap**: each outermost vmap region (from functorch's first ``_vmap_increment_nesting`` to
  its matching decrement) is traced again by ``make_fx`` on the export's fake tensors, where
  the batching rules run and leave the plain aten ops of the batched computation; those
  replace the region. The values the region computes are the same, op for op.
- **cond**: both branches are inlined and each output chosen with ``aten.where`` on the
  predicate (cond guarantees both branches give the same shapes and dtypes; the gradient of
  the branch not taken is zero, as with cond). A predicate that is a Python bool picks its
  branch. While capture exports, ``torch.cond`` itself does this (:func:`conds_inlined`),
  so no cond node is traced; a cond node that still reaches the graph is rewritten alike.
- **reentrant activation checkpointing** (``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=True)``, Hugging Face's default for ``gradient_checkpointing_enable()``) runs
  its function under ``no_grad`` and recomputes it in an autograd Function's backward, which
  export cannot see: traced as it is, the checkpointed layers would have no gradient. While
  capture exports, :func:`checkpoints_inlined` makes the checkpoint call its function
  directly, under ``no_grad`` only where the checkpoint gives no gradient either (no input
  needs one).

Non-strict export already inlines non-reentrant checkpoints and
``torch.compiler.nested_compile_region`` functions. Any other higher-order op (``while_loop``,
``map``, ``scan``, a ``torch.func`` transform other than vmap...) is refused by
:func:`refuse_higher_order` with a :class:`~plait.errors.CaptureError` naming the op, the
module that calls it and what to write instead.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.fx
import torch.utils.checkpoint
from torch.fx.experimental.proxy_tensor import make_fx

from plait._compat import HigherOrderOperator, functorch_levels_restored, tree_map
from plait.errors import CaptureError

__all__ = [
    "checkpoints_inlined",
    "conds_inlined",
    "inline_higher_order",
    "inlined_while_exporting",
    "refuse_higher_order",
]

_FUNCTORCH = "torch._functorch.predispatch"  # module of vmap's bookkeeping calls in a graph
# node meta copied from a replaced node to the ops that replace it (plait's region tags
# included: a vmap inside a no_grad block stays there)
_KEPT_META = ("nn_module_stack", "stack_trace", "plait_grad_enabled", "plait_autocast")


# --------------------------------------------------------------------------- checkpoints


def _call_directly(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
    """``CheckpointFunction.apply`` while capture exports: the function, with gradients where
    the checkpoint gives them. Its outputs need a gradient only when an input does (it is an
    autograd Function): a block reading only the batch trains nothing on one device either,
    so it runs under no_grad."""
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return function(*args)
    with torch.no_grad():
        return function(*args)


@contextlib.contextmanager
def checkpoints_inlined() -> Iterator[None]:
    """Reentrant activation checkpoints call their function directly inside the block.

    ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` (and wrappers built
    on it: ``checkpoint_sequential``, Hugging Face's gradient checkpointing, torch's
    ``checkpoint_wrapper`` with ``CheckpointImpl.REENTRANT``) reaches ``CheckpointFunction``,
    which runs ``fn`` under ``no_grad``. Export would record that and lose the gradient.
    Callers holding ``checkpoint`` itself (a ``functools.partial`` made before capture) are
    caught too, since the function is looked up on the class at call time.
    """
    holder = torch.utils.checkpoint.CheckpointFunction
    own = holder.__dict__.get("apply")  # None: inherited from autograd.Function
    holder.apply = staticmethod(_call_directly)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del holder.apply
        else:
            holder.apply = own  # type: ignore[method-assign]


def _chosen(pred: torch.Tensor, yes: Any, no: Any) -> Any:
    """One output of ``torch.cond``: ``where(pred, yes, no)`` for tensors."""
    return torch.where(pred, yes, no) if isinstance(yes, torch.Tensor) else yes


def _cond_as_where(pred: Any, true_fn: Any, false_fn: Any, operands: Any = ()) -> Any:
    """``torch.cond`` while capture exports: both branches, each output chosen by ``where``
    (what :func:`_inline_conds` makes of a cond node), no higher-order op traced."""
    operands = tuple(operands)
    if not isinstance(pred, torch.Tensor):
        return (true_fn if pred else false_fn)(*operands)
    return tree_map(lambda y, n: _chosen(pred, y, n), true_fn(*operands), false_fn(*operands))


@contextlib.contextmanager
def conds_inlined() -> Iterator[None]:
    """``torch.cond`` is :func:`_cond_as_where` inside the block.

    Export would record a ``higher_order.cond`` node, which :func:`_inline_conds` rewrites
    the same way; tracing it inline also works in a simulated world, whose (suspended) mode
    refuses higher-order ops. Code holding ``cond`` from before (``from torch import cond``)
    still gets the node.
    """
    original = torch.cond
    torch.cond = _cond_as_where  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cond = original


@contextlib.contextmanager
def inlined_while_exporting() -> Iterator[None]:
    """Reentrant checkpoints and ``torch.cond`` traced inline (see the two above)."""
    with checkpoints_inlined(), conds_inlined():
        yield


# --------------------------------------------------------------------------- entry point


def inline_higher_order(gm: torch.fx.GraphModule) -> None:
    """Rewrite vmap regions and conds of ``gm`` into aten ops, in place."""
    changed = _inline_vmaps(gm)
    changed |= _inline_conds(gm)
    if changed:
        _drop_unused_attributes(gm)
        gm.graph.lint()
        gm.recompile()


def refuse_higher_order(gm: torch.fx.GraphModule, model: str) -> None:
    """A CaptureError for the first higher-order op left in ``gm`` (see the module doc)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _hop_name(node)
        if name is None and not _is_functorch(node):
            continue
        what = name or f"torch.func transform ({node.target.__name__})"
        raise CaptureError(
            f"capture of {model}: module {_module_of(node)!r} calls {what}, a higher-order op "
            "plait cannot plan (it inlines torch.vmap, torch.cond and activation checkpoints "
            "only); write the loop or transform as plain tensor ops in the forward (a Python "
            "loop over a fixed count, torch.where for a choice), or keep it out of loss_fn"
        )


def _hop_name(node: torch.fx.Node) -> str | None:
    target = node.target
    return target.name() if isinstance(target, HigherOrderOperator) else None


def _is_functorch(node: torch.fx.Node) -> bool:
    return getattr(node.target, "__module__", None) == _FUNCTORCH


def _module_of(node: torch.fx.Node) -> str:
    """The user's module path of a node (the wrapper's prefix ``model.`` stripped)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path = next(reversed(stack.values()))[0]
    return path.removeprefix("model.") if path != "model" else "<top level>"


def _drop_unused_attributes(gm: torch.fx.GraphModule) -> None:
    """Attribute reads nothing uses any more (subgraphs and specs of inlined ops), and the
    subgraph modules nothing reads."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_children()):
        if name not in used and isinstance(getattr(gm, name), torch.fx.GraphModule):
            delattr(gm, name)


def _copy_meta(source: torch.fx.Node, target: torch.fx.Node) -> None:
    for key in _KEPT_META:
        if key in source.meta:
            target.meta.setdefault(key, source.meta[key])


# --------------------------------------------------------------------------- vmap


def _vmap_regions(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Outermost vmap regions: every node from functorch's first call at nesting depth 0 to
    the decrement that brings the depth back to 0 (nested vmaps are inside)."""
    regions: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] | None = None
    depth = 0
    for node in graph.nodes:
        functorch = node.op == "call_function" and _is_functorch(node)
        if current is None:
            if not functorch:
                continue
            current = []
        current.append(node)
        name = getattr(node.target, "__name__", "") if functorch else ""
        if name.endswith("_increment_nesting"):
            depth += 1
        elif name.endswith("_decrement_nesting"):
            depth -= 1
            if depth == 0:
                regions.append(current)
                current = None
    return regions


def _region_module(
    gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]
) -> tuple[torch.fx.GraphModule, list[torch.fx.Node], list[torch.fx.Node]]:
    """The region as a module of its own: (module, outer nodes it reads, nodes read after it)."""
    inside = set(nodes)
    outer = dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside)
    # attributes (a pytree spec, a function holder) are read as they are; values are inputs
    reads = [a for a in outer if a.op != "get_attr"]
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {a: sub.placeholder(a.name) for a in reads}
    for a in outer:
        if a.op == "get_attr":
            env[a] = sub.get_attr(cast(str, a.target))  # a get_attr node's target: a name
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    results = [n for n in nodes if any(u not in inside for u in n.users)]
    sub.output(tuple(env[n] for n in results))
    return torch.fx.GraphModule(gm, sub), reads, results


def _fake_mode(graph: torch.fx.Graph) -> Any:
    """The fake-tensor mode export traced in (every placeholder's value carries it)."""
    for node in graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return contextlib.nullcontext()


def _retraced(region: torch.fx.GraphModule, values: list[Any], fake: Any) -> torch.fx.Graph:
    """The region traced by make_fx: functorch's batching rules run, plain aten ops remain."""
    with fake, functorch_levels_restored():
        traced = make_fx(region)(*values)
    traced.graph.eliminate_dead_code()
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        raise NotImplementedError("a tensor literal inside torch.vmap")
    return traced.graph


def _splice(
    graph: torch.fx.Graph,
    traced: torch.fx.Graph,
    reads: Sequence[torch.fx.Node],
    results: Sequence[torch.fx.Node],
    nodes: Sequence[torch.fx.Node],
) -> None:
    """Replace ``nodes`` (reading ``reads``, read after as ``results``) by ``traced``'s ops."""
    placeholders = [n for n in traced.nodes if n.op == "placeholder"]
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, reads, strict=True))
    origin = next((n for n in nodes if n.meta.get("nn_module_stack")), nodes[0])
    outputs: Any = ()
    with graph.inserting_before(nodes[0]):
        for inner in traced.nodes:
            if inner.op == "output":
                outputs = inner.args[0]
            elif inner.op == "call_function":
                env[inner] = graph.node_copy(inner, env.__getitem__)
                _copy_meta(origin, env[inner])
    for old, new in zip(results, outputs, strict=True):
        old.replace_all_uses_with(env[new] if isinstance(new, torch.fx.Node) else new)
    for node in reversed(nodes):
        graph.erase_node(node)


def _inline_vmaps(gm: torch.fx.GraphModule) -> bool:
    regions = _vmap_regions(gm.graph)
    if not regions:
        return False
    fake = _fake_mode(gm.graph)
    for nodes in regions:
        region, reads, results = _region_module(gm, nodes)
        values = [a.meta.get("val") for a in reads]
        try:
            traced = _retraced(region, values, fake)
        except Exception as e:
            raise CaptureError(
                f"capture: module {_module_of(nodes[0])!r} calls torch.vmap and tracing its "
                f"batched ops failed ({type(e).__name__}: {str(e)[:200]}); compute the batch "
                "with broadcasting instead of torch.vmap"
            ) from e
        _splice(gm.graph, traced, reads, results, nodes)
    return True


# --------------------------------------------------------------------------- cond


def _inline_graph(
    graph: torch.fx.Graph, sub: torch.fx.GraphModule, operands: Sequence[Any], at: torch.fx.Node
) -> list[Any]:
    """Copy ``sub``'s ops before ``at`` on ``operands``; its outputs (nodes or constants)."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, operands, strict=True))
    outputs: Any = ()
    with graph.inserting_before(at):
        for inner in sub.graph.nodes:
            if inner.op == "output":
                outputs = inner.args[0]
            elif inner.op == "call_function":
                env[inner] = graph.node_copy(inner, env.__getitem__)
                _copy_meta(at, env[inner])
            elif inner.op == "get_attr":
                raise CaptureError(
                    f"capture: module {_module_of(at)!r}: a nested higher-order op inside "
                    f"{at.target}; plait inlines one level: move the inner one out"
                )
    flat = outputs if isinstance(outputs, tuple | list) else (outputs,)
    return [env.get(o, o) if isinstance(o, torch.fx.Node) else o for o in flat]


def _replace_results(graph: torch.fx.Graph, node: torch.fx.Node, results: Sequence[Any]) -> None:
    """Readers of ``node[i]`` read ``results[i]``; the node goes."""
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise CaptureError(
                f"capture: module {_module_of(node)!r}: the outputs of {node.target} are read "
                "as a whole; plait reads them by index only"
            )
        user.replace_all_uses_with(results[cast(int, user.args[1])])
        graph.erase_node(user)
    graph.erase_node(node)


def _where(graph: torch.fx.Graph, pred: torch.fx.Node, yes: Any, no: Any, at: torch.fx.Node) -> Any:
    """``where(pred, yes, no)`` as a node before ``at`` (the chosen branch's value)."""
    if not isinstance(yes, torch.fx.Node):
        return yes  # a constant output: cond requires both branches to return it alike
    with graph.inserting_before(at):
        chosen = graph.call_function(torch.ops.aten.where.self, (pred, yes, no))
    chosen.meta["val"] = yes.meta.get("val")
    _copy_meta(at, chosen)
    return chosen


def _inline_conds(gm: torch.fx.GraphModule) -> bool:
    graph = gm.graph
    conds = [n for n in graph.nodes if n.op == "call_function" and _hop_name(n) == "cond"]
    for node in conds:
        pred, yes_attr, no_attr, operands = node.args[:4]
        yes_sub, no_sub = getattr(gm, yes_attr.target), getattr(gm, no_attr.target)
        if not isinstance(pred, torch.fx.Node):  # a Python bool: the branch is known
            results = _inline_graph(graph, yes_sub if pred else no_sub, operands, node)
        else:
            yes = _inline_graph(graph, yes_sub, operands, node)
            no = _inline_graph(graph, no_sub, operands, node)
            results = [_where(graph, pred, y, n, node) for y, n in zip(yes, no, strict=True)]
        _replace_results(graph, node, results)
        for attr in (yes_attr, no_attr):
            if not attr.users:
                graph.erase_node(attr)
    return bool(conds)
