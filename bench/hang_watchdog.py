"""What the hang watchdog costs: steps with and without ``plait.init(hang_timeout=...)``.

The watchdog (``plait/launch/hang.py``) turns on torch's flight recorder, which records every
collective with the Python frames that issued it, and reads it every ``hang_timeout / 8``
seconds from a thread. This script trains the same model the same way twice on 4 gloo
processes, once without the watchdog and once with it (the recorder on from the process
group's creation), and prints the median step time of each and their ratio, beside a loop of
small all-reduces (where the recorder's cost per collective shows most). The losses of the two
runs must be equal.

    .venv/bin/python bench/hang_watchdog.py [--steps 30] [--collectives 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import plait
from plait.models import MLP
from plait.testing import run_workers

WORLD = 4
WARMUP = 5
HANG_TIMEOUT = 300.0


def _run(steps: int, collectives: int, watched: bool) -> dict[str, object]:
    plait.init(hang_timeout=HANG_TIMEOUT if watched else None)
    torch.manual_seed(0)
    model = MLP((256, 512, 512, 256))
    job = plait.parallelize(
        model,
        plait.ParallelConfig(mode="data_parallel", mesh={"dp": WORLD}),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
    )
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 256, generator=gen), torch.randn(32, 256, generator=gen))]
    times, losses = [], []
    for i in range(WARMUP + steps):
        dist.barrier()
        started = time.perf_counter()
        losses.append(job.step(batches[0]))
        if i >= WARMUP:
            times.append(time.perf_counter() - started)
    small = torch.ones(16)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(collectives):
        dist.all_reduce(small)
    per_collective = (time.perf_counter() - started) / collectives
    return {"step": statistics.median(times), "collective": per_collective, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--collectives", type=int, default=2000)
    args = parser.parse_args()
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    plain = run_workers(_run, WORLD, args.steps, args.collectives, False, timeout_s=600)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # as plait.init(hang_timeout=...) sets it
    watched = run_workers(_run, WORLD, args.steps, args.collectives, True, timeout_s=600)
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    same = all(a["losses"] == b["losses"] for a, b in zip(plain, watched, strict=True))
    step = (max(r["step"] for r in plain), max(r["step"] for r in watched))  # type: ignore[type-var]
    one = (
        max(r["collective"] for r in plain),  # type: ignore[type-var]
        max(r["collective"] for r in watched),  # type: ignore[type-var]
    )
    print(
        f"torch {torch.__version__}, {WORLD} gloo processes, MLP 256-512-512-256, batch 32 a "
        f"rank, {args.steps} timed steps after {WARMUP}; {args.collectives} all-reduces of 16 "
        f"floats; hang_timeout {HANG_TIMEOUT:g} s; losses equal: {same}"
    )
    print("| what | without the watchdog | with it | with / without |")
    print("|---|---:|---:|---:|")
    print(
        f"| data-parallel step, median ms | {step[0] * 1e3:.2f} | {step[1] * 1e3:.2f} | "
        f"{step[1] / step[0]:.3f} |"
    )
    print(
        f"| one small all-reduce, us | {one[0] * 1e6:.1f} | {one[1] * 1e6:.1f} | "
        f"{one[1] / one[0]:.3f} |"
    )
    print(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
