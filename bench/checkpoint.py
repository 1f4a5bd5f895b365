"""Checkpoint speed: plait's ``job.save`` / ``job.load`` against plain DCP of the same state.

One GPT (``TinyGPT``, by default vocab 4096, seq 64, width 512, 8 heads, 4 layers: 16.8 M
parameters, 202 MB of fp32 parameters and AdamW moments) on 4 gloo processes, under each plan
in turn in the same processes:

* ``dp``: plain data parallel, ``ParallelConfig(mode="data_parallel", mesh={"dp": 4})``;
* ``zero3``: the same with ``optimizer_shard=3`` (default threshold: biases and norms whole);
* ``megatron``: dp=2 x tp=2, ``annotate_megatron(model, 2)``, ``mode="semi_auto"``.

Each plan takes ``--warmup`` AdamW steps on a global batch of ``--batch`` sequences (so the
optimizer states exist), then, ``--repeats`` times after one untimed round, into fresh
directories under one temporary directory:

* save: ``job.save(path)`` and plain ``dcp.save(tensor_state(job),
  storage_writer=FileSystemWriter(path2))`` (``tensor_state`` is the flat tensor dict a plait
  checkpoint stores; building it is inside DCP's timed region too);
* load: ``job.load(path)`` and ``dcp.load(tensor_state(job),
  storage_reader=FileSystemReader(path2))``, in place into the same job.

plait and DCP take turns (which goes first alternates by repeat). Every op starts after a
full ``gc.collect()`` (see ``cpu_timed``; ``--no-collect`` leaves it out, as earlier runs did)
and a barrier and is timed on every rank; a repeat's time is the slowest rank's, and the
table gives the median over repeats and the ratio plait / DCP (the issue's target: <= 1.10),
and beside them the CPU time the op took on all ranks together (``time.process_time``, helper threads
included; median over repeats), which other tenants of the machine move less than wall time.
The files are read back from the page cache in both cases (each load reads the checkpoint its
repeat just wrote). While plait's ops run, the functions its save and load call (DCP's write and
read, the checksum pass, manifest, commit...) are wrapped with timers (in these processes
only; plait's files are unchanged) to show where plait's time goes: per repeat the slowest
rank's time in each, less the timed functions it calls, the median over repeats ("other":
the rest). The XXH3-64 plait makes of each file as DCP writes it is inside "DCP write"; a
load's share of the checksums ("checksum share") runs inside DCP's plan step, and is counted
apart from "DCP read". Only the calling thread is timed: each rank's small files are written
and synced by a helper thread beside DCP's writes. The
model state is checked unchanged by the loads (a fingerprint of every tensor).

Async save: ``--async-repeats`` times, ``--steps`` training steps with no save in flight,
then ``job.save(path, async_save=True)`` (its blocking time: the staging copy), then steps
while the background write goes on, until it is committed on every rank (at most
``--max-async-steps``), then ``handle.wait()``. A tiny all-reduce before each step is both the
barrier and the check whether any rank is still writing.

Run from the repository root: ``.venv/bin/python bench/checkpoint.py`` (CPU, 4 gloo processes;
about 2.5 minutes on 2 cores). ``--dir /dev/shm`` puts the checkpoints in memory (tmpfs), which
takes the disk out of both sides.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import plait
from plait import ParallelConfig
from plait.checkpoint import files
from plait.comm import checkpoint_io as io
from plait.comm.dtensor import is_dtensor, local_piece
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss, token_batches
from plait.planning.records import Plan as PlanRecord
from plait.runtime.engine import checkpoint as ckpt
from plait.runtime.engine.checkpoint import tensor_state
from plait.testing import run_workers

WORLD = 4
LR = 1e-3
TARGET = 1.10

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Plan:
    key: str
    name: str
    settings: dict[str, Any]
    megatron: bool = False


PLANS = [
    Plan("dp", "data parallel dp=4", {"mode": "data_parallel", "mesh": {"dp": 4}}),
    Plan(
        "zero3",
        "ZeRO-3 dp=4",
        {"mode": "data_parallel", "mesh": {"dp": 4}, "optimizer_shard": 3},
    ),
    Plan(
        "megatron",
        "dp=2 x tp=2 semi_auto Megatron",
        {"mode": "semi_auto", "mesh": {"dp": 2, "tp": 2}},
        megatron=True,
    ),
]
BY_KEY = {p.key: p for p in PLANS}

# What plait's save and load call, timed while plait's ops run: (module, attribute, label).
# Each label gets the time spent in its functions less the time spent in other timed functions
# they call (the checksum pass runs inside DCP's load, the commit inside DCP's save).
SAVE_PHASES = [
    (ckpt, "tensor_state", "tensor_state"),
    (ckpt, "_extras", "extras"),
    (ckpt, "_manifest", "manifest dict"),
    (ckpt, "_staged", "staging copy"),
    (ckpt, "_serialized", "small state bytes"),
    (PlanRecord, "save", "plan.json"),
    (io, "save_tensors", "DCP write"),
    (ckpt, "_commit", "commit (coordinator)"),
    (files, "files_of", "list files"),
    (files, "checksum", "checksum"),
    (io, "all_gather_objects", "gather objects"),
    (files, "write_manifest", "write manifest"),
    (files, "commit", "renames"),
    (io, "barrier", "barriers"),
]
LOAD_PHASES = [
    (files, "read_manifest", "read manifest"),
    (ckpt, "_open", "sizes, metadata, extras"),
    (ckpt, "read_extras", "read extras"),
    (ckpt, "_optimizer_destinations", "optimizer destinations"),
    (io, "load_tensors", "DCP read"),
    (ckpt, "_verify_share", "checksum share"),
]


# ---------------------------------------------------------------------------------------------
# Phase timers: wrap module functions, accumulate while switched on.


class Phases:
    """Timers around module functions, on while ``on``; each label's time excludes the time
    of timed functions called inside (self time), so the labels add up to the op."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per active timed call: time of timed calls inside it

    def install(self, table: list[tuple[Any, str, str]]) -> None:
        for module, name, label in table:
            fn = getattr(module, name)
            if getattr(fn, "_bench_label", None) is None:
                setattr(module, name, self._timed(fn, label))

    def _timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.on or threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)  # helper threads' time overlaps the op's phases
            t0 = time.perf_counter()
            self._inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                inner = self._inner.pop()
                self.seconds[label] = self.seconds.get(label, 0.0) + elapsed - inner
                if self._inner:
                    self._inner[-1] += elapsed

        wrapper._bench_label = label  # type: ignore[attr-defined]
        return wrapper

    def start(self) -> None:
        self.seconds = {}
        self._inner = []
        self.on = True

    def stop(self) -> dict[str, float]:
        self.on = False
        return dict(self.seconds)


PHASES = Phases()


# ---------------------------------------------------------------------------------------------
# Model, data, job.


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def build_job(plan: Plan, cfg: GPTConfig, example: Batch) -> plait.Job:
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    if plan.megatron:
        annotate_megatron(model, 2)
    config = ParallelConfig(**plan.settings)
    return plait.parallelize(
        model, config, optimizer=adamw, loss_fn=gpt_loss, example_batch=example
    )


def local_slice(job: plait.Job, batch: Batch) -> Batch:
    mesh = job.mesh
    dp = mesh.axis_size("dp")
    index = int(job.device_mesh.get_coordinate()[mesh.axis_index("dp")])
    return tuple(x.chunk(dp)[index] for x in batch)  # type: ignore[return-value]


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, the sum of |x| of this rank's piece (float64)."""
    out = {}
    for k, v in state.items():
        piece = local_piece(v) if is_dtensor(v) else v
        out[k] = float(piece.detach().double().abs().sum())
    return out


def local_bytes(state: dict[str, torch.Tensor]) -> int:
    total = 0
    for v in state.values():
        piece = local_piece(v) if is_dtensor(v) else v
        total += piece.numel() * piece.element_size()
    return total


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------
# The timed ops: each after a barrier, on every rank.


COLLECT = True
"""Whether each op starts with ``gc.collect()`` (``--no-collect`` turns it off)."""


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, its helper threads included).

    First, outside both measures, a full collection by Python's GC: without it a
    generation-2 collection (a 0.2 to 0.5 s pause on the busy 2-core machine, due about every
    fifth op from the objects earlier ops left) lands inside whichever op, on either side,
    crosses its threshold, and decides that round's ratio."""
    if COLLECT:
        gc.collect()
    c0 = time.process_time()
    seconds = timed(fn)
    return seconds, time.process_time() - c0


def plait_save(job: plait.Job, path: Path) -> tuple[float, float, dict[str, float]]:
    PHASES.start()
    try:
        seconds, cpu = cpu_timed(lambda: job.save(path))
    finally:
        phases = PHASES.stop()
    return seconds, cpu, phases


def plait_load(job: plait.Job, path: Path) -> tuple[float, float, dict[str, float]]:
    PHASES.start()
    try:
        seconds, cpu = cpu_timed(lambda: job.load(path))
    finally:
        phases = PHASES.stop()
    return seconds, cpu, phases


def dcp_save(job: plait.Job, path: Path) -> tuple[float, float]:
    def run() -> None:
        dcp.save(tensor_state(job), storage_writer=FileSystemWriter(os.fspath(path)))

    return cpu_timed(run)


def dcp_load(job: plait.Job, path: Path) -> tuple[float, float]:
    def run() -> None:
        dcp.load(tensor_state(job), storage_reader=FileSystemReader(os.fspath(path)))

    return cpu_timed(run)


def read_speed(path: Path) -> dict[str, float]:
    """Seconds to read ``path`` with and without its checksum (files.checksum, XXH3-64 of the
    mapped file; read into a 1 MB buffer and hashed, as before), to hash its bytes alone with XXH3-64 and with zlib's CRC-32 (what plait used before), and its
    size."""
    size = path.stat().st_size
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 23):
            pass
    read = time.perf_counter() - t0
    t0 = time.perf_counter()
    files.checksum(path)
    checksum = time.perf_counter() - t0
    t0 = time.perf_counter()
    hasher, buffer = xxhash.xxh3_64(), memoryview(bytearray(1 << 20))
    with open(path, "rb", buffering=0) as f:  # what files.checksum did before it mapped files
        while n := f.readinto(buffer):
            hasher.update(buffer[:n])
    buffered = time.perf_counter() - t0
    data = path.read_bytes()
    t0 = time.perf_counter()
    xxhash.xxh3_64_intdigest(data)
    xxh3_only = time.perf_counter() - t0
    t0 = time.perf_counter()
    zlib.crc32(data)
    crc_only = time.perf_counter() - t0
    return {
        "bytes": size,
        "read_s": read,
        "checksum_s": checksum,
        "buffered_s": buffered,
        "xxh3_s": xxh3_only,
        "crc_s": crc_only,
    }


def remove(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# One plan: sync save/load against DCP, then async save.


def still_writing(handle: Any) -> bool:
    """Whether any rank's background save is still running (also a barrier)."""
    flag = torch.tensor([0 if handle is None or handle.done() else 1])
    dist.all_reduce(flag)
    return bool(flag.item())


def timed_step(job: plait.Job, batch: Batch) -> float:
    t0 = time.perf_counter()
    job.step(local_slice(job, batch))
    return time.perf_counter() - t0


def run_plan(plan: Plan, cfg: GPTConfig, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    batches = token_batches(cfg, args.batch, 4)
    started = time.perf_counter()
    job = build_job(plan, cfg, batches[0])
    for i in range(args.warmup):
        job.step(local_slice(job, batches[i % len(batches)]))
    state = tensor_state(job)
    before = fingerprint(state)
    out: dict[str, Any] = {
        "setup_s": time.perf_counter() - started,
        "local_mb": local_bytes(state) / 1e6,
        "tensors": len(state),
    }
    del state
    out.update(against_dcp(job, args.repeats, root / plan.key))
    out["unchanged"] = before == fingerprint(tensor_state(job))
    out["async"] = async_saves(job, batches, args, root / plan.key)
    del job
    return out


def against_dcp(job: plait.Job, repeats: int, base: Path) -> dict[str, Any]:
    """Sync save and load, plait's and DCP's taking turns; round 0 untimed."""
    out: dict[str, Any] = {
        "save": {"plait": [], "dcp": [], "plait_cpu": [], "dcp_cpu": []},
        "load": {"plait": [], "dcp": [], "plait_cpu": [], "dcp_cpu": []},
        "save_phases": [],
        "load_phases": [],
    }
    for r in range(repeats + 1):
        paths = {"plait": base / f"plait-{r}", "dcp": base / f"dcp-{r}"}
        order = ("plait", "dcp") if r % 2 == 0 else ("dcp", "plait")
        for op in ("save", "load"):
            for who in order:
                if who == "plait":
                    fn = plait_save if op == "save" else plait_load
                    seconds, cpu, phases = fn(job, paths[who])
                else:
                    seconds, cpu = (dcp_save if op == "save" else dcp_load)(job, paths[who])
                if r > 0:
                    out[op][who].append(seconds)
                    out[op][f"{who}_cpu"].append(cpu)
                    if who == "plait":
                        out[f"{op}_phases"].append(phases)
        if r == 0:
            out["disk_mb"] = {k: dir_bytes(v) / 1e6 for k, v in paths.items()}
            data = sorted(paths["plait"].glob("*.distcp"))
            if dist.get_rank() == 0 and data:
                out["read_speed"] = read_speed(max(data, key=lambda p: p.stat().st_size))
        for path in paths.values():
            remove(path)
    return out


def async_saves(
    job: plait.Job, batches: list[Batch], args: argparse.Namespace, base: Path
) -> list[dict[str, Any]]:
    """Step times with no save in flight, then while an async save writes; round 0 untimed
    (its save makes the background group)."""
    out = []
    steps = 0
    for r in range(args.async_repeats + 1):
        quiet = []
        for _ in range(args.steps):
            still_writing(None)
            quiet.append(timed_step(job, batches[steps % len(batches)]))
            steps += 1
        path = base / f"async-{r}"
        dist.barrier()
        PHASES.start()
        t0 = time.perf_counter()
        handle = job.save(path, async_save=True)
        blocked = time.perf_counter() - t0
        phases = PHASES.stop()
        busy = []
        while len(busy) < args.max_async_steps and still_writing(handle):
            busy.append(timed_step(job, batches[steps % len(batches)]))
            steps += 1
        t0 = time.perf_counter()
        handle.wait()
        waited = time.perf_counter() - t0
        remove(path)
        if r > 0:
            out.append(
                {"quiet": quiet, "busy": busy, "block": blocked, "wait": waited, "phases": phases}
            )
    return out


def bench_worker(cfg: GPTConfig, args: argparse.Namespace, keys: list[str], root: str) -> Any:
    global COLLECT
    COLLECT = not args.no_collect
    torch.set_num_threads(args.threads)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    logging.getLogger("plait").setLevel(logging.ERROR)
    PHASES.install(SAVE_PHASES + LOAD_PHASES)
    out = {}
    for key in keys:
        dist.barrier()
        out[key] = run_plan(BY_KEY[key], cfg, args, Path(root))
        dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# The parent: tables.


def slowest(per_rank: list[dict[str, Any]], key: str, op: str, who: str) -> list[float]:
    """Per repeat, the slowest rank's seconds."""
    return [max(ts) for ts in zip(*(r[key][op][who] for r in per_rank), strict=True)]


def cpu_total(per_rank: list[dict[str, Any]], key: str, op: str, who: str) -> float:
    """The median over repeats of the CPU seconds all ranks spent in the op (helper threads
    included): what the op costs the machine, less moved by other tenants than wall time."""
    per_repeat = zip(*(r[key][op][f"{who}_cpu"] for r in per_rank), strict=True)
    return statistics.median(sum(ts) for ts in per_repeat)


def phase_medians(per_rank: list[dict[str, Any]], key: str, op: str) -> dict[str, float]:
    """Per phase, the median over repeats of the seconds the slowest rank spent in it (the
    rest of that rank's time is "other")."""
    totals = [r[key][op]["plait"] for r in per_rank]
    chosen = []
    for i in range(len(totals[0])):
        slow = max(range(len(per_rank)), key=lambda rank: totals[rank][i])
        phases = dict(per_rank[slow][key][f"{op}_phases"][i])
        phases["other"] = totals[slow][i] - sum(phases.values())
        chosen.append(phases)
    labels = {k for phases in chosen for k in phases}
    return {k: statistics.median(phases.get(k, 0.0) for phases in chosen) for k in labels}


def tables(per_rank: list[dict[str, Any]], keys: list[str]) -> str:
    lines = [
        "| plan | op | plait s | DCP s | plait / DCP | median of paired ratios | target <= 1.10 "
        "| CPU s, all ranks (plait / DCP) | CPU ratio | on disk MB (plait / DCP) |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for key in keys:
        res = per_rank[0][key]
        for op in ("save", "load"):
            ps, ds = slowest(per_rank, key, op, "plait"), slowest(per_rank, key, op, "dcp")
            p, d = statistics.median(ps), statistics.median(ds)
            ratio = p / d
            paired = statistics.median(a / b for a, b in zip(ps, ds, strict=True))
            met = "met" if ratio <= TARGET else "missed"
            pc, dc = cpu_total(per_rank, key, op, "plait"), cpu_total(per_rank, key, op, "dcp")
            disk = f"{res['disk_mb']['plait']:.1f} / {res['disk_mb']['dcp']:.1f}"
            lines.append(
                f"| {BY_KEY[key].name} | {op} | {p:.3f} | {d:.3f} | {ratio:.2f} | {paired:.2f} "
                f"| {met} | {pc:.3f} / {dc:.3f} | {pc / dc:.2f} | {disk} |"
            )
    lines += [
        "",
        "| plan | step ms, no save | step ms while an async save writes (steps) | ratio "
        "| async save call blocks ms | sync save s | blocks / sync save | wait() ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in keys:
        runs = [r[key]["async"] for r in per_rank]
        quiet, busy, block, wait = [], [], [], []
        for i in range(len(runs[0])):
            quiet += [max(ts) for ts in zip(*(run[i]["quiet"] for run in runs), strict=True)]
            busy += [max(ts) for ts in zip(*(run[i]["busy"] for run in runs), strict=True)]
            block.append(max(run[i]["block"] for run in runs))
            wait.append(max(run[i]["wait"] for run in runs))
        q = statistics.mean(quiet)
        b = statistics.mean(busy) if busy else float("nan")
        blk = statistics.median(block)
        sync = statistics.median(slowest(per_rank, key, "save", "plait"))
        lines.append(
            f"| {BY_KEY[key].name} | {q * 1e3:.1f} | {b * 1e3:.1f} ({len(busy)}) | {b / q:.2f} "
            f"| {blk * 1e3:.1f} | {sync:.3f} | {blk / sync:.2f} "
            f"| {statistics.median(wait) * 1e3:.1f} |"
        )
    return "\n".join(lines)


def phase_lines(per_rank: list[dict[str, Any]], keys: list[str]) -> str:
    lines = []
    for key in keys:
        for op in ("save", "load"):
            phases = phase_medians(per_rank, key, op)
            total = statistics.median(slowest(per_rank, key, op, "plait"))
            parts = ", ".join(
                f"{k} {v * 1e3:.0f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])
            )
            lines.append(f"{BY_KEY[key].name}, plait {op} {total * 1e3:.0f} ms: {parts}")
    return "\n".join(lines)


def async_phase_lines(per_rank: list[dict[str, Any]], keys: list[str]) -> str:
    """What the async save call blocks on: the slowest rank's phases, median over saves."""
    lines = []
    for key in keys:
        runs = [r[key]["async"] for r in per_rank]
        chosen = []
        for i in range(len(runs[0])):
            slow = max(range(len(runs)), key=lambda rank: runs[rank][i]["block"])
            phases = dict(runs[slow][i]["phases"])
            phases["other"] = runs[slow][i]["block"] - sum(phases.values())
            chosen.append(phases)
        labels = {k for phases in chosen for k in phases}
        medians = {k: statistics.median(ph.get(k, 0.0) for ph in chosen) for k in labels}
        parts = ", ".join(
            f"{k} {v * 1e3:.0f}" for k, v in sorted(medians.items(), key=lambda kv: -kv[1]) if v
        )
        lines.append(f"{BY_KEY[key].name}, async save call: {parts}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds of save and load")
    parser.add_argument("--async-repeats", type=int, default=2, help="timed async saves")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the first save")
    parser.add_argument("--steps", type=int, default=3, help="steps timed with no save")
    parser.add_argument("--max-async-steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--dir", default=None, help="where the temporary directory goes")
    parser.add_argument(
        "--no-collect",
        action="store_true",
        help="no gc.collect() before each timed save and load (as earlier runs did)",
    )
    parser.add_argument(
        "--only",
        default=",".join(p.key for p in PLANS),
        metavar="KEYS",
        help="comma-separated plans: " + ", ".join(p.key for p in PLANS),
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    keys = [k for k in args.only.split(",") if k]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise SystemExit(f"unknown plan(s) {unknown}; known: {list(BY_KEY)}")
    keys = [p.key for p in PLANS if p.key in keys]
    cfg = GPTConfig(args.vocab, args.seq, args.width, args.heads, args.layers)
    params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    print(
        f"torch {torch.__version__}, {WORLD} gloo processes ({args.threads} thread(s) each), "
        f"{cfg}: {params / 1e6:.2f} M parameters ({params * 12 / 1e6:.0f} MB with AdamW's "
        f"two moments), global batch {args.batch}; {args.repeats} timed rounds (+1 untimed) of "
        f"save and load, {args.async_repeats} async saves; {os.cpu_count()} CPUs, load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plait-bench-ckpt-", dir=args.dir) as root:
        per_rank = run_workers(bench_worker, WORLD, cfg, args, keys, root, timeout_s=900.0)
    results = per_rank[0]
    print(
        "setup: "
        + ", ".join(f"{k} {results[k]['setup_s']:.1f} s" for k in keys)
        + "; state per rank (MB, rank 0): "
        + ", ".join(f"{k} {results[k]['local_mb']:.1f}" for k in keys)
    )
    print()
    print(tables(per_rank, keys))
    print()
    print(
        "where plait's time goes (ms; per repeat the slowest rank's phases, median over repeats):"
    )
    print(phase_lines(per_rank, keys))
    print(async_phase_lines(per_rank, keys))
    speeds = [results[k]["read_speed"] for k in keys if "read_speed" in results[k]]
    for s in speeds[:1]:
        mb = s["bytes"] / 1e6
        print(
            f"one data file of {mb:.1f} MB (rank 0, page cache): read {mb / s['read_s']:.0f} MB/s,"
            f" files.checksum {mb / s['checksum_s']:.0f} MB/s (read into a buffer and hashed "
            f"{mb / s['buffered_s']:.0f} MB/s), xxhash.xxh3_64 alone "
            f"{mb / s['xxh3_s']:.0f} MB/s, zlib.crc32 alone {mb / s['crc_s']:.0f} MB/s"
        )
    bad = [k for k in keys if not all(r[k]["unchanged"] for r in per_rank)]
    print(
        "state after the loads equals the state before: "
        + ("yes, every plan and rank" if not bad else f"NO for {bad}")
    )
    print(
        f"load average after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; total wall time "
        f"{time.perf_counter() - start:.1f} s"
    )
    if bad:
        raise SystemExit(f"loads changed the state of {bad}")


if __name__ == "__main__":
    main()
