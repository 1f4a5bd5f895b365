"""Speed of plait's optimizer parallel and recompute against torch's own, side by side in one run.

One TinyGPT (same initial weights, same global batches, AdamW) trained on 4 gloo processes,
data parallel over the 4 ranks, in six ways that take turns step by step in the same
processes, so a busy spell of the machine hits all of them:

* ZeRO-3:
  (a) ``torch FSDP2`` (the baseline of b): ``torch.distributed.fsdp.fully_shard`` on every
      block, then on the root, over a 4-rank mesh; AdamW on its DTensor parameters;
  (b) ``plait ZeRO-3``: ``ParallelConfig(mode="data_parallel", optimizer_shard=3)``;
* ZeRO-1:
  (c) ``torch DDP + ZeroRedundancyOptimizer`` (the baseline of d):
      ``DistributedDataParallel`` with its defaults and
      ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=AdamW)``;
  (d) ``plait ZeRO-1``: ``optimizer_shard=1``;
* recompute:
  (e) ``plait recompute none`` (the baseline of f): ``mode="semi_auto", mesh={"dp": 4}`` with
      no annotation: data parallel by the compiled per-rank program, the path recompute takes;
  (f) ``plait recompute full``: ``mode="data_parallel", recompute="full"`` (about one more
      forward per step is expected).

plait's cases use ``optimizer_shard_threshold=0``: the default (64 KiB) would keep every
parameter of this small model whole. torch's cases return the global loss as plait's ``step``
does (one scalar all-reduce over the ranks).

Each case warms up, then every step is timed on every rank after a barrier; rank 0's median
wall time and median process CPU time per step are reported with the ratio to the case's
baseline. Every case's global loss at every measured step must equal its baseline's to
``--rtol`` (relative), so the cases do equal work; the script fails otherwise.

Run from the repository root: ``.venv/bin/python bench/zero.py``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

import plait
from plait import ParallelConfig
from plait.models import GPTConfig, TinyGPT, gpt_loss, token_batches
from plait.testing import run_workers

WORLD = 4
LR = 1e-3

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[Batch], float]


@dataclass(frozen=True)
class Case:
    key: str
    name: str
    baseline: str
    """The key of the case this one is compared with (itself for a baseline)."""
    target: float | None = None
    """The issue's bound on the ratio to the baseline (None: reported only)."""


CASES = [
    Case("fsdp2", "(a) torch FSDP2 fully_shard (blocks + root)", "fsdp2"),
    Case("zero3", "(b) plait ZeRO-3", "fsdp2", 1.10),
    Case("ddp_zero", "(c) torch DDP + ZeroRedundancyOptimizer", "ddp_zero"),
    Case("zero1", "(d) plait ZeRO-1", "ddp_zero", 1.05),
    Case("none", "(e) plait recompute none (program path)", "none"),
    Case("full", "(f) plait recompute full", "none"),
]
BY_KEY = {c.key: c for c in CASES}


# ---------------------------------------------------------------------------------------------
# Model, data, optimizer (identical in every process).


def initial_model(cfg: GPTConfig) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(cfg)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def my_slice(batch: Batch) -> Batch:
    rank = dist.get_rank()
    ids, targets = batch
    return ids.chunk(WORLD)[rank], targets.chunk(WORLD)[rank]


def global_loss(loss: torch.Tensor) -> float:
    """The mean of the ranks' losses, as plait's ``step`` returns it."""
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / WORLD


# ---------------------------------------------------------------------------------------------
# The cases: each builds its step function on this rank.


def torch_fsdp2(cfg: GPTConfig) -> StepFn:
    mesh = init_device_mesh("cpu", (WORLD,))
    model = initial_model(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model.parameters())

    def step(batch: Batch) -> float:
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(model, batch)
        loss.backward()
        opt.step()
        return global_loss(loss)

    return step


def torch_ddp_zero(cfg: GPTConfig) -> StepFn:
    model = nn.parallel.DistributedDataParallel(initial_model(cfg))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)

    def step(batch: Batch) -> float:
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(model, batch)
        loss.backward()
        opt.step()
        return global_loss(loss)

    return step


def plait_job(cfg: GPTConfig, config: ParallelConfig, example: Batch) -> StepFn:
    job = plait.parallelize(
        initial_model(cfg), config, optimizer=adamw, loss_fn=gpt_loss, example_batch=example
    )
    return job.step


def build(key: str, cfg: GPTConfig, example: Batch) -> StepFn:
    if key == "fsdp2":
        return torch_fsdp2(cfg)
    if key == "ddp_zero":
        return torch_ddp_zero(cfg)
    shard = {"optimizer_shard_threshold": 0}
    configs = {
        "zero3": ParallelConfig(mode="data_parallel", optimizer_shard=3, **shard),
        "zero1": ParallelConfig(mode="data_parallel", optimizer_shard=1, **shard),
        "none": ParallelConfig(mode="semi_auto", mesh={"dp": WORLD}),
        "full": ParallelConfig(mode="data_parallel", recompute="full"),
    }
    return plait_job(cfg, configs[key], example)


# ---------------------------------------------------------------------------------------------
# The worker: every case in the same 4 processes, taking turns step by step.


def bench_worker(
    cfg: GPTConfig, batch: int, keys: list[str], warmup: int, steps: int, threads: int
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    total = warmup + steps
    batches = token_batches(cfg, batch, total)
    local = [my_slice(b) for b in batches]
    runs: dict[str, StepFn] = {}
    out: dict[str, Any] = {}
    for key in keys:
        dist.barrier()
        t0 = time.perf_counter()
        runs[key] = build(key, cfg, batches[0])
        dist.barrier()
        out[key] = {"setup_s": time.perf_counter() - t0, "losses": [], "times": [], "cpu": []}
    for i in range(total):
        for key, step in runs.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(local[i])
            out[key]["times"].append(time.perf_counter() - t0)
            out[key]["cpu"].append(time.process_time() - c0)
            out[key]["losses"].append(loss)
    return out


# ---------------------------------------------------------------------------------------------
# The parent: table and loss check.


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def table(results: dict[str, Any], warmup: int) -> tuple[str, dict[str, float]]:
    lines = [
        "| case | median ms/step | p90 ms | CPU ms/step | ratio to baseline | CPU ratio "
        "| target | max rel. loss diff vs baseline |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    medians = {k: statistics.median(r["times"][warmup:]) for k, r in results.items()}
    cpus = {k: statistics.median(r["cpu"][warmup:]) for k, r in results.items()}
    diffs: dict[str, float] = {}
    for key, r in results.items():
        case = BY_KEY[key]
        times = sorted(r["times"][warmup:])
        p90 = times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)]
        target = "-"
        diff = "-"
        if case.baseline == key:
            ratio = cpu_ratio = "1.00 (baseline)"
        elif case.baseline in results:
            value = medians[key] / medians[case.baseline]
            ratio = f"{value:.2f}"
            cpu_ratio = f"{cpus[key] / cpus[case.baseline]:.2f}"
            if case.target is not None:
                met = "met" if value <= case.target else "missed"
                target = f"<= {case.target:.2f}: {met}"
            diffs[key] = max_rel_diff(
                r["losses"][warmup:], results[case.baseline]["losses"][warmup:]
            )
            diff = f"{diffs[key]:.1e}"
        else:
            ratio = cpu_ratio = "-"
        lines.append(
            f"| {case.name} | {medians[key] * 1e3:.1f} | {p90 * 1e3:.1f} | {cpus[key] * 1e3:.1f} "
            f"| {ratio} | {cpu_ratio} | {target} | {diff} |"
        )
    return "\n".join(lines), diffs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per case")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per case")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--rtol", type=float, default=1e-4, help="loss agreement with baseline")
    parser.add_argument(
        "--only",
        default=",".join(c.key for c in CASES),
        metavar="KEYS",
        help="comma-separated cases: " + ", ".join(c.key for c in CASES),
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    keys = [k for k in args.only.split(",") if k]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {list(BY_KEY)}")
    keys = [c.key for c in CASES if c.key in keys]  # table order
    if args.batch % WORLD:
        raise SystemExit(f"--batch must divide by {WORLD}")
    cfg = GPTConfig(args.vocab, args.seq, args.width, args.heads, args.layers)
    print(
        f"torch {torch.__version__}, {WORLD} gloo processes ({args.threads} thread(s) each), "
        f"{cfg}, global batch {args.batch}, AdamW lr {LR}, {args.warmup} warm-up + "
        f"{args.steps} timed steps per case; {os.cpu_count()} CPUs, load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    start = time.perf_counter()
    per_rank = run_workers(
        bench_worker,
        WORLD,
        cfg,
        args.batch,
        keys,
        args.warmup,
        args.steps,
        args.threads,
        timeout_s=600.0,
    )
    results = per_rank[0]
    print("setup: " + ", ".join(f"{k} {r['setup_s']:.1f} s" for k, r in results.items()))
    text, diffs = table(results, args.warmup)
    print()
    print(text)
    print()
    for key in ("fsdp2", "ddp_zero", "none"):
        if key in results:
            losses = results[key]["losses"]
            print(
                f"{BY_KEY[key].name} losses: first {losses[0]:.6f}, first measured "
                f"{losses[args.warmup]:.6f}, last {losses[-1]:.6f}"
            )
    if diffs:
        print(
            f"largest relative loss difference of any case from its baseline over the "
            f"{args.steps} measured steps {max(diffs.values()):.2e} (tolerance {args.rtol:g})"
        )
    print(
        f"load average after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; total wall time "
        f"{time.perf_counter() - start:.1f} s"
    )
    bad = {k: d for k, d in diffs.items() if d > args.rtol}
    if bad:
        raise SystemExit(f"losses differ from the baseline's beyond rtol {args.rtol:g}: {bad}")


if __name__ == "__main__":
    main()
