"""Communication techniques side by side with them off: sequence parallel and multi-copy
parallel against plain tensor parallel (issue #32's ``bench/communication.py``; the other
techniques join as they are built).

Four jobs from the same weights on the same 4 gloo processes, dp=2 x tp=2,
``mode="semi_auto"``, a TinyGPT annotated by ``plait.annotate.megatron(model, 2)``: the
outputs of the row projections and the embedding kept whole between the blocks (an
``out_strategy``: Megatron's plain tensor parallel, all-reduces), left to semi_auto's
propagation, marked by ``sequence_parallel=True``, and the first again with
``interleave_num=2`` (multi-copy: each micro-batch cut into two copies whose all-reduces run
while the other copy computes). ``--warmup`` untimed steps, then
``--steps`` timed steps taken in turns. A step's time is the slowest rank's after a barrier;
the table gives the median, the ratio to the first side, the plan's collectives over tp a
step and their predicted time (the cost model's, on the uncalibrated ``local`` profile), the
measured peak memory and activations of one step on rank 0 (``measure_step_memory``), the
plan's predicted activations, and the losses' largest relative difference from the first
side (all three train alike: each equals one device).

Two CPU cores cannot show what sequence parallel buys on a GPU (activation memory at long
sequences; the same bytes on a ring as tensor parallel's all-reduces, in twice the
collectives), nor what multi-copy buys (four processes share two cores, so a collective in
flight takes the core the other copy would compute on). The table prints what this machine
measures; the activations column is the effect sequence parallel is for, the predicted step
what the cost model says of each.

Run from the repository root: ``.venv/bin/python bench/communication.py`` (CPU, 4 gloo
processes, about a minute on 2 shared cores).
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
from plait.launch.local import run_workers
from plait.models import GPTConfig, TinyGPT, gpt_loss, token_batches
from plait.runtime.engine.measure import measure_step_memory

SIDES = {
    "TP, whole between blocks": ("whole", 1),
    "TP, semi_auto's choice": ("free", 1),
    "sequence parallel": ("sequence", 1),
    "TP whole, interleave_num=2": ("whole", 2),
}
"""Each side's annotation of what leaves the row projections and the embedding, and its
``interleave_num``: ``whole`` (``out_strategy`` replicated over tp: an all-reduce, plain
Megatron tensor parallel), ``free`` (no mark: semi_auto's propagation chooses by its cost
model), ``sequence`` (``megatron(..., sequence_parallel=True)``)."""
BASE = "TP, whole between blocks"


def _job(cfg: GPTConfig, batch: Any, side: str, copies: int) -> Any:
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    report = plait.annotate.megatron(model, 2, sequence_parallel=side == "sequence")
    if side == "whole":
        whole = plait.Layout((2, 2), ("dp", "tp"))("dp", "None", "None")
        rows = [m.path for m in report.matched if m.strategy == "row"] + ["tok"]
        for path in rows:
            plait.shard(model.get_submodule(path), out_strategy=(whole,))
    return plait.parallelize(
        model,
        ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, interleave_num=copies),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss_fn=gpt_loss,
        example_batch=batch,
    )


def _local(job: Any, batch: Any) -> Any:
    """This rank's data-parallel slice of the global batch."""
    dp = job.device_mesh.get_coordinate()[job.mesh.axis_index("dp")]
    return tuple(x.chunk(job.mesh.axis_size("dp"))[dp] for x in batch)


def _tp_seconds(plan: Any) -> float:
    """The plan's predicted seconds of its collectives over tp a step (the cost model's
    alpha-beta time of each, on the profile the plan was made for)."""
    return sum(c.seconds * c.count for c in plan.collectives if "tp" in c.axes)


def worker(cfg: GPTConfig, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    batches = token_batches(cfg, args.batch, args.warmup + args.steps + 1)
    jobs = {name: _job(cfg, batches[0], *side) for name, side in SIDES.items()}
    times, losses = in_turns(jobs, batches[:-1], args.warmup, _local)
    out: dict[str, Any] = {}
    for name, job in jobs.items():
        memory = measure_step_memory(job, _local(job, batches[-1]))
        plan = job.loss_fn.plan
        out[name] = {
            "times": times[name],
            "losses": losses[name],
            "tp_seconds": _tp_seconds(plan),
            "tp_collectives": sum(c.count for c in plan.collectives if "tp" in c.axes),
            "peak": memory.peak,
            "activations": memory.activations,
            "predicted_activations": plan.predicted.memory_by_kind.get("activations", 0),
            "predicted_step": plan.predicted.step_time_s,
        }
    return out


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    r = results[0]
    base = statistics.median(r[BASE]["times"])
    lines = [
        "| side | step ms | / whole | predicted step ms | tp collectives a step "
        "| their predicted ms | peak MiB | activations MiB (measured) "
        "| activations MiB (predicted) | max rel. loss diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in SIDES:
        side = r[name]
        median = statistics.median(side["times"])
        pairs = zip(side["losses"], r[BASE]["losses"], strict=True)
        diff = max(abs(a - b) / abs(b) for a, b in pairs)
        if diff > args.rtol:
            raise SystemExit(f"{name}: losses differ from {BASE}'s by {diff:.2e}")
        mib = 1 << 20
        lines.append(
            f"| {name} | {median * 1e3:.1f} | {median / base:.3f} "
            f"| {side['predicted_step'] * 1e3:.1f} | {side['tp_collectives']} "
            f"| {side['tp_seconds'] * 1e3:.2f} | {side['peak'] / mib:.2f} "
            f"| {side['activations'] / mib:.2f} | {side['predicted_activations'] / mib:.2f} "
            f"| {diff:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()
    cfg = GPTConfig(
        vocab=args.vocab, seq=args.seq, width=args.width, heads=args.heads, layers=args.layers
    )
    print(
        f"torch {torch.__version__}, 4 gloo processes, dp=2 x tp=2 semi_auto, {cfg}, "
        f"global batch {args.batch}, AdamW, {args.warmup} warm-up + {args.steps} timed steps "
        "a side, taken in turns"
    )
    start = time.perf_counter()
    results = run_workers(worker, 4, cfg, args, timeout_s=900.0)
    print(report(results, args))
    print(f"total wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
