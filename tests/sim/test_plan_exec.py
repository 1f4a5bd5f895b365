"""Plans run operator by operator (plait.runtime.engine.plan_exec) on simulated ranks.

Each case plans a model with ``plait.plan``, runs the plan with ``build_plan_job`` on N
simulated ranks and trains it; losses and final parameters must match single-device training
(fp32, rtol 1e-4). The collectives of one step, counted per (kind, mesh axis) and bytes, must
equal the plan's list exactly (gradient buckets and frozen parameters included).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait.annotate import shard
from plait.comm.dtensor import build_device_mesh, distribute, full_value, layout_of
from plait.comm.redistribute import execute_redistribution
from plait.config import CommFusion, ParallelConfig
from plait.errors import ShardingError
from plait.graph import ExecutableCapture, capture_program
from plait.layout.redistribute import plan_redistribution
from plait.models import GPTConfig, ModelSpec, TinyGPT, annotate_megatron, build, gpt_loss
from plait.planning import Plan, plan_graph
from plait.runtime.engine.plan_exec import PlanExecutor
from plait.runtime.engine.plan_job import build_plan_job
from plait.testing.comm import CollectiveLog, collective_kind
from plait.testing.equivalence import Run, assert_same_run, parallel_steps, reference_run

RTOL = 1e-4
STEPS = 5
# One bucket per gradient: each reduction is matched on its own (the plan lists the buckets
# the config makes; tests/sim/test_plan_buckets_exec.py covers the default fusion).
NO_FUSION = CommFusion(bucket_mb=1e-9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-6)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def gpt_batches(cfg: GPTConfig, n: int, batch: int = 8) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


# --------------------------------------------------------------------------- accounting


def planned_collectives(plan: Plan) -> Counter[tuple[str, str, int]]:
    """(kind, axis, bytes per occurrence) -> count per step, as the plan lists them."""
    out: Counter[tuple[str, str, int]] = Counter()
    for c in plan.collectives:
        for axis in c.axes:
            out[(c.kind, axis, c.nbytes)] += c.count
    return out


def executed_collectives(log: CollectiveLog) -> Counter[tuple[str, str, int]]:
    return Counter((e.kind, e.axis, e.bytes) for e in log.events)


def by_kind(collectives: Counter[tuple[str, str, int]]) -> Counter[str]:
    """(kind, axis, bytes) counts -> counts per kind."""
    out: Counter[str] = Counter()
    for (kind, _, _), n in collectives.items():
        out[kind] += n
    return out


def debug_counts(debug: CommDebugMode) -> Counter[str]:
    """CommDebugMode's counts per kind; a collective of a kind plait does not name fails."""
    out: Counter[str] = Counter()
    for op, n in debug.get_comm_counts().items():
        kind = collective_kind(op)
        assert kind is not None, f"CommDebugMode counted an unexpected collective {op}"
        out[kind] += n
    return out


# --------------------------------------------------------------------------- running


def run_plan(
    model: torch.nn.Module,
    captured: ExecutableCapture,
    plan: Plan,
    cfg: ParallelConfig,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: Callable[..., torch.optim.Optimizer],
    batches: list[Any],
    world_size: int,
) -> tuple[Run, Counter[tuple[str, str, int]], Counter[str], PlanExecutor]:
    """Train a copy of ``model`` under ``plan``; collectives of step 2: plait's log (kind,
    mesh axis, bytes) and CommDebugMode's counts per kind."""
    model = copy.deepcopy(model)
    with plait.testing.simulate(world_size):
        job = build_plan_job(model, plan, cfg, loss_fn, optimizer, batches[0], captured=captured)
        losses = []
        counted: Counter[tuple[str, str, int]] = Counter()
        debug: Counter[str] = Counter()
        for i, batch in enumerate(batches):
            if i == 1:
                with CommDebugMode() as mode, CollectiveLog(job.device_mesh) as log:
                    losses.append(job.step(batch))
                counted = executed_collectives(log)
                debug = debug_counts(mode)
            else:
                losses.append(job.step(batch))
        state = job.full_state_dict()
    executor = job.loss_fn
    assert isinstance(executor, PlanExecutor)
    return Run(losses, state), counted, debug, executor


def check_case(model, batches, cfg, loss_fn, optimizer, world_size) -> Plan:
    # one export serves planning and running (plan_graph plans an already captured graph)
    captured = capture_program(model, batches[0], loss_fn)
    plan = plan_graph(captured.graph, cfg, model=model)
    expected = reference_run(model, loss_fn, optimizer, batches)
    run, executed, debug, executor = run_plan(
        model, captured, plan, cfg, loss_fn, optimizer, batches, world_size
    )
    assert_same_run(expected, run, rtol=RTOL, atol=1e-5)
    assert executor.mismatches == [], [m.describe() for m in executor.mismatches]
    expected_steps = planned_collectives(plan)
    assert executed == expected_steps, (
        f"executed - expected: {executed - expected_steps}; "
        f"expected - executed: {expected_steps - executed}"
    )
    # CommDebugMode also sees DTensor's own all-to-all, which the log does not
    assert debug == by_kind(executed)
    return plan


# --------------------------------------------------------------------------- cases


GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
DP_TP = {"dp": 2, "tp": 2}


def zoo_case(kind: str, n: int, **extra: Any):
    """A tiny zoo model, its loss and ``n`` different batches (seeded)."""
    spec = ModelSpec(kind=kind, layers=1, hidden=16, heads=4, seq=8, vocab=32, batch=4, **extra)
    torch.manual_seed(0)
    model, first, loss_fn = build(spec)
    return model, [first] + [build(spec)[1] for _ in range(n - 1)], loss_fn


def test_gpt_megatron_semi_auto_plan_matches_one_device():
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batches = gpt_batches(GPT, STEPS)
    cfg = ParallelConfig(mode="semi_auto", mesh=DP_TP, comm_fusion=NO_FUSION)
    check_case(model, batches, cfg, gpt_loss, adamw, 4)


def test_gpt_megatron_on_8_ranks_with_sgd():
    """SGD exposes gradient-scale errors that Adam's normalisation hides."""
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(GPT), 2)
    batches = gpt_batches(GPT, 3)
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 4, "tp": 2}, comm_fusion=NO_FUSION)
    check_case(model, batches, cfg, gpt_loss, sgd, 8)


def annotate_zoo_megatron(model: torch.nn.Module, kind: str, tp: int = 2) -> torch.nn.Module:
    """Megatron column/row splits on a zoo llama or bert (attention and MLP linears)."""
    for block in model.blocks if kind == "llama" else model.layers:
        if kind == "llama":
            columns = [block.attn.q, block.attn.k, block.attn.v, block.mlp.gate, block.mlp.up]
            rows = [block.attn.o, block.mlp.down]
        else:
            columns, rows = [block.qkv, block.fc1], [block.out, block.fc2]
        for lin in columns:
            shard(lin, parameter_strategy={"weight": (tp, 1)})
        for lin in rows:
            shard(lin, parameter_strategy={"weight": (1, tp)})
    return model


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_zoo_transformer_auto_plan_from_annotations_matches_one_device(kind):
    """Sharding propagation from Megatron-annotated linears: grouped-query attention, rotary
    embeddings and RMSNorm (llama), a fused qkv projection and post-norm (bert) on tp."""
    extra = {"kv_heads": 2} if kind == "llama" else {}
    model, batches, loss_fn = zoo_case(kind, STEPS, **extra)
    annotate_zoo_megatron(model, kind)
    if kind == "bert":
        # the key third of the fused qkv bias has an exactly zero gradient (softmax ignores a
        # constant per row); Adam turns its rounding noise into lr-sized steps: freeze it
        for layer in model.layers:
            layer.qkv.bias.requires_grad_(False)
    cfg = ParallelConfig(mode="auto", mesh=DP_TP, comm_fusion=NO_FUSION)
    # Adam's step m/sqrt(v) does not depend on the gradient's size: where a BERT gradient
    # element nearly cancels over the batch (fc2), the different fp32 summation order of split
    # matmuls changes it by ~1e-3 relative, and Adam turns that into 1e-3 of lr per step
    # (2.4e-5 seen, over rtol 1e-4). SGD's error is lr times the absolute gradient error,
    # which fp32 rounding bounds: exactness is tested with SGD here, AdamW in test_plan_matrix.
    plan = check_case(model, batches, cfg, loss_fn, sgd if kind == "bert" else adamw, 4)
    assert {"all_reduce", "all_gather"} <= {c.kind for c in plan.collectives if c.axes == ("tp",)}


def test_cnn_auto_plan_matches_one_device_with_sgd():
    """(AdamW on every model and searcher: tests/sim/test_plan_matrix.py.)"""
    model, batches, loss_fn = zoo_case("cnn", 2)
    # A convolution's bias feeding batch norm has an exactly zero gradient; Adam turns the
    # rounding noise in it into lr-sized steps on any parallel run. Freeze those biases.
    for block in model.features:
        block[0].bias.requires_grad_(False)
    cfg = ParallelConfig(mode="auto", mesh=DP_TP, comm_fusion=NO_FUSION)
    plan = check_case(model, batches, cfg, loss_fn, sgd, 4)
    # the plan splits batch norm over channels: running statistics live split, updated locally
    assert any(op.target == "aten.batch_norm.default" and op.inputs[0].dims[1] for op in plan.ops)


def hf_model(arch: str) -> torch.nn.Module:
    """An unmodified Hugging Face GPT-2 ("gpt2") or Llama, tiny, from a config, random weights."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[dev]')"
    )
    torch.manual_seed(0)
    if arch == "gpt2":
        conf = transformers.GPT2Config(
            vocab_size=32,
            n_positions=8,
            n_embd=16,
            n_layer=1,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(conf)
    conf = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
    )
    return transformers.LlamaForCausalLM(conf)


def hf_loss(model, batch):
    ids, targets = batch
    t = ids.shape[1]
    # A prepared 4-D causal mask is used as given; building one itself under export, the
    # model goes through vmap, a higher-order op that capture does not plan.
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(ids.shape[0], 1, t, t)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_plan_that_does_not_fit_the_model_is_refused():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2))
    batches = gpt_batches(GPT, 1)
    cfg = ParallelConfig(mode="semi_auto", mesh=DP_TP)
    plan = plait.plan(model, batches[0], cfg, loss_fn=gpt_loss)
    with plait.testing.simulate(4), pytest.raises(plait.PlanError, match=r"blocks\.1"):
        build_plan_job(TinyGPT(GPT), plan, cfg, gpt_loss, adamw, batches[0])


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (("a", None), (None, "b")),  # all_gather + slice
        (("b", "a"), (("b", "a"), None)),  # all_to_all between strided shards
        ((None, ("a", "b")), ("b", "a")),
    ],
)
def test_execute_redistribution_runs_the_planned_steps_and_returns_gradients(src, dst):
    lay = plait.Layout((2, 2), ("a", "b"))
    source, target = lay(*(d or "None" for d in src)), lay(*(d or "None" for d in dst))
    full = torch.arange(96.0).reshape(8, 12)
    plan = plan_redistribution(source, target, (8, 12))
    with plait.testing.simulate(4):
        mesh = build_device_mesh(lay.mesh)
        x = distribute(full, mesh, source).requires_grad_(True)
        with CollectiveLog(mesh) as log:
            y = execute_redistribution(x, plan)
        assert [(e.kind, e.axis, e.bytes) for e in log.events] == [
            (s.kind, s.axis, s.nbytes) for s in plan.steps if not s.is_local
        ]
        assert layout_of(y) == target
        assert torch.equal(full_value(y), full)
        (y * y).sum().backward()
        assert layout_of(x.grad) == source  # the gradient comes back in the source's layout
        assert torch.equal(full_value(x.grad), 2 * full)


class _DropNorm(torch.nn.Module):
    """Dropout and batch norm: ops that behave differently in evaluation; and an op only
    evaluation runs (the user's own ``if not self.training`` branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.drop = torch.nn.Dropout(0.5)
        self.norm = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.drop(torch.relu(self.fc1(x))))
        if not self.training:
            h = h.clamp(-0.5, 0.5)
        return self.fc2(h)


def _mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def test_evaluate_runs_the_plan_in_evaluation_mode_and_changes_no_state():
    """job.evaluate on a plan job: no dropout, batch norm on its running statistics, the
    eval-only clamp run (replicated, as an op the plan does not have), and no buffer updated
    (running statistics, batch count), as model.eval() on one device."""
    torch.manual_seed(0)
    model = _DropNorm()
    batch = (torch.randn(8, 16), torch.randn(8, 8))
    cfg = ParallelConfig(mode="auto", mesh=DP_TP)
    with torch.no_grad():  # running statistics that differ from the batch's
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    expected = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = _mse(expected, batch).item()
    plan = plait.plan(model, batch, cfg, loss_fn=_mse)
    with plait.testing.simulate(4):
        job = build_plan_job(copy.deepcopy(model), plan, cfg, _mse, sgd, batch)
        before = job.full_state_dict()
        got = [job.evaluate(batch)]
        with CollectiveLog(job.device_mesh) as log:
            got.append(job.evaluate(batch))
        after = job.full_state_dict()
        # evaluation ran as its own per-rank program (the forward alone, nothing trained),
        # and issued its collectives and the loss's one reduction, nothing more
        program = job.evaluation_program
        assert program is not None and program is not job.program and program.trained == ()
        expected = Counter((c.kind, c.axis) for c in program.collectives())
        for i, placement in enumerate(program.loss_placements):
            if placement.is_partial():
                expected["all_reduce", job.device_mesh.mesh_dim_names[i]] += 1
    assert expected and log.counts() == dict(expected)
    assert got == pytest.approx([want, want], rel=1e-5)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    evaluation = job.loss_fn._evaluation
    assert {op.name for op in evaluation.plan.ops if not op.covered} == {"clamp"}
    assert not {op.name for op in plan.ops} - {op.name for op in evaluation.plan.ops} - {"add_"}


class _Norm(torch.nn.Module):
    """Batch norm between two linears: training and evaluation compute different things."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("given", ["config", "plan"])
def test_model_handed_over_in_eval_mode_trains_in_training_mode(given: str):
    """plait.plan and parallelize export the program Job.step runs (training mode) whatever
    mode the model was left in, and leave the user's module modes as they were."""
    torch.manual_seed(0)
    model = _Norm()
    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(3)]
    expected = reference_run(model.train(), _mse, sgd, batches)  # batch statistics, updated
    model.eval()
    cfg = ParallelConfig(mode="auto", mesh=DP_TP)
    if given == "plan":
        cfg = plait.plan(model, batches[0], cfg, loss_fn=_mse)
        assert not model.training
        assert any(op.target == "aten.add_.Tensor" for op in cfg.ops)  # the batch count
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=_mse, example_batch=batches[0]
        )
        assert not job.model.training  # building changed no mode
        targets = [str(n.args[5]) for n in job.loss_fn.captured.program.graph.nodes
                   if str(n.target) == "aten.batch_norm.default"]  # fmt: skip
        assert targets == ["True"]  # training=True: the training program
        actual = parallel_steps(job, batches)
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)


class _TrainingOnly(torch.nn.Module):
    """Training-only work before and beside what both modes run: a noise-free "drop path"
    scale (an op ahead of the shared ones, shifting op names) and an auxiliary head whose
    parameters evaluation never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)
        self.aux = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x * 0.9
        h = torch.relu(self.fc1(x))
        out = self.fc2(h * 2.0)
        if self.training:
            out = out + 0.3 * self.aux(h)
        return out


@pytest.mark.parametrize("search", ["sharding_propagation", "dynamic_programming"])
def test_training_only_ops_and_parameters_leave_evaluation_correct(search: str):
    torch.manual_seed(0)
    model = _TrainingOnly()
    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(3)]
    expected = reference_run(model, _mse, sgd, batches)
    cfg = ParallelConfig(mode="auto", mesh=DP_TP, search=search)
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=_mse, example_batch=batches[0]
        )
        actual = parallel_steps(job, batches)
        got = job.evaluate(batches[0])
        evaluation = job.loss_fn._evaluation.plan
    assert_same_run(expected, actual, rtol=1e-4, atol=1e-5)
    trained = copy.deepcopy(model)
    trained.load_state_dict(expected.state)
    with torch.no_grad():
        want = _mse(trained.eval(), batches[0]).item()
    assert got == pytest.approx(want, rel=1e-5)
    readers = {p.name: p.op for p in evaluation.parameters}
    assert readers["aux.weight"] == "" and readers["fc1.weight"] == "linear"
    assert all(op.covered for op in evaluation.ops)  # every eval op matched a planned one


def test_python_values_in_the_batch_are_fixed_by_the_export():
    """A float in the batch is a constant of the exported program: the same value runs; under
    a given plan another is refused by name before any collective (it would silently be
    ignored); a job plait planned exports and plans again for it (plait.runtime.engine.replan)."""

    def scaled(model, batch):
        x, y, scale = batch
        return F.mse_loss(model(x) * scale, y)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    cfg = ParallelConfig(mode="auto", mesh=DP_TP)
    batches = [(x, y, 0.5), (x, y, 2.0)]
    expected = reference_run(model, scaled, sgd, batches)
    plan = plait.plan(model, cfg, example_batch=batches[0], loss_fn=scaled)
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=scaled, example_batch=batches[0]
        )
        actual = parallel_steps(job, batches)
        given = plait.parallelize(
            copy.deepcopy(model), plan, optimizer=sgd, loss_fn=scaled, example_batch=batches[0]
        )
        given.step(batches[0])
        with CommDebugMode() as comm, pytest.raises(ShardingError, match=r"batch leaf 2 is 2.0"):
            given.step(batches[1])
    assert comm.get_total_counts() == 0
    assert_same_run(expected, actual, rtol=1e-5, atol=1e-6)
