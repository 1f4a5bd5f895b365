"""Compiled pipeline stages against the same stages on DTensors, per setting.

Pipeline stages with tensor parallel inside run as compiled per-rank programs
(``plait/runtime/pipeline/stage_program.py``) unless ``ParallelConfig(stage_programs=False)``; recompute
(the stage's and per module), activation offload, mixed precision and ZeRO on such stages
compile too. This script measures what that buys, setting by setting, in one run: for each
setting, two jobs built from the same weights on the same 4 gloo processes (pp=2 x tp=2,
Megatron layout, ``mode="semi_auto"``), one compiled and one with ``stage_programs=False``,
each ``--warmup`` untimed steps, then ``--steps`` timed steps taken in turns (compiled,
eager, compiled, ...). A step's time is the slowest rank's after a barrier; the table gives
medians and the ratio compiled / eager, the compiled stage's bytes kept for backward per
micro-batch (``program.saved_bytes``) and, with offload, the bytes moved to the host a step.
Losses of the two sides are compared (``--rtol``; bf16 to its own tolerance).

``--mesh pp2_dp2``: the same on pp=2 x dp=2 (``mode="data_parallel"``, no tensor parallel),
whose stages are plain tensors: compiled against eager stages, where recompute runs as
torch's checkpoint (selective: torch's selective checkpoint) and activation offload as
saved-tensor hooks around the eager forward, against the program's rematerialization pass and
the hooks around its call. The zero-bubble row's eager column is zero bubble too there.

Settings: ``1f1b`` (no option), ``recompute=full``, ``recompute=selective``,
``offload=activations`` (threshold 0: every value moves), ``bf16`` (autocast), and
``zero_bubble`` (compiled only: on DTensors the schedule is refused with tp; its eager column
shows 1f1b on DTensors instead).

Run from the repository root: ``.venv/bin/python bench/stage_programs.py`` (CPU, 4 gloo
processes, about 2 minutes on 2 shared cores).
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
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss, token_batches

SETTINGS: dict[str, dict[str, Any]] = {
    "1f1b": {},
    "recompute=full": {"recompute": "full"},
    "recompute=selective": {"recompute": "selective"},
    "offload=activations": {"offload": "activations"},
    "bf16": {"precision": "bf16"},
    "zero_bubble": {"schedule": "zero_bubble"},
}


MESHES: dict[str, dict[str, int]] = {"pp2_tp2": {"pp": 2, "tp": 2}, "pp2_dp2": {"pp": 2, "dp": 2}}


def _model(cfg: GPTConfig, tp: bool) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    if tp:
        annotate_megatron(model, 2)
    return model


def _job(cfg: GPTConfig, args: argparse.Namespace, extra: dict[str, Any], compiled: bool) -> Any:
    tp = "tp" in MESHES[args.mesh]
    if not compiled and extra.get("schedule") == "zero_bubble" and tp:
        extra = {}  # refused on DTensor stages with tp: 1f1b on DTensors stands in
    config = ParallelConfig(
        mode="semi_auto" if tp else "data_parallel", mesh=MESHES[args.mesh],
        micro_batches=args.micro, stage_programs=compiled, **extra,
    )  # fmt: skip
    job = plait.parallelize(
        _model(cfg, tp),
        config,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss_fn=gpt_loss,
        example_batch=token_batches(cfg, args.batch, 1)[0],
    )
    if job.activation_offload is not None:
        job.activation_offload.min_bytes = 0
    return job


def _local(job: Any, batch: Any) -> Any:
    """This rank's slice of the global batch (each dp rank trains on its own)."""
    if "dp" not in job.mesh.axis_names:
        return batch
    dp = job.device_mesh.get_coordinate()[job.mesh.axis_index("dp")]
    return tuple(x.chunk(job.mesh.axis_size("dp"))[dp] for x in batch)


def worker(cfg: GPTConfig, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    batches = token_batches(cfg, args.batch, args.warmup + args.steps)
    out: dict[str, Any] = {}
    for name, extra in SETTINGS.items():
        jobs = {side: _job(cfg, args, extra, side == "compiled") for side in ("compiled", "eager")}
        times, losses = in_turns(jobs, batches, args.warmup, _local)
        programs = jobs["compiled"].stage_programs
        offload = jobs["compiled"].activation_offload
        out[name] = {
            "times": times,
            "losses": losses,
            "saved": [p.saved_bytes for p in programs],
            "compiled": [p.calls > 0 and p.refused is None for p in programs],
            "moved": None if offload is None else offload.moved_bytes,
        }
        del jobs
    return out


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    other = "on DTensors" if "tp" in MESHES[args.mesh] else "eager"
    lines = [
        f"| setting | compiled ms | {other} ms | compiled / {other} | bytes kept for "
        "backward a micro-batch, compiled (before recompute -> after) | moved to host a step "
        "| max rel. loss diff |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    ratios = []
    for name in SETTINGS:
        r = results[0][name]
        compiled = statistics.median(r["times"]["compiled"])
        eager = statistics.median(r["times"]["eager"])
        ratios.append(compiled / eager)
        pairs = zip(r["losses"]["compiled"], r["losses"]["eager"], strict=True)
        diff = max(abs(a - b) / abs(b) for a, b in pairs)
        tolerance = 2e-2 if name == "bf16" else args.rtol
        if (name != "zero_bubble" or "tp" not in MESHES[args.mesh]) and diff > tolerance:
            raise SystemExit(f"{name}: losses differ by {diff:.2e} (> {tolerance})")
        if not all(all(c) for c in (rr[name]["compiled"] for rr in results)):
            raise SystemExit(f"{name}: a stage did not run as its compiled program")
        saved = ", ".join(f"{a:,} -> {b:,}" for a, b in r["saved"])
        moved = "-" if r["moved"] is None else f"{r['moved']:,}"
        stand_in = name == "zero_bubble" and "tp" in MESHES[args.mesh]
        eager_label = f"{eager * 1e3:.1f}" + (" (1f1b)" if stand_in else "")
        lines.append(
            f"| {name} | {compiled * 1e3:.1f} | {eager_label} | {compiled / eager:.3f} "
            f"| {saved} | {moved} | {diff:.1e} |"
        )
    geo = statistics.geometric_mean(ratios)
    lines.append("")
    lines.append(f"geometric mean of compiled / {other} over {len(ratios)} settings: {geo:.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", choices=sorted(MESHES), default="pp2_tp2")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()
    cfg = GPTConfig(
        vocab=args.vocab, seq=args.seq, width=args.width, heads=args.heads, layers=args.layers
    )
    print(
        f"torch {torch.__version__}, 4 gloo processes, {args.mesh}, {cfg}, batch {args.batch} "
        f"in {args.micro} micro-batches, AdamW, {args.warmup} warm-up + {args.steps} timed "
        "steps a side, taken in turns"
    )
    start = time.perf_counter()
    results = run_workers(worker, 4, cfg, args, timeout_s=900.0)
    print(report(results, args))
    print(f"total wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
