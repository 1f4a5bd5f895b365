"""Communication hidden behind compute (plait.planning.overlap): the bucket-by-bucket
simulation on a hand-timed graph, and what plans predict with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from plait.config import ParallelConfig
from plait.cost.errors import CostError
from plait.cost.hardware import get_profile
from plait.graph import capture
from plait.planning.assemble import assemble_plan
from plait.planning.overlap import (
    GATHER_BACKWARD,
    GATHER_FORWARD,
    P2P,
    REDUCE,
    Overlappable,
    StageClock,
)
from plait.planning.setup import prepare
from plait.search.propagation import sharding_propagation


def _three_linears():
    """x -> l0 -> l1 -> l2 -> sum: three matmul ops reading one weight each (no biases)."""
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))
    with torch.device("meta"):
        graph = capture(model.to("meta"), torch.zeros(2, 4), lambda m, x: m(x).sum())
    readers = {}
    for i, op in enumerate(graph.ops):
        for ref in op.inputs:
            g = graph.graph_input(ref)
            if g is not None and g.kind == "parameter":
                readers[g.target] = (i, g.name)
    return graph, readers


def _clock(graph, times: dict[int, float], micro_batches: int = 1) -> StageClock:
    """Every op 0 s except those in ``times`` (index -> seconds of forward + backward)."""
    op_time = {op.name: times.get(i, 0.0) for i, op in enumerate(graph.ops)}
    stage_of = {op.name: 0 for op in graph.ops}
    return StageClock(graph, stage_of, op_time, [False] * len(graph.ops), 1, micro_batches)


def test_a_bucket_hides_behind_the_backward_still_to_run_after_it() -> None:
    """Each linear costs 3 s (1 forward, 2 backward): backward runs l2, l1, l0 in 6 s. l2's
    bucket is ready at 2 s and its 1 s reduction ends at 3 s, inside backward; l0's is
    ready only when backward ends, so its 1 s is exposed: 1 of 2 s hides."""
    graph, readers = _three_linears()
    clock = _clock(graph, {readers[f"{k}.weight"][0]: 3.0 for k in range(3)})
    assert clock.backward_s == [pytest.approx(6.0)]
    last = Overlappable(REDUCE, (readers["2.weight"][1],), 1.0)
    first = Overlappable(REDUCE, (readers["0.weight"][1],), 1.0)
    assert clock.hidden(0, [first, last], 1.0) == pytest.approx(1.0)
    # a reduction longer than the backward after it: it runs past the end of backward
    long = Overlappable(REDUCE, (readers["2.weight"][1],), 5.0)
    assert clock.hidden(0, [long, first], 1.0) == pytest.approx(4.0)  # ends 7, l0 at 8: 2 late
    # the hardware's overlap scales what hides; nothing hides at 0
    assert clock.hidden(0, [first, last], 0.5) == pytest.approx(0.5)
    assert clock.hidden(0, [first, last], 0.0) == 0.0
    # micro-batches: only the last one's backward (6/3 = 2 s) can hide the reductions
    clock3 = _clock(graph, {readers[f"{k}.weight"][0]: 3.0 for k in range(3)}, micro_batches=3)
    assert clock3.hidden(0, [last], 1.0) == pytest.approx(1.0)  # ready 2/3, ends 5/3 < 2
    assert clock3.hidden(0, [long], 1.0) == pytest.approx(2.0 - 2 / 3)


def test_prefetched_gathers_wait_only_where_compute_needs_them_first() -> None:
    """Forward: l0 at 0 s, l1 at 1 s, l2 at 2 s. Gathers of 1 s each, issued back to back: the
    first is needed at once (1 s exposed), the others are done when needed (2 s hide). Before
    backward the same mirrored: l2's gather is needed at once, l0's after 4 s."""
    graph, readers = _three_linears()
    clock = _clock(graph, {readers[f"{k}.weight"][0]: 3.0 for k in range(3)})
    names = {k: (readers[f"{k}.weight"][1],) for k in range(3)}
    forward = [Overlappable(GATHER_FORWARD, names[k], 1.0) for k in range(3)]
    assert clock.hidden(0, forward, 1.0) == pytest.approx(2.0)
    backward = [Overlappable(GATHER_BACKWARD, names[k], 1.0) for k in range(3)]
    assert clock.hidden(0, backward, 1.0) == pytest.approx(2.0)
    slow = [Overlappable(GATHER_FORWARD, names[k], 3.0) for k in range(3)]
    # done at 3, 6, 9 against needs 0, 1, 2: compute waits 7 s in all, 2 of 9 s hide
    assert clock.hidden(0, slow, 1.0) == pytest.approx(2.0)


def _dp_plan(hardware, **extra):
    from plait.models import ModelSpec, build

    spec = ModelSpec(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=128, batch=16)
    with torch.device("meta"):
        model, batch, loss = build(spec)
    graph = capture(model, batch, loss)
    cfg = ParallelConfig(mode="data_parallel", mesh={"dp": 8}, hardware="a100-80g", **extra)
    setup = prepare(graph, cfg, model=model)
    decisions = sharding_propagation(setup.problem, setup.allowed, setup.configured)
    return assemble_plan(graph, cfg, setup.mesh, setup.problem, decisions, setup.topology, hardware)


@pytest.mark.parametrize("extra", [{}, {"optimizer_shard": 3}])
def test_a_plan_takes_what_hides_off_its_step(extra) -> None:
    """Data parallel on 8 A100s (ZeRO-3 too): the buckets' reductions (and the gathers) partly
    hide behind compute; the step is compute + communication - what hides + optimizer; the
    first bucket's reduction (the embeddings, made last) never hides. Without overlap in the
    profile, nothing hides and the step is the sum as before."""
    a100 = get_profile("a100-80g")
    plan = _dp_plan(a100, **extra)
    p = plan.predicted
    assert 0 < p.overlapped_s < p.communication_s
    assert p.step_time_s == pytest.approx(
        p.compute_s + p.communication_s - p.overlapped_s + p.bubble_s + p.optimizer_s
    )
    none = _dp_plan(dataclasses.replace(a100, comm_overlap=0.0), **extra).predicted
    assert none.overlapped_s == 0.0 and none.communication_s == p.communication_s
    assert none.step_time_s == pytest.approx(p.step_time_s + p.overlapped_s)


def test_comm_overlap_outside_0_1_is_refused_by_name() -> None:
    with pytest.raises(CostError, match=r"comm_overlap=1.5 .* in \[0, 1\]"):
        dataclasses.replace(get_profile("h100"), comm_overlap=1.5)


@pytest.mark.parametrize(("overhead", "floor"), [(1e-3, 0.0), (0.0, 1e-3)])
def test_micro_batches_pay_each_ops_fixed_costs_again(overhead, floor) -> None:
    """Four micro-batches run every op four times on a quarter of the work: its byte- and
    FLOP-bound time is the same, its per-op host cost (or the kernel floor of an op below it)
    is paid three times more, forward and backward (3 passes), per micro-step."""
    from plait.cost.hardware import local_defaults
    from plait.planning.estimate import micro_batch_seconds
    from plait.planning.setup import compute_model

    graph, _ = _three_linears()
    hw = dataclasses.replace(local_defaults(), op_overhead=overhead, kernel_latency=floor)
    stage_of = {op.name: 0 for op in graph.ops}
    pieces = {op.name: 1 for op in graph.ops}
    cfg = ParallelConfig(micro_batches=4, grad_accumulation=2)
    op_compute = compute_model(hw, "fp32")
    (extra,) = micro_batch_seconds(graph, stage_of, pieces, op_compute, cfg, 1)
    working = sum(1 for op in graph.ops if op.flops or op.bytes)
    counted = len(graph.ops) if overhead else working  # the floor only where there is work
    assert extra == pytest.approx(counted * 3 * 1e-3 * 3 * 2)
    one = dataclasses.replace(cfg, micro_batches=1)
    assert micro_batch_seconds(graph, stage_of, pieces, op_compute, one, 1) == [0.0]


def test_all_but_one_pipeline_transfer_each_way_hide() -> None:
    """Four micro-batches: a stage's four activations received and four gradients sent; in
    the steady state three of each arrive while it computes other micro-batches."""
    graph, _ = _three_linears()
    clock = _clock(graph, {}, micro_batches=4)
    sends = [Overlappable(P2P, (), 8.0), Overlappable(P2P, (), 4.0)]  # 4 transfers of 2 s, of 1 s
    assert clock.hidden(0, sends, 1.0) == pytest.approx(6.0 + 3.0)
    assert _clock(graph, {}, micro_batches=1).hidden(0, sends, 1.0) == 0.0


def test_a_pipeline_plan_hides_its_steady_state_transfers() -> None:
    from plait.models import ModelSpec, build

    spec = ModelSpec(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=128, batch=16)
    with torch.device("meta"):
        model, batch, loss = build(spec)
    graph = capture(model, batch, loss)
    cfg = ParallelConfig(
        mode="auto", mesh={"pp": 2, "tp": 2}, pipeline_stages=2, micro_batches=4,
        hardware="a100-80g",
    )  # fmt: skip
    setup = prepare(graph, cfg, model=model)
    decisions = sharding_propagation(setup.problem, setup.allowed, setup.configured)
    plan = assemble_plan(
        graph, cfg, setup.mesh, setup.problem, decisions, setup.topology, setup.hardware
    )
    sends = [c for c in plan.collectives if c.kind == "send_recv"]
    assert sends and all(c.count == 4 for c in sends)
    p = plan.predicted
    assert 0 < p.overlapped_s < p.communication_s
