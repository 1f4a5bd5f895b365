"""Pipeline parallel: plait's ``job.step`` against a hand-written torch.distributed.pipelining
script of the same split, and the measured pipeline bubble against the predicted one.

One TinyGPT (by default vocab 512, seq 64, width 128, 8 heads, 8 layers: 1.72 M parameters),
AdamW, 4 gloo processes (one torch thread each), global batch ``--batch``, ``--micro`` (8)
micro-batches a step. Meshes: ``pp4`` (4 stages, dp=1), ``pp2xdp2`` (2 stages, each
replicated twice), ``pp2tp2`` (2 stages, each split over tp=2 in Megatron's layout) and
``pp2dp2z3`` (2 stages replicated twice with ZeRO-3 over dp); schedules ``gpipe``, ``1f1b``,
``interleaved_1f1b``, ``zero_bubble`` and ``zero_bubble_v`` (each with 2 stages a rank; the V:
rank r runs stages r and 2 pp - 1 - r). For each mesh and schedule, in the same processes:

* ``plait``: ``plait.parallelize(model, ParallelConfig(mode="data_parallel", mesh=...,
  micro_batches=8, schedule=...), optimizer=AdamW, loss_fn=gpt_loss, example_batch=...)``,
  then ``job.step(local batch)``;
* ``baseline``: what a user writes with ``torch.distributed.pipelining`` directly:
  ``init_device_mesh`` with the same ``pp`` / ``dp`` layout, ``pipeline(model, mb_args=(one
  micro-batch,), split_spec={name: SplitPoint.BEGINNING for the modules plait cut before
  (job.stage_starts)})``, ``pipe.build_stage`` for the same stage indices (rank + k pp), the
  same torch schedule class with a cross-entropy ``loss_fn(output, target)`` (``scale_grads``
  left at its default, True: the gradient of the mean micro-batch loss, as plait), AdamW over
  the stages' parameters, and for dp=2 one flat all-reduce of the stage's gradients over the
  dp group, divided by 2 (hand-written, the same for every schedule; DDP on the stage modules
  was not tried: torch's stage drives a DDP module through ``no_sync`` and
  ``prepare_for_backward``, and the zero-bubble schedule's split backward computes gradients
  with ``autograd.grad``, which DDP's gradient hooks do not see). ``schedule.step`` is
  called with ``return_outputs=False`` as plait calls it (else the last stage concatenates
  every micro-batch's logits, work plait does not do). The baseline's step returns the last
  stage's mean loss with no collective; plait's returns the global loss (one scalar
  all-reduce over the 4 ranks).

Stages holding tensor parallel or ZeRO (``pp2tp2``, ``pp2dp2z3``):

* ``pp2tp2``, plait: ``annotate_megatron(model, 2)`` (q, k, v and fc1 column parallel, the
  attention's out and fc2 row parallel), ``ParallelConfig(mode="semi_auto", mesh={"pp": 2,
  "tp": 2}, ...)``. Baseline: torch's tracer frontend cannot be used with tensor parallel
  (``parallelize_module`` on a ``pipe.build_stage`` module is refused: its submodules are
  traced ``InterpreterModule`` objects and ColwiseParallel takes only ``nn.Linear``;
  parallelising the model first, ``pipeline()`` cannot capture it with ``torch.export``), so
  the baseline uses torch's manual frontend, as torchtitan does: a stage module holding the
  model's own modules between plait's ``job.stage_starts`` (embeddings in the first stage,
  final norm and head in the last, TinyGPT.forward's code), ``parallelize_module`` over the
  tp sub-mesh with ``ColwiseParallel`` / ``RowwiseParallel`` in the same layout and a
  ``PrepareModuleInput`` on each attention (its input made a replicated DTensor once, so q,
  k and v share one all-reduce of its gradient: Megatron's 2 all-reduces a block forward and
  2 backward, as plait), then ``PipelineStage(module, index, stages, input_args=...,
  output_args=...)``; the schedule runs under ``implicit_replication`` (the attention adds
  its plain causal mask to DTensor scores). q, k and v keep DTensor outputs
  (``use_local_output=False``) because TinyGPT's attention splits heads by the width of its
  input, not of the local piece, so the baseline's attention runs on DTensors (DTensor's
  per-op dispatch; plait's stages run on DTensors too, through its own dispatch mode).
* ``pp2dp2z3``, plait: ``ParallelConfig(mode="data_parallel", mesh={"pp": 2, "dp": 2},
  optimizer_shard=3, optimizer_shard_threshold=0)`` (every parameter split, as FSDP2 on the
  whole stage module splits them; plait's default threshold keeps parameters under 64 KiB
  whole). Baseline: the tracer split as above, then ``fully_shard(stage.submod,
  mesh=device_mesh["dp"], reshard_after_forward=True)`` on each stage module (FSDP2 averages
  the gradients over dp itself: no hand-written all-reduce).

A combination plait refuses (``PlaitError`` at ``parallelize``) or the baseline's build
raises on is shown as refused with the reason, and its other side is not run. plait
refuses the zero-bubble schedules with ``optimizer_shard`` in the stages (and with tensor
parallel where the stages would not compile: not in these fp32 runs). For ``zero_bubble_v``
on the tracer frontend, the baseline leaves out the messages torch's stages would send from a
rank to itself in their first-step greeting (``skip_messages_to_self``: gloo cannot carry
them, the pair's socket resets; plait's stages do the same); the manual frontend's
``PipelineStage`` (``pp2tp2``) skips them itself.
Tried once by hand (torch 2.13, 4 layers, 2 steps): torch's zero-bubble schedule runs the
manual tp stages above with losses equal to 1f1b's; on FSDP2 stages it runs but the second
step's loss differs from 1f1b's by 2.5e-4 relative (plait's stated reason for refusing it:
FSDP2 reduce-scatters before the separate weight-gradient passes have run).

Both start from the same weights and take the same batches, so their losses must agree (to
``--rtol``; checked). After ``--warmup`` untimed steps each, ``--steps`` timed steps each,
interleaved (which side goes first alternates). Every step starts after a barrier and is timed
on every rank; a step's time is the slowest rank's; the table gives the median over steps and
the ratio plait / baseline (the issue's target: <= 1.05).

Measured bubble: the stage objects' ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` and the schedule's ``_compute_loss`` are wrapped (bound methods
on these instances, in this script only) with timers; a rank's busy time is their sum, its
bubble ``1 - busy / (wall time of schedule.step)``; the table gives, per step, the mean over
ranks, median over steps. The window is the schedule's step, not the whole step, so the
data-parallel all-reduce and the optimizer (outside any pipeline formula) are not counted as
bubble. Predicted bubble: ``plait.planning.timeline.bubble_seconds`` (the planner's
per-schedule closed forms; this script's own copy of them where plait has none) on the busiest
rank's measured passes per micro-batch (F: forward and loss, B: input gradient, W: weight
gradient), as a fraction of ``m (F + B + W) + bubble``. For gpipe and 1f1b that is
``(p - 1) / (m + p - 1)`` whatever the times (Huang et al. 2019; Narayanan et al. 2021), for
interleaved 1f1b ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021: the bubble divided by
``v``); for zero bubble ZB-H1's ``(p - 1) max(F, B, F + B - W) / v`` (Qi et al. 2023), which
depends on the measured F:B:W (shown, with the figure for F = B = W beside it).

Where plait's step spends its time: the functions ``PipelineJob._step`` calls (finding the
model's inputs, cutting micro-batches, the schedule, the tied-parameter sync, the gradient
mean, the optimizer and its zero_grad, the loss all-reduce) are wrapped the same way; per
phase, the time on the rank that set the step's time (the slowest), median over steps (the
baseline's phases likewise). "CPU share" is the process CPU time of the 4 ranks inside
``schedule.step`` over (CPU cores x its wall time): how much of the machine the pipeline got
(4 processes share 2 cores here, so a rank that waits lends its core to another; other
tenants' load lowers it too). "CPU s/step" is the 4 ranks' process CPU time of a whole step.

Run from the repository root: ``.venv/bin/python bench/pipeline.py`` (CPU, 4 gloo processes;
about 3 minutes on 2 shared cores for ``pp4`` and ``pp2xdp2``, the two other meshes add about
as much again). ``--meshes pp4 --schedules 1f1b --steps 4`` for a short run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    SplitPoint,
    pipeline,
)
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

import plait
from plait import ParallelConfig
from plait.comm import pipeline as pp_comm
from plait.errors import PlaitError
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss, token_batches
from plait.runtime.pipeline import job as pp_job
from plait.testing import run_workers

WORLD = 4
LR = 1e-3
TARGET = 1.05
CORES = os.cpu_count() or 1


@dataclass(frozen=True)
class Mesh:
    """One configuration of the 4 processes (a row group of the table)."""

    axes: dict[str, int]
    label: str
    tp: bool = False
    """Tensor parallel in the stages: plait semi_auto with Megatron annotations; the baseline
    on torch's manual stages with parallelize_module."""
    zero: int | None = None
    """plait's optimizer_shard (threshold 0); the baseline's fully_shard over dp."""


MESHES: dict[str, Mesh] = {
    "pp4": Mesh({"pp": 4}, "pp=4"),
    "pp2xdp2": Mesh({"pp": 2, "dp": 2}, "pp=2 x dp=2"),
    "pp2tp2": Mesh({"pp": 2, "tp": 2}, "pp=2 x tp=2", tp=True),
    "pp2dp2z3": Mesh({"pp": 2, "dp": 2}, "pp=2 x dp=2 ZeRO-3", zero=3),
}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v")
TORCH_SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zero_bubble_v": ScheduleZBVZeroBubble,
}
LOOPED = ("gpipe", "1f1b")  # one stage a rank
VIRTUAL = 2  # stages a rank for the interleaved and zero-bubble schedules

Batch = tuple[torch.Tensor, torch.Tensor]
BUSY = ("forward", "backward", "weight", "loss")
PLAIT_PHASES = (
    "zero_grad",
    "inputs",
    "split",
    "schedule",
    "ties",
    "grad mean",
    "optimizer",
    "loss all-reduce",
)
BASE_PHASES = ("zero_grad", "schedule", "grad mean", "optimizer")


# ---------------------------------------------------------------------------------------------
# Timers: wrapped callables add their wall time (and CPU time) to one clock per process.


class Clock:
    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        """the calling thread's CPU time"""
        self.process_cpu: dict[str, float] = {}
        """the process's CPU time (gloo's threads included)"""

    def reset(self) -> None:
        self.wall, self.cpu, self.process_cpu = {}, {}, {}

    def add(self, label: str, wall: float, cpu: float = 0.0, process_cpu: float = 0.0) -> None:
        self.wall[label] = self.wall.get(label, 0.0) + wall
        self.cpu[label] = self.cpu.get(label, 0.0) + cpu
        self.process_cpu[label] = self.process_cpu.get(label, 0.0) + process_cpu

    def timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(
                    label,
                    time.perf_counter() - t0,
                    time.thread_time() - c0,
                    time.process_time() - p0,
                )

        wrapper._bench_label = label  # type: ignore[attr-defined]
        return wrapper

    def wrap(self, obj: Any, name: str, label: str) -> None:
        """Replace ``obj.name`` (a module function or an instance's bound method) by a timed
        one, once."""
        fn = getattr(obj, name)
        if getattr(fn, "_bench_label", None) is None:
            setattr(obj, name, self.timed(fn, label))


CLOCK = Clock()


def wrap_pipeline(stages: list[Any], schedule: Any, optimizer: torch.optim.Optimizer) -> None:
    """Time the stages' compute, the schedule's loss and step, and the optimizer's step."""
    for stage in stages:
        CLOCK.wrap(stage, "forward_one_chunk", "forward")
        CLOCK.wrap(stage, "backward_one_chunk", "backward")
        CLOCK.wrap(stage, "backward_weight_one_chunk", "weight")
    CLOCK.wrap(schedule, "_compute_loss", "loss")
    CLOCK.wrap(schedule, "step", "schedule")
    CLOCK.wrap(optimizer, "step", "optimizer")
    CLOCK.wrap(optimizer, "zero_grad", "zero_grad")


def wrap_plait_phases() -> None:
    """The functions PipelineJob._step calls, looked up at call time (so patchable here)."""
    CLOCK.wrap(pp_job, "model_inputs", "inputs")
    CLOCK.wrap(pp_job, "split_micro_batches", "split")
    CLOCK.wrap(pp_comm, "mean_over_group", "grad mean")
    CLOCK.wrap(pp_comm, "start_sum_over_world", "loss all-reduce")  # its start: the wait hides


# ---------------------------------------------------------------------------------------------
# Model, data, optimizer (identical in every process).


def initial_model(cfg: GPTConfig) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(cfg)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def local_slice(batch: Batch, dp: int, dp_rank: int) -> Batch:
    ids, targets = batch
    return ids.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]


def _closed_form_bubble_seconds(
    schedule: str, p: int, forward: float, backward: float, weight: float, v: int
) -> float:
    """The closed forms, for when plait.planning has none: (p - 1)(F + B + W) for gpipe and
    1f1b (Huang et al. 2019; Narayanan et al. 2021), divided by v for interleaved 1f1b
    (Narayanan et al. 2021), ZB-H1's (p - 1) max(F, B, F + B - W) / v for zero bubble (Qi et
    al. 2023); B here is the input-gradient pass, ``backward - weight``."""
    f, b, w = forward, backward - weight, weight
    if schedule in LOOPED:
        return (p - 1) * (f + b + w)
    if schedule == "interleaved_1f1b":
        return (p - 1) * (f + b + w) / v
    return (p - 1) * max(f, b, f + b - w) / v


try:  # the planner's per-schedule bubble (plait/planning/timeline.py), where there is one
    from plait.planning.timeline import bubble_seconds as _bubble_seconds

    PREDICTOR = "plait.planning.timeline.bubble_seconds"
except ImportError:  # pragma: no cover - older plait
    _bubble_seconds = None
    PREDICTOR = "the closed forms in bench/pipeline.py (plait.planning has no bubble function)"


def predicted_bubble(
    schedule: str, p: int, m: int, v: int, forward: float, backward: float, weight: float
) -> float:
    """The predicted bubble as a fraction of the schedule's time on a rank whose passes of one
    micro-batch through its share of the model take ``forward``, ``backward`` (whole, weight
    gradient included) and ``weight`` seconds: bubble / (m (F + B) + bubble). For gpipe and
    1f1b that is (p - 1) / (m + p - 1) whatever the times, (p - 1) / (v m + p - 1) for
    interleaved 1f1b."""
    v = 1 if schedule in LOOPED else v
    if _bubble_seconds is not None:
        bubble = _bubble_seconds(schedule, p, forward, backward, weight, v)
    else:
        bubble = _closed_form_bubble_seconds(schedule, p, forward, backward, weight, v)
    return bubble / (m * (forward + backward) + bubble)


# ---------------------------------------------------------------------------------------------
# The two sides: each builds a step function on this rank.

StepFn = Callable[[Batch], float | None]


def build_plait(
    cfg: GPTConfig, mesh: Mesh, schedule: str, micro: int, example: Batch
) -> tuple[StepFn, Any]:
    model = initial_model(cfg)
    if mesh.tp:  # Megatron's layout by plait.shard marks, run in mode semi_auto
        annotate_megatron(model, mesh.axes["tp"])
    zero = {"optimizer_shard": mesh.zero, "optimizer_shard_threshold": 0} if mesh.zero else {}
    config = ParallelConfig(
        mode="semi_auto" if mesh.tp else "data_parallel",
        mesh=dict(mesh.axes),
        micro_batches=micro,
        schedule=schedule,
        **zero,
    )
    job = plait.parallelize(model, config, optimizer=adamw, loss_fn=gpt_loss, example_batch=example)
    wrap_pipeline(job.stages, job._schedule, job.optimizer)
    if hasattr(job, "_sync_ties"):  # tied parameters across stages (none in TinyGPT)
        CLOCK.wrap(job, "_sync_ties", "ties")
    return job.step, job


class GPTStage(nn.Module):
    """One stage of TinyGPT for torch's manual pipeline frontend: the model's own modules of
    that stage (the embeddings in the first, the final norm and head in the last), under the
    model's parameter names, and TinyGPT.forward's code for them."""

    def __init__(self, model: TinyGPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.tok = model.tok if first else None
        self.pos = model.pos if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.ln = model.ln if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.ln is not None and self.head is not None:
            x = self.head(self.ln(x))
        return x


def megatron_plan(blocks: range) -> dict[str, Any]:
    """Megatron's layout with torch's tensor-parallel styles: q, k, v and fc1 column parallel,
    the attention's out and fc2 row parallel (their partial sums all-reduced). The attention's
    input enters replicated once, so q, k and v share one all-reduce of its gradient; q, k and
    v stay DTensors, as TinyGPT's attention splits heads by the model's (global) shapes."""
    plan: dict[str, Any] = {}
    for i in blocks:
        b = f"blocks.{i}"
        plan[f"{b}.attn"] = PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Replicate(),),
            use_local_output=False,
        )
        for name in ("q", "k", "v"):
            plan[f"{b}.attn.{name}"] = ColwiseParallel(use_local_output=False)
        plan[f"{b}.attn.out"] = RowwiseParallel()
        plan[f"{b}.fc1"] = ColwiseParallel()
        plan[f"{b}.fc2"] = RowwiseParallel()
    return plan


def manual_tp_stages(
    cfg: GPTConfig,
    model: TinyGPT,
    device_mesh: DeviceMesh,
    indices: list[int],
    count: int,
    starts: list[str],
    micro_ids: torch.Tensor,
) -> list[Any]:
    """Stages cut at plait's ``starts`` by hand (torch's tracer refuses either order: its
    traced stage modules are not nn.Linear, which ColwiseParallel requires, and torch.export
    cannot capture a model parallelised first), each parallelised over tp, then
    ``PipelineStage`` with its input and output shapes given."""
    if not all(s.startswith("blocks.") for s in starts):
        raise ValueError(f"stage starts {starts} are not all TinyGPT blocks")
    bounds = [0, *(int(s.split(".")[1]) for s in starts), cfg.layers]
    rows, seq = micro_ids.shape
    stages = []
    for i in indices:
        first, last = i == 0, i == count - 1
        blocks = range(bounds[i], bounds[i + 1])
        module = GPTStage(model, blocks, first, last)
        parallelize_module(module, device_mesh["tp"], megatron_plan(blocks))
        # the shapes torch's static metadata takes; requires_grad on the activations says
        # that their gradients travel back (else the stage before never receives them)
        inputs = micro_ids if first else torch.zeros(rows, seq, cfg.width, requires_grad=True)
        width = cfg.vocab if last else cfg.width
        output = torch.zeros(rows, seq, width, requires_grad=True)
        stages.append(
            PipelineStage(
                module,
                i,
                count,
                torch.device("cpu"),
                input_args=(inputs,),
                output_args=(output,),
                group=device_mesh.get_group("pp"),
            )
        )
    return stages


def skip_messages_to_self(stage: Any) -> None:
    """torch's traced stages (``pipe.build_stage``) greet their neighbour stages on the first
    step with a send and a receive each way, also where the neighbour is on the same rank (the
    V's turn); gloo cannot send from a rank to itself (the pair's socket resets). A user on
    gloo must leave those messages out, as here (plait's stages do the same); the turn's
    activations and gradients are handed over in memory by torch's schedule anyway."""
    ops = stage._get_init_p2p_neighbors_ops
    me = dist.get_rank(stage.group)
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in ops() if op.group_peer != me]


def build_baseline(
    cfg: GPTConfig,
    mesh: Mesh,
    device_mesh: DeviceMesh,
    schedule: str,
    micro: int,
    starts: list[str],
    local_example: Batch,
) -> tuple[StepFn, list[int]]:
    """The hand-written torch.distributed.pipelining script (see the module docstring)."""
    pp = device_mesh.size(0)
    dp = mesh.axes.get("dp", 1)
    pp_rank = device_mesh.get_local_rank("pp")
    virtual = 1 if schedule in LOOPED else VIRTUAL
    if schedule == "zero_bubble_v":  # the V: rank r runs stages r and 2 pp - 1 - r
        indices = [pp_rank, 2 * pp - 1 - pp_rank]
    else:
        indices = [pp_rank + k * pp for k in range(virtual)]

    model = initial_model(cfg)
    ids, _ = local_example
    micro_ids = ids[: ids.shape[0] // micro]
    if mesh.tp:
        stages = manual_tp_stages(cfg, model, device_mesh, indices, pp * virtual, starts, micro_ids)
        modules = [s.submod for s in stages]
    else:
        pipe = pipeline(
            model,
            mb_args=(micro_ids,),
            split_spec={name: SplitPoint.BEGINNING for name in starts},
        )
        stages = [
            pipe.build_stage(i, torch.device("cpu"), device_mesh.get_group("pp")) for i in indices
        ]
        if schedule == "zero_bubble_v":
            for stage in stages:
                skip_messages_to_self(stage)
        modules = [s.submod for s in stages]
        if mesh.zero:  # FSDP2 over the dp sub-mesh, on each stage module
            for m in modules:
                fully_shard(m, mesh=device_mesh["dp"], reshard_after_forward=mesh.zero == 3)
    params = [p for m in modules for p in m.parameters()]
    opt = adamw(params)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    cls = TORCH_SCHEDULES[schedule]
    sched = cls(stages[0] if schedule in LOOPED else stages, micro, loss_fn=loss_fn)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    wrap_pipeline(stages, sched, opt)
    average = dp > 1 and not mesh.zero  # FSDP2 averages the gradients over dp itself
    dp_group = device_mesh.get_group("dp") if average else None

    def mean_over_dp() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    grad_mean = CLOCK.timed(mean_over_dp, "grad mean")
    # TinyGPT's attention adds its causal mask (a plain tensor) to DTensor scores
    replicated = implicit_replication if mesh.tp else nullcontext

    def step(batch: Batch) -> float | None:
        ids, targets = batch
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        with replicated():
            sched.step(
                *((ids,) if first else ()),
                target=targets if last else None,
                losses=losses if last else None,
                return_outputs=False,
            )
        if average:
            grad_mean()
        opt.step()
        return float(torch.stack(losses).detach().mean()) if losses else None

    return step, indices


# ---------------------------------------------------------------------------------------------
# The worker: every mesh and schedule in the same 4 processes.


def timed_step(step: StepFn, batch: Batch) -> dict[str, Any]:
    dist.barrier()
    CLOCK.reset()
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    loss = step(batch)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "step": wall,
        "step_cpu": cpu,
        "step_thread_cpu": time.thread_time() - m0,
        "loss": loss,
        "wall": dict(CLOCK.wall),
        "cpu": dict(CLOCK.cpu),
        "process_cpu": dict(CLOCK.process_cpu),
    }


def attempt(build: Callable[[], Any], refusals: tuple[type[BaseException], ...]) -> Any:
    """``build()``, or the refusal one of the ranks met (every rank learns it: one
    all_gather_object, so all of them skip the case together). Returns (result, None) or
    (None, "ErrorType: message")."""
    result, error = None, None
    try:
        result = build()
    except refusals as e:
        error = f"{type(e).__name__}: {e}"
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    refused = next((e for e in errors if e is not None), None)
    return (None, refused) if refused is not None else (result, None)


def run_case(
    cfg: GPTConfig,
    mesh_key: str,
    schedule: str,
    args: argparse.Namespace,
    meshes: dict[str, DeviceMesh],
) -> dict[str, Any]:
    mesh = MESHES[mesh_key]
    dp = mesh.axes.get("dp", 1)
    inner = "tp" if mesh.tp else "dp"  # the baseline mesh's second dim
    batches = token_batches(cfg, args.batch, args.warmup + args.steps)
    t0 = time.perf_counter()
    built, refused = attempt(
        lambda: build_plait(cfg, mesh, schedule, args.micro, batches[0]), (PlaitError,)
    )
    if refused is not None:  # the baseline is not run (a failure inside a step would hang)
        return {"refused": f"by plait: {refused}"}
    plait_step, job = built
    plait_setup = time.perf_counter() - t0
    coordinate = job.device_mesh.get_coordinate()
    dp_rank = int(coordinate[job.mesh.axis_index("dp")]) if dp > 1 else 0
    if mesh_key not in meshes:
        meshes[mesh_key] = init_device_mesh(
            "cpu", (mesh.axes["pp"], mesh.axes.get(inner, 1)), mesh_dim_names=("pp", inner)
        )
    device_mesh = meshes[mesh_key]
    for axis in mesh.axes:
        mine = int(coordinate[job.mesh.axis_index(axis)])
        assert device_mesh.get_local_rank(axis) == mine, "baseline mesh layout differs from plait's"
    local = [local_slice(b, dp, dp_rank) for b in batches]
    starts = job.stage_starts
    dist.barrier()
    t0 = time.perf_counter()
    built, refused = attempt(
        lambda: build_baseline(cfg, mesh, device_mesh, schedule, args.micro, starts, local[0]),
        (Exception,),
    )
    if refused is not None:
        del job, plait_step
        gc.collect()
        dist.barrier()
        return {"refused": f"by torch (the baseline): {refused}"}
    base_step, indices = built
    base_setup = time.perf_counter() - t0
    assert indices == job.stage_indices, (indices, job.stage_indices)
    out: dict[str, Any] = {
        "plait": [],
        "baseline": [],
        "setup": {"plait": plait_setup, "baseline": base_setup},
        "starts": job.stage_starts,
        "indices": indices,
    }
    sides = {"plait": plait_step, "baseline": base_step}
    for i in range(args.warmup + args.steps):
        order = ("plait", "baseline") if i % 2 == 0 else ("baseline", "plait")
        for side in order:
            out[side].append(timed_step(sides[side], local[i]))
    del job, plait_step, base_step, sides
    gc.collect()
    dist.barrier()
    return out


def bench_worker(cfg: GPTConfig, cases: list[tuple[str, str]], args: argparse.Namespace) -> Any:
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)
    wrap_plait_phases()
    meshes: dict[str, DeviceMesh] = {}
    return {f"{m}/{s}": run_case(cfg, m, s, args, meshes) for m, s in cases}


# ---------------------------------------------------------------------------------------------
# The parent: tables and the loss check.


def measured(per_rank: list[dict[str, Any]], side: str, warmup: int) -> dict[str, Any]:
    """Per measured step: the slowest rank's step time and phases (the rank that sets the
    step's time), the bubble of every rank and their mean; medians over steps."""
    n = len(per_rank[0][side])
    steps, bubbles, step_bubbles, utilisation, before_loss = [], [], [], [], []
    step_cpu, bookkeeping = [], []
    rank_bubbles: list[list[float]] = [[] for _ in per_rank]
    phases: dict[str, list[float]] = {}
    passes: list[dict[str, list[float]]] = [{} for _ in per_rank]
    labels = {k for r in per_rank for s in r[side] for k in s["wall"]} - set(BUSY)
    for i in range(warmup, n):
        records = [r[side][i] for r in per_rank]
        busy = [sum(r["wall"].get(k, 0.0) for k in BUSY) for r in records]
        window = [r["wall"]["schedule"] for r in records]
        per_rank_bubble = [1 - b / w for b, w in zip(busy, window, strict=True)]
        for mine, value in zip(rank_bubbles, per_rank_bubble, strict=True):
            mine.append(value)
        for mine, r in zip(passes, records, strict=True):
            for kind in BUSY:
                mine.setdefault(kind, []).append(r["wall"].get(kind, 0.0))
        bubbles.append(statistics.mean(per_rank_bubble))
        # the schedule's own work between the passes (Python, posting sends and receives):
        # the main thread's CPU time in schedule.step outside the passes, share of the window
        bookkeeping.append(
            statistics.mean(
                (r["cpu"]["schedule"] - sum(r["cpu"].get(k, 0.0) for k in BUSY)) / w
                for r, w in zip(records, window, strict=True)
            )
        )
        step_bubbles.append(
            statistics.mean(1 - b / r["step"] for b, r in zip(busy, records, strict=True))
        )
        step_cpu.append(sum(r["step_cpu"] for r in records))
        cpu = sum(r["process_cpu"]["schedule"] for r in records)
        utilisation.append(cpu / (min(CORES, WORLD) * max(window)))
        # when the last rank reached plait's loss all-reduce (the step without it)
        before_loss.append(max(r["step"] - r["wall"].get("loss all-reduce", 0.0) for r in records))
        slowest = max(range(len(records)), key=lambda k: records[k]["step"])
        record = records[slowest]
        steps.append(record["step"])
        for label in labels:
            phases.setdefault(label, []).append(record["wall"].get(label, 0.0))
        phases.setdefault("busy", []).append(busy[slowest])
        outside = sum(v for k, v in record["wall"].items() if k not in BUSY)
        phases.setdefault("other", []).append(record["step"] - outside)
        # the main thread's CPU time outside the phases, mean over ranks (not preemption)
        other_cpu = [
            r["step_thread_cpu"] - sum(v for k, v in r["cpu"].items() if k not in BUSY)
            for r in records
        ]
        phases.setdefault("other CPU", []).append(statistics.mean(other_cpu))
    busiest = max(passes, key=lambda d: sum(statistics.median(v) for v in d.values()))
    per_pass = {k: statistics.median(v) for k, v in busiest.items()}
    return {
        "passes": per_pass,
        "steps": steps,
        "loss_all_reduce_cost": statistics.median(
            a - b for a, b in zip(steps, before_loss, strict=True)
        ),
        "step": statistics.median(steps),
        "cpu": statistics.median(step_cpu),
        "bubble": statistics.median(bubbles),
        "bookkeeping": statistics.median(bookkeeping),
        "rank_bubbles": [statistics.median(b) for b in rank_bubbles],
        "step_bubble": statistics.median(step_bubbles),
        "utilisation": statistics.median(utilisation),
        "phases": {k: statistics.median(v) for k, v in phases.items()},
    }


def losses(per_rank: list[dict[str, Any]], side: str) -> list[float]:
    """Per step, the global loss: plait's return value; the mean of the baseline's last
    stages' (one per dp replica)."""
    n = len(per_rank[0][side])
    out = []
    for i in range(n):
        values = [r[side][i]["loss"] for r in per_rank if r[side][i]["loss"] is not None]
        out.append(statistics.mean(values))
    return out


def short_reason(reason: str) -> str:
    """A refusal for the table: who refused, the error's type and what it refuses, without
    plait's echo of the config and its advice (the details below the table give it whole)."""
    who, _, rest = reason.partition(": ")
    kind, _, text = rest.partition(": ")
    text = re.sub(r"^ParallelConfig\(.*?\) with pipeline_stages=\d+: ", "", text)
    text = text.split("; use ")[0].split(" with pipeline parallel is not built")[0]
    return f"{who} ({kind}): {text[:240]}"


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, str, float]:
    lines = [
        "| config | schedule | plait ms | baseline ms | plait / baseline | median of paired "
        f"ratios | target <= {TARGET:.2f} | CPU s/step plait / baseline (ratio) | measured bubble plait / baseline | predicted bubble "
        "| bubble of whole step plait / baseline | CPU share in schedule plait / baseline |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    detail = []
    worst = 0.0
    ratios: list[float] = []
    paired_ratios: list[float] = []
    cpu_ratios: list[float] = []
    for key in results[0]:
        mesh_key, schedule = key.split("/")
        per_rank = [r[key] for r in results]
        mesh = MESHES[mesh_key].label
        if "refused" in per_rank[0]:
            reason = per_rank[0]["refused"]
            lines.append(f"| {mesh} | {schedule} | refused {short_reason(reason)} |" + " - |" * 9)
            detail.append(f"{mesh} {schedule}: refused {reason}")
            continue
        p = measured(per_rank, "plait", args.warmup)
        b = measured(per_rank, "baseline", args.warmup)
        pp = MESHES[mesh_key].axes["pp"]
        m = args.micro
        t = p["passes"]  # the busiest rank's passes in a step (its whole share of the model)
        forward, weight = (t["forward"] + t["loss"]) / m, t["weight"] / m
        backward = t["backward"] / m + weight
        pred = predicted_bubble(schedule, pp, m, VIRTUAL, forward, backward, weight)
        predicted = f"{pred:.3f}"
        if schedule in ("zero_bubble", "zero_bubble_v"):  # also with F = B = W (the planner's)
            even = predicted_bubble(schedule, pp, m, VIRTUAL, 1.0, 2.0, 1.0)
            fbw = f"1:{(backward - weight) / forward:.1f}:{weight / forward:.1f}"
            predicted += f" (measured F:B:W {fbw}; F=B=W: {even:.3f})"
        ratio = p["step"] / b["step"]
        paired = statistics.median(x / y for x, y in zip(p["steps"], b["steps"], strict=True))
        met = "met" if ratio <= TARGET else "missed"
        lines.append(
            f"| {mesh} | {schedule} | {p['step'] * 1e3:.1f} | {b['step'] * 1e3:.1f} "
            f"| {ratio:.3f} | {paired:.3f} | {met} "
            f"| {p['cpu']:.2f} / {b['cpu']:.2f} ({p['cpu'] / b['cpu']:.3f}) | {p['bubble']:.3f} / {b['bubble']:.3f} | {predicted} "
            f"| {p['step_bubble']:.3f} / {b['step_bubble']:.3f} "
            f"| {p['utilisation']:.2f} / {b['utilisation']:.2f} |"
        )
        plait_l, base_l = losses(per_rank, "plait"), losses(per_rank, "baseline")
        diff = max(abs(x - y) / abs(y) for x, y in zip(plait_l, base_l, strict=True))
        worst = max(worst, diff)
        ratios.append(ratio)
        paired_ratios.append(paired)
        cpu_ratios.append(p["cpu"] / b["cpu"])

        def fmt(phases: dict[str, float], order: tuple[str, ...]) -> str:
            parts = [f"{k} {phases.get(k, 0.0) * 1e3:.1f}" for k in order]
            other = f"other {phases['other'] * 1e3:.1f} (CPU {phases['other CPU'] * 1e3:.1f})"
            return ", ".join([*parts, other])

        setup = per_rank[0]["setup"]
        detail.append(
            f"{mesh} {schedule} (stages start at {', '.join(per_rank[0]['starts'])}; setup "
            f"plait {setup['plait']:.1f} s, baseline {setup['baseline']:.1f} s; max rel. loss "
            f"diff {diff:.1e}):\n"
            f"  plait    {p['step'] * 1e3:.1f} ms: {fmt(p['phases'], PLAIT_PHASES)}; "
            f"busy {p['phases']['busy'] * 1e3:.1f}; bubble by rank "
            f"{' '.join(f'{x:.2f}' for x in p['rank_bubbles'])} (of which the schedule's own CPU "
            f"work between passes {p['bookkeeping']:.2f}); the loss all-reduce adds "
            f"{p['loss_all_reduce_cost'] * 1e3:.1f} to the slowest rank's step\n"
            f"  baseline {b['step'] * 1e3:.1f} ms: {fmt(b['phases'], BASE_PHASES)}; "
            f"busy {b['phases']['busy'] * 1e3:.1f}; bubble by rank "
            f"{' '.join(f'{x:.2f}' for x in b['rank_bubbles'])} (schedule's own CPU "
            f"{b['bookkeeping']:.2f})"
        )
    if len(ratios) > 1:
        detail.append(
            f"over the {len(ratios)} configurations, geometric mean of plait / baseline "
            f"{statistics.geometric_mean(ratios):.3f}, of the medians of paired ratios "
            f"{statistics.geometric_mean(paired_ratios):.3f}, of the CPU ratios "
            f"{statistics.geometric_mean(cpu_ratios):.3f}"
        )
    return "\n".join(lines), "\n".join(detail), worst


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default=",".join(MESHES), help=f"of {list(MESHES)}")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"of {SCHEDULES}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches a step")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--rtol", type=float, default=1e-4, help="loss agreement")
    parser.add_argument("--raw", help="also write every rank's records to this JSON file")
    parser.add_argument("--from-raw", help="report from a JSON file of --raw instead of running")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    meshes = [m for m in args.meshes.split(",") if m]
    schedules = [s for s in args.schedules.split(",") if s]
    bad = [m for m in meshes if m not in MESHES] + [s for s in schedules if s not in SCHEDULES]
    if bad:
        raise SystemExit(f"unknown mesh or schedule {bad}; known: {list(MESHES)}, {SCHEDULES}")
    if args.batch % (2 * args.micro):
        raise SystemExit(f"--batch must divide by dp x micro-batches = {2 * args.micro}")
    cfg = GPTConfig(args.vocab, args.seq, args.width, args.heads, args.layers)
    params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    cases = [(m, s) for m in meshes for s in schedules]
    print(
        f"torch {torch.__version__}, {WORLD} gloo processes ({args.threads} thread(s) each), "
        f"{cfg} ({params / 1e6:.2f} M parameters), global batch {args.batch}, {args.micro} "
        f"micro-batches, AdamW lr {LR}, {args.warmup} warm-up + {args.steps} timed steps per "
        f"side; {CORES} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    start = time.perf_counter()
    if args.from_raw:
        with open(args.from_raw) as f:
            results = json.load(f)
    else:
        results = run_workers(bench_worker, WORLD, cfg, cases, args, timeout_s=900.0)
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump(results, f)
    text, detail, worst = report(results, args)
    print()
    print(text)
    print()
    print(
        "Per phase on the rank that set each step's time, median over steps, ms (busy: forward "
        "+ backward + weight + loss chunks, inside the schedule; other: the step outside the "
        "phases named, with the main thread's CPU time in it, mean over ranks), and each "
        "rank's bubble (median over steps):"
    )
    print(detail)
    print()
    print(f"predicted bubble by {PREDICTOR}, on the busiest rank's measured passes")
    print()
    print(f"largest relative loss difference plait vs baseline over all steps {worst:.2e}")
    print(
        f"load average after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; total wall time "
        f"{time.perf_counter() - start:.1f} s"
    )
    if worst > args.rtol:
        raise SystemExit(f"plait's losses differ from the baseline's beyond rtol {args.rtol:g}")


if __name__ == "__main__":
    main()
