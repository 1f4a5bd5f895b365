"""Activation recompute (rematerialization) as a pass over a per-rank program.

The per-rank program (:mod:`plait.runtime.program.compile`) is one FX graph: the forward's local aten
ops, then the backward's, with functional collectives explicit. A forward value read by a
backward node is what autograd would have saved: it stays alive from where forward computes it
until backward's last read. :func:`rematerialize` rewrites such reads to read a *clone* of the
forward computation placed in backward instead, so the original dies after its last forward
reader (FX's generated code drops every value after its last use) and only the clone's inputs
stay alive in between. That is activation checkpointing done on the graph, as MindSpore's
``Cell.recompute()`` and Megatron's full and selective recompute do; ZeRO-3 reuses the same pass
to gather parameters again in backward instead of keeping the gathered copy (a policy that says
True for the all-gather of a parameter).

Which forward nodes to recompute is a policy, a predicate on nodes. :func:`recompute_policy`
builds the two usual ones over *regions*: forward nodes traced inside
``torch.fx.traceback.annotate({"plait_module": path})`` carry ``node.meta["custom"]
["plait_module"]`` (:data:`TAG`), and :func:`regions` maps each to the recompute region (a
module path) it lies in.

Whatever a policy says, some nodes are never cloned, because a clone must compute the very
value forward computed: placeholders and constants (they are alive anyway), ops that write
memory (in-place, ``out=``), ops that draw random numbers (dropout's mask, ``rand*``: their
results are kept, so a recomputed dropout reuses forward's mask bit for bit), ops that return
uninitialized memory, and any node whose inputs or result are written by some op after it
(forward saw the values before the write, a clone would see them after).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx
from torch.fx import Node

# the memory model's rule, which reads schema names ("aten::mm") too: what the plan predicts
# is what the pass keeps (pipeline stages import it from here)
from plait.cost.saved import kept_by_selective

__all__ = [
    "TAG",
    "is_collective",
    "memory_root",
    "module_of",
    "recompute_policy",
    "regions",
    "rematerialize",
    "saved_bytes",
]

TAG = "plait_module"
"""Key in ``node.meta["custom"]`` holding the module path a forward node was traced in."""

RegionOf = Callable[[Node], str | None]

# Ops whose result is uninitialized memory: a clone would return different garbage (forward
# always writes such a buffer before reading it, and a written buffer is never cloned anyway).
_UNINITIALIZED = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::empty_permuted",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)


_COLLECTIVES = "_c10d_functional"


# --------------------------------------------------------------------------- node facts


def module_of(node: Node) -> str | None:
    """The module path ``node`` was traced in (:data:`TAG`), None when untagged."""
    custom = node.meta.get("custom")
    tag = custom.get(TAG) if isinstance(custom, dict) else None
    return tag if isinstance(tag, str) else None


def _schema(node: Node) -> Any:
    """The aten/custom op schema of a call_function node, None for Python callables."""
    if node.op != "call_function":
        return None
    return getattr(node.target, "_schema", None)


def _op_name(node: Node) -> str:
    schema = _schema(node)
    return schema.name if schema is not None else ""


def _is_getitem(node: Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _is_wait(node: Node) -> bool:
    return _op_name(node) == f"{_COLLECTIVES}::wait_tensor"


def is_collective(node: Node) -> bool:
    """A functional collective or the wait on one."""
    return _op_name(node).startswith(f"{_COLLECTIVES}::")


_is_collective = is_collective


def _is_matmul_like(node: Node) -> bool:
    return kept_by_selective(_op_name(node))


def _argument(node: Node, index: int, arg: Any) -> Any:
    """The value ``node`` passes for schema argument ``arg`` (position ``index``)."""
    if index < len(node.args) and not arg.kwarg_only:
        return node.args[index]
    if arg.name in node.kwargs:
        return node.kwargs[arg.name]
    return arg.default_value if arg.has_default_value() else None


def _nodes_in(value: Any) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, Node)]
    return []


def _aliased_input(node: Node, output: int) -> Node | None:
    """The input whose memory result ``output`` of ``node`` shares (views, in-place ops)."""
    if _is_wait(node):
        # wait_tensor hands back its input's buffer once the collective is done.
        return node.args[0] if isinstance(node.args[0], Node) else None
    schema = _schema(node)
    if schema is None or output >= len(schema.returns):
        return None
    alias = schema.returns[output].alias_info
    if alias is None:
        return None
    for index, arg in enumerate(schema.arguments):
        if arg.alias_info is None:
            continue
        # Lists of views (split, unbind) name no set on the return: the aliased argument is
        # the one annotated argument.
        if not alias.before_set or arg.alias_info.before_set & alias.before_set:
            found = _nodes_in(_argument(node, index, arg))
            return found[0] if found else None
    return None


def _written(node: Node) -> list[Node]:
    """The inputs ``node`` writes into (in-place self, ``out=``, mutated lists)."""
    schema = _schema(node)
    if schema is None or not schema.is_mutable:
        return []
    out: list[Node] = []
    for index, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.extend(_nodes_in(_argument(node, index, arg)))
    return out


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        try:
            return int(value.numel()) * value.element_size()
        except Exception:  # an unbacked symbolic size: unknown, counted as free
            return 0
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _node_bytes(node: Node) -> int:
    return _nbytes(node.meta.get("val"))


def _always_alive(node: Node) -> bool:
    """Graph inputs and constants: the caller holds them for the whole step."""
    return node.op in ("placeholder", "get_attr")


def draws_random(node: Node) -> bool:
    """Whether the op at ``node`` draws random numbers (dropout, ``rand``...): tagged seeded,
    except an attention kernel tagged so only for its dropout and called with dropout off."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags and not _deterministic_attention(node)


def _deterministic_attention(node: Node) -> bool:
    """An attention kernel tagged random only for its dropout, called with dropout off."""
    schema = _schema(node)
    for index, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            return _argument(node, index, arg) == 0
    return False


# --------------------------------------------------------------------------- graph facts


@dataclass(frozen=True)
class _Facts:
    """What the pass and the policies need to know about one graph, computed once."""

    position: dict[Node, int]
    start: int
    """Position of the first backward node."""
    root: dict[Node, Node]
    """Each node -> the node that allocated the memory its value lives in."""
    last_write: dict[Node, int]
    """Each written root -> position of the last node that writes into it."""

    @staticmethod
    def of(graph: torch.fx.Graph, backward_start: Node) -> _Facts:
        position = {n: i for i, n in enumerate(graph.nodes)}
        if backward_start not in position:
            raise ValueError(f"backward_start {backward_start.name!r} is not in this graph")
        root: dict[Node, Node] = {}
        last_write: dict[Node, int] = {}
        for n in graph.nodes:
            root[n] = _root_of(n, root)
            for written in _written(n):
                target = root.get(written, written)
                last_write[target] = max(last_write.get(target, -1), position[n])
        return _Facts(position, position[backward_start], root, last_write)

    def forward(self, node: Node) -> bool:
        """Before the backward start (nodes added after the analysis are not forward)."""
        return self.position.get(node, self.start) < self.start

    def clonable(self, node: Node) -> bool:
        """Whether a clone of ``node`` placed in backward computes forward's value exactly."""
        if not _pure(node):
            return False
        here = self.position[node]
        # Memory written after ``node`` ran: forward read it before the write, a clone reads
        # it after (its own result included: a buffer filled in place later).
        return all(
            self.last_write.get(self.root.get(n, n), -1) < here
            for n in (node, *node.all_input_nodes)
        )


def _root_of(node: Node, root: dict[Node, Node]) -> Node:
    if _is_getitem(node):
        source, index = node.args[0], node.args[1]
        if isinstance(source, Node) and isinstance(index, int):
            schema = _schema(source)
            # One list return (split, unbind) holds every piece; a tuple return is per index.
            output = 0 if schema is not None and len(schema.returns) == 1 else index
            aliased = _aliased_input(source, output)
            if aliased is not None:
                return root.get(aliased, aliased)
        return node
    aliased = _aliased_input(node, 0)
    return node if aliased is None else root.get(aliased, aliased)


def memory_root(node: Node) -> Node:
    """The node whose memory ``node``'s value lives in (itself, unless it is a view)."""
    root: Node = node
    while True:
        if _is_wait(root) or root.op != "call_function":
            return root
        parent = _root_of(root, {})
        if parent is root:
            return root
        root = parent


def _pure(node: Node) -> bool:
    """Ops that compute the same value from the same inputs and write nothing."""
    if node.op != "call_function":
        return False  # placeholders, get_attr, output: nothing to recompute
    if _is_getitem(node):
        return True
    schema = _schema(node)
    if schema is None:
        # Python arithmetic on sizes (operator.*) is pure; other callables are unknown.
        return getattr(node.target, "__module__", None) in ("_operator", "operator", "math")
    if schema.is_mutable or schema.name in _UNINITIALIZED:
        return False
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_bitwise in tags:
        return False
    return not draws_random(node)


def _decider(facts: _Facts, recompute: Callable[[Node], bool]) -> Callable[[Node], bool]:
    """Memoized: is forward node ``n`` cloned when backward (or another clone) reads it?"""
    memo: dict[Node, bool] = {}

    def chosen(n: Node) -> bool:
        if n in memo:
            return memo[n]
        if not facts.forward(n) or not facts.clonable(n):
            result = False
        elif _is_wait(n):
            # A wait is recomputed exactly when its collective is: a wait alone would wait on
            # the forward collective's handle, keeping its buffer alive anyway.
            source = n.args[0]
            result = isinstance(source, Node) and chosen(source)
        elif _is_getitem(n) and isinstance(n.args[0], Node) and facts.forward(n.args[0]):
            # A piece read out of a kept tuple costs nothing; cloning it would keep the whole
            # tuple alive until backward instead.
            result = bool(recompute(n)) and chosen(n.args[0])
        else:
            result = bool(recompute(n))
        memo[n] = result
        return result

    return chosen


def _backward_users(facts: _Facts, graph: torch.fx.Graph) -> list[Node]:
    """Backward nodes that may read forward values through a clone (not the output: a value
    the step returns stays alive to the end anyway, a clone would only add a copy)."""
    return [n for n in graph.nodes if not facts.forward(n) and n.op != "output"]


# --------------------------------------------------------------------------- the pass


def rematerialize(
    gm: torch.fx.GraphModule,
    *,
    backward_start: Node,
    recompute: Callable[[Node], bool],
) -> int:
    """Recompute in backward the forward nodes ``recompute`` selects; returns clones made.

    In place: each backward node reading a forward node ``f`` with ``recompute(f)`` reads a
    clone of ``f`` instead, placed just before the first backward node that needs it and shared
    by later ones. A clone's own forward inputs are resolved the same way (selected ones cloned
    too, ancestors first), the others are read as saved values. Nodes before ``backward_start``
    are forward; it and every later node are backward. Never-clone nodes (see the module
    docstring) stay saved whatever ``recompute`` says; a ``wait_tensor`` follows its collective;
    a ``getitem`` is cloned only when its tuple is.
    """
    graph = gm.graph
    facts = _Facts.of(graph, backward_start)
    chosen = _decider(facts, recompute)
    clones: dict[Node, Node] = {}
    for user in _backward_users(facts, graph):
        needed = [a for a in user.all_input_nodes if chosen(a)]
        if not needed:
            continue
        with graph.inserting_before(user):
            for value in needed:
                _clone_with_ancestors(graph, value, chosen, clones)
        for value in needed:
            user.replace_input_with(value, clones[value])
    graph.lint()
    gm.recompile()
    return len(clones)


def _clone_with_ancestors(
    graph: torch.fx.Graph, node: Node, chosen: Callable[[Node], bool], clones: dict[Node, Node]
) -> None:
    """Clone ``node`` and its selected forward ancestors at the insertion point, inputs first.

    Iterative (a region can be thousands of nodes deep, beyond Python's recursion limit).
    """
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        current, inputs_done = stack.pop()
        if current in clones:
            continue
        if inputs_done:
            clones[current] = _copy(graph, current, clones)
            continue
        stack.append((current, True))
        stack.extend((a, False) for a in current.all_input_nodes if a not in clones and chosen(a))


def _copy(graph: torch.fx.Graph, node: Node, clones: dict[Node, Node]) -> Node:
    def load(a: Node) -> Node:
        return clones.get(a, a)

    clone = graph.create_node(
        node.op,
        node.target,
        torch.fx.node.map_arg(node.args, load),
        torch.fx.node.map_arg(node.kwargs, load),
        name=f"{node.name}_recomputed",
        type_expr=node.type,
    )
    # "val" (shape, dtype) and the rest of the meta describe the clone exactly as the original;
    # "recomputed_from" lets reports and tests tell clones apart.
    clone.meta = dict(node.meta)
    if isinstance(clone.meta.get("custom"), dict):  # its own copy: tags edited on one stay there
        clone.meta["custom"] = dict(clone.meta["custom"])
    clone.meta["recomputed_from"] = node.name
    return clone


# --------------------------------------------------------------------------- measuring


def saved_bytes(gm: torch.fx.GraphModule, backward_start: Node) -> int:
    """Bytes of forward values that backward nodes read: what stays alive between forward and
    backward (autograd's saved tensors).

    Counted per buffer (views of one buffer once, from ``meta["val"]``); graph inputs and
    constants are not counted (the caller holds them anyway), nor values only the output
    returns.
    """
    facts = _Facts.of(gm.graph, backward_start)
    buffers = {
        facts.root.get(a, a)
        for user in _backward_users(facts, gm.graph)
        for a in user.all_input_nodes
        if facts.forward(a)
    }
    return sum(_node_bytes(b) for b in buffers if not _always_alive(b))


# --------------------------------------------------------------------------- policies


def regions(module_paths: Sequence[str], traced_in: RegionOf | None = None) -> RegionOf:
    """A node's recompute region: the longest path P of ``module_paths`` whose module the node
    was traced in (its tag is P or below P); None when untagged or outside every region.
    The path "" is the root module: every tagged node is inside it. ``traced_in``: where a
    node's module path is read (default :func:`module_of`, the program's tag)."""
    paths = sorted(set(module_paths), key=len, reverse=True)
    read = traced_in or module_of

    def region_of(node: Node) -> str | None:
        tag = read(node)
        if tag is None:
            return None
        for path in paths:
            if path == "" or tag == path or tag.startswith(path + "."):
                return path
        return None

    return region_of


def recompute_policy(
    mode: Literal["full", "selective"],
    region_of: RegionOf,
    *,
    backward_start: Node,
) -> Callable[[Node], bool]:
    """The forward nodes to recompute, for :func:`rematerialize`.

    ``"full"`` (MindSpore's ``Cell.recompute()``, Megatron's full recompute): every node inside
    a region but the region's outputs. ``"selective"`` (Megatron's selective recompute): inside
    regions, keep also the results of matmul-like ops (matrix products, convolutions,
    attention kernels, embedding lookups) and of collectives; recompute the cheap rest
    (pointwise ops, activations, norms, softmax, views, casts).

    A *region output* is a node of a region that a forward node outside the region reads (the
    next region, code outside every region such as the loss), or that the step returns. It is
    kept: if the next region's input were recomputed, the next region's clones would need the
    previous region recomputed, and so on through the whole network. A value only backward
    reads (a norm's statistics) is no output: the region recomputes it from its inputs.

    Then two refinements, so recompute never costs more memory than keeping:

    * a node whose buffer a kept node also holds (a kept output is a view of it) is kept:
      that buffer stays alive anyway, a clone would compute a second copy of it (a view *of*
      a kept buffer may still be recomputed: a view costs no memory);
    * a node whose clone would need kept inputs that backward does not read anyway, together
      bigger than the node itself, is kept. This is MindSpore's caveat on casts: recomputing
      a high->low precision cast keeps the wide input alive instead of the narrow output, more
      memory; a low->high cast (its input smaller) stays recomputed. Ties recompute (no worse).
      The test is per clone, so a wide input shared by several clones is counted against
      each of them: it errs towards keeping.

    The decision is made for the whole graph on the first call (``backward_start``'s graph,
    as it is then) and looked up afterwards; nodes added later are never recomputed.
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode {mode!r}: use 'full' or 'selective'")
    decided: set[Node] | None = None

    def recompute(node: Node) -> bool:
        nonlocal decided
        if decided is None:
            decided = _plan(mode, region_of, backward_start)
        return node in decided

    return recompute


def _plan(mode: str, region_of: RegionOf, backward_start: Node) -> set[Node]:
    graph = backward_start.graph
    facts = _Facts.of(graph, backward_start)
    forward = [n for n in graph.nodes if facts.forward(n) and n.op == "call_function"]
    region = {n: region_of(n) for n in forward}
    candidates = {n for n in forward if region[n] is not None and facts.clonable(n)}
    candidates -= _region_outputs(forward, region, facts)
    if mode == "selective":
        candidates -= {n for n in candidates if _is_matmul_like(n) or _is_collective(n)}
    while True:
        size = len(candidates)
        candidates = _consistent(candidates)
        candidates = _unshared(candidates, forward, facts)
        candidates = _no_worse(candidates, facts, graph)
        if len(candidates) == size:
            return candidates


def _region_outputs(
    forward: Iterable[Node], region: dict[Node, str | None], facts: _Facts
) -> set[Node]:
    outputs: set[Node] = set()
    for n in forward:
        if region[n] is None:
            continue
        for user in n.users:
            if user.op == "output" or (facts.forward(user) and region.get(user) != region[n]):
                outputs.add(n)
                break
    return outputs


def _consistent(candidates: set[Node]) -> set[Node]:
    """Pieces of a kept tuple are kept; a collective and its wait go together."""
    out = set(candidates)
    for n in candidates:
        source = n.args[0] if n.args and isinstance(n.args[0], Node) else None
        if source is None:
            continue
        if (_is_getitem(n) or _is_wait(n)) and source not in candidates:
            out.discard(n)
    for n in candidates:
        waits = [u for u in n.users if _is_wait(u)]
        if any(u not in candidates for u in waits):
            out.discard(n)
            out.difference_update(waits)
    return out


def _unshared(candidates: set[Node], forward: Sequence[Node], facts: _Facts) -> set[Node]:
    """Keep a node whose buffer a kept node also holds (a region output that is a view of
    it): a clone would compute a second copy of a buffer that stays alive anyway. The
    converse, a view of a kept buffer, stays a candidate: cloning a view costs no memory."""
    kept = {facts.root[n] for n in forward if n not in candidates}
    return {n for n in candidates if not (facts.root[n] is n and n in kept)}


def _no_worse(candidates: set[Node], facts: _Facts, graph: torch.fx.Graph) -> set[Node]:
    """Drop clones that would make a bigger kept value stay alive than the one they free."""
    chosen = _decider(facts, lambda n: n in candidates)
    users = _backward_users(facts, graph)
    saved_anyway = {
        facts.root[a]
        for user in [*users, *(n for n in graph.nodes if n.op == "output")]
        for a in user.all_input_nodes
        if facts.forward(a) and not chosen(a)
    }
    cloned = _cloned(users, chosen)
    worse: set[Node] = set()
    for f in cloned:
        pinned = {
            facts.root[a]
            for a in f.all_input_nodes
            if not chosen(a) and not _always_alive(facts.root[a])
        } - saved_anyway
        if sum(_node_bytes(r) for r in pinned) > _node_bytes(facts.root[f]):
            worse.add(f)
    return candidates - worse


def _cloned(users: Iterable[Node], chosen: Callable[[Node], bool]) -> set[Node]:
    """The forward nodes :func:`rematerialize` would clone for these backward readers."""
    seen: set[Node] = set()
    stack = [a for user in users for a in user.all_input_nodes if chosen(a)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if a not in seen and chosen(a))
    return seen
