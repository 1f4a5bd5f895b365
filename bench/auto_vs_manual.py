"""Step time of plans made by ``mode="auto"`` against hand-written plans, beside their predictions.

One TinyGPT (same initial weights, same global batches, AdamW) is trained on 4 gloo processes
in several ways, side by side in one invocation, the variants taking turns step by step so a
slow spell of the machine hits all of them:

* ``data_parallel``: ``ParallelConfig(mode="data_parallel")`` on dp=4 (plain tensors, fused
  gradient buckets; plait's pure data-parallel path).
* ``semi_auto Megatron``: ``annotate_megatron(model, 2)``, mesh dp=2 x tp=2 (hand-written
  tensor parallel, run on DTensors).
* ``auto dp=2 x tp=2``: ``ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2})`` on the
  unannotated model: plait chooses every op's strategy (``plait.plan``'s searcher on the
  calibrated ``local`` profile) and the plan runs op by op (``build_plan_job``).
* ``auto, no mesh``: ``ParallelConfig(mode="auto")`` on 4 processes: the outer planner also
  chooses the mesh (among the plans the executor runs: no pipeline stages, ZeRO or recompute).

The auto rows are repeated for each ``--search``. A single-process plain PyTorch run of the
same model and global batches (in this process, before the workers start) is the baseline row.

Every row shows the plan's predicted step time (compute + communication, on hardware
``local``): for the auto rows the plan each job ran, for the others ``plait.plan`` with the same
config (``mode="stand_alone"`` for the baseline); then the measured median step time of rank 0
(after warm-up, each step starting after a barrier), measured / predicted, and the speed
relative to data_parallel (its median divided by the row's). "CPU" is the median process CPU
time of rank 0 per step (``time.process_time``: all its threads, gloo's included), which other
programs on a busy machine inflate less than wall time. The script fails if any variant's
losses differ from the single-process run's by more than 1e-3.

The ``local`` hardware profile is the one at plait's default path (``$PLAIT_HOME/local.json``
or ``~/.cache/plait/local.json``); with ``--hardware-file PATH`` that file is used instead, and
when neither exists ``plait calibrate --quick`` writes one into a temporary ``PLAIT_HOME``. The
workers plan through ``parallelize``, which reads ``local`` from ``$PLAIT_HOME``: the script
points ``PLAIT_HOME`` at a temporary copy of the chosen profile before starting them.

Run from the repository root:

    .venv/bin/python bench/auto_vs_manual.py [--steps 10] [--warmup 3] [--layers 2] ...
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import plait
from plait import ParallelConfig
from plait.cost.calibrate import calibrate, format_profile
from plait.cost.hardware import HardwareProfile, default_profile_path, load_profile
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss, token_batches
from plait.planning import plan_graph
from plait.testing import run_workers

WORLD = 4
LR = 1e-3
LOSS_TOLERANCE = 1e-3
DP_NAME = "data_parallel (dp=4)"

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Shape:
    """The model and batch the bench trains (command-line flags)."""

    gpt: GPTConfig
    batch: int


@dataclass(frozen=True)
class Variant:
    """One way of training: a config, and whether the model carries Megatron annotations."""

    name: str
    kind: str
    """What --only selects: "dp", "semi_auto", "auto_mesh" or "auto_no_mesh"."""
    config: ParallelConfig
    megatron: bool = False

    @property
    def planned(self) -> bool:
        return self.config.mode == "auto"


def variants(searches: list[str]) -> list[Variant]:
    """data_parallel first (the reference of the speed column), then the hand-written plan."""
    out = [
        Variant(DP_NAME, "dp", ParallelConfig(mode="data_parallel", mesh={"dp": WORLD})),
        Variant(
            "semi_auto Megatron (dp=2, tp=2)",
            "semi_auto",
            ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
            megatron=True,
        ),
    ]
    for search in searches:
        out.append(
            Variant(
                f"auto, mesh dp=2 x tp=2 ({search})",
                "auto_mesh",
                ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2}, search=search),
            )
        )
        out.append(
            Variant(
                f"auto, no mesh ({search})",
                "auto_no_mesh",
                ParallelConfig(mode="auto", search=search),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Model, data, optimizer (identical in every process).


def initial_model(shape: Shape, megatron: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(shape.gpt)
    return annotate_megatron(model, 2) if megatron else model


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


# ---------------------------------------------------------------------------------------------
# Workers: every variant in the same 4 processes.


def _dp_slice(job: plait.Job, batch: Batch) -> Batch:
    """This rank's piece of a global batch: dim 0 split over the job's data-parallel axis."""
    mesh = job.mesh
    if mesh is None or "dp" not in mesh.axis_names or mesh.axis_size("dp") == 1:
        return batch
    index = int(job.device_mesh.get_coordinate()[mesh.axis_index("dp")])
    ids, targets = batch
    size = mesh.axis_size("dp")
    return ids.chunk(size)[index], targets.chunk(size)[index]


def _plan_info(job: plait.Job) -> dict[str, Any] | None:
    """The plan a planned job runs: mesh, searcher, prediction, executor mismatches."""
    plan = getattr(job.loss_fn, "plan", None)
    if plan is None:
        return None
    p = plan.predicted
    return {
        "mesh": plan.mesh.as_dict(),
        "search": plan.search,
        "step_s": p.step_time_s,
        "compute_s": p.compute_s,
        "communication_s": p.communication_s,
        "mismatches": len(job.loss_fn.mismatches),
    }


def bench_worker(
    shape: Shape, names: list[str], searches: list[str], total: int, threads: int
) -> dict[str, Any]:
    """Build every variant on this rank, then step them in turns; rank 0's numbers matter."""
    torch.set_num_threads(threads)
    # DTensor warns once per rank that the global loss (pending over dp and tp) is reduced
    # with two all-reduces; true, and noise in this table.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    batches = token_batches(shape.gpt, shape.batch, total)
    runs: dict[str, tuple[plait.Job, list[Batch]]] = {}
    results: dict[str, Any] = {}
    for variant in variants(searches):
        if variant.name not in names:
            continue
        start = time.perf_counter()
        job = plait.parallelize(
            initial_model(shape, variant.megatron),
            variant.config,
            optimizer=adamw,
            loss_fn=gpt_loss,
            example_batch=batches[0] if variant.planned else None,
        )
        dist.barrier()
        runs[variant.name] = job, [_dp_slice(job, b) for b in batches]
        results[variant.name] = {
            "setup_s": time.perf_counter() - start,
            "plan": _plan_info(job),
            "losses": [],
            "times": [],
            "cpu": [],
        }
    for i in range(total):
        for name, (job, local) in runs.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = job.step(local[i])
            results[name]["times"].append(time.perf_counter() - t0)
            results[name]["cpu"].append(time.process_time() - c0)
            results[name]["losses"].append(loss)
    for name, (job, _) in runs.items():  # the executor records mismatches while it runs
        results[name]["plan"] = _plan_info(job)
    return results


# ---------------------------------------------------------------------------------------------
# The parent: profile, baseline, predictions, table.


def prepare_profile(hardware_file: str | None, home: Path) -> HardwareProfile:
    """Put the profile to plan on at ``home/local.json`` and point ``PLAIT_HOME`` there."""
    target = home / "local.json"
    default = default_profile_path()  # read before PLAIT_HOME changes
    if hardware_file is not None:
        load_profile(hardware_file)  # a bad file fails here, not in four workers
        shutil.copyfile(hardware_file, target)
        origin = f"--hardware-file {hardware_file}"
    elif default.exists():
        shutil.copyfile(default, target)
        origin = f"default path {default}"
    else:
        print(f"no calibrated profile at {default}: running `plait calibrate --quick` ...")
        calibrate(run_workers, quick=True, out=target)
        origin = "calibrated now (quick), in a temporary PLAIT_HOME"
    os.environ["PLAIT_HOME"] = str(home)  # the workers inherit it
    profile = load_profile(target)
    print(f"hardware profile 'local' from {origin}:")
    print(format_profile(profile))
    return profile


def baseline_run(
    shape: Shape, total: int, threads: int
) -> tuple[list[float], list[float], list[float]]:
    """Plain PyTorch on one process: step times, CPU times and losses over the global batches."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = initial_model(shape)
        opt = adamw(model.parameters())
        times, cpu, losses = [], [], []
        for batch in token_batches(shape.gpt, shape.batch, total):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            loss = gpt_loss(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return times, cpu, losses
    finally:
        torch.set_num_threads(previous)


def predicted(shape: Shape, variant: Variant | None) -> dict[str, Any]:
    """``plait.plan``'s prediction for a config on hardware ``local`` (no process group).

    ``None`` is the single-device baseline (``mode="stand_alone"``). Mode auto without a mesh
    plans among runnable plans only, as ``parallelize`` does.
    """
    batch = token_batches(shape.gpt, shape.batch, 1)[0]
    if variant is None:
        cfg, model = ParallelConfig(mode="stand_alone"), initial_model(shape)
    else:
        cfg, model = variant.config, initial_model(shape, variant.megatron)
    if cfg.mode == "auto" and cfg.mesh is None:
        graph = plait.capture(model, batch, gpt_loss)
        plan = plan_graph(
            graph, ParallelConfig(mode="auto", search=cfg.search, devices=WORLD), model=model,
            runnable_only=True,
        )  # fmt: skip
    else:
        plan = plait.plan(model, batch, cfg, loss_fn=gpt_loss)
    p = plan.predicted
    return {
        "mesh": plan.mesh.as_dict(),
        "search": plan.search,
        "step_s": p.step_time_s,
        "compute_s": p.compute_s,
        "communication_s": p.communication_s,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _mesh_text(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


def table(rows: list[dict[str, Any]], dp_median: float) -> str:
    lines = [
        "| variant | mesh | predicted ms (compute + comm) | measured median ms | p90 ms "
        "| CPU median ms | measured / predicted | speed vs data_parallel |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        pred, times = row["prediction"], row["times"]
        median = statistics.median(times)
        lines.append(
            f"| {row['name']} | {_mesh_text(pred['mesh'])} | {pred['step_s'] * 1e3:.1f} "
            f"({pred['compute_s'] * 1e3:.1f} + {pred['communication_s'] * 1e3:.1f}) "
            f"| {median * 1e3:.1f} | {percentile(times, 0.9) * 1e3:.1f} "
            f"| {statistics.median(row['cpu']) * 1e3:.1f} "
            f"| {median / pred['step_s']:.1f} | {dp_median / median:.2f}x |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument(
        "--search",
        default="sharding_propagation,dynamic_programming",
        help="comma-separated searchers for the auto rows (ParallelConfig.search values)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--baseline-threads",
        type=int,
        default=1,
        help="torch threads of the single-process baseline (default 1, one worker's share; "
        "2 threads on a busy 2-core machine ran 10x slower here)",
    )
    parser.add_argument(
        "--hardware-file", default=None, metavar="PATH", help="a `plait calibrate` profile"
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="KINDS",
        help="comma-separated kinds to run besides data_parallel: semi_auto, auto_mesh, "
        "auto_no_mesh (default: all)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    shape = Shape(GPTConfig(args.vocab, args.seq, args.width, args.heads, args.layers), args.batch)
    searches = [s for s in args.search.split(",") if s]
    all_variants = variants(searches)
    names = [v.name for v in all_variants]
    if args.only:
        wanted = set(args.only.split(",")) | {"dp"}
        names = [v.name for v in all_variants if v.kind in wanted]
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="plait-bench-home-") as home:
        prepare_profile(args.hardware_file, Path(home))
        print(
            f"torch {torch.__version__}, {WORLD} gloo processes ({args.threads} thread(s) each), "
            f"{shape.gpt}, global batch {shape.batch}, AdamW, {args.warmup} warm-up + "
            f"{args.steps} timed steps per variant; {os.cpu_count()} CPUs, load average "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        base_times, base_cpu, base_losses = baseline_run(shape, total, args.baseline_threads)
        chosen = [v for v in all_variants if v.name in names]
        predictions = {v.name: predicted(shape, v) for v in chosen}
        base_prediction = predicted(shape, None)
        per_rank = run_workers(
            bench_worker, WORLD, shape, names, searches, total, args.threads, timeout_s=600.0
        )
    results = per_rank[0]
    rows = [
        {
            "name": f"plain PyTorch, 1 process ({args.baseline_threads} threads)",
            "prediction": base_prediction,
            "times": base_times[args.warmup :],
            "cpu": base_cpu[args.warmup :],
        }
    ]
    worst = 0.0
    for v in chosen:
        r = results[v.name]
        ran = r["plan"]
        prediction = ran if ran is not None else predictions[v.name]
        planned_here = predictions[v.name]
        if ran is not None and (
            ran["mesh"] != planned_here["mesh"]
            or not math.isclose(ran["step_s"], planned_here["step_s"], rel_tol=1e-6)
        ):
            print(
                f"note: {v.name}: plait.plan predicts {planned_here['step_s'] * 1e3:.2f} ms on "
                f"{planned_here['mesh']}, the job ran {ran['step_s'] * 1e3:.2f} ms on {ran['mesh']}"
            )
        name = v.name
        if v.planned and v.config.mesh is None:
            name += f": chose {_mesh_text(prediction['mesh'])}"
        rows.append(
            {
                "name": name,
                "prediction": prediction,
                "times": r["times"][args.warmup :],
                "cpu": r["cpu"][args.warmup :],
            }
        )
        diff = max(abs(a - b) for a, b in zip(r["losses"], base_losses, strict=True))
        worst = max(worst, diff)
        extra = "" if ran is None else f", executor layout mismatches {ran['mismatches']}"
        print(f"{v.name}: setup {r['setup_s']:.1f} s, max |loss - baseline| {diff:.2e}{extra}")
    dp_median = statistics.median(results[DP_NAME]["times"][args.warmup :])
    print()
    print(table(rows, dp_median))
    print()
    print(
        f"losses over {total} steps: first {base_losses[0]:.6f}, last {base_losses[-1]:.6f} "
        f"(single process); largest difference of any variant {worst:.2e}"
    )
    print(
        f"load average after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; total wall time "
        f"{time.perf_counter() - start:.1f} s"
    )
    if worst > LOSS_TOLERANCE:
        raise SystemExit(f"a variant's losses differ from one device's by {worst:.2e}")


if __name__ == "__main__":
    main()
