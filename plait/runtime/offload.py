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

from plait.runtime.remat import memory_root

__all__ = ["offload_saved"]

_A = torch.ops.aten


def offload_saved(
    graph_module: torch.fx.GraphModule,
    backward_start: Node,
    *,
    device: torch.device,
    min_bytes: int = 1 << 20,
) -> int:
    """Move each large forward value backward reads to the host between its forward and
    backward readers (in place). Returns the bytes moved per step."""
    graph = graph_module.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    start = position[backward_start]
    host = torch.device("cpu")
    pinned = device.type == "cuda"
    moved = 0
    for node in nodes[:start]:
        if not _movable(node, min_bytes):
            continue
        readers = list(node.users)
        late = sorted((u for u in readers if position.get(u, start) >= start), key=position.get)
        early = [u for u in readers if position.get(u, start) < start]
        if not late or late[0].op == "output":
            continue
        val = node.meta["val"]
        last_forward = max(early, key=position.__getitem__) if early else node
        with graph.inserting_after(last_forward):
            down = graph.call_function(
                _A._to_copy.default,
                (node,),
                {"device": host, "pin_memory": pinned, "non_blocking": pinned},
            )
        down.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device="meta")
        with graph.inserting_before(late[0]):
            up = graph.call_function(
                _A._to_copy.default, (down,), {"device": device, "non_blocking": pinned}
            )
        up.meta["val"] = val
        for reader in late:
            if reader.op != "output":
                reader.replace_input_with(node, up)
        moved += val.numel() * val.element_size()
    graph.lint()
    graph_module.recompile()
    return moved


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
