"""Step time of plait's semi_auto Megatron training against hand-written torch tensor parallel.

Both variants train the same TinyGPT (same initial weights, same global batches, AdamW) on 4
gloo processes arranged as a dp=2 x tp=2 mesh, side by side in one invocation:

* ``plait``: ``annotate_megatron(model, 2)`` then ``plait.parallelize(mode="semi_auto")`` and
  ``job.step(local_batch)``; plait lays parameters out as DTensors and runs every op of the step
  through DTensor.
* ``torch TP``: what a user would write by hand: ``parallelize_module`` with ``ColwiseParallel``
  for q, k, v, fc1 and ``RowwiseParallel`` for attn.out and fc2 on the tp sub-mesh (the
  attention reshapes with local head counts, since these styles hand back local tensors), every
  other parameter replicated, and data parallel as an all-reduce of every gradient over the dp
  group divided by the dp size.

The two variants take turns step by step. Every rank warms up, then times each step
(``time.perf_counter`` after a barrier); rank 0's times are reported. The script also checks
that both runs give the same loss at every step.

Run from the repository root: ``.venv/bin/python bench/semi_auto_tp.py``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import plait
from plait import ParallelConfig
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss, token_batches
from plait.testing import run_workers

WORLD = 4
DP = 2
TP = 2
CFG = GPTConfig(vocab=256, seq=64, width=128, heads=4, layers=2)
LR = 1e-3

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[Batch], float]


# ---------------------------------------------------------------------------------------------
# The baseline model: TinyGPT's parameters and math, attention written for local heads.


class LocalHeadAttention(nn.Module):
    """TinyGPT's attention; the head count follows the width it is given (heads // tp under TP)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.width // cfg.heads
        self.q = nn.Linear(cfg.width, cfg.width)
        self.k = nn.Linear(cfg.width, cfg.width, bias=False)
        self.v = nn.Linear(cfg.width, cfg.width)
        self.out = nn.Linear(cfg.width, cfg.width)
        mask = torch.full((cfg.seq, cfg.seq), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def _split(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        return x_BTD.view(b, t, d // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q, k, v = self._split(self.q(x_BTD)), self._split(self.k(x_BTD)), self._split(self.v(x_BTD))
        scores_BHTT = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + self.mask[:t, :t]
        y_BHTK = scores_BHTT.softmax(dim=-1) @ v
        # Local width: heads_local * head_dim (RowwiseParallel on `out` expects the local shard).
        return self.out(y_BHTK.transpose(1, 2).reshape(b, t, -1))


class BaselineBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = LocalHeadAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc1 = nn.Linear(cfg.width, 4 * cfg.width)
        self.fc2 = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BaselineGPT(nn.Module):
    """Same parameter names and shapes as TinyGPT, so it loads TinyGPT's state dict."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(BaselineBlock(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids_BT) + self.pos(torch.arange(ids_BT.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ---------------------------------------------------------------------------------------------
# Data and the two step functions.


def initial_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CFG)


def local_slice(batch: Batch, dp_index: int) -> Batch:
    ids, targets = batch
    return ids.chunk(DP)[dp_index], targets.chunk(DP)[dp_index]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def plait_step_fn(model: TinyGPT) -> tuple[StepFn, int]:
    """plait semi_auto Megatron; returns the step function and this rank's dp coordinate."""
    annotate_megatron(model, TP)
    config = ParallelConfig(mode="semi_auto", mesh={"dp": DP, "tp": TP})
    job = plait.parallelize(model, config, optimizer=adamw, loss_fn=gpt_loss)
    return job.step, job.device_mesh.get_coordinate()[0]


def tp_plan() -> dict[str, ColwiseParallel | RowwiseParallel]:
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {
        f"attn.{name}": ColwiseParallel() for name in ("q", "k", "v")
    }
    plan["fc1"] = ColwiseParallel()
    plan["attn.out"] = RowwiseParallel()
    plan["fc2"] = RowwiseParallel()
    return plan


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient's local storage (a DTensor's shard, or the plain gradient)."""
    g = p.grad
    if isinstance(g, DTensor):
        return g.to_local()  # under no_grad: the local tensor itself, so in-place ops stick
    return g


def torch_tp_step_fn(model: TinyGPT) -> tuple[StepFn, int]:
    """Hand-written torch TP on the tp sub-mesh plus gradient all-reduce over dp."""
    mesh: DeviceMesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    baseline = BaselineGPT(CFG)
    baseline.load_state_dict(model.state_dict())
    for block in baseline.blocks:
        parallelize_module(block, mesh["tp"], tp_plan())
    opt = adamw(baseline.parameters())
    dp_group = mesh["dp"].get_group()
    params = list(baseline.parameters())

    def step(batch: Batch) -> float:
        baseline.train()
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(baseline, batch)
        loss.backward()
        with torch.no_grad():
            for p in params:
                g = local_grad(p)
                if g is not None:
                    dist.all_reduce(g, group=dp_group)
                    g.div_(DP)
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=dp_group)
        return global_loss.item() / DP

    return step, mesh.get_coordinate()[0]


# ---------------------------------------------------------------------------------------------
# One worker runs both variants; the parent summarises rank 0.


VARIANTS: dict[str, Callable[[TinyGPT], tuple[StepFn, int]]] = {
    "plait semi_auto": plait_step_fn,
    "torch TP (hand-written)": torch_tp_step_fn,
}


def timed_step(step: StepFn, batch: Batch) -> tuple[float, float]:
    """The step's global loss and its wall time, all ranks starting together."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = step(batch)
    return loss, time.perf_counter() - t0


def bench_worker(warmup: int, steps: int, batch: int, threads: int) -> dict[str, Any]:
    """Both variants on this rank, from the same initial weights, on the same batches.

    The variants take turns step by step, so a slow spell of the machine hits both alike.
    """
    torch.set_num_threads(threads)
    batches = token_batches(CFG, batch, warmup + steps)
    runs: dict[str, tuple[StepFn, list[Batch]]] = {}
    for name, build in VARIANTS.items():
        step, dp_index = build(copy.deepcopy(initial_model()))
        runs[name] = step, [local_slice(b, dp_index) for b in batches]
    results: dict[str, Any] = {name: {"losses": [], "times": []} for name in runs}
    for i in range(warmup + steps):
        for name, (step, local) in runs.items():
            loss, elapsed = timed_step(step, local[i])
            results[name]["losses"].append(loss)
            if i >= warmup:
                results[name]["times"].append(elapsed)
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def table(results: dict[str, Any], tokens_per_step: int) -> str:
    names = list(results)
    base_median = statistics.median(results[names[-1]]["times"])
    rows = [
        "| variant | median step ms | p90 ms | tokens/s | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        times = results[name]["times"]
        median = statistics.median(times)
        rows.append(
            f"| {name} | {median * 1e3:.1f} | {percentile(times, 0.9) * 1e3:.1f} | "
            f"{tokens_per_step / median:,.0f} | {median / base_median:.2f} |"
        )
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(
        f"torch {torch.__version__}, {WORLD} gloo processes, mesh dp={DP} x tp={TP}, {CFG}, "
        f"global batch {args.batch}, {args.threads} thread(s)/process, "
        f"{args.warmup} warm-up + {args.steps} timed steps per variant"
    )
    start = time.perf_counter()
    per_rank = run_workers(
        bench_worker, WORLD, args.warmup, args.steps, args.batch, args.threads, timeout_s=300.0
    )
    results = per_rank[0]
    plait_losses, base_losses = (r["losses"] for r in results.values())
    diff = max(abs(a - b) for a, b in zip(plait_losses, base_losses, strict=True))
    print(table(results, args.batch * CFG.seq))
    print(
        f"losses over {len(plait_losses)} steps: first {plait_losses[0]:.6f}, last "
        f"{plait_losses[-1]:.6f} (plait) vs {base_losses[-1]:.6f} (torch TP); "
        f"max abs difference {diff:.2e}"
    )
    print(f"total wall time {time.perf_counter() - start:.1f} s")
    if diff > 1e-4:
        raise SystemExit(f"plait and torch TP losses disagree (max abs difference {diff:.2e})")


if __name__ == "__main__":
    main()
