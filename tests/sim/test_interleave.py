"""Multi-copy parallel (``ParallelConfig(interleave_num=k)``) on simulated ranks.

Each micro-batch is cut into k copies along the batch; the plan is made for one copy and the
per-rank program runs every copy, ordered so that a copy's collective is in flight while
another copy computes (:mod:`plait.runtime.program.interleave`). TinyGPT with Megatron's
annotations on dp=2 x tp=2: training equals one device (fp32, AdamW, rtol 1e-4: every
parameter of TinyGPT has a gradient, none is a key bias); the step's collectives are exactly
the plan's (each copy's, half the bytes; the gradient reductions once); the program's order
puts another copy's compute between each forward all-reduce and its wait. Through
``parallelize`` (mode auto) with ZeRO-3 and gradient accumulation too. Settings it cannot
serve are refused by name before anything runs.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait import support
from plait.annotate import megatron
from plait.config import ParallelConfig
from plait.cost.hardware import local_defaults, save_profile
from plait.cost.link import Link
from plait.errors import ConfigError, NotBuiltError, ShardingError
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.runtime.program.interleave import copy_masks
from plait.runtime.program.remat import is_collective
from plait.testing.comm import CollectiveLog
from plait.testing.equivalence import Run, assert_same_run, reference_run
from tests.sim.test_plan_exec import (
    adamw,
    debug_counts,
    executed_collectives,
    gpt_batches,
    planned_collectives,
    sgd,
)

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2)
MESH = {"dp": 2, "tp": 2}
RTOL = 1e-4
_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _turns(graph) -> tuple[int, int]:
    """(covered, uncovered): collectives of one copy between whose start and wait the
    program computes something of the other copy, and those where it does not."""
    nodes = list(graph.nodes)
    backward = next(
        n for n in nodes if (n.meta.get("custom") or {}).get("plait_phase") == "backward"
    )
    masks = copy_masks(graph, backward)
    position = {n: i for i, n in enumerate(nodes)}
    covered = uncovered = 0
    for wait in (n for n in nodes if n.target is _WAIT):
        start = wait.args[0]
        if masks[start] not in (1, 2):
            continue  # a collective of no single copy (the gradient buckets, the loss)
        other = 3 - masks[start]
        between = nodes[position[start] + 1 : position[wait]]
        if any(masks[n] == other and not is_collective(n) for n in between):
            covered += 1
        else:
            uncovered += 1
    return covered, uncovered


def test_copies_train_as_one_device_each_with_its_own_collectives() -> None:
    """semi_auto on dp=2 x tp=2 with interleave_num=2 (AdamW): equal to one device; step 2's
    collectives are the plan's (plait's log and CommDebugMode alike), each copy's the
    collectives of one micro-batch on half its rows; the program takes turns."""
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    megatron(model, 2)
    batches = gpt_batches(GPT, 3)
    expected = reference_run(model, gpt_loss, adamw, batches)
    one = plait.plan(model, ParallelConfig(mode="semi_auto", mesh=MESH), example_batch=batches[0],
                     loss_fn=gpt_loss)  # fmt: skip
    cfg = ParallelConfig(mode="semi_auto", mesh=MESH, interleave_num=2)
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batches[0]
        )
        plan = job.loss_fn.plan
        losses = [job.step(batches[0])]
        with CommDebugMode() as debug, CollectiveLog(job.device_mesh) as log:
            losses.append(job.step(batches[1]))
        losses.append(job.step(batches[2]))
        actual = Run(losses, job.full_state_dict())
        graph = job.program.graph_module.graph
    assert_same_run(expected, actual, rtol=RTOL, atol=1e-6)
    executed = executed_collectives(log)
    assert executed == planned_collectives(plan)
    assert sum(debug_counts(debug).values()) == sum(executed.values())
    assert job.loss_fn.mismatches == []
    assert plan.interleave_num == 2 and job.program.copies == 2
    assert plan.batch == tuple((s[0] // 2, *s[1:]) for s in one.batch)
    # Each copy issues the tensor-parallel collectives of one micro-batch on half its rows:
    # twice as many, each half the bytes. The gradients are summed over the copies inside
    # the program and reduced over dp once, in the same buckets; the loss is reduced once.
    planned_one = planned_collectives(one)
    over_tp = Counter({(k, b // 2): 2 * n for (k, a, b), n in planned_one.items() if a == "tp"})
    assert Counter({(k, b): n for (k, a, b), n in executed.items() if a == "tp"}) == over_tp
    gradients = {key: n for key, n in planned_one.items() if key[1] == "dp" and key[2] > 64}
    assert {key: n for key, n in executed.items() if key[1] == "dp" and key[2] > 64} == gradients
    assert "per copy, 2 copies interleaved" in plan.summary()
    reasons = [c.reason for c in plan.collectives if "tp" in c.axes]
    assert reasons and all(r.endswith("(each of 2 copies, interleaved)") for r in reasons)
    # Between each tp collective a copy starts and its wait, the other copy computes (5 in
    # forward and 5 in backward a copy), but where a copy has nothing left to compute
    covered, uncovered = _turns(graph)
    assert covered >= 16 and uncovered <= 4, (covered, uncovered)


def test_auto_with_zero3_accumulation_and_recompute_trains_as_one_device() -> None:
    """parallelize in mode auto on dp=2 x tp=2 with interleave_num=2, ZeRO-3,
    grad_accumulation=2 and full recompute (SGD): equal to one device; what runs is what the
    plan lists; evaluate takes the step's batch."""
    torch.manual_seed(1)
    model = TinyGPT(GPT)
    megatron(model, 2)
    batches = gpt_batches(GPT, 3, batch=8)
    expected = reference_run(model, gpt_loss, sgd, batches)
    cfg = ParallelConfig(
        mode="auto", search="dynamic_programming", mesh=MESH, interleave_num=2,
        grad_accumulation=2, optimizer_shard=3, recompute="full",
    )  # fmt: skip
    with plait.testing.simulate(world_size=4):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=gpt_loss, example_batch=batches[0]
        )
        plan = job.loss_fn.plan
        losses = [job.step(batches[0])]
        with CollectiveLog(job.device_mesh) as log:
            losses.append(job.step(batches[1]))
        losses.append(job.step(batches[2]))
        actual = Run(losses, job.full_state_dict())
        evaluated = job.evaluate(batches[0])
    assert_same_run(expected, actual, rtol=RTOL, atol=1e-5)
    assert executed_collectives(log) == planned_collectives(plan)
    assert plan.batch == ((2, GPT.seq), (2, GPT.seq))  # 8 rows: 2 micro-steps x 2 copies
    trained = copy.deepcopy(model)
    trained.load_state_dict(expected.state)
    with torch.no_grad():
        quarters = [
            gpt_loss(trained, tuple(x[i : i + 2] for x in batches[0])) for i in (0, 2, 4, 6)
        ]
    assert evaluated == pytest.approx(float(sum(quarters)) / 4, rel=1e-5)


def test_settings_it_cannot_serve_are_refused_by_name() -> None:
    model = TinyGPT(GPT)
    megatron(model, 2)
    batch = gpt_batches(GPT, 1)[0]
    with pytest.raises(ConfigError, match=r"interleave_num=2.*would do nothing.*'tp' axis"):
        plait.plan(model, ParallelConfig(mode="data_parallel", devices=4, interleave_num=2),
                   example_batch=batch, loss_fn=gpt_loss)  # fmt: skip
    with pytest.raises(NotBuiltError, match=r"interleave_num=2.*pipeline"):
        plait.plan(model, ParallelConfig(mode="semi_auto", mesh={"pp": 2, "tp": 2},
                                         interleave_num=2),
                   example_batch=batch, loss_fn=gpt_loss)  # fmt: skip
    with pytest.raises(NotBuiltError, match=r"interleave_num=2, mode='hybrid'"):
        support.check(ParallelConfig(mode="hybrid", mesh=MESH, interleave_num=2))
    with pytest.raises(ConfigError, match=r"interleave_num=0 is not allowed"):
        ParallelConfig(interleave_num=0)
    with pytest.raises(ShardingError, match=r"grad_accumulation=1 micro-batches of "
                                             r"interleave_num=3 copies"):  # fmt: skip
        plait.plan(model, ParallelConfig(mode="semi_auto", mesh=MESH, interleave_num=3),
                   example_batch=batch, loss_fn=gpt_loss)  # fmt: skip
    with pytest.raises(ConfigError, match="did you mean interleave_num"):
        ParallelConfig(multi_copy=2)  # type: ignore[call-arg]


def test_the_plan_prices_the_copies_overlap() -> None:
    """On a profile whose collectives run beside compute (a100-80g: comm_overlap 1), two
    copies hide part of the ops' tp collectives behind the other copy's compute, where one
    copy hides none of them: the prediction's overlapped seconds grow by what
    ``interleaved_seconds`` gives, and the copies' activations are held at once."""
    from plait.planning.estimate import interleaved_seconds

    model = TinyGPT(GPTConfig(vocab=256, seq=64, width=128, heads=4, layers=2))
    megatron(model, 2)
    batch = gpt_batches(GPTConfig(vocab=256, seq=64, width=128, heads=4, layers=2), 1, batch=16)[0]
    plans = {
        k: plait.plan(
            model,
            ParallelConfig(mode="semi_auto", mesh=MESH, interleave_num=k, hardware="a100-80g"),
            example_batch=batch,
            loss_fn=gpt_loss,
        )
        for k in (1, 2)
    }
    one, two = plans[1].predicted, plans[2].predicted
    params = {p.name for p in plans[2].parameters}
    op_comm = sum(
        c.seconds * c.count
        for c in plans[2].collectives
        if c.op not in params and c.op != "loss" and "tp" in c.axes
    )
    assert op_comm > 0
    gained = two.overlapped_s - one.overlapped_s
    # at most the other copy's share of compute; never more than the step communicates
    assert 0 < gained <= interleaved_seconds(two.communication_s, two.compute_s, 0.0, 2, 1.0)
    assert gained >= interleaved_seconds(op_comm, two.compute_s, one.overlapped_s, 2, 1.0)
    assert two.overlapped_s <= two.communication_s
    assert two.memory_by_kind["activations"] > 0.9 * one.memory_by_kind["activations"]


def _profile(home: Path, *, overlap: float) -> None:
    """``local`` (``$PLAIT_HOME/local.json``) as a machine whose compute is slow beside its
    links (1e7 FLOP/s, 1 MB/s, no latency), so the ops' tp collectives are most of a step;
    ``overlap``: the share of them that runs beside compute (``comm_overlap``)."""
    base = local_defaults()
    link = Link(bandwidth=1e6, latency=0.0)
    slow = dataclasses.replace(
        base,
        comm_overlap=overlap,
        peak_flops=dict.fromkeys(base.peak_flops, 1e7),
        memory_bandwidth=1e7,
        intra_node=link,
        inter_node=link,
    )
    save_profile(slow, home / "local.json")


def test_auto_weighs_the_copy_count_and_trains_the_one_it_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``interleave_num="auto"``: mode auto plans 1 and 2 copies (each on its own batch
    piece) and keeps the faster. Where collectives run beside compute, 2 copies hide part of
    Megatron's tp all-reduces and win; the plan is the one ``interleave_num=2`` gives, its
    options hold both counts and its note says what each predicted. Where nothing overlaps,
    copies only add collectives: 1 is kept. parallelize takes the same choice and trains
    equal to one device (SGD)."""
    monkeypatch.setenv("PLAIT_HOME", str(tmp_path))
    torch.manual_seed(2)
    model = TinyGPT(GPT)
    megatron(model, 2)
    batches = gpt_batches(GPT, 2)

    def plan(k: int | str) -> plait.Plan:
        cfg = ParallelConfig(mode="auto", mesh=MESH, interleave_num=k)  # type: ignore[arg-type]
        return plait.plan(model, cfg, example_batch=batches[0], loss_fn=gpt_loss)

    _profile(tmp_path, overlap=1.0)
    chosen, one, two = plan("auto"), plan(1), plan(2)
    assert chosen.interleave_num == 2 and chosen.batch == two.batch
    assert chosen.predicted.step_time_s == two.predicted.step_time_s
    assert two.predicted.step_time_s < 0.95 * one.predicted.step_time_s
    assert {o.interleave_num for o in chosen.options} == {1, 2}
    assert chosen.options[0].interleave_num == 2
    assert "interleave_num='auto' chose 2 copies; weighed 1 copy: " in chosen.notes[-1]
    assert "2 copies interleaved" in chosen.notes[-2]  # the outer planner's why, per copy count
    header = chosen.summary().split("options weighed\n")[1].splitlines()[0].split()
    assert header[:3] == ["mesh", "micro", "copies"]  # the options table says each one's count
    with plait.testing.simulate(world_size=4):
        cfg = ParallelConfig(mode="auto", mesh=MESH, interleave_num="auto")
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=sgd, loss_fn=gpt_loss, example_batch=batches[0]
        )
        losses = [job.step(b) for b in batches]
        actual = Run(losses, job.full_state_dict())
    assert job.loss_fn.plan.interleave_num == 2 and job.program.copies == 2
    assert job.config.interleave_num == 2
    assert_same_run(reference_run(model, gpt_loss, sgd, batches), actual, rtol=RTOL, atol=1e-6)

    _profile(tmp_path, overlap=0.0)
    kept = plan("auto")
    assert kept.interleave_num == 1
    assert kept.predicted.step_time_s == plan(1).predicted.step_time_s
    assert "chose 1 copy (multi-copy off)" in kept.notes[-1]


def test_auto_copy_count_is_refused_where_it_cannot_choose() -> None:
    """``interleave_num="auto"`` is mode auto's to choose; on a mesh of data parallel alone
    it would do nothing; a count whose batch does not divide is left out by name."""
    model = TinyGPT(GPT)
    megatron(model, 2)
    with pytest.raises(ConfigError, match=r"interleave_num='auto'\) with mode='semi_auto'.*"
                                          r"only mode 'auto'"):  # fmt: skip
        ParallelConfig(mode="semi_auto", mesh=MESH, interleave_num="auto")
    with pytest.raises(ConfigError, match=r"interleave_num=auto.*would do nothing"):
        plait.plan(model, ParallelConfig(mode="auto", mesh={"dp": 4}, interleave_num="auto"),
                   example_batch=gpt_batches(GPT, 1)[0], loss_fn=gpt_loss)  # fmt: skip
    with pytest.raises(ConfigError, match=r"interleave_num='auto'\) with servers=2.*not both"):
        plait.plan(model, ParallelConfig(mode="auto", devices=4, interleave_num="auto"),
                   example_batch=gpt_batches(GPT, 1)[0], loss_fn=gpt_loss, servers=2)  # fmt: skip
    odd = gpt_batches(GPT, 1, batch=2)[0]  # 2 rows on dp=2: no room for 2 copies
    plan = plait.plan(model, ParallelConfig(mode="auto", mesh=MESH, interleave_num="auto"),
                      example_batch=odd, loss_fn=gpt_loss)  # fmt: skip
    assert plan.interleave_num == 1
    assert "2 copies not weighed" in plan.notes[-1]
