"""Speed of plait's run paths against torch's own, side by side in one run (issue 12, item 4).

One TinyGPT (same initial weights, same global batches, AdamW) trained on 4 gloo processes in
six ways, and an MLP in three (below), that take turns step by step in the same processes, so a
busy spell of the machine hits all of them:

* data parallel over 4 ranks:
  (a) ``torch DDP``: ``nn.parallel.DistributedDataParallel`` with its defaults (the baseline
      of b and c), plus one scalar all-reduce for the global loss, which plait's ``step``
      returns;
  (b) ``plait data_parallel``: ``ParallelConfig(mode="data_parallel")``, the plain-tensor path;
  (c) ``plait auto dp=4``: ``ParallelConfig(mode="auto", mesh={"dp": 4})``, the compiled
      per-rank program (``plait/runtime/program/compile.py``; its gradient buckets and loss value
      all-reduced inside it);
* Megatron tensor parallel on a dp=2 x tp=2 mesh:
  (d) ``torch TP + DDP``, hand-written (the baseline of e and f): ``parallelize_module`` on the
      tp sub-mesh with ``ColwiseParallel`` for attn.q/k/v and fc1 and ``RowwiseParallel`` for
      attn.out and fc2 (attention reshaped with the local head count), then torch's TP+DDP
      recipe (``_pre_dp_module_transform``, ``DistributedDataParallel`` over the dp group);
  (e) ``plait semi_auto``: ``annotate_megatron(model, 2)``, ``mode="semi_auto"``;
  (f) ``plait auto``: the same annotations, ``mode="auto"`` on the same mesh (the plan seeded
      by the annotations, run as the compiled program).

With ``--only``: (g) and (h) are (b) and (e) with ``compile=True``; (i) is the dp-only plan
(``mode="semi_auto", mesh={"dp": 4}``, no annotation) run as the per-rank program without
torch.compile; (j) is (f) with ``compile=True``.

An MLP of large matrix products (``plait.models.MLP``, ``--mlp-layers`` linear layers of
``--mlp-width`` = 1024 features, GELU between, MSE loss, AdamW, global batch ``--mlp-batch``)
is trained the three data-parallel ways in the same turns (issue 30, item 4): (k) torch DDP
(the baseline of l and m), (l) plait data_parallel, (m) plait auto on mesh dp=4, the program.

Each case warms up, then every step is timed on every rank after a barrier; rank 0's median
wall time and median process CPU time per step are reported, with the ratio to the case's
baseline. The script checks that every case's global loss at every measured step equals that of
torch DDP on the same model to ``--rtol`` (relative), so the cases do equal work, and fails
otherwise.
``--profile CASE`` adds a cProfile of rank 0 over a few extra steps of one case.

Run from the repository root: ``.venv/bin/python bench/one_path.py``.
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
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

import plait
from plait import ParallelConfig
from plait.models import (
    MLP,
    GPTConfig,
    TinyGPT,
    annotate_megatron,
    gpt_loss,
    mlp_loss,
    token_batches,
)
from plait.testing import run_workers

WORLD = 4
DP, TP = 2, 2
LR = 1e-3

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[Batch], float]
Built = tuple[StepFn, list[Batch], str | None]
"""A case on this rank: its step, its slice of every global batch, its program's collectives."""
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """One model to train: how to build it (same initial weights in every process), its loss
    and the global batches every case of it trains on."""

    model: Callable[[], nn.Module]
    loss: LossFn
    batches: list[Batch]


@dataclass(frozen=True)
class Case:
    key: str
    """What --only and --profile select."""
    name: str
    baseline: str
    """The key of the case this one is compared with (itself for a baseline)."""
    model: str = "gpt"
    """The workload it trains: "gpt" or "mlp"."""

    @property
    def reference(self) -> str:
        """The case whose losses this one's must equal: torch DDP on the same model."""
        return "mlp_ddp" if self.model == "mlp" else "ddp"


CASES = [
    Case("ddp", "(a) torch DDP, dp=4", "ddp"),
    Case("dp", "(b) plait data_parallel, dp=4", "ddp"),
    Case("auto_dp", "(c) plait auto, mesh dp=4", "ddp"),
    Case("tp", "(d) torch TP + DDP (hand-written), dp=2 x tp=2", "tp"),
    Case("semi_auto", "(e) plait semi_auto Megatron, dp=2 x tp=2", "tp"),
    Case("auto_tp", "(f) plait auto Megatron, dp=2 x tp=2", "tp"),
    Case("dp_compiled", "(g) plait data_parallel, dp=4, compile=True", "ddp"),
    Case("semi_auto_compiled", "(h) plait semi_auto Megatron, compile=True", "tp"),
    Case("dp_plan", "(i) plait dp-only plan (semi_auto, mesh dp=4), the program", "ddp"),
    Case("auto_tp_compiled", "(j) plait auto Megatron, compile=True", "tp"),
    Case("mlp_ddp", "(k) MLP: torch DDP, dp=4", "mlp_ddp", "mlp"),
    Case("mlp_dp", "(l) MLP: plait data_parallel, dp=4", "mlp_ddp", "mlp"),
    Case("mlp_auto_dp", "(m) MLP: plait auto, mesh dp=4", "mlp_ddp", "mlp"),
]
DEFAULT_CASES = (
    "ddp",
    "dp",
    "auto_dp",
    "tp",
    "semi_auto",
    "auto_tp",
    "mlp_ddp",
    "mlp_dp",
    "mlp_auto_dp",
)
"""Without --only: the compiled cases pay inductor's compilation (tens of seconds each)."""
BY_KEY = {c.key: c for c in CASES}


# ---------------------------------------------------------------------------------------------
# Model, data, optimizer (identical in every process).


def gpt_workload(cfg: GPTConfig, batch: int, n: int) -> Workload:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return TinyGPT(cfg)

    return Workload(model, gpt_loss, token_batches(cfg, batch, n))


def mlp_workload(width: int, layers: int, batch: int, n: int) -> Workload:
    """``layers`` linear layers of ``width`` features (GELU between), regression on random
    inputs and targets (seed 1)."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return MLP((width,) * (layers + 1))

    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen))
        for _ in range(n)
    ]
    return Workload(model, mlp_loss, batches)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def chunk(batch: Batch, parts: int, index: int) -> Batch:
    ids, targets = batch
    return ids.chunk(parts)[index], targets.chunk(parts)[index]


def global_loss(loss: torch.Tensor, group: Any, size: int) -> float:
    """The mean of the data-parallel ranks' losses, as plait's ``step`` returns it."""
    value = loss.detach().clone()
    dist.all_reduce(value, group=group)
    return value.item() / size


# ---------------------------------------------------------------------------------------------
# The cases: each builds its step function and this rank's slice of every global batch.


def torch_ddp(work: Workload) -> Built:
    model = nn.parallel.DistributedDataParallel(work.model())
    opt = adamw(model.parameters())

    def step(batch: Batch) -> float:
        opt.zero_grad(set_to_none=True)
        loss = work.loss(model, batch)
        loss.backward()
        opt.step()
        return global_loss(loss, None, WORLD)

    rank = dist.get_rank()
    return step, [chunk(b, WORLD, rank) for b in work.batches], None


def program_collectives(job: plait.Job) -> str | None:
    """The compiled program's collectives by kind and mesh axis (None: the job has none)."""
    program = job.program
    if program is None:
        return None
    counts: dict[tuple[str, str], list[int]] = {}
    for c in program.collectives():
        entry = counts.setdefault((c.kind, c.axis), [0, 0])
        entry[0] += 1
        entry[1] += c.nbytes
    return ", ".join(
        f"{n} {kind} over {axis} ({nbytes / 1e3:.0f} kB)"
        for (kind, axis), (n, nbytes) in sorted(counts.items())
    )


def plait_job(work: Workload, config: ParallelConfig, megatron: bool) -> Built:
    model = work.model()
    if megatron:
        annotate_megatron(cast(TinyGPT, model), TP)
    batches = work.batches
    job = plait.parallelize(
        model,
        config,
        optimizer=adamw,
        loss_fn=work.loss,
        example_batch=batches[0]
        if config.mode in ("auto", "semi_auto") or config.compile
        else None,
    )
    mesh = job.mesh
    dp = mesh.axis_size("dp")
    index = int(job.device_mesh.get_coordinate()[mesh.axis_index("dp")]) if dp > 1 else 0
    return job.step, [chunk(b, dp, index) for b in batches], program_collectives(job)


def local_head_attention(self: nn.Module, x_BTD: torch.Tensor) -> torch.Tensor:
    """TinyGPT's attention on this rank's heads: q, k, v give local widths under ColwiseParallel
    (``use_local_output``), attn.out (RowwiseParallel) takes the local width back."""
    b, t, _ = x_BTD.shape
    head_dim = self.q.out_features // self.heads  # the full layer's head width

    def split(y: torch.Tensor) -> torch.Tensor:
        return y.view(b, t, -1, head_dim).transpose(1, 2)

    q, k, v = split(self.q(x_BTD)), split(self.k(x_BTD)), split(self.v(x_BTD))
    scores_BHTT = q @ k.transpose(-2, -1) / math.sqrt(head_dim) + self.mask[:t, :t]
    y_BHTK = scores_BHTT.softmax(dim=-1) @ v
    return self.out(y_BHTK.transpose(1, 2).reshape(b, t, -1))


def torch_tp(work: Workload) -> Built:
    """Megatron with torch's own tools: parallelize_module over tp, DDP over dp."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = cast(TinyGPT, work.model())
    plan = {name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "fc1")}
    plan.update({name: RowwiseParallel() for name in ("attn.out", "fc2")})
    for block in model.blocks:
        block.attn.forward = types.MethodType(local_head_attention, block.attn)
        parallelize_module(block, mesh["tp"], plan)
    _pre_dp_module_transform(model)  # DTensor parameters -> local ones DDP can bucket
    dp_group = mesh["dp"].get_group()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=dp_group)
    opt = adamw(ddp.parameters())

    def step(batch: Batch) -> float:
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(ddp, batch)
        loss.backward()
        opt.step()
        return global_loss(loss, dp_group, DP)

    index = int(mesh.get_coordinate()[0])
    return step, [chunk(b, DP, index) for b in work.batches], None


def build(key: str, work: Workload) -> Built:
    tp_mesh = {"dp": DP, "tp": TP}
    if key in ("ddp", "mlp_ddp"):
        return torch_ddp(work)
    if key in ("dp", "mlp_dp"):
        return plait_job(work, ParallelConfig(mode="data_parallel"), False)
    if key in ("auto_dp", "mlp_auto_dp"):
        return plait_job(work, ParallelConfig(mode="auto", mesh={"dp": WORLD}), False)
    if key == "tp":
        return torch_tp(work)
    if key == "semi_auto":
        return plait_job(work, ParallelConfig(mode="semi_auto", mesh=tp_mesh), True)
    if key == "auto_tp":
        return plait_job(work, ParallelConfig(mode="auto", mesh=tp_mesh), True)
    if key == "dp_compiled":
        return plait_job(work, ParallelConfig(mode="data_parallel", compile=True), False)
    if key == "semi_auto_compiled":
        config = ParallelConfig(mode="semi_auto", mesh=tp_mesh, compile=True)
        return plait_job(work, config, True)
    if key == "dp_plan":  # no annotation: every op data parallel, run as the per-rank program
        return plait_job(work, ParallelConfig(mode="semi_auto", mesh={"dp": WORLD}), False)
    if key == "auto_tp_compiled":
        return plait_job(work, ParallelConfig(mode="auto", mesh=tp_mesh, compile=True), True)
    raise ValueError(key)


# ---------------------------------------------------------------------------------------------
# The worker: every case in the same 4 processes, taking turns step by step.


def bench_worker(
    cfg: GPTConfig,
    batch: int,
    mlp: tuple[int, int, int],
    keys: list[str],
    warmup: int,
    steps: int,
    threads: int,
    profile: str | None,
    profile_steps: int,
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    # DTensor notes once per rank that a loss pending over dp and tp is reduced in two steps.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    total = warmup + steps
    n = total + profile_steps
    workloads = {"gpt": gpt_workload(cfg, batch, n), "mlp": mlp_workload(*mlp, n)}
    runs: dict[str, tuple[StepFn, list[Batch]]] = {}
    out: dict[str, Any] = {}
    for key in keys:
        dist.barrier()
        t0 = time.perf_counter()
        step, local, program = build(key, workloads[BY_KEY[key].model])
        runs[key] = step, local
        dist.barrier()
        out[key] = {"setup_s": time.perf_counter() - t0, "program": program}
        out[key].update(losses=[], times=[], cpu=[])
    for i in range(total):
        for key, (step, local) in runs.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(local[i])
            out[key]["times"].append(time.perf_counter() - t0)
            out[key]["cpu"].append(time.process_time() - c0)
            out[key]["losses"].append(loss)
    if profile is not None:
        step, local = runs[profile]
        profiler = cProfile.Profile()
        for i in range(total, total + profile_steps):
            dist.barrier()
            profiler.enable()
            step(local[i])
            profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
        out["profile"] = text.getvalue()
    return out


# ---------------------------------------------------------------------------------------------
# The parent: table and loss check.


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def table(results: dict[str, Any], warmup: int) -> tuple[str, dict[str, float]]:
    lines = [
        "| case | median ms/step | p90 ms | CPU ms/step | ratio to baseline | CPU ratio "
        "| max rel. loss diff vs DDP (same model) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    medians = {k: statistics.median(r["times"][warmup:]) for k, r in results.items()}
    cpus = {k: statistics.median(r["cpu"][warmup:]) for k, r in results.items()}
    diffs: dict[str, float] = {}
    for key, r in results.items():
        case = BY_KEY[key]
        reference = results.get(case.reference, {}).get("losses")
        times = sorted(r["times"][warmup:])
        p90 = times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)]
        if case.baseline in results and case.baseline != key:
            ratio = f"{medians[key] / medians[case.baseline]:.2f}"
            cpu_ratio = f"{cpus[key] / cpus[case.baseline]:.2f}"
        else:
            ratio = cpu_ratio = "1.00 (baseline)" if case.baseline == key else "-"
        diff = "-"
        if reference is not None:
            diffs[key] = max_rel_diff(r["losses"][warmup:], reference[warmup:])
            diff = f"{diffs[key]:.1e}"
        lines.append(
            f"| {case.name} | {medians[key] * 1e3:.1f} | {p90 * 1e3:.1f} | {cpus[key] * 1e3:.1f} "
            f"| {ratio} | {cpu_ratio} | {diff} |"
        )
    return "\n".join(lines), diffs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per case")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--mlp-width", type=int, default=1024, help="MLP features per layer")
    parser.add_argument("--mlp-layers", type=int, default=4, help="MLP linear layers")
    parser.add_argument("--mlp-batch", type=int, default=256, help="MLP global batch (rows)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--rtol", type=float, default=1e-4, help="loss agreement with DDP")
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT_CASES),
        metavar="KEYS",
        help="comma-separated cases (default: all but the compiled ones): "
        + ", ".join(c.key for c in CASES),
    )
    parser.add_argument(
        "--profile", default=None, metavar="KEY", help="cProfile rank 0 on one case's steps"
    )
    parser.add_argument("--profile-steps", type=int, default=5)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    keys = [k for k in args.only.split(",") if k]
    unknown = [k for k in [*keys, args.profile or "ddp"] if k not in BY_KEY]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {list(BY_KEY)}")
    if args.profile is not None and args.profile not in keys:
        keys.append(args.profile)
    keys = [c.key for c in CASES if c.key in keys]  # table order
    cfg = GPTConfig(args.vocab, args.seq, args.width, args.heads, args.layers)
    if args.batch % WORLD or args.heads % TP or args.mlp_batch % WORLD:
        raise SystemExit(f"--batch and --mlp-batch must divide by {WORLD}, --heads by {TP}")
    mlp = (args.mlp_width, args.mlp_layers, args.mlp_batch)
    print(
        f"torch {torch.__version__}, {WORLD} gloo processes ({args.threads} thread(s) each), "
        f"{cfg}, global batch {args.batch}; MLP {args.mlp_layers} x {args.mlp_width} wide, "
        f"global batch {args.mlp_batch}; AdamW lr {LR}, {args.warmup} warm-up + "
        f"{args.steps} timed steps per case; {os.cpu_count()} CPUs, load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; plait from "
        f"{os.path.dirname(os.path.dirname(plait.__file__))}"
    )
    start = time.perf_counter()
    per_rank = run_workers(
        bench_worker,
        WORLD,
        cfg,
        args.batch,
        mlp,
        keys,
        args.warmup,
        args.steps,
        args.threads,
        args.profile,
        args.profile_steps if args.profile else 0,
        timeout_s=600.0,
    )
    results = per_rank[0]
    profile = results.pop("profile", None)
    for key, r in results.items():
        program = "" if r["program"] is None else f"; program: {r['program']}"
        print(f"{BY_KEY[key].name}: setup {r['setup_s']:.1f} s{program}")
    text, diffs = table(results, args.warmup)
    print()
    print(text)
    print()
    for reference in ("ddp", "mlp_ddp"):
        if reference not in results:
            continue
        losses = results[reference]["losses"]
        mine = [d for k, d in diffs.items() if BY_KEY[k].reference == reference]
        print(
            f"{BY_KEY[reference].name} losses: first {losses[0]:.6f}, first measured "
            f"{losses[args.warmup]:.6f}, last {losses[-1]:.6f}; largest relative difference "
            f"of its cases over the {args.steps} measured steps {max(mine):.2e} "
            f"(tolerance {args.rtol:g})"
        )
    print(
        f"load average after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; total wall time "
        f"{time.perf_counter() - start:.1f} s"
    )
    if profile is not None:
        print(f"\ncProfile of rank 0, {args.profile_steps} steps of {BY_KEY[args.profile].name}:")
        print(profile)
    bad = {k: d for k, d in diffs.items() if d > args.rtol}
    if bad:
        raise SystemExit(f"losses differ from DDP's (same model) beyond rtol {args.rtol:g}: {bad}")


if __name__ == "__main__":
    main()
