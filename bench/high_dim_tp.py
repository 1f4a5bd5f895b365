"""High-dimensional tensor parallel as plait's planner prices it: 2-D against 1-D on 16 GPUs.

    .venv/bin/python bench/high_dim_tp.py            # every row (~1 min here)
    .venv/bin/python bench/high_dim_tp.py --width 4096

What it shows: a stack of residual feed-forward blocks (``x + down(relu(up(x)))``, inner width
4x, MindSpore's page's two matmuls) planned by mode auto (``dynamic_programming``) on the
``h100`` profile, its mesh fixed to 16 devices three ways: one model axis (``tp=16``, Megatron's
1-D split) and two (``x=4 x y=4``, ``x=2 x y=8``: the 2-D strategies, each weight dim on one
axis, among the candidates). Per row: the predicted step, its communication, the memory per
device, and how the plan splits each weight (``1-D``: one dim over the axes; ``2-D``: both
dims, one axis each). Planning only: meta-device models, no training, no processes; the
numbers are the cost model's, not measurements (two CPU cores show nothing of NVLink and
InfiniBand; the 4-process check that 2-D trains equal to one device with exactly the plan's
collectives is ``tests/sim/test_high_dim_tp.py``).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from plait import ParallelConfig
from plait.graph import capture_program
from plait.planning import plan_graph

MESHES = ({"tp": 16}, {"x": 4, "y": 4}, {"x": 2, "y": 8})
ROWS = (64, 1024, 4096)


class FeedForward(nn.Module):
    """Residual feed-forward blocks, two matmuls each."""

    def __init__(self, hidden: int, blocks: int) -> None:
        super().__init__()
        inner = 4 * hidden
        self.ups = nn.ModuleList(nn.Linear(hidden, inner, bias=False) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(inner, hidden, bias=False) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.ups, self.downs, strict=True):
            x = x + down(torch.relu(up(x)))
        return x


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _split(dims: tuple[tuple[str, ...], ...]) -> str:
    split = [axes for axes in dims if axes]
    if not split:
        return "whole"
    if len(split) == 1:
        return f"1-D ({', '.join(split[0])})"
    return "2-D " + " / ".join(", ".join(axes) for axes in split)


def row(width: int, rows: int, blocks: int) -> list[list[str]]:
    with torch.device("meta"):
        model = FeedForward(width, blocks)
        batch = (torch.randn(rows, width), torch.randn(rows, width))
    captured = capture_program(model, batch, _mse)
    out: list[list[str]] = []
    base = None
    for mesh in MESHES:
        cfg = ParallelConfig(mode="auto", mesh=mesh, search="dynamic_programming", hardware="h100")
        plan = plan_graph(captured.graph, cfg, model=model)
        p = plan.predicted
        base = base or p.step_time_s
        weights = {q.name: q.layout.dims for q in plan.parameters}
        out.append(
            [
                str(width),
                str(rows),
                " x ".join(f"{k}={v}" for k, v in mesh.items()),
                f"{p.step_time_s * 1e3:.2f}",
                f"{p.communication_s * 1e3:.2f}",
                f"{p.memory_bytes / 2**20:.0f}",
                _split(weights["ups.0.weight"]),
                _split(weights["downs.0.weight"]),
                f"{p.step_time_s / base:.3f}",
            ]
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    head = ["width", "rows", "mesh", "step ms", "comm ms", "MiB/dev", "up weight",
            "down weight", "vs tp=16"]  # fmt: skip
    lines = [head]
    start = time.perf_counter()
    for width in args.width:
        for rows in ROWS:
            lines += row(width, rows, args.blocks)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in lines[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    print(f"\nplanned in {time.perf_counter() - start:.1f} s (h100 profile, dynamic_programming)")


if __name__ == "__main__":
    main()
