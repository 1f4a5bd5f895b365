"""Parameter-server training against plain data parallel and host modules (issue 31, item 7).

An embedding-heavy recommender: two tables of ``--rows`` x ``--dim`` (default 1M x 64, 256 MB
each in fp32) - ``users`` (``nn.Embedding``, one id a sample) and ``items``
(``nn.EmbeddingBag``, a bag of ``--bag`` ids summed) - and a small MLP (128 -> 256 -> 256 ->
1), trained on ``--workers`` gloo processes with ``--batch`` samples each a step. Ids are
skewed as real traffic is: ``floor(rows * u ** 3)`` for uniform ``u``, so low ids are hot.

Sides, each its own ``plait run`` (same model, seed, batches and dense optimizer, Adam 1e-3):

* ``data parallel``: ``mode="data_parallel"``, every worker holds both tables, their dense
  gradients all-reduced every step, Adam's states for every row on every worker (what
  ``DistributedDataParallel`` does with ``nn.Embedding``);
* ``host modules``: the same with ``host_modules=("users", "items")`` (on this CPU machine the
  host is the device: the same work, listed because a GPU user would weigh it);
* ``ps sync`` / ``ps async``: ``mode="parameter_server"`` with ``--servers`` more processes
  holding the tables (``SparseOptimizer(kind="adam")``: lazy per-row Adam; built on the meta
  device and made on the servers, ``init_in_server``) and the workers pulling and pushing the
  rows a batch names; async with ``max_staleness=2``;
* ``ps async + cache``: async with ``vocab_cache_size=--cache`` rows of each table cached on
  every worker and the next step's rows prefetched before each step.

Each step starts after a barrier of the workers and is timed on rank 0. The table gives the
median step, samples a second over all workers, the bytes a worker moves a step (data
parallel: a ring all-reduce of the dense gradients moves ``2 (n-1)/n`` of their bytes per
rank; parameter server: the rows and ids pulled and pushed, counted by the worker), the
tensor bytes a worker holds (parameters, gradients and optimizer states), its peak RSS and the
share of rows read that the worker's cache served.

Run from the repository root: ``.venv/bin/python bench/parameter_server.py`` (about 4 minutes
here); ``--rows 100000`` for a quick run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
SIDES = ("data parallel", "host modules", "ps sync", "ps async", "ps async + cache")


class Recommender(nn.Module):
    def __init__(self, rows: int, dim: int, *, tables_on: str | None = None) -> None:
        super().__init__()
        self.users = nn.Embedding(rows, dim, device=tables_on)
        self.items = nn.EmbeddingBag(rows, dim, mode="sum", device=tables_on)
        self.mlp = nn.Sequential(
            nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
        )

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.users(users), self.items(items)], -1)).squeeze(-1)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(
        model(batch["users"], batch["items"]), batch["label"]
    )


def batch_of(step: int, rank: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)

    def skewed(*shape: int) -> torch.Tensor:
        return (args.rows * torch.rand(*shape, generator=g) ** 3).long()

    return {
        "users": skewed(args.batch),
        "items": skewed(args.batch, args.bag),
        "label": torch.randint(0, 2, (args.batch,), generator=g).float(),
    }


def worker(side: str, out: str, args: argparse.Namespace) -> None:
    """One process of one side (under ``plait run``)."""
    import torch.distributed as dist

    import plait
    from plait import ParallelConfig, SparseOptimizer

    torch.set_num_threads(1)
    world = plait.init()  # the servers of a ps side stay inside
    torch.manual_seed(0)
    ps = side.startswith("ps")
    # a parameter server's tables never exist whole on a worker: built on meta, made on the
    # servers (data parallel needs them on every worker)
    model = Recommender(args.rows, args.dim, tables_on="meta" if ps else None)
    if ps:
        asynchronous = side.startswith("ps async")
        plait.on_server(model.users, init_in_server=True, seed=1)
        plait.on_server(model.items, init_in_server=True, seed=2)
        config = ParallelConfig(
            mode="parameter_server",
            server_optimizer=SparseOptimizer(kind="adam", lr=1e-3),
            ps_mode="async" if asynchronous else "sync",
            max_staleness=2 if asynchronous else 0,
            vocab_cache_size=args.cache if side.endswith("cache") else 0,
        )
    elif side == "host modules":
        config = ParallelConfig(host_modules=("users", "items"))
    else:
        config = ParallelConfig()
    job = plait.parallelize(
        model, config, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss_fn=loss_fn
    )
    client = job.parameter_server
    times, moved, waited = [], [], []
    for step in range(args.warmup + args.steps):
        batch = batch_of(step, world.rank, args)
        if client is not None and client.cache_rows:  # the next step's rows, asked now
            following = batch_of(step + 1, world.rank, args)
            client.prefetch({"users": following["users"], "items": following["items"]})
        dist.barrier()
        before = client.traffic.bytes_pulled + client.traffic.bytes_pushed if client else 0
        in_ps = client.traffic.pull_s + client.traffic.push_s if client else 0.0
        start = time.perf_counter()
        job.step(batch)
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
            if client is not None:
                moved.append(client.traffic.bytes_pulled + client.traffic.bytes_pushed - before)
                waited.append(client.traffic.pull_s + client.traffic.push_s - in_ps)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    held += sum(
        v.numel() * v.element_size()
        for state in job.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    if client is None:  # a ring all-reduce of every dense gradient
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        moved = [2 * (world.world_size - 1) / world.world_size * grads]
    result = {
        "median_s": statistics.median(times),
        "ps_s": statistics.median(waited) if waited else None,
        "bytes_moved": statistics.mean(moved),
        "held": held,
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "workers": world.world_size,
        "hit_rate": client.traffic.hit_rate if client is not None else None,
    }
    everyone: list[dict | None] = [None] * world.world_size
    dist.all_gather_object(everyone, result)
    if world.rank == 0:
        Path(out).write_text(json.dumps(everyone))


def run_side(side: str, args: argparse.Namespace, folder: Path) -> list[dict]:
    out = folder / f"{side.replace(' ', '_')}.json"
    servers = ["--server-num", str(args.servers)] if side.startswith("ps") else []
    cmd = [
        sys.executable, "-m", "plait", "run", "--worker-num", str(args.workers), *servers,
        "--log-dir", str(folder / f"{side.replace(' ', '_')}-logs"), __file__, "--worker",
        side, "--out", str(out), *_forwarded(args),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _forwarded(args: argparse.Namespace) -> list[str]:
    names = ("rows", "dim", "bag", "batch", "steps", "warmup", "cache")
    return [x for n in names for x in (f"--{n}", str(getattr(args, n)))]


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bag", type=int, default=8)
    p.add_argument("--batch", type=int, default=512, help="samples a worker a step")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--cache", type=int, default=200_000, help="vocab_cache_size of + cache")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument(
        "--no-calibrate", action="store_true",
        help="predict with the uncalibrated local defaults (default: plait calibrate first)",
    )  # fmt: skip
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.out, args)
        return
    sides = [s.strip() for s in args.sides.split(",")]
    print(
        f"# {args.workers} workers (+{args.servers} servers for ps), tables 2 x {args.rows:,} x "
        f"{args.dim}, batch {args.batch} a worker, bag {args.bag}, {args.steps} timed steps"
    )
    print(
        "| side | step (median) | predicted | pulls and pushes | predicted | samples/s "
        "| moved a step, a worker | predicted moved | held a worker | peak RSS a worker "
        "| cache hits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="plait-bench-ps-") as tmp:
        if not args.no_calibrate:  # the profile the plans read: calibrated now, here
            os.environ["PLAIT_HOME"] = tmp
            from plait.cost.calibrate import calibrate
            from plait.launch.local import run_workers

            calibrate(run_workers, world_size=args.workers)
        for side in sides:
            predicted, predicted_ps, predicted_moved = predict(side, args)
            ranks = run_side(side, args, Path(tmp))
            step = ranks[0]["median_s"]
            samples = args.batch * ranks[0]["workers"] / step
            moved = statistics.mean(r["bytes_moved"] for r in ranks)
            held = max(r["held"] for r in ranks)
            rss = max(r["rss"] for r in ranks)
            hits = ranks[0]["hit_rate"]
            ps_s = ranks[0]["ps_s"]
            in_ps = "-" if ps_s is None else f"{ps_s * 1e3:,.1f} ms"
            ps_predicted = "-" if ps_s is None else f"{predicted_ps * 1e3:,.1f} ms"
            print(
                f"| {side} | {step * 1e3:,.0f} ms | {predicted * 1e3:,.0f} ms "
                f"({predicted / step:.2f}) | {in_ps} | {ps_predicted} | {samples:,.0f} "
                f"| {_mb(moved)} "
                f"| {_mb(predicted_moved)} | {_mb(held)} | {_mb(rss)} "
                f"| {'-' if not hits else f'{hits:.0%}'} |",
                flush=True,
            )


def predict(side: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """plait.plan's step time, the tables' traffic's share of it (parameter server) and the
    bytes a worker moves a step for ``side``, on the first timed step's global batch (every
    worker's, as the job cuts it)."""
    import plait
    from plait import ParallelConfig, SparseOptimizer

    step = args.warmup
    parts = [batch_of(step, rank, args) for rank in range(args.workers)]
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    model = Recommender(args.rows, args.dim, tables_on="meta")
    if side.startswith("ps"):
        asynchronous = side.startswith("ps async")
        config = ParallelConfig(
            mode="parameter_server", devices=args.workers, server_modules=("users", "items"),
            server_optimizer=SparseOptimizer(kind="adam", lr=1e-3),
            ps_mode="async" if asynchronous else "sync", max_staleness=2 if asynchronous else 0,
            vocab_cache_size=args.cache if side.endswith("cache") else 0,
        )  # fmt: skip
        plan = plait.plan(model, config, example_batch=batch, loss_fn=loss_fn, servers=args.servers)
        moved = sum(t.pull_bytes + t.push_bytes for t in plan.server_tables)
        in_ps = sum(t.seconds for t in plan.server_tables)
        return plan.predicted.step_time_s, in_ps, float(moved)
    with torch.device("meta"):  # data parallel: one device, the whole model on it
        model = Recommender(args.rows, args.dim)
    config = ParallelConfig(mode="data_parallel", devices=args.workers)
    plan = plait.plan(model, config, example_batch=batch, loss_fn=loss_fn)
    grads = sum(p.numel() * 4 for p in model.parameters())
    return plan.predicted.step_time_s, 0.0, 2 * (args.workers - 1) / args.workers * grads


if __name__ == "__main__":
    main()
