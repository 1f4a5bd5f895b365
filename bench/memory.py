"""Memory per rank by kind, measured against the plan's prediction (ZeRO levels, recompute, TP).

One GPT (``TinyGPT``, by default width 256, 8 heads, 4 layers, seq 128, vocab 256; global
batch 16 sequences; AdamW, fp32) is trained on 4 gloo processes in each of these ways, one
after another in the same processes:

* ``data_parallel``: ``ParallelConfig(mode="data_parallel")``, the plain-tensor path (its
  prediction is ``plait.plan`` of the same config, the plan that path stands for);
* ``ZeRO-1``, ``ZeRO-2``, ``ZeRO-3``: ``mode="data_parallel", optimizer_shard=1 | 2 | 3``
  (default ``optimizer_shard_threshold``, 64 KiB: biases and norms stay whole);
* ``recompute none``: ``mode="semi_auto", mesh={"dp": 4}`` with no annotation: data parallel
  by the compiled per-rank program, the path ``selective`` and ``full`` take;
* ``recompute selective``, ``recompute full``: ``mode="data_parallel", recompute=...``;
* ``ZeRO-3 + recompute full``: both;
* ``Megatron dp=2 x tp=2``: ``annotate_megatron(model, 2)``, ``mode="semi_auto"``.

``--extra`` adds more plans (``EXTRA``): ZeRO-2 with selective recompute, ZeRO-3 with 1 MB
gradient buckets, gradient accumulation over 2 micro-steps (with and without ZeRO-1), and the
Megatron plan with full recompute.

Each case is built, takes ``--warmup`` steps (AdamW makes its states), then one step is
measured by :func:`plait.runtime.engine.measure.measure_step_memory` on every rank: parameters,
gradients and optimizer states held (ZeRO-1/2's shard copies count as optimizer, as the plan
counts them), activations (the peak minus the model states alive at it: everything else the
step holds at once) and the peak. The job is then dropped before the next case is built. The
table gives rank 0's prediction (``plan.predicted.memory_by_kind`` and ``memory_bytes``),
measurement and their ratio for each kind; a summary checks the targets of the issue: under
ZeRO-3 the model states per rank are 1/dp of data parallel's within 5 %, and every row's
predicted peak is within 15 % of the measured one. The script reports, it does not fail on a
missed target. The warm-up losses of every case are checked against data parallel's (rtol),
so the cases do the same work.

On CUDA (``--device cuda --backend nccl``) the peak is the caching allocator's
(``torch.cuda.max_memory_allocated``), one process per GPU; with ``--nproc 1`` (one GPU) the
cases that need several ranks (ZeRO, which splits over dp, and Megatron) are left out:
``data_parallel`` and the three recompute rows run on one device.

Run from the repository root: ``.venv/bin/python bench/memory.py`` (CPU, 4 gloo processes,
about 2 minutes on 2 cores); ``.venv/bin/python bench/memory.py --device cuda --backend nccl
--nproc 1`` on one GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import plait
from plait import ParallelConfig
from plait.config import CommFusion
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss, token_batches
from plait.runtime.engine.measure import (
    KINDS,
    ComparisonRow,
    MemoryMeasurement,
    compare,
    measure_step_memory,
    plan_of,
)
from plait.testing import run_workers

LR = 1e-3
MiB = 2**20

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Case:
    key: str
    name: str
    settings: dict[str, Any]
    """ParallelConfig fields (``mesh`` may name ``"WORLD"`` for the world size)."""
    min_world: int = 1
    """Fewest ranks the case means something on (ZeRO splits over dp; Megatron needs tp=2)."""
    megatron: bool = False


CASES = [
    Case("dp", "data_parallel (plain tensors)", {"mode": "data_parallel"}),
    Case("zero1", "ZeRO-1", {"mode": "data_parallel", "optimizer_shard": 1}, min_world=2),
    Case("zero2", "ZeRO-2", {"mode": "data_parallel", "optimizer_shard": 2}, min_world=2),
    Case("zero3", "ZeRO-3", {"mode": "data_parallel", "optimizer_shard": 3}, min_world=2),
    Case("none", "recompute none (program path)", {"mode": "semi_auto", "mesh": "WORLD"}),
    Case("selective", "recompute selective", {"mode": "data_parallel", "recompute": "selective"}),
    Case("full", "recompute full", {"mode": "data_parallel", "recompute": "full"}),
    Case(
        "zero3_full",
        "ZeRO-3 + recompute full",
        {"mode": "data_parallel", "optimizer_shard": 3, "recompute": "full"},
        min_world=2,
    ),
    Case(
        "megatron",
        "Megatron dp=2 x tp=2 (semi_auto)",
        {"mode": "semi_auto", "mesh": {"dp": 2, "tp": 2}},
        min_world=4,
        megatron=True,
    ),
]
# More plans the memory model is checked on (``--extra``; not in the default table).
EXTRA = [
    Case(
        "zero2_selective",
        "ZeRO-2 + recompute selective",
        {"mode": "data_parallel", "optimizer_shard": 2, "recompute": "selective"},
        min_world=2,
    ),
    Case(
        "zero3_buckets",
        "ZeRO-3, 1 MB buckets",
        {"mode": "data_parallel", "optimizer_shard": 3, "comm_fusion": CommFusion(bucket_mb=1)},
        min_world=2,
    ),
    Case(
        "accumulation",
        "gradient accumulation 2",
        {"mode": "semi_auto", "mesh": "WORLD", "grad_accumulation": 2},
    ),
    Case(
        "zero1_accumulation",
        "ZeRO-1 + gradient accumulation 2",
        {"mode": "data_parallel", "optimizer_shard": 1, "grad_accumulation": 2},
        min_world=2,
    ),
    Case(
        "megatron_full",
        "Megatron dp=2 x tp=2 + recompute full",
        {"mode": "semi_auto", "mesh": {"dp": 2, "tp": 2}, "recompute": "full"},
        min_world=4,
        megatron=True,
    ),
]
BY_KEY = {c.key: c for c in [*CASES, *EXTRA]}


class GPT(TinyGPT):
    """TinyGPT whose position ids are made on the ids' device (TinyGPT makes them on the CPU,
    which a CUDA run cannot index with); the same model otherwise."""

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        t = ids_BT.shape[1]
        x = self.tok(ids_BT) + self.pos(torch.arange(t, device=ids_BT.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def initial_model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def config_of(case: Case, world: int) -> ParallelConfig:
    settings = dict(case.settings)
    if settings.get("mesh") == "WORLD":
        settings["mesh"] = {"dp": world}
    return ParallelConfig(**settings)


def local_slice(job: Any, batch: Batch, device: torch.device) -> Batch:
    """This rank's part of a global batch: its dp index's chunk (as bench/one_path.py)."""
    mesh = job.mesh
    dp = mesh.axis_size("dp") if mesh is not None and "dp" in mesh.axis_names else 1
    index = int(job.device_mesh.get_coordinate()[mesh.axis_index("dp")]) if dp > 1 else 0
    return tuple(x.chunk(dp)[index].to(device) for x in batch)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# The worker: every case in the same processes, one after another.


def run_case(
    case: Case, cfg: GPTConfig, batches: list[Batch], warmup: int, device: torch.device
) -> dict[str, Any]:
    world = dist.get_world_size()
    config = config_of(case, world)
    model = initial_model(cfg)
    if case.megatron:
        annotate_megatron(model, 2)
    example = batches[0]
    started = time.perf_counter()
    job = plait.parallelize(model, config, optimizer=adamw, loss_fn=gpt_loss, example_batch=example)
    losses = [job.step(local_slice(job, b, device)) for b in batches[:warmup]]
    m = measure_step_memory(job, local_slice(job, batches[warmup], device))
    plan = plan_of(job)
    if plan is None:  # the plain path: the plan of the same config is its prediction
        fresh = initial_model(cfg)
        whole = dataclasses.replace(config, devices=world)
        plan = plait.plan(fresh, whole, example_batch=example, loss_fn=gpt_loss)
    program = getattr(job, "program", None)
    out = {
        "measured": m,
        "rows": compare(m, plan),
        "losses": losses,
        "seconds": time.perf_counter() - started,
        "saved_bytes": None if program is None else program.saved_bytes,
    }
    del job, model, plan, program
    gc.collect()
    return out


def bench_worker(
    cfg: GPTConfig, batch: int, keys: list[str], warmup: int, threads: int, device_type: str
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    logging.getLogger("plait").setLevel(logging.ERROR)  # dp=1 plans note DTensor's layouts
    device = torch.device(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    batches = token_batches(cfg, batch, warmup + 1)
    out: dict[str, Any] = {}
    for key in keys:
        dist.barrier()
        try:
            out[key] = run_case(BY_KEY[key], cfg, batches, warmup, device)
        except Exception:  # report the case and go on with the others
            out[key] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# Processes: gloo through plait.testing.run_workers; NCCL, one process per GPU, here.


def _nccl_worker(
    rank: int, world: int, init_file: str, out_dir: str, fn: Callable[..., Any], args: Any
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            "nccl",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
            device_id=torch.device("cuda", rank),
        )
        result: tuple[str, Any] = ("ok", fn(*args))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def run_nccl(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    if world > torch.cuda.device_count():
        raise SystemExit(f"--nproc {world} needs {world} GPUs; {torch.cuda.device_count()} seen")
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _nccl_worker,
            args=(world, init_file, tmp, fn, args),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise SystemExit(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


# ---------------------------------------------------------------------------------------------
# The parent: tables.


def mib(n: int) -> str:
    return f"{n / MiB:.2f}"


def cell(row: ComparisonRow) -> str:
    ratio = "-" if row.measured == 0 and row.predicted == 0 else f"{row.ratio:.2f}"
    return f"{mib(row.predicted)} / {mib(row.measured)} ({ratio})"


def kinds_table(results: dict[str, Any]) -> str:
    lines = [
        "| case | parameters | gradients | optimizer | activations | peak | peak within 15 % |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for key, r in results.items():
        if "error" in r:
            lines.append(f"| {BY_KEY[key].name} | failed (see below) | | | | | |")
            continue
        rows = {row.kind: row for row in r["rows"]}
        ok = abs(rows["peak"].ratio - 1) <= 0.15
        cells = " | ".join(cell(rows[k]) for k in (*KINDS, "peak"))
        lines.append(f"| {BY_KEY[key].name} | {cells} | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def zero_summary(results: dict[str, Any], world: int) -> list[str]:
    out = []
    base = results.get("dp")
    if base is None or "error" in base:
        return out
    total: MemoryMeasurement = base["measured"]
    for key in ("zero1", "zero2", "zero3", "zero3_full"):
        r = results.get(key)
        if r is None or "error" in r:
            continue
        m: MemoryMeasurement = r["measured"]
        share = m.model_states / total.model_states
        line = (
            f"{BY_KEY[key].name}: model states per rank {mib(m.model_states)} MiB = "
            f"{share:.3f} of data parallel's {mib(total.model_states)} MiB"
        )
        if key in ("zero3", "zero3_full"):
            met = abs(share * world - 1) <= 0.05
            line += (
                f" (target 1/{world} = {1 / world:.3f} within 5 %: {'met' if met else 'missed'})"
            )
        out.append(line)
    return out


def recompute_summary(results: dict[str, Any]) -> list[str]:
    out = []
    for key in ("none", "selective", "full", "zero3_full"):
        r = results.get(key)
        if r is None or "error" in r:
            continue
        m: MemoryMeasurement = r["measured"]
        saved = r["saved_bytes"]
        kept = (
            ""
            if saved is None
            else f"; program keeps {mib(saved[1])} MiB for backward ({mib(saved[0])} without "
            "the rematerialization pass)"
        )
        out.append(f"{BY_KEY[key].name}: activations {mib(m.activations)} MiB{kept}")
    return out


def report(
    results: dict[str, Any], per_rank: list[Any], keys: list[str], args: argparse.Namespace
) -> list[str]:
    """Print the table and the summary; return the cases whose losses differ from dp's."""
    source = next((r["measured"].source for r in results.values() if "measured" in r), "-")
    print()
    print(f"Per rank (rank 0), MiB: predicted / measured (predicted / measured); by {source}")
    print()
    print(kinds_table(results))
    print()
    for line in [*zero_summary(results, args.nproc), *recompute_summary(results)]:
        print(f"- {line}")
    peaks = {
        key: max(rank[key]["measured"].peak for rank in per_rank)
        for key in keys
        if all("measured" in rank[key] for rank in per_rank)
    }
    print(
        "- measured peak, largest rank: "
        + ", ".join(f"{BY_KEY[k].name} {mib(v)} MiB" for k, v in peaks.items())
    )
    others = {k: r["measured"].other for k, r in results.items() if "measured" in r}
    if any(others.values()):
        print(
            "- CUDA allocator bytes outside tensors at the step's start (cuBLAS workspaces; in "
            "the peak, not in activations): "
            + ", ".join(f"{BY_KEY[k].name} {mib(v)} MiB" for k, v in others.items())
        )
    met = [k for k, r in results.items() if "rows" in r and abs(r["rows"][-1].ratio - 1) <= 0.15]
    print(f"- predicted peak within 15 % of measured: {len(met)} of {len(results)} rows")
    bad = []
    reference = results.get("dp", {}).get("losses")
    if reference:
        for key, r in results.items():
            losses = r.get("losses", reference)
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
            if diff > args.rtol:
                bad.append(f"{key} ({diff:.1e})")
        verdict = "all cases" if not bad else "not " + ", ".join(bad)
        print(f"- warm-up losses equal data parallel's within rtol {args.rtol:g}: {verdict}")
    print(
        "- build, warm-up and measured step per case: "
        + ", ".join(f"{k} {r['seconds']:.0f} s" for k, r in results.items() if "seconds" in r)
    )
    return bad


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="processes (ranks)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measured one")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--rtol", type=float, default=1e-4, help="warm-up losses vs dp's")
    parser.add_argument(
        "--extra",
        action="store_true",
        help="also the plans of EXTRA: " + ", ".join(c.key for c in EXTRA),
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="KEYS",
        help="comma-separated cases (default: all that fit --nproc): "
        + ", ".join(c.key for c in CASES),
    )
    return parser.parse_args()


def selected(args: argparse.Namespace) -> list[str]:
    cases = [*CASES, *EXTRA] if args.extra else CASES
    keys = [c.key for c in cases if c.min_world <= args.nproc]
    if args.only:
        wanted = [k for k in args.only.split(",") if k]
        unknown = [k for k in wanted if k not in BY_KEY]
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; known: {list(BY_KEY)}")
        keys = [c.key for c in [*CASES, *EXTRA] if c.key in wanted]
    return keys


def main() -> None:
    args = parse_args()
    if (args.device == "cuda") != (args.backend == "nccl"):
        raise SystemExit("use --device cpu --backend gloo, or --device cuda --backend nccl")
    if args.batch % args.nproc:
        raise SystemExit(f"--batch must divide by --nproc ({args.nproc})")
    keys = selected(args)
    cfg = GPTConfig(args.vocab, args.seq, args.width, args.heads, args.layers)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    print(
        f"torch {torch.__version__}, {args.nproc} {args.backend} processes on {args.device} "
        f"({args.threads} thread(s) each), {cfg} ({params / 1e6:.2f} M parameters), global "
        f"batch {args.batch}, AdamW fp32, {args.warmup} warm-up step(s) then one measured; "
        f"{os.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    start = time.perf_counter()
    worker_args = (cfg, args.batch, keys, args.warmup, args.threads, args.device)
    if args.backend == "gloo":
        per_rank = run_workers(bench_worker, args.nproc, *worker_args, timeout_s=900.0)
    else:
        per_rank = run_nccl(bench_worker, args.nproc, *worker_args)
    results = per_rank[0]
    bad = report(results, per_rank, keys, args)
    print(f"- total wall time {time.perf_counter() - start:.0f} s")
    for key, r in results.items():
        if "error" in r:
            print(f"\n{BY_KEY[key].name} failed on rank 0:\n{r['error']}", file=sys.stderr)
    if bad:
        raise SystemExit("cases trained differently from data parallel: " + ", ".join(bad))


if __name__ == "__main__":
    main()
