"""pp=2 x tp=2: plait's pipeline with tensor-parallel stages against hand-written torch
pipelining with ``parallelize_module`` stages (issue 30, item 4).

Two models of the zoo (``plait.models.build``), each trained the same way on 4 gloo processes
(one torch thread each), same initial weights (seed 0), same global batches, AdamW (lr 1e-3),
schedule 1f1b, ``--micro`` micro-batches a step:

* ``llama``: plait's Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention through
  ``F.scaled_dot_product_attention``; ``--heads`` query heads over ``--kv-heads``);
* ``gpt``: TinyGPT (LayerNorm, learned positions, GELU MLP, its own softmax attention).

Sides, built and stepped in the same processes, taking turns step by step (the order
alternates), so a busy spell of the shared machine hits all of them:

* ``plait semi_auto``: ``plait.annotate.megatron(model, 2)`` (q, k, v, the MLP's up/gate
  column parallel; attention out and MLP down row parallel; the token embedding and the LM
  head split over the vocabulary), then ``plait.parallelize(model, ParallelConfig(
  mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=M, schedule="1f1b"), ...)`` and
  ``job.step(batch)``. Its stages run as compiled per-rank programs
  (``plait/runtime/pipeline/stage_program.py``);
* ``plait auto``: the same annotations, ``mode="auto"`` on the same mesh (``--no-auto``
  leaves it out);
* ``torch``: what a user writes with torch's own tools, as torchtitan does. A 2-D
  ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))``; the model cut by hand at
  plait's ``job.stage_starts`` into a stage module holding the model's own modules (token
  embedding in the first; final norm and LM head in the last; the model's forward code for
  them); ``parallelize_module`` on the tp sub-mesh in the same Megatron layout:
  ``ColwiseParallel`` for q, k, v, the MLP's up (and Llama's gate), ``RowwiseParallel`` for
  the attention's out and the MLP's down, ``PrepareModuleInput`` (replicated, kept a DTensor)
  on the attention and the MLP so their column-parallel projections share one all-reduce of
  the input gradient (Megatron's 2 all-reduces a block forward and 2 backward),
  ``RowwiseParallel(input_layouts=Replicate())`` for the token embedding (vocabulary rows) and
  ``ColwiseParallel(output_layouts=Replicate())`` for the LM head (vocabulary columns, the
  logits gathered); attention on each rank's local heads (Llama: ``attn.heads`` and
  ``attn.kv_heads`` divided by tp, as torchtitan does; TinyGPT: its attention's forward
  written for the local heads). Then ``PipelineStage(module, i, 2, input_args=...,
  output_args=..., group=mesh.get_group("pp"))``, ``Schedule1F1B(stage, M, loss_fn=cross
  entropy)`` (``scale_grads`` left True: the mean micro-batch loss, as plait), AdamW over the
  stage's parameters (DTensors where split), ``schedule.step(..., return_outputs=False)`` as
  plait calls it. The step's loss is the last stage's mean (no collective; plait's ``step``
  all-reduces its global loss, one scalar).

All sides start from the same weights and take the same batches: the step-1 losses are
printed and every step's losses must agree to ``--rtol`` (checked). After ``--warmup``
untimed steps, ``--steps`` timed steps; each step starts after a barrier, is timed on every
rank, and counts as its slowest rank's time; the table gives the median over steps and the
ratio plait / torch (the issue's target: <= 1.05), and the median of the per-step ratios.
``--profile SIDE`` adds a cProfile of rank 0 over ``--profile-steps`` extra steps of a side.
Below the table: where plait cut the stages and the collectives each compiled stage issues a
micro-batch (plait's Llama split hands the rotary tables from the first stage to the second
as activations, so the second stage computes their gradients, all-reduces them over tp (2
all-reduces a micro-batch more than TinyGPT's) and sends them back; torch's hand-cut stages
compute the tables in each stage). Mode auto logs, per stage, where its compiled stage's
collectives differ from those its plan lists (the stages follow DTensor's propagation from
the plan's parameter layouts).

Run from the repository root: ``.venv/bin/python bench/pp_tp.py`` (CPU, 4 gloo processes,
about 3 minutes on 2 shared cores). ``--models llama --steps 4`` for a short run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import math
import os
import pstats
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

import plait
from plait import ParallelConfig
from plait.annotate import megatron
from plait.models import ModelSpec, build
from plait.testing import run_workers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/one_path.py's TinyGPT attention on local heads

from one_path import local_head_attention  # noqa: E402

WORLD, PP, TP = 4, 2, 2
LR = 1e-3
TARGET = 1.05
SIDES = ("torch", "semi_auto", "auto")
LABELS = {
    "torch": "torch pipelining + parallelize_module",
    "semi_auto": "plait semi_auto (megatron marks)",
    "auto": "plait auto (megatron marks)",
}

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[Batch], float | None]


# ---------------------------------------------------------------------------------------------
# Model, data, optimizer (identical in every process).


def spec_of(kind: str, args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(
        kind=kind,
        vocab=args.vocab,
        seq=args.seq,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads if kind == "llama" else None,
        layers=args.layers,
        batch=args.batch,
    )


def initial_model(spec: ModelSpec) -> nn.Module:
    torch.manual_seed(0)
    model, _, _ = build(spec)
    return model


def _zoo_loss(spec: ModelSpec) -> Callable[[nn.Module, Batch], torch.Tensor]:
    with torch.device("meta"):
        _, _, loss = build(spec)
    return loss


def batches_of(spec: ModelSpec, n: int) -> list[Batch]:
    """``n`` global batches of ``spec.batch`` random token rows, targets the rows rolled by one."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


# ---------------------------------------------------------------------------------------------
# plait


def build_plait(spec: ModelSpec, mode: str, micro: int, example: Batch) -> tuple[StepFn, Any]:
    model = initial_model(spec)
    megatron(model, TP)
    config = ParallelConfig(mode=mode, mesh={"pp": PP, "tp": TP}, micro_batches=micro,
                            schedule="1f1b")  # fmt: skip
    job = plait.parallelize(
        model, config, optimizer=adamw, loss_fn=_zoo_loss(spec), example_batch=example
    )
    return job.step, job


# ---------------------------------------------------------------------------------------------
# torch: manual stages, parallelize_module over tp


class Stage(nn.Module):
    """One stage of a zoo LM for torch's manual frontend: the model's own modules between two
    cuts, under the model's names, and the model's forward code for them."""

    def __init__(self, model: nn.Module, kind: str, blocks: range, first: bool, last: bool):
        super().__init__()
        self.kind = kind
        self.tok = model.tok if first else None
        self.pos = model.pos if first and kind == "gpt" else None
        self.rope = model.rope if kind == "llama" else None  # buffers only: every stage
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        norm = (model.norm if kind == "llama" else model.ln) if last else None
        self.norm = norm
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.tok is not None:
            x = self.tok(x)
            if self.pos is not None:
                x = x + self.pos(torch.arange(t, device=x.device))
        if self.rope is not None:
            cos, sin = self.rope(t)
            for block in self.blocks.values():
                x = block(x, cos, sin)
        else:
            for block in self.blocks.values():
                x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def tp_plan(kind: str, blocks: range, first: bool, last: bool) -> dict[str, Any]:
    """Megatron's layout in torch's styles (see the module docstring)."""
    shared_input = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    plan: dict[str, Any] = {}
    if first:
        plan["tok"] = RowwiseParallel(input_layouts=Replicate())
    if last:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    for i in blocks:
        b = f"blocks.{i}"
        if kind == "llama":
            plan[f"{b}.attn"] = PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=False,
            )
            plan.update({f"{b}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
            plan[f"{b}.attn.o"] = RowwiseParallel()
            plan[f"{b}.mlp"] = shared_input
            plan.update({f"{b}.mlp.{n}": ColwiseParallel() for n in ("gate", "up")})
            plan[f"{b}.mlp.down"] = RowwiseParallel()
        else:
            plan[f"{b}.attn"] = shared_input
            plan.update({f"{b}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
            plan[f"{b}.attn.out"] = RowwiseParallel()
            plan[f"{b}.fc1"] = ColwiseParallel()
            plan[f"{b}.fc2"] = RowwiseParallel()
    return plan


def build_torch(
    spec: ModelSpec, device_mesh: Any, micro: int, starts: list[str], example: Batch
) -> StepFn:
    pp_rank = device_mesh.get_local_rank("pp")
    if not all(s.startswith("blocks.") for s in starts):
        raise ValueError(f"stage starts {starts} are not all blocks")
    bounds = [0, *(int(s.split(".")[1]) for s in starts), spec.layers]
    first, last = pp_rank == 0, pp_rank == PP - 1
    blocks = range(bounds[pp_rank], bounds[pp_rank + 1])
    model = initial_model(spec)
    for i in blocks:
        attn = model.blocks[i].attn
        if spec.kind == "llama":  # as torchtitan: the attention's head counts made local
            attn.heads //= TP
            attn.kv_heads //= TP
        else:
            attn.forward = types.MethodType(local_head_attention, attn)
    module = Stage(model, spec.kind, blocks, first, last)
    parallelize_module(module, device_mesh["tp"], tp_plan(spec.kind, blocks, first, last))
    ids, _ = example
    micro_ids = ids[: ids.shape[0] // micro]
    rows = micro_ids.shape[0]
    # the shapes torch's static metadata takes; requires_grad on activations: their gradients
    # travel back
    inputs = micro_ids if first else torch.zeros(rows, spec.seq, spec.hidden, requires_grad=True)
    width = spec.vocab if last else spec.hidden
    output = torch.zeros(rows, spec.seq, width, requires_grad=True)
    stage = PipelineStage(
        module, pp_rank, PP, torch.device("cpu"), input_args=(inputs,), output_args=(output,),
        group=device_mesh.get_group("pp"),
    )  # fmt: skip
    opt = adamw(module.parameters())

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    schedule = Schedule1F1B(stage, micro, loss_fn=loss_fn)

    def step(batch: Batch) -> float | None:
        ids, targets = batch
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(
            *((ids,) if first else ()),
            target=targets if last else None,
            losses=losses if last else None,
            return_outputs=False,
        )
        opt.step()
        return float(torch.stack(losses).detach().mean()) if losses else None

    return step


# ---------------------------------------------------------------------------------------------
# The worker


def run_model(kind: str, args: argparse.Namespace, sides: list[str]) -> dict[str, Any]:
    spec = spec_of(kind, args)
    n = args.warmup + args.steps
    batches = batches_of(spec, n + args.profile_steps)
    built: dict[str, StepFn] = {}
    out: dict[str, Any] = {"setup": {}, "collectives": {}}
    job = None
    for side in sides:
        if side == "torch":
            continue
        dist.barrier()
        t0 = time.perf_counter()
        step, job_ = build_plait(spec, side, args.micro, batches[0])
        built[side] = step
        out["setup"][side] = time.perf_counter() - t0
        job = job or job_
        out.setdefault("starts", {})[side] = list(job_.stage_starts)
        out[f"job_{side}"] = job_
    assert job is not None, "a plait side is needed for the stage cuts"
    if "torch" in sides:
        mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
        coordinate = job.device_mesh.get_coordinate()
        assert list(mesh.get_coordinate()) == list(coordinate), "mesh layouts differ"
        dist.barrier()
        t0 = time.perf_counter()
        built["torch"] = build_torch(spec, mesh, args.micro, list(job.stage_starts), batches[0])
        out["setup"]["torch"] = time.perf_counter() - t0
    order = [s for s in sides if s in built]
    times: dict[str, list[float]] = {s: [] for s in order}
    losses: dict[str, list[float | None]] = {s: [] for s in order}
    for i in range(n):
        turn = order if i % 2 == 0 else order[::-1]
        for side in turn:
            dist.barrier()
            t0 = time.perf_counter()
            loss = built[side](batches[i])
            times[side].append(time.perf_counter() - t0)
            losses[side].append(loss)
    out["times"], out["losses"] = times, losses
    for side in order:
        j = out.pop(f"job_{side}", None)
        if j is not None:
            out["collectives"][side] = [
                {f"{ph} {k}": c for (ph, k), c in sorted(p.collectives().items())}
                for p in j.stage_programs
            ]
            out.setdefault("refused", {})[side] = [p.refused for p in j.stage_programs]
    if args.profile in built:
        step = built[args.profile]
        profiler = cProfile.Profile()
        for i in range(n, n + args.profile_steps):
            dist.barrier()
            if dist.get_rank() == 0:
                profiler.enable()
            step(batches[i])
            profiler.disable()
        if dist.get_rank() == 0:
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(50)
            out["profile"] = text.getvalue()
    del built, job
    dist.barrier()
    return out


def bench_worker(models: list[str], sides: list[str], args: argparse.Namespace) -> Any:
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return {kind: run_model(kind, args, sides) for kind in models}


# ---------------------------------------------------------------------------------------------
# The parent: table and loss check


def global_losses(per_rank: list[dict[str, Any]], side: str) -> list[float]:
    n = len(per_rank[0]["losses"][side])
    return [
        statistics.mean(r["losses"][side][i] for r in per_rank if r["losses"][side][i] is not None)
        for i in range(n)
    ]


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, str, float]:
    lines = [
        "| model | side | median ms/step | p90 ms | plait / torch | median of paired ratios "
        f"| target <= {TARGET:.2f} | step-1 loss | max rel. loss diff vs torch | setup s |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    notes = []
    worst = 0.0
    for kind in results[0]:
        per_rank = [r[kind] for r in results]
        sides = list(per_rank[0]["times"])
        n = len(per_rank[0]["times"][sides[0]])
        steps = {
            s: [max(r["times"][s][i] for r in per_rank) for i in range(args.warmup, n)]
            for s in sides
        }
        med = {s: statistics.median(v) for s, v in steps.items()}
        ref = global_losses(per_rank, "torch") if "torch" in sides else None
        for side in sides:
            ts = sorted(steps[side])
            p90 = ts[min(len(ts) - 1, math.ceil(0.9 * len(ts)) - 1)]
            mine = global_losses(per_rank, side)
            ratio = paired = met = diff = "-"
            if ref is not None and side != "torch":
                r = med[side] / med["torch"]
                ratio = f"{r:.3f}"
                pairs = zip(steps[side], steps["torch"], strict=True)
                paired = f"{statistics.median(a / b for a, b in pairs):.3f}"
                met = "met" if r <= TARGET else "missed"
                d = max(abs(a - b) / abs(b) for a, b in zip(mine, ref, strict=True))
                worst = max(worst, d)
                diff = f"{d:.1e}"
            setup = per_rank[0]["setup"].get(side, 0.0)
            lines.append(
                f"| {kind} | {LABELS[side]} | {med[side] * 1e3:.1f} | {p90 * 1e3:.1f} | {ratio} "
                f"| {paired} | {met} | {mine[0]:.6f} | {diff} | {setup:.1f} |"
            )
        info = per_rank[0]
        for side in info["collectives"]:
            stages = [
                f"stage on rank {rank}: "
                + ", ".join(f"{k} {v}" for k, v in r[kind]["collectives"][side][0].items())
                for rank, r in enumerate(results)
                if rank in (0, WORLD - 1) and r[kind]["collectives"][side]
            ]
            refused = {x for r in per_rank for x in r["refused"][side] if x is not None}
            notes.append(
                f"{kind} {side}: stages start at {info['starts'][side]}; compiled programs' "
                f"collectives a micro-batch: {'; '.join(stages)}"
                + (f"; REFUSED (eager): {refused}" if refused else "")
            )
        if "profile" in info:
            notes.append(f"cProfile of rank 0, {kind}, {args.profile}:\n{info['profile']}")
    return "\n".join(lines), "\n".join(notes), worst


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gpt", help="of llama, gpt")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"of {SIDES}")
    parser.add_argument("--no-auto", action="store_true", help="leave out plait auto")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches a step")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4, help="llama's key/value heads")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--rtol", type=float, default=1e-4, help="loss agreement")
    parser.add_argument("--profile", choices=SIDES, help="cProfile rank 0 on this side")
    parser.add_argument("--profile-steps", type=int, default=3)
    args = parser.parse_args()
    if args.profile is None:
        args.profile_steps = 0
    return args


def main() -> None:
    args = parse_args()
    models = [m for m in args.models.split(",") if m]
    sides = [s for s in args.sides.split(",") if s and not (args.no_auto and s == "auto")]
    bad = [m for m in models if m not in ("llama", "gpt")] + [s for s in sides if s not in SIDES]
    if bad:
        raise SystemExit(f"unknown {bad}")
    if args.batch % args.micro:
        raise SystemExit("--batch must divide by --micro")
    specs = {m: spec_of(m, args) for m in models}
    sizes = {m: sum(p.numel() for p in initial_model(s).parameters()) for m, s in specs.items()}
    print(
        f"torch {torch.__version__}, {WORLD} gloo processes ({args.threads} thread(s) each), "
        f"pp={PP} x tp={TP}, schedule 1f1b, "
        + "; ".join(f"{specs[m]} ({sizes[m] / 1e6:.2f} M parameters)" for m in models)
        + f"; global batch {args.batch} in {args.micro} micro-batches, AdamW lr {LR}, "
        f"{args.warmup} warm-up + {args.steps} timed steps a side, taken in turns; "
        f"{os.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    start = time.perf_counter()
    results = run_workers(bench_worker, WORLD, models, sides, args, timeout_s=1800.0)
    text, notes, worst = report(results, args)
    print()
    print(text)
    print()
    print(notes)
    print()
    print(f"largest relative loss difference plait vs torch over all steps {worst:.2e}")
    print(
        f"load average after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; total wall time "
        f"{time.perf_counter() - start:.0f} s"
    )
    if worst > args.rtol:
        raise SystemExit(f"plait's losses differ from torch's beyond rtol {args.rtol:g}")


if __name__ == "__main__":
    main()
