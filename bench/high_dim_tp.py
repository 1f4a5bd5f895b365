"""High-dimensional tensor parallel: 2-D against 1-D, as the planner prices it on 16 GPUs and
as 4 gloo processes run it here.

    .venv/bin/python bench/high_dim_tp.py            # the predicted table (planning only, seconds)
    .venv/bin/python bench/high_dim_tp.py --width 4096
    .venv/bin/python bench/high_dim_tp.py --measure  # the measured table (4 gloo processes, ~1 min)

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

``--measure``: the same blocks (``--measure-width``, 4 blocks) trained on 4 gloo processes in
semi_auto, side by side from the same weights: Megatron's 1-D split on ``tp=4`` (the first
matmul's weight split on its output dim, the second's on its input dim; semi_auto's
propagation between) and MindSpore's 2-D on ``x=2 x y=2`` (the layouts of
docs/semi_auto.md, activations held split over both axes). ``--warmup`` untimed steps, then
``--steps`` timed ones taken in turns; a step's time is the slowest rank's after a barrier. The
table gives the median, the ratio to 1-D, the collectives a step and their predicted time (the
plan's, ``local`` profile), the measured peak and activations of one step on rank 0
(``measure_step_memory``), the plan's predicted activations, and the losses' largest relative
difference from 1-D (both equal one device). Two CPU cores sharing four processes show the
collectives' count and bytes, not NVLink against InfiniBand: the activations column is what
2-D is for.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from sides import in_turns

import plait
from plait import ParallelConfig
from plait.graph import capture_program
from plait.launch.local import run_workers
from plait.models import FeedForward, mlp_loss
from plait.planning import plan_graph
from plait.runtime.engine.measure import measure_step_memory

MESHES = ({"tp": 16}, {"x": 4, "y": 4}, {"x": 2, "y": 8})
ROWS = (64, 1024, 4096)


def _split(dims: tuple[tuple[str, ...], ...]) -> str:
    split = [axes for axes in dims if axes]
    if not split:
        return "whole"
    if len(split) == 1:
        return f"1-D ({', '.join(split[0])})"
    return "2-D " + " / ".join(", ".join(axes) for axes in split)


def row(width: int, rows: int, blocks: int) -> list[list[str]]:
    with torch.device("meta"):
        model = FeedForward(width, 4 * width, blocks)
        batch = (torch.randn(rows, width), torch.randn(rows, width))
    captured = capture_program(model, batch, mlp_loss)
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


MEASURED = {"1-D, tp=4 (Megatron)": "1d", "2-D, x=2 x y=2 (MindSpore)": "2d"}
BASE = "1-D, tp=4 (Megatron)"


def _annotated(model: FeedForward, side: str) -> tuple[FeedForward, dict[str, int]]:
    """``model`` with ``side``'s layouts, and its mesh."""
    if side == "1d":
        tp = plait.Layout((4,), ("tp",))
        for up, down in zip(model.ups, model.downs, strict=True):
            plait.shard(up, parameter_strategy={"weight": tp("tp", "None")})
            plait.shard(down, parameter_strategy={"weight": tp("None", "tp")})
        return model, {"tp": 4}
    xy = plait.Layout((2, 2), ("x", "y"))
    for up, down in zip(model.ups, model.downs, strict=True):
        plait.shard(up, parameter_strategy={"weight": xy("y", "x")},
                    out_strategy=(xy("None", ("y", "x")),))  # fmt: skip
        plait.shard(down, parameter_strategy={"weight": xy("x", "y")},
                    out_strategy=(xy("None", ("x", "y")),))  # fmt: skip
    return model, {"x": 2, "y": 2}


def measure_worker(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    width = args.measure_width
    batches = [
        (torch.randn(args.rows, width, generator=gen), torch.randn(args.rows, width, generator=gen))
        for _ in range(args.warmup + args.steps + 1)
    ]
    jobs = {}
    for name, side in MEASURED.items():
        torch.manual_seed(0)
        model, mesh = _annotated(FeedForward(width, 4 * width, 4), side)
        jobs[name] = plait.parallelize(
            model,
            ParallelConfig(mode="semi_auto", mesh=mesh),
            optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
            loss_fn=mlp_loss,
            example_batch=batches[0],
        )
    times, losses = in_turns(jobs, batches[:-1], args.warmup)
    out: dict[str, Any] = {}
    for name, job in jobs.items():
        memory = measure_step_memory(job, batches[-1])
        plan = job.loss_fn.plan
        out[name] = {
            "times": times[name],
            "losses": losses[name],
            "collectives": sum(c.count for c in plan.collectives),
            "comm_seconds": sum(c.seconds * c.count for c in plan.collectives),
            "peak": memory.peak,
            "activations": memory.activations,
            "predicted_activations": plan.predicted.memory_by_kind.get("activations", 0),
        }
    return out


def measured_table(r: dict[str, Any], rtol: float) -> str:
    base = statistics.median(r[BASE]["times"])
    mib = 1 << 20
    lines = [
        "| side | step ms | / 1-D | collectives a step | their predicted ms | peak MiB "
        "| activations MiB (measured) | activations MiB (predicted) | max rel. loss diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in MEASURED:
        side = r[name]
        median = statistics.median(side["times"])
        pairs = zip(side["losses"], r[BASE]["losses"], strict=True)
        diff = max(abs(a - b) / abs(b) for a, b in pairs)
        if diff > rtol:
            raise SystemExit(f"{name}: losses differ from {BASE}'s by {diff:.2e}")
        lines.append(
            f"| {name} | {median * 1e3:.1f} | {median / base:.3f} | {side['collectives']} "
            f"| {side['comm_seconds'] * 1e3:.2f} | {side['peak'] / mib:.2f} "
            f"| {side['activations'] / mib:.2f} | {side['predicted_activations'] / mib:.2f} "
            f"| {diff:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help="train on 4 gloo processes")
    parser.add_argument("--measure-width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()
    if args.measure:
        print(
            f"torch {torch.__version__}, 4 gloo processes, semi_auto, 4 feed-forward blocks of "
            f"width {args.measure_width} (inner x4), {args.rows} rows, SGD, {args.warmup} "
            f"warm-up + {args.steps} timed steps a side, taken in turns"
        )
        start = time.perf_counter()
        results = run_workers(measure_worker, 4, args, timeout_s=900.0)
        print(measured_table(results[0], args.rtol))
        print(f"total wall time {time.perf_counter() - start:.0f} s")
        return
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
