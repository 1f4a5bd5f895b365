"""Megatron's sequence parallel on simulated ranks: equal to one device, its collectives.

``plait.annotate.megatron(model, tp, sequence_parallel=True)`` marks the vocabulary embedding
and every row-parallel projection with ``split_sequence``: their pending sums leave as a
reduce-scatter over the sequence, the norms and residual adds between the blocks run on a
slice of the sequence, each column-parallel projection all-gathers its input. TinyGPT on
dp=2 x tp=2 (semi_auto): training equals one device (fp32, AdamW, rtol 1e-4: every parameter
has a gradient, no key bias), the step's collectives are exactly the plan's list, the forward
all-reduces nothing over tp (plain tensor parallel all-reduces each row projection's output),
and the plan's activations are smaller. Bad marks are refused by name before anything runs.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait.annotate import get_shard_spec, megatron, split_sequence
from plait.config import ParallelConfig
from plait.errors import LayoutError, ShardingError
from plait.graph import capture_program
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.planning import plan_graph
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import Run, assert_same_run, reference_run
from tests.sim.test_plan_exec import (
    adamw,
    debug_counts,
    executed_collectives,
    gpt_batches,
    planned_collectives,
    run_plan,
)

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2)
MESH = {"dp": 2, "tp": 2}
RTOL = 1e-4


@pytest.fixture(scope="module")
def gpt_and_batches():
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batches = gpt_batches(GPT, 3)
    return model, batches, reference_run(model, gpt_loss, adamw, batches)


def _train(model, batches, sequence_parallel: bool):
    """Megatron annotations, semi_auto on dp=2 x tp=2, 3 steps; step 2's collectives checked
    against the plan's list (plait's log and torch's CommDebugMode alike)."""
    model = copy.deepcopy(model)
    megatron(model, 2, sequence_parallel=sequence_parallel)
    cfg = ParallelConfig(mode="semi_auto", mesh=MESH)
    captured = capture_program(model, batches[0], gpt_loss)
    plan = plan_graph(captured.graph, cfg, model=model)
    run, executed, debug, _ = run_plan(model, captured, plan, cfg, gpt_loss, adamw, batches, 4)
    assert executed == planned_collectives(plan)
    assert sum(debug.values()) == sum(executed.values())
    return plan, run


def _over_tp(plan) -> Counter[tuple[str, str]]:
    """(kind, phase) -> count per step of the plan's collectives over tp that move values of
    the step (parameters' gradient sums, listed under the parameter, left out)."""
    params = {p.name for p in plan.parameters}
    out: Counter[tuple[str, str]] = Counter()
    for c in plan.collectives:
        if "tp" in c.axes and c.op not in params:
            out[(c.kind, c.phase)] += c.count
    return out


def test_sequence_parallel_trains_as_one_device_with_reduce_scatters(gpt_and_batches):
    model, batches, expected = gpt_and_batches
    tp_plan, tp_run = _train(model, batches, sequence_parallel=False)
    sp_plan, sp_run = _train(model, batches, sequence_parallel=True)
    assert_same_run(expected, tp_run, rtol=RTOL, atol=1e-6)
    assert_same_run(expected, sp_run, rtol=RTOL, atol=1e-6)
    # plain tensor parallel all-reduces the vocab-parallel embedding's and the 4 row
    # projections' outputs in forward, and the inputs' gradients of the 5 column-parallel
    # readers (q/k/v and fc1 of each block, the head) in backward. Sequence parallel turns
    # each into a reduce-scatter and an all-gather: those outputs reduce-scattered over the
    # sequence, the readers' inputs all-gathered, each the other way round in backward.
    split = 1 + 2 * GPT.layers
    tp = _over_tp(tp_plan)
    assert tp[("all_reduce", "forward")] == tp[("all_reduce", "backward")] == split
    sp = _over_tp(sp_plan)
    assert ("all_reduce", "forward") not in sp and ("all_reduce", "backward") not in sp
    assert sp[("reduce_scatter", "forward")] == sp[("reduce_scatter", "backward")] == split
    assert sp[("all_gather", "backward")] == split
    assert sp[("all_gather", "forward")] == tp[("all_gather", "forward")] + split
    # what it all-reduces over tp besides: gradients of parameters read on a slice of the
    # sequence (the norms, the position embedding: 11 here), summed over the slices, all in
    # one all-reduce (#32 item 4: once one each, and each over dp alone too), then over dp
    # in their bucket with the rest
    pending = {p.name for p in sp_plan.parameters if p.grad_reduce_axes == ("dp", "tp")}
    assert {"blocks.0.ln1.weight", "ln.bias", "pos.weight"} <= pending and len(pending) == 11
    summed = [c for c in sp_plan.collectives if c.kind == "all_reduce" and "tp" in c.axes]
    nbytes = sum(4 * math.prod(p.shape) for p in sp_plan.parameters if p.name in pending)
    assert [(c.count, c.phase, c.nbytes) for c in summed] == [(1, "backward", nbytes)]
    assert summed[0].reason.startswith("gradients of 11 parameters (pos.weight, ")
    assert "summed over 'tp' in one fused all-reduce" in summed[0].reason
    over_dp = [c for c in sp_plan.collectives if c.axes == ("dp",) and c.phase == "backward"]
    assert [c.kind for c in over_dp] == ["all_reduce"]  # one bucket, the norms' among them
    assert not [c for c in sp_plan.collectives if "reduced alone" in c.reason]
    # the norms' and adds' activations are split: less kept per device
    activations = [p.predicted.memory_by_kind["activations"] for p in (sp_plan, tp_plan)]
    assert activations[0] < activations[1]


def test_megatron_marks_the_embedding_and_row_projections():
    model = TinyGPT(GPT)
    report = megatron(model, 2, sequence_parallel=True)
    rows = [path for path, (_, split) in report.roles.items() if split == "row"]
    assert report.sequence_parallel == ("tok", *rows)
    for path in report.sequence_parallel:
        spec = get_shard_spec(model.get_submodule(path))
        assert spec is not None and spec.sequence_split == ("tp", 1)
    assert "seq out" in str(report)
    plain = TinyGPT(GPT)
    assert megatron(plain, 2).sequence_parallel == ()
    assert get_shard_spec(plain.blocks[0].fc2).sequence_split is None  # type: ignore[union-attr]


def test_split_sequence_refuses_bad_marks():
    model = TinyGPT(GPT)
    with pytest.raises(ShardingError, match="dim must be the sequence dim"):
        split_sequence(model.blocks[0].fc2, "tp", dim=0)
    with pytest.raises(ShardingError, match="axis must be a mesh axis name"):
        split_sequence(model.blocks[0].fc2, "")
    with pytest.raises(ShardingError, match=r"expects an nn\.Module"):
        split_sequence("fc2")  # type: ignore[type-var]
    split_sequence(model.blocks[0].fc2, "tp")
    with pytest.raises(ShardingError, match="marked split along dim 1 over 'tp' before"):
        split_sequence(model.blocks[0].fc2, "mp")


@pytest.mark.parametrize(
    ("mesh", "seq", "error", "match"),
    [
        ({"dp": 2, "mp": 2}, 8, ShardingError, r"mesh \{'dp': 2, 'mp': 2\} has no axis 'tp'"),
        (
            {"dp": 1, "tp": 4},
            6,
            LayoutError,
            r"split_sequence on blocks\.0\.attn\.out .*dim 1 has size 6, which does not divide",
        ),
    ],
    ids=["no_such_axis", "sequence_does_not_divide"],
)
def test_a_mark_the_mesh_or_batch_cannot_take_is_refused_at_planning(mesh, seq, error, match):
    cfg = GPTConfig(vocab=32, seq=seq, width=16, heads=4, layers=2)
    model = TinyGPT(cfg)
    for block in model.blocks:
        split_sequence(block.attn.out, "tp")
    batch = gpt_batches(cfg, 1)[0]
    config = ParallelConfig(mode="semi_auto", mesh=mesh)
    with pytest.raises(error, match=match):
        plait.plan(model, config, example_batch=batch, loss_fn=gpt_loss)


@pytest.mark.parametrize(("optimizer_shard", "accumulation"), [(None, 2), (2, 1)])
def test_sequence_parallel_norm_gradients_are_summed_in_their_bucket(
    gpt_and_batches, optimizer_shard, accumulation
):
    """The norms' gradients, pending over dp and tp, are summed over tp once for all of them,
    then over dp with their bucket: inside the program's backward, and with gradient
    accumulation (the program's gradients summed first, reduced once a step by the Job's
    buckets) the same collectives; with ZeRO-2 the split parameters' reduce-scatter beside
    (the norms stay whole). Equal to one device (AdamW; the norms' true gradients are not
    zero), and what runs is the plan's list (plait's log and CommDebugMode). Without
    either, the first test here checks the same."""
    model, batches, expected = gpt_and_batches
    model = copy.deepcopy(model)
    megatron(model, 2, sequence_parallel=True)
    cfg = ParallelConfig(
        mode="semi_auto", mesh=MESH, grad_accumulation=accumulation,
        optimizer_shard=optimizer_shard,
    )  # fmt: skip
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            model, cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batches[0]
        )
        losses = [job.step(batches[0])]
        with CommDebugMode() as debug, CollectiveLog(job.device_mesh) as log:
            losses.append(job.step(batches[1]))
        losses.append(job.step(batches[2]))
        actual = Run(losses, job.full_state_dict())
    plan = job.loss_fn.plan
    assert_same_run(expected, actual, rtol=RTOL, atol=1e-6)
    executed = executed_collectives(log)
    assert executed == planned_collectives(plan)
    assert sum(debug_counts(debug).values()) == sum(executed.values())
    first = [c for c in plan.collectives if "in one fused all-reduce (pending there" in c.reason]
    assert [(c.axes, c.count) for c in first] == [(("tp",), 1)], first
