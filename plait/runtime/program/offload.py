"""Activation offload as a pass over the per-rank program (``offload="activations"``).

A forward value backward reads stays in device memory from forward until backward reads it
(what autograd "saves"). This pass moves the large ones to host memory instead: right after
forward last reads a value, the program copies it to the host (pinned, asynchronous on the
device's stream), and just before backward first reads it, copies it back; the device copy
dies after forward, as with recompute, but nothing is computed twice. MindSpore's activation
swap and torch's ``save_on_cpu`` do the same; here it is visible in the program
(``print(job.program)``) and runs under ``torch.compile`` too.

What moves: forward values with a backward reader, at least ``min_bytes`` large, computed in
forward (views of parameters or of the batch stay, they cost nothing of their own); a view of
an activation moves as it is, so its base can die after forward. On a CPU device the host is the device: the
copies run (so the numerics are the same path) but save nothing.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx import Node

from plait.runtime.program.remat import memory_root

__all__ = ["SideCopies", "offload_saved"]

_A = torch.ops.aten


def offload_saved(
    graph_module: torch.fx.GraphModule,
    backward_start: Node,
    *,
    device: torch.device,
    min_bytes: int = 1 << 20,
    side_stream: bool = True,
) -> int:
    """Move each large forward value backward reads to the host between its forward and
    backward readers (in place). Returns the bytes moved per step.

    On CUDA with ``side_stream`` the copies run on a second stream (:class:`SideCopies`): a
    copy to the host overlaps the forward compute after it, and each copy back is issued one
    value ahead of its first backward reader, overlapping the backward compute before it.
    Otherwise (CPU, or a program torch.compile takes whole) they are plain ``_to_copy`` ops.
    """
    graph = graph_module.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    start = position[backward_start]
    copies = SideCopies(device) if side_stream and device.type == "cuda" else None
    moved: list[tuple[Node, Node, list[Node]]] = []  # (value, its host copy, backward readers)
    for node in nodes[:start]:
        if not _movable(node, min_bytes):
            continue
        readers = list(node.users)
        late = sorted(
            (u for u in readers if position.get(u, start) >= start), key=position.__getitem__
        )
        early = [u for u in readers if position.get(u, start) < start]
        if not late or late[0].op == "output":
            continue
        val = node.meta["val"]
        last_forward = max(early, key=position.__getitem__) if early else node
        with graph.inserting_after(last_forward):
            down = _down(graph, node, device, copies)
        down.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device="meta")
        moved.append((node, down, [u for u in late if u.op != "output"]))
    # copies back in the order backward needs them, each issued before the previous one's
    # first reader (one value of prefetch)
    moved.sort(key=lambda m: position[m[2][0]])
    for k, (node, down, late) in enumerate(moved):
        issue_at = moved[k - 1][2][0] if k and copies is not None else late[0]
        with graph.inserting_before(issue_at):
            up = _up(graph, down, device, copies)
        up.meta["val"] = node.meta["val"]
        for reader in late:
            reader.replace_input_with(node, up)
    graph.lint()
    graph_module.recompile()
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n, _, _ in moved)


class SideCopies:
    """Copies between a CUDA device and pinned host memory on a side stream.

    ``down`` starts a device-to-host copy after everything the compute stream has queued so
    far and returns the host tensor; the device value's memory is not reused until the copy
    is done (``record_stream``). ``up`` waits for that copy, starts the host-to-device copy on
    the side stream and makes the compute stream wait for it before anything queued later.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def down(self, value: torch.Tensor) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            host = torch.empty_like(value, device="cpu", pin_memory=True)
            host.copy_(value, non_blocking=True)
        value.record_stream(self.stream)
        return host

    def up(self, host: torch.Tensor) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            value = host.to(self.device, non_blocking=True)
        compute.wait_stream(self.stream)
        value.record_stream(compute)
        return value


def _down(
    graph: torch.fx.Graph, node: Node, device: torch.device, copies: SideCopies | None
) -> Node:
    if copies is not None:
        return graph.call_function(copies.down, (node,))
    pinned = device.type == "cuda"
    return graph.call_function(
        _A._to_copy.default,
        (node,),
        {"device": torch.device("cpu"), "pin_memory": pinned, "non_blocking": pinned},
    )


def _up(graph: torch.fx.Graph, down: Node, device: torch.device, copies: SideCopies | None) -> Node:
    if copies is not None:
        return graph.call_function(copies.up, (down,))
    pinned = device.type == "cuda"
    return graph.call_function(
        _A._to_copy.default, (down,), {"device": device, "non_blocking": pinned}
    )


def _movable(node: Node, min_bytes: int) -> bool:
    if node.op != "call_function":
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() * val.element_size() < min_bytes:
        return False
    # a view of a graph input (a parameter's transpose) costs no memory of its own; a view
    # of an activation moves as it is, so its base can die after forward
    if memory_root(node).op in ("placeholder", "get_attr"):
        return False
    return not any(_reads_strides(u) for u in node.users)


def _reads_strides(node: Node) -> bool:
    """Ops that depend on their input's exact strides (a copy back may be contiguous)."""
    return node.op == "call_function" and node.target in (
        _A.as_strided.default,
        _A.as_strided_.default,
    )
