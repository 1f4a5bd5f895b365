"""Multi-copy parallel as a pass over the per-rank program (``ParallelConfig.interleave_num``).

MindSpore's ``MicroBatchInterleaved`` cuts each micro-batch into copies along the batch so
that while one copy waits on a tensor-parallel collective, another computes. Here the program
is traced with the plan's executor called once per copy (each copy a slice of the batch
inputs, tagged ``plait_copy``; the copies' losses averaged, one backward, which sums the
copies' gradients), and :func:`interleave_copies` orders that graph: the copies take turns,
each running until it would wait on a collective it started in this turn, so the
collective is in flight while the next copy computes. Forward and backward are ordered
separately (every forward node stays before the backward's first node, which the recompute
and offload passes read).

A node belongs to copy ``j`` when it depends on copy ``j``'s batch slice and no other's; a
node that depends on none (a parameter's transpose, the backward's seed) runs where a copy
first needs it; a node joining copies (a parameter's gradient summed over them, the averaged
loss) runs as soon as its inputs have run, so the data-parallel buckets behind it start as
early as before. In backward the loss's average counts for no copy: every gradient descends
from it. The pass moves nodes only; what each computes, and so the numerics, stay the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from torch.fx import Node

from plait._compat import node_tags
from plait.errors import PlanError
from plait.runtime.program.remat import is_collective

__all__ = ["COPY_TAG", "copy_masks", "interleave_copies"]

COPY_TAG = "plait_copy"
"""The ``annotated`` tag on each copy's slice of a batch input (its copy's index)."""

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def interleave_copies(
    graph_module: torch.fx.GraphModule, copies: int, backward_start: Node | None
) -> int:
    """Order ``graph_module`` (traced with ``copies`` tagged copies) so that the copies take
    turns at their collectives, forward and backward separately (in place). Returns how many
    turns ended with a collective in flight (0: nothing to interleave)."""
    if copies < 2:
        return 0
    graph = graph_module.graph
    masks = copy_masks(graph, backward_start)
    found = {m for m in masks.values() if m and not _is_join(m)}
    if len(found) != copies:  # the trace lost the copies' tags: nothing to order by
        raise PlanError(
            f"interleave_num={copies}: the per-rank program holds {len(found)} tagged copies "
            f"of the batch, not {copies}; this is a bug in plait, please report it"
        )
    # placeholders stay first, in their order (the program's arguments), the output last
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    cut = nodes.index(backward_start) if backward_start is not None else len(nodes)
    order: list[Node] = []
    turns = 0
    for phase in (nodes[:cut], nodes[cut:]):
        placed, count = _phase_order(phase, masks, copies)
        order += placed
        turns += count
    anchor = inputs[-1]
    for node in order:
        anchor.append(node)
        anchor = node
    graph.lint()
    graph_module.recompile()
    return turns


def copy_masks(graph: torch.fx.Graph, backward_start: Node | None) -> dict[Node, int]:
    """Each node's copies as a bit mask (bit ``j``: it depends on copy ``j``'s batch slice;
    0: on none). Backward nodes read a forward node of several copies (the averaged loss, from
    which every gradient descends) as one of no copy."""
    masks: dict[Node, int] = {}
    forward: set[Node] = set()
    backward = False
    for node in graph.nodes:
        backward = backward or node is backward_start
        if not backward:
            forward.add(node)
        mask = 0
        for source in node.all_input_nodes:
            bits = masks.get(source, 0)
            if backward and source in forward and _is_join(bits):
                continue
            mask |= bits
        tag = node_tags(node).get(COPY_TAG)
        if isinstance(tag, int):
            mask |= 1 << tag
        masks[node] = mask
    return masks


def _is_join(mask: int) -> bool:
    return mask & (mask - 1) != 0


class _Placer:
    """Places a phase's nodes, each after its inputs: nodes of no copy where first needed,
    joins of copies as soon as their last input is placed."""

    def __init__(self, phase: Sequence[Node], masks: dict[Node, int]) -> None:
        self.inside = set(phase)
        self.position = {n: i for i, n in enumerate(phase)}
        self.placed: list[Node] = []
        self.done: set[Node] = set()
        self.missing = {
            n: sum(1 for i in n.all_input_nodes if i in self.inside)
            for n in phase
            if _is_join(masks[n])
        }

    def place(self, node: Node) -> None:
        stack = [node]
        while stack:
            top = stack[-1]
            if top in self.done:
                stack.pop()
                continue
            waiting = [i for i in top.all_input_nodes if i in self.inside and i not in self.done]
            if waiting:
                stack.extend(sorted(waiting, key=self.position.__getitem__, reverse=True))
                continue
            stack.pop()
            self._placed(top, stack)

    def _placed(self, node: Node, stack: list[Node]) -> None:
        self.done.add(node)
        self.placed.append(node)
        for user in node.users:
            if user in self.missing and user not in self.done:
                self.missing[user] -= 1
                if self.missing[user] == 0:
                    stack.insert(0, user)  # after what is being placed now


def _phase_order(
    phase: Sequence[Node], masks: dict[Node, int], copies: int
) -> tuple[list[Node], int]:
    """One phase's nodes in turn order, and how many turns ended at a collective."""
    queues: list[list[Node]] = [[] for _ in range(copies)]
    for node in phase:
        mask = masks[node]
        if mask and not _is_join(mask):
            queues[mask.bit_length() - 1].append(node)
    placer = _Placer(phase, masks)
    heads = [0] * copies
    turns = 0
    current = 0
    while any(heads[j] < len(queues[j]) for j in range(copies)):
        queue = queues[current]
        started = False
        while heads[current] < len(queue):
            node = queue[heads[current]]
            others = any(heads[j] < len(queues[j]) for j in range(copies) if j != current)
            if started and node.target is _WAIT and others and node not in placer.done:
                turns += 1
                break  # wait later: another copy computes while this one's collective runs
            placer.place(node)
            heads[current] += 1
            started = started or (is_collective(node) and node.target is not _WAIT)
        current = (current + 1) % copies
    for node in phase:  # what no copy needed (joins are placed as they become ready)
        placer.place(node)
    return placer.placed, turns
