"""Every model x every searcher, on 4 and 8 simulated ranks: automatic plans run op by op and
train exactly like one device (issue #7's acceptance matrix).

Models: plait's GPT example, the zoo's Llama (RMSNorm, rotary embeddings, SwiGLU,
grouped-query attention), BERT-style encoder and CNN, and unmodified Hugging Face GPT-2 and
Llama built from a config with random weights. Searchers: sharding_propagation,
recursive_programming, dynamic_programming, ilp. Meshes: dp=2 x tp=2 (4 ranks) and
dp=2 x tp=4 (8 ranks). Nothing is annotated: the searcher chooses every op.

On a real profile these tiny models are best fully replicated (collective latency dwarfs their
compute), which would test nothing but data parallelism. They are planned on a *compute-bound*
profile instead (slow compute, free links), where splitting every op over every axis pays: the
plans split most ops over tp, and each searcher reaches them its own way.

For each case: 5 AdamW steps equal single-device training (losses and final parameters, fp32,
rtol 1e-4); the collectives executed in step 2 (kind, mesh axis, bytes, count, from plait's
collective log) equal the plan's list exactly, under the default gradient fusion;
CommDebugMode's counts per kind equal the plan's; DTensor's output layouts agree with the plan at every op.

Searchers often agree: a plan whose executable content (mesh, every op's layouts, parameter
layouts and reductions) equals one already run is not run again; its own collective list is
still compared with what that run executed.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from plait.config import ParallelConfig
from plait.cost.hardware import local_defaults, save_profile
from plait.cost.link import Link
from plait.graph import ExecutableCapture, capture_program
from plait.layout import TensorLayout
from plait.models import GPTConfig, ModelSpec, TinyGPT, build, gpt_loss
from plait.planning import Plan, plan_graph
from plait.runtime.engine.plan_exec import PlanExecutor
from plait.testing.equivalence import Run, assert_same_run, reference_run
from tests.sim.test_plan_exec import (
    adamw,
    by_kind,
    gpt_batches,
    hf_loss,
    hf_model,
    planned_collectives,
    run_plan,
    sgd,
)

SEARCHERS = ("sharding_propagation", "recursive_programming", "dynamic_programming", "ilp")
MODELS = ("gpt", "llama", "bert", "cnn", "hf_gpt2", "hf_llama")
MESHES = {4: {"dp": 2, "tp": 2}, 8: {"dp": 2, "tp": 4}}
STEPS = 5
GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)


@dataclasses.dataclass
class Case:
    model: nn.Module
    batches: list[Any]
    loss_fn: Callable[..., torch.Tensor]
    captured: ExecutableCapture
    expected: Run


Outcome = tuple[Run, Counter[tuple[str, str, int]], Counter[str], PlanExecutor]


# --------------------------------------------------------------------------- models


def _zoo(kind: str, **extra: Any) -> tuple[nn.Module, list[Any], Callable[..., torch.Tensor]]:
    spec = ModelSpec(kind=kind, layers=1, hidden=16, heads=4, seq=8, vocab=32, batch=4, **extra)
    torch.manual_seed(0)
    model, first, loss_fn = build(spec)
    return model, [first] + [build(spec)[1] for _ in range(STEPS - 1)], loss_fn


def _build(kind: str) -> tuple[nn.Module, list[Any], Callable[..., torch.Tensor]]:
    if kind == "gpt":
        torch.manual_seed(0)
        return TinyGPT(GPT), gpt_batches(GPT, STEPS), gpt_loss
    if kind == "llama":
        return _zoo("llama", kv_heads=2)
    if kind == "bert":
        model, batches, loss_fn = _zoo("bert")
        # The key third of the fused qkv bias has an exactly zero gradient (softmax ignores a
        # constant per row); Adam turns its rounding noise into lr-sized steps: freeze it.
        for layer in model.layers:
            layer.qkv.bias.requires_grad_(False)
        return model, batches, loss_fn
    if kind == "cnn":
        model, batches, loss_fn = _zoo("cnn")
        # A convolution's bias feeding batch norm has an exactly zero gradient: freeze it.
        for block in model.features:
            block[0].bias.requires_grad_(False)
        return model, batches, loss_fn
    model = hf_model(kind.removeprefix("hf_"))
    return model, gpt_batches(GPT, STEPS, batch=4), hf_loss


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def compute_bound(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A profile on which splitting pays: 1 MFLOP/s and 1 MB/s per device, free links."""
    free = Link(bandwidth=1e15, latency=1e-12)
    profile = dataclasses.replace(
        local_defaults(),
        peak_flops={"float32": 1e6, "bfloat16": 1e6, "float16": 1e6},
        memory_bandwidth=1e6,
        intra_node=free,
        inter_node=free,
        kernel_latency=0.0,
        source="test: compute-bound (tests/sim/test_plan_matrix.py)",
    )
    return str(save_profile(profile, tmp_path_factory.mktemp("hw") / "compute_bound.json"))


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    """Model kind -> its case (built, exported and trained on one device once per module)."""
    return {}


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[object, ...], Outcome]:
    """(model, world, executable plan content) -> the outcome of running that plan."""
    return {}


def _case(cases: dict[str, Case], kind: str) -> Case:
    if kind not in cases:
        model, batches, loss_fn = _build(kind)
        captured = capture_program(model, batches[0], loss_fn)
        expected = reference_run(model, loss_fn, adamw, batches)
        cases[kind] = Case(model, batches, loss_fn, captured, expected)
    return cases[kind]


def _executable(plan: Plan) -> tuple[object, ...]:
    """Everything of a plan the executor reads (the searcher's reasons are left out)."""
    return (
        plan.mesh,
        tuple((op.name, op.target, op.inputs, op.outputs, op.covered) for op in plan.ops),
        tuple((p.name, p.layout, p.grad_reduce_axes) for p in plan.parameters),
    )


def _split_over(plan: Plan, axis: str) -> int:
    return sum(
        any(axis in d for layout in (*op.inputs, *op.outputs) for d in layout.dims)
        for op in plan.ops
    )


# --------------------------------------------------------------------------- the matrix


# Every model x searcher on 4 ranks runs in `make test`; on 8 ranks each model runs with one
# searcher there (ilp for the small zoo models, sharding_propagation for the larger Llama and
# Hugging Face ones, whose 8-rank ilp cases are the slowest), and every other 8-rank case (nine
# traced per-rank programs each) runs in `make test-nightly`: the suite stays under 15 minutes.
_EVERY_RUN_8 = {
    "gpt": "ilp",
    "bert": "ilp",
    "cnn": "ilp",
    "llama": "sharding_propagation",
    "hf_gpt2": "sharding_propagation",
    "hf_llama": "sharding_propagation",
}
# The Hugging Face models' recursive_programming and dynamic_programming rows on 4 ranks are
# nightly too: tests/sim/test_hf_capture.py's nightly matrix runs every searcher on them.
_NIGHTLY_4 = {("hf_gpt2", "recursive_programming"), ("hf_gpt2", "dynamic_programming"),
              ("hf_llama", "recursive_programming"), ("hf_llama", "dynamic_programming")}  # fmt: skip


def _nightly(kind: str, search: str, world: int) -> bool:
    if world == 8:
        return _EVERY_RUN_8.get(kind, "ilp") != search
    return (kind, search) in _NIGHTLY_4


MATRIX = [
    pytest.param(kind, search, world, marks=pytest.mark.nightly)
    if _nightly(kind, search, world)
    else (kind, search, world)
    for kind in MODELS
    for search in SEARCHERS
    for world in sorted(MESHES)
]


@pytest.mark.parametrize(("kind", "search", "world"), MATRIX)
def test_auto_plan_runs_and_matches_one_device(
    kind: str,
    search: str,
    world: int,
    compute_bound: str,
    cases: dict[str, Case],
    outcomes: dict[tuple[object, ...], Outcome],
) -> None:
    case = _case(cases, kind)
    cfg = ParallelConfig(mode="auto", mesh=MESHES[world], search=search)
    plan = plan_graph(case.captured.graph, cfg, model=case.model, hardware_file=compute_bound)
    assert plan.search == search
    # the searcher really split the model over the tensor-parallel axis (propagation from the
    # batch alone splits few ops; the others split most)
    assert _split_over(plan, "tp") > 0, plan.summary()

    key = (kind, world, _executable(plan))
    if key not in outcomes:
        outcomes[key] = run_plan(
            case.model,
            case.captured,
            plan,
            cfg,
            case.loss_fn,
            adamw,
            case.batches,
            world,
        )
    run, executed, debug, executor = outcomes[key]

    assert_same_run(case.expected, run, rtol=1e-4, atol=1e-5)
    assert executor.mismatches == [], [m.describe() for m in executor.mismatches]
    planned = planned_collectives(plan)
    assert executed == planned, (
        f"executed, not planned: {executed - planned}; planned, not executed: {planned - executed}"
    )
    assert debug == by_kind(executed)


# --------------------------------------------------------------------------- no rule


class _WithUncoveredOp(nn.Module):
    """Two linears around ``logcumsumexp``, an op plait's catalogue has no rule for."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.logcumsumexp(torch.tanh(self.fc1(x)), dim=-1))


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("search", ["sharding_propagation", "dynamic_programming"])
def test_op_without_a_rule_runs_replicated_and_the_plan_says_so(
    search: str, compute_bound: str
) -> None:
    torch.manual_seed(0)
    model = _WithUncoveredOp()
    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(STEPS)]
    captured = capture_program(model, batches[0], _mse)
    cfg = ParallelConfig(mode="auto", mesh=MESHES[4], search=search)
    plan = plan_graph(captured.graph, cfg, model=model, hardware_file=compute_bound)

    (uncovered,) = [op for op in plan.ops if not op.covered]
    assert uncovered.target == "aten.logcumsumexp.default"
    assert uncovered.reason == "no rule in the catalogue: replicated"
    for layout in (*uncovered.inputs, *uncovered.outputs):
        assert layout == TensorLayout.replicated(plan.mesh, len(layout.dims))
    assert "replicated: no rule (1 op)" in plan.summary()
    assert "no rule in the catalogue, replicated" in plan.explain(uncovered.name)
    assert _split_over(plan, "tp") > 0  # the ops around it split: it is moved to and from whole

    expected = reference_run(model, _mse, adamw, batches)
    run, executed, debug, executor = run_plan(model, captured, plan, cfg, _mse, adamw, batches, 4)
    assert_same_run(expected, run, rtol=1e-4, atol=1e-5)
    assert executor.mismatches == []
    assert executed == planned_collectives(plan)
    assert debug == by_kind(executed)


@pytest.mark.parametrize("loss", ["mse", "smooth_l1"])
def test_mean_reduced_loss_on_a_split_batch_has_the_global_gradient(
    loss: str, compute_bound: str
) -> None:
    """DTensor's backward of these aten losses divides by the local element count; the plan
    executor's loss split over dp x tp must still give one device's gradients (SGD shows any
    scale error that Adam's normalisation would hide)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    fn = torch.nn.functional.mse_loss if loss == "mse" else torch.nn.functional.smooth_l1_loss

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return fn(m(batch[0]), batch[1])

    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(3)]
    captured = capture_program(model, batches[0], loss_fn)
    cfg = ParallelConfig(mode="auto", mesh=MESHES[4], search="dynamic_programming")
    plan = plan_graph(captured.graph, cfg, model=model, hardware_file=compute_bound)
    (op,) = [op for op in plan.ops if op.target.endswith("_loss.default")]
    assert set(op.inputs[0].dims[0]) == {"dp", "tp"}  # the batch of the loss split 4 ways
    expected = reference_run(model, loss_fn, sgd, batches)
    run, executed, _, executor = run_plan(model, captured, plan, cfg, loss_fn, sgd, batches, 4)
    assert_same_run(expected, run, rtol=1e-4, atol=1e-5)
    assert executor.mismatches == []
    assert executed == planned_collectives(plan)


# --------------------------------------------------------------------------- run locally


class _PoolNorm(nn.Module):
    """Group norm and the pooling ops DTensor cannot run backward (average, adaptive max,
    3-D): the executor runs them on local pieces by plait's rules."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8)
        self.head = nn.Linear(8 * 2 * 2 + 8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x)))
        a = torch.nn.functional.avg_pool2d(h, 2)  # 8 x 4 x 4
        b = torch.nn.functional.adaptive_max_pool2d(a, 2).flatten(1)  # 8 x 2 x 2
        c = torch.nn.functional.avg_pool3d(h.unsqueeze(2), (1, 8, 8)).flatten(1)  # 8
        return self.head(torch.cat([b, c], dim=1))


@pytest.mark.parametrize("search", ["sharding_propagation", "dynamic_programming"])
@pytest.mark.parametrize("world", sorted(MESHES))
def test_pooling_and_group_norm_run_on_local_pieces(
    search: str, world: int, compute_bound: str
) -> None:
    torch.manual_seed(0)
    model = _PoolNorm()
    batches = [(torch.randn(8, 4, 8, 8), torch.randn(8, 8)) for _ in range(3)]
    captured = capture_program(model, batches[0], _mse)
    cfg = ParallelConfig(mode="auto", mesh=MESHES[world], search=search)
    plan = plan_graph(captured.graph, cfg, model=model, hardware_file=compute_bound)
    split = [op.target for op in plan.ops if op.label != "replicate"]
    assert "aten.group_norm.default" in split or "aten.avg_pool2d.default" in split, split
    expected = reference_run(model, _mse, sgd, batches)
    run, executed, debug, executor = run_plan(model, captured, plan, cfg, _mse, sgd, batches, world)
    assert_same_run(expected, run, rtol=1e-4, atol=1e-5)
    assert executor.mismatches == []
    assert executed == planned_collectives(plan)
    assert debug == by_kind(executed)


# --------------------------------------------------------------------------- class losses


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(ids))))


_CLASS_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "ignore_index": lambda m, b: torch.nn.functional.cross_entropy(
        m(b[0]).reshape(-1, 32), b[1].reshape(-1), ignore_index=-100
    ),
    "ignore_index_smoothing": lambda m, b: torch.nn.functional.cross_entropy(
        m(b[0]).transpose(1, 2), b[1], ignore_index=-100, label_smoothing=0.1
    ),
    "nll_loss": lambda m, b: torch.nn.functional.nll_loss(
        torch.log_softmax(m(b[0]), -1).reshape(-1, 32), b[1].reshape(-1)
    ),
    # a sum needs no count: the plan lists no count all-reduce and none runs
    "sum": lambda m, b: (
        torch.nn.functional.cross_entropy(
            m(b[0]).reshape(-1, 32), b[1].reshape(-1), reduction="sum"
        )
        / 40
    ),
    "probability_targets": lambda m, b: torch.nn.functional.cross_entropy(
        m(b[0]).reshape(-1, 32), (b[1].clamp(min=0) % 7).float().reshape(-1, 1).expand(-1, 32)
    ),
}


@pytest.mark.parametrize("loss", sorted(_CLASS_LOSSES))
@pytest.mark.parametrize("world", sorted(MESHES))
def test_mean_class_loss_with_ignored_targets_matches_one_device(
    loss: str, world: int, compute_bound: str
) -> None:
    """PyTorch's mean divides by the targets not ignored, which differ between the ranks of a
    split batch (a row of one rank entirely ignored here): the executor divides every rank's
    sum by the all-reduced global count, the one scalar all-reduce the plan lists."""
    torch.manual_seed(0)
    model = _TinyLM()
    batches = []
    for _ in range(3):
        ids, targets = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
        targets[torch.rand(8, 8) < 0.3] = -100
        targets[1] = -100
        batches.append((ids, targets))
    loss_fn = _CLASS_LOSSES[loss]
    captured = capture_program(model, batches[0], loss_fn)
    cfg = ParallelConfig(mode="auto", mesh=MESHES[world], search="dynamic_programming")
    plan = plan_graph(captured.graph, cfg, model=model, hardware_file=compute_bound)
    (op,) = [op for op in plan.ops if "loss" in op.target]
    assert op.outputs[0].partial, op  # the batch of the loss is split
    expected = reference_run(model, loss_fn, sgd, batches)
    run, executed, debug, executor = run_plan(
        model, captured, plan, cfg, loss_fn, sgd, batches, world
    )
    assert_same_run(expected, run, rtol=1e-4, atol=1e-5)
    assert executor.mismatches == []
    assert executed == planned_collectives(plan)
    assert debug == by_kind(executed)
