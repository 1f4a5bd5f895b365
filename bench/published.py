"""plait's predicted step time against published measurements: Megatron-LM's weak-scaling table.

    .venv/bin/python bench/published.py                 # every row of Table 1 (~30 s here)
    .venv/bin/python bench/published.py --rows 1.7b 1t  # some rows
    .venv/bin/python bench/published.py --detail        # also each row's anatomy (below)
    .venv/bin/python bench/published.py --rows 3.6b 7.5b 18b --interleave 2
                                                        # the cost model's multi-copy what-if

What it checks: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21 (arXiv 2104.04473), Table 1 measured GPT training from 1.7B
to 1T parameters on 32 to 3,072 A100 80GB GPUs (Selene: DGX A100 nodes of 8 GPUs, NVLink3
inside a node, 8 InfiniBand HDR 200 Gb/s links per node). Each row is planned here with
``plait.planning.plan_graph`` on ``hardware="a100-80g"`` with the published mesh fixed and
Megatron's settings, and the predicted ``Prediction.step_time_s`` is set beside the published
seconds per iteration. Planning only: meta-device models, no training, no processes.

Published seconds per iteration. The paper reports teraFLOP/s per GPU, X, counting the FLOPs
of its equation (3), F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) per iteration, which
includes the forward recomputed in backward (activation recomputation on). The same formula
turns X back into time: seconds per iteration = F / (n X), n the GPU count.

Sources, and which numbers were confirmed:

- Table 1 (heads, hidden, layers, tensor- and pipeline-parallel sizes, GPUs, batch, teraFLOP/s
  per GPU, % of peak): confirmed, all ten rows, in a Markdown transcription of the paper's full
  text (section 5.1: Table 1, equations (2) and (3), and "we use the interleaved pipeline
  schedule with the scatter/gather optimization enabled"), and again in two paper notes that
  quote Table 1 row by row (the three agree; they also agree with memory). The abstract
  (arxiv.org/abs/2104.04473, as quoted by tldr.takara.ai/p/2104.04473) confirms the 1T row:
  502 petaFLOP/s on 3,072 GPUs, 52% of peak. Nothing in the table is from memory alone.
- Micro-batch sizes and interleaving (not in Table 1): NVIDIA/Megatron-LM
  ``examples/sc21/run_table_1.sh``, the paper's reproduction script (read at commit 79a3bb6):
  ``--micro-batch-size`` 16, 16, 16, 8, 4, 2, 2, 1, 1, 1 by row and
  ``--num-layers-per-virtual-pipeline-stage`` 5 (76B), 5 (145B), 3 (310B), 1 (530B), none for
  the other rows; ``--DDP-impl`` torch for 1.7B to 18B (gradient all-reduce overlapped with
  backward), local for the others (after backward). The same directory's ``CONFIG.sh``:
  ``--fp16``, ``--seq-length 2048``.
- Vocabulary 51,200, sequence 2048, A100 peak 312 teraFLOP/s at 16-bit: the paper, section 5.
- From memory, not confirmed: Megatron's fp16 runs of 2021 all-reduced fp16 gradients (its
  fp32 gradient accumulation was an option, off by default).

Assumptions, stated per row in the table:

- Precision fp16 (``--fp16`` in CONFIG.sh; plait prices fp16 and bf16 the same on an A100).
- Micro-batches per step m = batch / (dp x micro-batch size), the scripts' micro-batch size;
  with pp = 1 they are gradient-accumulation micro-batches (plait: ``micro_batches=m``).
- Schedule: ``interleaved_1f1b`` with ``virtual_stages = layers / (pp x layers per virtual
  stage)`` where the script interleaves (3, 2, 2, 3), else ``1f1b``.
- ``recompute="full"`` (every transformer block), ``optimizer_shard=None`` (no ZeRO: the
  paper's runs predate Megatron's distributed optimizer), Megatron tensor-parallel annotations
  (``annotate_megatron``) and mode auto for the rest (embedding, head, loss) on the fixed mesh
  ``{pp, dp, tp}`` (tp innermost, as Megatron orders ranks). plait's TinyGPT has an untied LM
  head and no key bias; Megatron ties the head to the embedding: V h more parameters here (7%
  of the 1.7B model's gradient bytes, 0.1% of the 1T model's), the same FLOPs.
- The published time includes everything (data loading, optimizer, logging); plait's includes
  compute, communication (less the data-parallel reductions hidden behind the last micro-batch's
  backward: ``Prediction.overlapped_s``), the schedule's bubble and the optimizer step.

``--detail`` prints, per row, where the busiest rank's predicted compute goes (flop-bound and
memory-bound ops by their roofline, the attention-score ops among them) and its collectives by
kind, axis and phase. (Its first version also sized two gaps by arithmetic, the recomputed
forward and fp16 activation bytes; both are in the cost model since commits 54e1669 and
a09a590.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plait.config import ParallelConfig
    from plait.graph import OpGraph, OpNode
    from plait.planning import Plan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/plan_scale.py's helpers, imported below

from plan_scale import _phases, _timing_kw  # noqa: E402

SEQ, VOCAB = 2048, 51200
TOLERANCE = 0.15


@dataclass(frozen=True)
class Row:
    """One row of Table 1, with the reproduction script's micro-batch size and interleaving."""

    name: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved teraFLOP/s per GPU
    peak_pct: int  # % of theoretical peak, as published
    micro_batch_size: int  # run_table_1.sh --micro-batch-size
    layers_per_virtual: int | None  # run_table_1.sh --num-layers-per-virtual-pipeline-stage

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def micro_batches(self) -> int:
        return self.batch // (self.dp * self.micro_batch_size)

    @property
    def virtual_stages(self) -> int:
        if self.layers_per_virtual is None:
            return 1
        return self.layers // (self.pp * self.layers_per_virtual)


# fmt: off
ROWS: tuple[Row, ...] = (
    Row("1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 16, None),
    Row("3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 16, None),
    Row("7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 16, None),
    Row("18b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 8, None),
    Row("39b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 4, None),
    Row("76b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 2, 5),
    Row("145b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 2, 5),
    Row("310b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 1, 3),
    Row("530b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 1, 1),
    Row("1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 1, None),
)
# fmt: on
BY_NAME = {r.name: r for r in ROWS}


# --------------------------------------------------------------------------- published side


def paper_flops(row: Row) -> float:
    """FLOPs of one iteration by the paper's equation (3) (recomputed forward included)."""
    b, s, l, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB  # noqa: E741
    return 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))


def published_seconds(row: Row) -> float:
    """Seconds per iteration implied by the published teraFLOP/s per GPU."""
    return paper_flops(row) / (row.gpus * row.tflops * 1e12)


# --------------------------------------------------------------------------- plait side


@dataclass(frozen=True)
class Planned:
    """What planning one row gave."""

    step_s: float
    compute_s: float
    comm_s: float
    hidden_s: float
    bubble_s: float
    optimizer_s: float
    memory_gib: float
    plan_s: float
    phases: str
    comm_by_kind: dict[str, float]
    anatomy: dict[str, float]
    copies: int = 1
    """Copies of each micro-batch the plan runs (``interleave_num``)."""


def row_config(row: Row) -> ParallelConfig:
    import plait

    v = row.virtual_stages
    # Without pipeline stages Megatron runs its micro-batches one after another, forward and
    # backward each, adding into the gradients: plait's gradient accumulation (micro_batches
    # without stages would hold every micro-batch's activations at once, as GPipe does).
    pipelined = row.pp > 1
    return plait.ParallelConfig(
        mode="auto",
        mesh={"pp": row.pp, "dp": row.dp, "tp": row.tp},
        pipeline_stages=row.pp,
        micro_batches=row.micro_batches if pipelined else 1,
        grad_accumulation=1 if pipelined else row.micro_batches,
        schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v if v > 1 else None,
        recompute="full",
        optimizer_shard=None,
        precision="fp16",
        hardware="a100-80g",
    )


def stage_of_collectives(plan: Plan) -> dict[str, int]:
    """Pipeline stage (rank) of every op and parameter a collective names; 0 without stages.
    Gradient buckets name their first parameter, placed on the stage of the op reading it."""
    stages = plan.stages or ((),)
    ranks = plan.pipeline_stages
    of = {op: s % ranks for s, ops in enumerate(stages) for op in ops}
    of.update({p.name: of.get(p.op, 0) for p in plan.parameters})
    return of


def busiest_comm(plan: Plan) -> dict[str, float]:
    """Seconds per step of the busiest stage's collectives by kind, axes and phase (the
    stage whose communication is the prediction's)."""
    stage_of = stage_of_collectives(plan)
    per_stage: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for c in plan.collectives:
        key = f"{c.kind}({','.join(c.axes)}) {c.phase}"
        per_stage[stage_of.get(c.op, 0)][key] += c.seconds * c.count
    if not per_stage:
        return {}
    target = plan.predicted.communication_s
    stage = min(per_stage, key=lambda s: abs(sum(per_stage[s].values()) - target))
    return dict(sorted(per_stage[stage].items(), key=lambda kv: -kv[1]))


def busiest_rank_ops(plan: Plan, graph: OpGraph) -> list[OpNode]:
    """The ops the busiest pipeline rank runs (every op without stages); a rank runs stages
    r, r + pp, ... under the interleaved schedules."""
    if not plan.stages:
        return list(graph.ops)
    ranks = plan.pipeline_stages
    rank = max(range(ranks), key=lambda r: plan.stage_compute_s[r])
    names = {op for s, ops in enumerate(plan.stages) if s % ranks == rank for op in ops}
    return [op for op in graph.ops if op.name in names]


def compute_anatomy(plan: Plan, graph: OpGraph) -> dict[str, float]:
    """The busiest rank's predicted compute seconds split by what bounds each op's roofline
    (the attention-score ops among them). Each op's share is its roofline
    time on whole tensors (every op on these meshes is cut into the same dp x tp pieces, so
    shares equal those of the local pieces), scaled to ``Prediction.compute_s``."""
    from plait.cost import get_profile
    from plait.cost.compute import is_matmul, op_seconds

    hw = get_profile("a100-80g")
    flop_rate = hw.peak("float16") * hw.compute_efficiency
    byte_rate = hw.memory_bandwidth * hw.memory_efficiency
    parts: dict[str, float] = defaultdict(float)
    for op in busiest_rank_ops(plan, graph):
        gemm = is_matmul(op.target, op.input_metas, op.outputs)
        t = op_seconds(op.flops, op.bytes, "float16", hw, matmul=gemm)
        bound = "flop-bound" if op.flops / flop_rate >= op.bytes / byte_rate else "memory-bound"
        parts[bound] += t
        if op.module_path.endswith(".attn"):  # Attention.forward's own ops, not its linears
            parts["attention scores"] += t  # q k^T, scale, mask, softmax, scores v, views
    scale = plan.predicted.compute_s / max(parts["flop-bound"] + parts["memory-bound"], 1e-30)
    return {k: v * scale for k, v in parts.items()}


def plan_row(row: Row, copies: int | str = 1) -> Planned:
    """Build the row's GPT on the meta device, capture it, plan it on the fixed mesh; with
    ``copies``, multi-copy parallel (``interleave_num``: the plan is one copy's batch;
    ``"auto"``: mode auto weighs 1 and 2 copies, :func:`plait.planning.copies.weigh_copies`)."""
    from plait.graph import capture
    from plait.models import ModelSpec, annotate_megatron, build
    from plait.planning import plan_graph
    from plait.planning.copies import weigh_copies
    from plait.planning.setup import mesh_of

    kw = _timing_kw()
    timing = kw.get("timing")
    start = time.perf_counter()

    def plan_one(cfg: ParallelConfig) -> tuple[Any, Any]:
        # gradient accumulation (no stages: row_config) plans one micro-step's batch, as
        # plait.plan does when it is handed the whole step's
        steps = (1 if row.pp > 1 else row.micro_batches) * cfg.copies
        spec = ModelSpec(
            kind="gpt", layers=row.layers, hidden=row.hidden, heads=row.heads, seq=SEQ,
            vocab=VOCAB, batch=row.batch // steps,
        )  # fmt: skip
        with torch.device("meta"):
            model, batch, loss = build(spec)
        if row.tp > 1:
            annotate_megatron(model, tp=row.tp)
        if timing is not None:
            with timing.phase("capture"):
                graph = capture(model, batch, loss)
        else:
            graph = capture(model, batch, loss)
        return plan_graph(graph, cfg, mesh=mesh_of(cfg), model=model, **kw), graph

    cfg = dataclasses.replace(row_config(row), interleave_num=copies)  # type: ignore[arg-type]
    plan, graph = weigh_copies(cfg, plan_one) if copies == "auto" else plan_one(cfg)
    plan_s = time.perf_counter() - start
    p = plan.predicted
    return Planned(
        step_s=p.step_time_s,
        compute_s=p.compute_s,
        comm_s=p.communication_s,
        hidden_s=p.overlapped_s,
        bubble_s=p.bubble_s,
        optimizer_s=p.optimizer_s,
        memory_gib=p.memory_bytes / 2**30,
        plan_s=plan_s,
        copies=plan.interleave_num,
        phases=_phases({"timing": timing.as_dict()}) if timing is not None else "-",
        comm_by_kind=busiest_comm(plan),
        anatomy=compute_anatomy(plan, graph),
    )


# --------------------------------------------------------------------------- table


HEAD = [
    "model", "mesh pp x dp x tp", "m (mbs), schedule", "predicted s/iter",
    "compute / comm (hidden) / bubble / optimizer", "published s/iter", "predicted / published",
    "within 15%", "TFLOP/s/GPU pred. / pub.", "memory", "plan time",
]  # fmt: skip


def table_cells(row: Row, got: Planned) -> list[str]:
    pub = published_seconds(row)
    ratio = got.step_s / pub
    sched = f"interleaved v={row.virtual_stages}" if row.virtual_stages > 1 else "1f1b"
    pred_tflops = paper_flops(row) / (row.gpus * got.step_s) / 1e12
    return [
        f"{row.params_b:g}B",
        f"{row.pp} x {row.dp} x {row.tp} ({row.gpus})",
        f"{row.micro_batches} ({row.micro_batch_size}), {sched}",
        f"**{got.step_s:.2f}**",
        f"{got.compute_s:.2f} / {got.comm_s:.2f} ({got.hidden_s:.2f}) / {got.bubble_s:.2f} / "
        f"{got.optimizer_s:.3f}",
        f"{pub:.2f}",
        f"**{ratio:.2f}**",
        "yes" if abs(ratio - 1) <= TOLERANCE else "no",
        f"{pred_tflops:.0f} / {row.tflops:.0f} ({row.peak_pct}%)",
        f"{got.memory_gib:.0f} GiB",
        f"{got.plan_s:.1f} s",
    ]


def detail_lines(row: Row, got: Planned) -> list[str]:
    a = got.anatomy
    lines = [
        f"  {row.name}: plan phases capture / cand. / search / estimate / assemble {got.phases} s",
        f"    compute {got.compute_s:.2f} s = flop-bound {a['flop-bound']:.2f} + memory-bound "
        f"{a['memory-bound']:.2f} (attention scores {a['attention scores']:.2f})",
        "    busiest stage's communication per step:",
    ]
    lines += [f"      {k:<36} {v:8.3f} s" for k, v in got.comm_by_kind.items() if v >= 5e-4]
    return lines


def header() -> str:
    rev = subprocess.run(
        ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    return (
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}, commit {rev or '?'}; hardware a100-80g, fp16, recompute "
        f"full, no ZeRO; published: Narayanan et al. SC'21 Table 1 (F / (n X), equation (3))"
    )


def _copies(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", choices=list(BY_NAME), help="rows to plan")
    parser.add_argument("--detail", action="store_true", help="anatomy, collectives, what-ifs")
    parser.add_argument(
        "--interleave", type=_copies, default=1,
        help="plan with interleave_num=K (multi-copy; rows with tp and without pipeline "
        "stages), or 'auto': the planner weighs 1 and 2 copies per row",
    )  # fmt: skip
    args = parser.parse_args()
    rows = [BY_NAME[n] for n in args.rows] if args.rows else list(ROWS)
    if args.interleave != 1:
        rows = [row for row in rows if row.pp == 1 and row.tp > 1]  # refused elsewhere
    print(header())
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
    details: list[str] = []
    chosen: list[str] = []
    for row in rows:
        got = plan_row(row, args.interleave)
        print("| " + " | ".join(table_cells(row, got)) + " |", flush=True)
        details += detail_lines(row, got)
        if args.interleave == "auto":
            chosen.append(f"{row.params_b:g}B: {got.copies} {'copy' if got.copies == 1 else 'copies'}")
    if chosen:
        print("interleave_num='auto' chose: " + ", ".join(chosen))
    if args.detail:
        print("\n".join(details))


if __name__ == "__main__":
    main()
