"""Optimizer parallel over shard groups smaller than the dp axis (HSDP, MindSpore's
``optimizer_weight_shard_size``) on simulated ranks.

dp=4 cut into shard groups of 2: each split parameter's optimizer states (and at level 3 the
parameter) are 1/2 of its piece; the step's collectives are exactly the plan's (reduce-scatter
and all-gathers inside a group of 2, the reduced shards all-reduced across the 2 groups);
training equals one device (TinyGPT, no key bias: every parameter has a real gradient, so
AdamW's steps compare at a tight tolerance). ``optimizer_shard_threshold=0`` splits every
parameter that can be split (the tiny model's pieces are all under the 64 KiB default).
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait.comm.dtensor import local_piece
from plait.config import CommFusion, ParallelConfig
from plait.graph import capture_program
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.planning import Plan, plan_graph
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import Run, assert_same_run, reference_run
from tests.sim.test_plan_exec import adamw, debug_counts, gpt_batches

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2)
RTOL = 1e-4
K = 2


@pytest.fixture(scope="module")
def gpt_and_batches():
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batches = gpt_batches(GPT, 3)
    return model, batches, reference_run(model, gpt_loss, adamw, batches)


def _planned(plan: Plan) -> Counter[tuple[str, str, int, int | None]]:
    """(kind, axis, bytes, group size or None for the whole axis) -> count per step."""
    out: Counter[tuple[str, str, int, int | None]] = Counter()
    for c in plan.collectives:
        for axis in c.axes:
            out[(c.kind, axis, c.nbytes, c.group_size)] += c.count
    return out


def _executed(log: CollectiveLog, groups, dp: int) -> Counter[tuple[str, str, int, int | None]]:
    """The log's collectives, HSDP's two groups named as the plan names them (dp, size)."""
    sizes = {groups.group: groups.n, groups.replicate: dp // groups.n}
    return Counter(
        (e.kind, "dp" if e.axis in sizes else e.axis, e.bytes, sizes.get(e.axis))
        for e in log.events
    )


def _train(model, cfg, batches, world: int):
    """Train a copy; step 2's collectives by plait's log and by CommDebugMode."""
    losses = []
    with plait.testing.simulate(world):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batches[0]
        )
        for i, batch in enumerate(batches):
            if i != 1:
                losses.append(job.step(batch))
                continue
            with CommDebugMode() as debug, CollectiveLog(job.device_mesh) as log:
                losses.append(job.step(batch))
        run = Run(losses, job.full_state_dict())
        # evaluation and prediction programs: the shards gathered inside them
        job.evaluated = job.evaluate(batches[0])
        job.predicted = job.predict((batches[0][0],))
    return job, run, log, debug


def _check_states(job, level: int) -> None:
    """Each split parameter's optimizer states are 1/K of its piece (not 1/dp); under ZeRO-3
    so is the parameter, under 1 and 2 it stays whole."""
    zero = job.optimizer._plait_shadows
    assert zero.n == K and zero.replicate is not None
    split = [spec for _, _, spec in zero.pairs if spec is not None]
    assert len(split) >= 20
    for p, shadow, spec in zero.pairs:
        piece = math.prod(spec.piece_shape if spec is not None else local_piece(p).shape)
        expected = piece // K if spec is not None else piece
        state = job.optimizer.state[shadow]
        assert shadow.numel() == expected
        assert state["exp_avg"].numel() == expected and state["exp_avg_sq"].numel() == expected
        if spec is not None:
            assert local_piece(p).numel() == (expected if level == 3 else piece)


# level 1 (whole gradients all-reduced, then the shards' gather) runs nightly: levels 2 and 3
# cover the shard groups' reduce-scatter and gathers in the default suite (make test's time)
@pytest.mark.parametrize("level", [pytest.param(1, marks=pytest.mark.nightly), 2, 3])
def test_shard_groups_of_two_on_dp4_match_one_device_with_the_plans_collectives(
    gpt_and_batches, level
):
    """dp=4, groups of 2, a few buckets: one step's collectives (kind, axis, bytes, group size)
    are exactly the plan's: level 1 all-reduces the whole gradients over dp and all-gathers
    the updated shards in groups of 2; levels 2 and 3 reduce-scatter in groups of 2 and
    all-reduce the shards across the 2 groups; level 3 gathers in groups of 2 before forward
    and again before backward. Optimizer states are 1/2 of each piece; training equals one
    device."""
    model, batches, expected = gpt_and_batches
    cfg = ParallelConfig(
        mode="semi_auto",
        mesh={"dp": 4},
        optimizer_shard=level,
        optimizer_shard_threshold=0,
        optimizer_weight_shard_size=K,
        comm_fusion=CommFusion(bucket_mb=0.004),  # a few buckets, not one
    )
    plan = plan_graph(capture_program(model, batches[0], gpt_loss).graph, cfg, model=model)
    assert plan.optimizer_weight_shard_size == K
    planned = _planned(plan)
    kinds = Counter()
    for (kind, _, _, size), n in planned.items():
        kinds[kind, size] += n
    phase = "forward" if level == 3 else "optimizer"
    buckets = sum(c.count for c in plan.collectives if (c.kind, c.phase) == ("all_gather", phase))
    assert buckets >= 4 and kinds["all_gather", None] == 0
    if level == 3:  # gathered again for backward (not a bucket backward never reads)
        assert buckets < kinds["all_gather", K] < 2 * buckets
    assert kinds["reduce_scatter", K] == (0 if level == 1 else buckets)
    assert kinds["all_reduce", 4 // K] == (0 if level == 1 else buckets)
    assert kinds["reduce_scatter", None] == 0
    job, run, log, debug = _train(model, cfg, batches, 4)
    assert _executed(log, job.optimizer._plait_shadows.groups, 4) == planned
    assert sum(debug_counts(debug).values()) == len(log.events)
    _check_states(job, level)
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)
    trained = copy.deepcopy(model)
    trained.load_state_dict(expected.state)
    with torch.no_grad():
        assert job.evaluated == pytest.approx(float(gpt_loss(trained.eval(), batches[0])), rel=RTOL)
        logits = trained.eval()(batches[0][0])
    torch.testing.assert_close(job.predicted, logits, rtol=RTOL, atol=1e-6)


@pytest.mark.nightly  # 8 simulated ranks, the slowest case here; dp x tp groups stay default in test_zero
def test_shard_groups_with_megatron_tp_on_eight_ranks(gpt_and_batches):
    """dp=4 x tp=2 (Megatron), ZeRO-3 in groups of 2 of dp: the tensor-parallel pieces are
    split again in groups of 2, and training equals one device."""
    model, batches, expected = gpt_and_batches
    model = annotate_megatron(copy.deepcopy(model), 2)
    cfg = ParallelConfig(
        mode="semi_auto",
        mesh={"dp": 4, "tp": 2},
        optimizer_shard=3,
        optimizer_shard_threshold=0,
        optimizer_weight_shard_size=K,
    )
    plan = plan_graph(capture_program(model, batches[0], gpt_loss).graph, cfg, model=model)
    job, run, log, _ = _train(model, cfg, batches, 8)
    assert _executed(log, job.optimizer._plait_shadows.groups, 4) == _planned(plan)
    _check_states(job, 3)
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)


def test_plan_records_the_shard_size_and_predicts_states_per_group():
    """The plan file keeps optimizer_weight_shard_size; the predicted optimizer states are
    those of groups of 2 (twice ZeRO over all 4), parameters at level 3 likewise."""
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    batch = gpt_batches(GPT, 1)[0]
    graph = capture_program(model, batch, gpt_loss).graph
    base = {"mode": "semi_auto", "mesh": {"dp": 4}, "optimizer_shard": 3}
    base["optimizer_shard_threshold"] = 0
    plans = {
        k: plan_graph(graph, ParallelConfig(**base, optimizer_weight_shard_size=k), model=model)
        for k in (None, 2)
    }
    full, half = (plans[k].predicted.memory_by_kind for k in (None, 2))
    assert half["optimizer"] > 1.8 * full["optimizer"]
    assert half["parameters"] > 1.5 * full["parameters"]
    back = Plan.from_json(plans[2].to_json())
    assert back == plans[2] and back.optimizer_weight_shard_size == 2
    reduce_scatters = [c for c in back.collectives if c.kind == "reduce_scatter"]
    assert reduce_scatters and all(c.group_size == 2 for c in reduce_scatters)


def test_a_parameter_no_dim_of_which_divides_by_the_group_stays_whole_naming_it(caplog):
    """A (6,) bias on dp=4 in groups of 4 would stay whole; in groups of 2 it splits. A (3,)
    bias divides by neither: it stays whole and the warning names it and the fix."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    x, y = torch.randn(8, 8), torch.randn(8, 3)

    def loss(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean()

    def sgd(p):
        return torch.optim.SGD(p, lr=0.1)

    expected = reference_run(model, loss, sgd, [(x, y), (x, y)])
    cfg = ParallelConfig(
        mesh={"dp": 4},
        optimizer_shard=2,
        optimizer_shard_threshold=0,
        optimizer_weight_shard_size=2,
    )
    with plait.testing.simulate(4), caplog.at_level("WARNING", logger="plait"):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=loss, example_batch=(x, y)
        )
        run = Run([job.step((x, y)) for _ in range(2)], job.full_state_dict())
    dims = {p.name: p.optimizer_shard_dim for p in job.loss_fn.plan.parameters}
    assert dims == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}
    warned = [r.getMessage() for r in caplog.records if "stays whole" in r.getMessage()]
    assert len(warned) == 1 and "2.bias" in warned[0]
    assert "optimizer_weight_shard_size=2" in warned[0] and "divisible by 2" in warned[0]
    assert_same_run(expected, run, rtol=1e-5, atol=1e-6)


def test_shard_groups_with_gradient_accumulation_reduce_once_per_step(gpt_and_batches):
    """HSDP level 2 with grad_accumulation=2: the micro-steps' gradients are summed locally
    and reduce-scattered in the groups once per step (as many reduce-scatters, and all-reduces
    across the groups, as the plan's buckets, not twice that); training equals one device."""
    model, batches, expected = gpt_and_batches
    cfg = ParallelConfig(
        mode="semi_auto",
        mesh={"dp": 4},
        optimizer_shard=2,
        optimizer_shard_threshold=0,
        optimizer_weight_shard_size=K,
        grad_accumulation=2,
    )
    losses = []
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batches[0]
        )
        losses.append(job.step(batches[0]))
        with CollectiveLog(job.device_mesh) as log:
            losses += [job.step(b) for b in batches[1:2]]
        losses += [job.step(b) for b in batches[2:]]
        run = Run(losses, job.full_state_dict())
    plan = job.loss_fn.plan
    buckets = sum(c.count for c in plan.collectives if c.kind == "reduce_scatter")
    assert buckets >= 1
    sizes = {job.optimizer._plait_shadows.groups.group: "group"}
    scatters = [e for e in log.events if e.kind == "reduce_scatter"]
    assert len(scatters) == buckets and all(e.axis in sizes for e in scatters)
    assert_same_run(expected, run, rtol=RTOL, atol=1e-6)
