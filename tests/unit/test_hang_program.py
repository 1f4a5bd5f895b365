"""Unit test of `plait.launch.hang.program_position`: a stack inside an FX program is placed at
its node, with the tags the plan's trace gave it (op, module, reason), a wait at the collective
it waits for."""

from __future__ import annotations

import sys

import torch
import torch.fx

from plait.launch.hang import program_position

SEEN: list[str | None] = []


def collective(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def wait_tensor(x: torch.Tensor) -> torch.Tensor:
    # read while the program's forward stands at this node, as the watchdog reads a rank's
    # stack while it waits (a frame's line is read when asked)
    SEEN.append(program_position(sys._getframe(1)))
    return x


torch.fx.wrap("collective")
torch.fx.wrap("wait_tensor")


class Step(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return wait_tensor(collective(y)) - 1


def test_a_wait_in_a_program_names_the_collective_and_the_plans_op() -> None:
    program = torch.fx.symbolic_trace(Step())
    node = next(n for n in program.graph.nodes if n.name == "collective")
    node.meta["custom"] = {
        "plait_op": "linear_1", "plait_module": "layers.1", "plait_phase": "backward",
        "plait_reason": "linear_1 needs output of gelu as [None, None]; it is [None, tp]",
    }  # fmt: skip
    SEEN.clear()
    program(torch.ones(2))
    assert SEEN == [
        "node 'collective' (collective), the plan's op 'linear_1' (module 'layers.1'), in"
        " backward: linear_1 needs output of gelu as [None, None]; it is [None, tp]"
    ]


def test_outside_a_program_there_is_no_position() -> None:
    assert program_position(sys._getframe()) is None
