"""Step time of plait data_parallel against torch DistributedDataParallel, side by side.

4 gloo processes on this machine, the same model, initial weights and batches for both; each
rank trains on its own quarter of every global batch. The two variants alternate step by step
in the same processes (so both see the same machine load): 5 warm-up steps, then the median
(and p90) over the timed steps, each step starting after a barrier. Also prints the
largest difference between the two variants' losses, which must be ~1e-6 (both equal
single-device training), and the machine's load average before and after the run.

plait runs pure data parallelism on plain tensors (no DTensor): gradients are summed in
buckets started from backward hooks, as DDP does (plait/runtime/engine/data_parallel.py).

    .venv/bin/python bench/dp_overhead.py [--steps 30] [--width 512] [--layers 4] [--batch 256] [--bucket-mb MB]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import plait
from plait.models import MLP
from plait.testing import run_workers

WORLD = 4
WARMUP = 5


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return MLP((width,) * (layers + 1))


def _batches(n: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen))
        for _ in range(n)
    ]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _ddp_step_fn(width: int, layers: int):  # type: ignore[no-untyped-def]
    model = nn.parallel.DistributedDataParallel(_model(width, layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(b: tuple[torch.Tensor, torch.Tensor]) -> float:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, b)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value)  # the global loss, as plait's step returns it
        return value.item() / WORLD

    return step


def _plait_step_fn(width: int, layers: int, bucket_mb: float | None):  # type: ignore[no-untyped-def]
    fusion = None if bucket_mb is None else plait.CommFusion(bucket_mb=bucket_mb)
    job = plait.parallelize(
        _model(width, layers),
        plait.ParallelConfig(mode="data_parallel", comm_fusion=fusion),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        loss_fn=_loss,
    )
    return job.step


def run_both(
    steps: int, width: int, layers: int, batch: int, bucket_mb: float | None
) -> dict[str, list[float]]:
    """Alternate DDP and plait step by step in the same processes, so both see the same load."""
    rank = dist.get_rank()
    variants = {
        "ddp": _ddp_step_fn(width, layers),
        "plait": _plait_step_fn(width, layers, bucket_mb),
    }
    local = [tuple(t.chunk(WORLD)[rank] for t in b) for b in _batches(steps, batch, width)]
    out: dict[str, list[float]] = {f"{k}_{w}": [] for k in variants for w in ("times", "losses")}
    for i, b in enumerate(local):
        for name, step in variants.items():
            dist.barrier()
            start = time.perf_counter()
            out[f"{name}_losses"].append(step(b))
            if i >= WARMUP:
                out[f"{name}_times"].append(time.perf_counter() - start)
    return out


def _row(name: str, times: list[float], tokens: int, base: float | None) -> str:
    med = statistics.median(times)
    p90 = sorted(times)[int(0.9 * (len(times) - 1))]
    ratio = f"{med / base:.2f}" if base else "1.00"
    return f"| {name} | {med * 1e3:.2f} | {p90 * 1e3:.2f} | {tokens / med:,.0f} | {ratio} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=30, help="timed steps per variant (plus 5 warm-up)"
    )
    parser.add_argument("--width", type=int, default=512, help="MLP width")
    parser.add_argument("--layers", type=int, default=4, help="MLP layers")
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument(
        "--bucket-mb", type=float, default=None, help="plait bucket size (default: plait's)"
    )
    args = parser.parse_args()
    total = args.steps + WARMUP
    load_before = os.getloadavg()
    shape = (total, args.width, args.layers, args.batch, args.bucket_mb)
    result = run_workers(run_both, WORLD, *shape)[0]
    ddp_times, ddp_losses = result["ddp_times"], result["ddp_losses"]
    plait_times, plait_losses = result["plait_times"], result["plait_losses"]
    params = sum(p.numel() for p in _model(args.width, args.layers).parameters())
    print(
        f"MLP width {args.width} x {args.layers} layers ({params:,} parameters), global batch "
        f"{args.batch}, {WORLD} gloo processes, torch {torch.__version__}, {args.steps} timed steps, "
        f"plait bucket {'default' if args.bucket_mb is None else f'{args.bucket_mb} MB'}"
    )
    print("| variant | median step ms | p90 ms | samples/s | ratio to DDP |")
    print("|---|---|---|---|---|")
    base = statistics.median(ddp_times)
    print(_row("torch DDP", ddp_times, args.batch, None))
    print(_row("plait data_parallel", plait_times, args.batch, base))
    diff = max(abs(a - b) for a, b in zip(ddp_losses, plait_losses, strict=True))
    print(f"max |loss(plait) - loss(DDP)| over {total} steps: {diff:.2e}")
    load_after = os.getloadavg()
    print(
        f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after {', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
