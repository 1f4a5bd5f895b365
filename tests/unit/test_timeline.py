"""Pipeline timelines: schedule orders, the predicted bubble per schedule, the picture, the trace.

Single process, no process group. The orders below were checked against the orders torch's
schedules build and against a real 2-process gloo run (StageTimer around torch's stages):
1F1B, GPipe, interleaved 1F1B and interleaved zero bubble ran exactly these passes.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from fractions import Fraction

import pytest
import torch

from plait.cli import main
from plait.config import ParallelConfig
from plait.cost.memory import in_flight_micro_batches
from plait.errors import PlanError
from plait.graph import capture
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.planning import Plan, plan_graph
from plait.planning.timeline import (
    SCHEDULES,
    StageTimes,
    Timeline,
    TimelineEvent,
    bubble_seconds,
    copies_timeline,
    schedule_order,
    simulate,
    stage_rank,
    timeline_from_records,
)
from plait.runtime.pipeline.stage_timer import StageTimer

VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zero_bubble_v": 2}
EVEN = StageTimes(forward_s=1.0, backward_s=2.0, weight_s=1.0)  # F = B = W, no communication


def _order(schedule: str, p: int, m: int, v: int = 1, *, stages: bool = False) -> list[str]:
    return [
        " ".join(a.short + (f"/{a.stage}" if stages else "") for a in rank)
        for rank in schedule_order(schedule, p, m, v)
    ]


# --------------------------------------------------------------------------- orders


def test_gpipe_and_1f1b_orders() -> None:
    assert _order("gpipe", 2, 3) == ["F0 F1 F2 B0 B1 B2"] * 2
    assert _order("1f1b", 2, 4) == ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]
    # 4 ranks: rank r warms up with 4 - r forwards; fewer micro-batches than that: all first
    assert _order("1f1b", 4, 6)[1] == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert _order("1f1b", 4, 2)[0] == "F0 F1 B0 B1"


def test_interleaved_and_zero_bubble_orders() -> None:
    """p=2, m=4, two chunks a rank (rank r runs chunks r and r + 2): forwards by chunk in
    rounds of micro-batches, backwards through the chunks in reverse; zero bubble warms up
    less, splits each backward and runs the weight passes one behind (rank 1: from its 2nd)."""
    assert _order("interleaved_1f1b", 2, 4, 2, stages=True) == [
        "F0/0 F1/0 F0/2 F1/2 F2/0 B0/2 F3/0 B1/2 F2/2 B0/0 F3/2 B1/0 B2/2 B3/2 B2/0 B3/0",
        "F0/1 F1/1 F0/3 B0/3 F1/3 B1/3 F2/1 B0/1 F3/1 B1/1 F2/3 B2/3 F3/3 B3/3 B2/1 B3/1",
    ]
    assert _order("zero_bubble", 2, 4, 2, stages=True)[1] == (
        "F0/1 F1/1 F0/3 B0/3 F1/3 B1/3 W0/3 F2/1 B0/1 W1/3 F3/1 B1/1 W0/1 F2/3 B2/3 W1/1 "
        "F3/3 B3/3 W2/3 B2/1 W3/3 B3/1 W2/1 W3/1"
    )
    # ZB-V: rank 0 runs chunks 0 and 3, rank 1 chunks 1 and 2 (the V turns on the last rank)
    assert [stage_rank("zero_bubble_v", s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert _order("zero_bubble_v", 2, 4, 2, stages=True)[1] == (
        "F0/1 F0/2 F1/1 F1/2 B0/2 W0/2 F2/1 B0/1 W0/1 F2/2 B1/2 W1/2 F3/1 B1/1 W1/1 F3/2 "
        "B2/2 W2/2 B2/1 B3/2 B3/1 W2/1 W3/2 W3/1"
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_pass_runs_once(schedule: str) -> None:
    p, m, v = 3, 6, VIRTUAL[schedule]
    kinds = (
        ("forward", "backward", "weight")
        if schedule.startswith("zero")
        else ("forward", "backward")
    )
    for r, rank in enumerate(schedule_order(schedule, p, m, v)):
        chunks = {s for s in range(p * v) if stage_rank(schedule, s, p) == r}
        want = sorted((k, s, i) for k in kinds for s in chunks for i in range(m))
        assert sorted((a.kind, a.stage, a.micro_batch) for a in rank) == want


def test_bad_pipelines_are_refused_by_name() -> None:
    with pytest.raises(PlanError, match="schedule='pipedream'"):
        schedule_order("pipedream", 2, 4)
    with pytest.raises(PlanError, match="runs one chunk a rank"):
        schedule_order("1f1b", 2, 4, 2)
    with pytest.raises(PlanError, match="micro_batches=5"):
        schedule_order("interleaved_1f1b", 2, 5, 2)


# --------------------------------------------------------------------------- the bubble


def test_simulated_bubble_equals_the_closed_forms() -> None:
    """Equal passes, no communication: the timeline's idle time is the formula's, for every
    schedule but ZB-V (equal there too when F = B = W)."""
    p, m = 4, 8
    for schedule in SCHEDULES:
        v = VIRTUAL[schedule]
        timeline = simulate(schedule, p, m, EVEN, v)
        assert timeline.bubble_s == pytest.approx(bubble_seconds(schedule, p, 1.0, 2.0, 1.0, v))
    one = simulate("1f1b", p, m, EVEN)
    assert one.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    # ZB-H1 (Qi et al.): (p - 1)(F + B - W), B the input gradient; here 1/3 of 1F1B's
    uneven = StageTimes(forward_s=1.0, backward_s=2.5, weight_s=0.5)
    zb = simulate("zero_bubble", p, m, uneven)
    assert zb.bubble_s == pytest.approx((p - 1) * (1.0 + 2.0 - 0.5))


def test_bubble_falls_from_1f1b_to_interleaved_to_zero_bubble() -> None:
    p, f, b, w = 4, 1.0, 2.0, 1.0
    bubble = {s: bubble_seconds(s, p, f, b, w, VIRTUAL[s]) for s in SCHEDULES}
    assert bubble["gpipe"] == bubble["1f1b"] == (p - 1) * (f + b)
    assert bubble["interleaved_1f1b"] == bubble["1f1b"] / 2
    assert bubble["zero_bubble"] < bubble["interleaved_1f1b"]
    assert bubble_seconds("interleaved_1f1b", p, f, b, w, 4) == bubble["1f1b"] / 4
    assert bubble_seconds("1f1b", 1, f, b) == 0


def test_in_flight_micro_batches_by_schedule() -> None:
    """GPipe keeps every micro-batch, 1F1B the ranks still ahead: the simulated peaks agree."""
    p, m = 4, 8
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        v = VIRTUAL[schedule]
        timeline = simulate(schedule, p, m, EVEN, v)
        for r in range(p):
            assert timeline.peak_in_flight(r) == in_flight_micro_batches(r, p, m, schedule, v)
    assert in_flight_micro_batches(0, p, m, "gpipe") == m
    assert [in_flight_micro_batches(r, p, m, "1f1b") for r in range(p)] == [4, 3, 2, 1]
    assert in_flight_micro_batches(0, p, m, "interleaved_1f1b", 2) == Fraction(11, 2)


# --------------------------------------------------------------------------- planner


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=64, seq=16, width=32, heads=4, layers=2))
        ids = torch.zeros(8, 16, dtype=torch.long)
    return capture(model, (ids, ids), gpt_loss)


def _plan(graph, schedule: str = "1f1b", **kw) -> Plan:
    cfg = ParallelConfig(
        mode="data_parallel", devices=4, pipeline_stages=2, micro_batches=4, schedule=schedule, **kw
    )
    return plan_graph(graph, cfg)


def test_planner_bubble_and_memory_by_schedule(graph) -> None:
    plans = {s: _plan(graph, s) for s in SCHEDULES}
    bubble = {s: p.predicted.bubble_s for s, p in plans.items()}
    activations = {s: p.predicted.memory_by_kind["activations"] for s, p in plans.items()}
    assert bubble["gpipe"] == bubble["1f1b"]
    assert bubble["interleaved_1f1b"] == pytest.approx(bubble["1f1b"] / 2)
    assert bubble["zero_bubble"] < bubble["interleaved_1f1b"]
    assert bubble["zero_bubble_v"] < bubble["interleaved_1f1b"]
    # GPipe's first stage keeps 4 micro-batches for backward, 1F1B's 2; the micro-batch in
    # backward and its working set are common to both (the memory model's walk), so GPipe
    # holds more than 1F1B but less than twice as much
    assert 1.25 * activations["1f1b"] < activations["gpipe"] < 2 * activations["1f1b"]
    # the interleaved warm-up runs ahead in chunks of half a stage: at least 1F1B's
    assert activations["interleaved_1f1b"] >= activations["1f1b"]
    p = plans["interleaved_1f1b"]
    assert (p.schedule, p.virtual_stages, len(p.stage_compute_s)) == ("interleaved_1f1b", 2, 2)
    assert max(p.stage_compute_s) == p.predicted.compute_s
    assert _plan(graph, "interleaved_1f1b", virtual_stages=4).predicted.bubble_s == pytest.approx(
        bubble["1f1b"] / 4
    )
    text = p.summary()
    assert (
        "pipeline schedule interleaved_1f1b, 2 chunks a rank (4 model chunks on 2 stages)" in text
    )
    assert "stage 0 holds activations of 2.5 micro-batches" in text


def test_plan_file_keeps_schedule_and_virtual_stages(graph) -> None:
    plan = _plan(graph, "zero_bubble", virtual_stages=2)
    data = json.loads(plan.to_json())
    assert (data["schedule"], data["virtual_stages"]) == ("zero_bubble", 2)
    assert len(data["stage_compute_s"]) == 2
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()
    for key in ("schedule", "virtual_stages", "stage_compute_s"):  # a file from before them
        del data[key]
    old = Plan.from_json(json.dumps(data))
    assert (old.schedule, old.virtual_stages, old.stage_compute_s) == ("1f1b", 1, ())
    assert old.timeline().ranks == 2  # drawn with the busiest stage's compute on each
    data.update(schedule="1f1b", virtual_stages=2)
    with pytest.raises(PlanError, match="virtual_stages=2 with schedule '1f1b'"):
        Plan.from_json(json.dumps(data))


# --------------------------------------------------------------------------- files


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plan_timeline_png_and_chrome_trace(graph, tmp_path) -> None:
    timeline = _plan(graph, "zero_bubble").timeline()
    assert timeline.order(1)[:4] == ["F0", "F1", "F0", "B0"]
    png = tmp_path / "step.png"
    width, height = timeline.to_png(png, width=900)
    data = png.read_bytes()
    # drawn by matplotlib (what the figure holds: tests/unit/test_plots.py)
    assert _png_size(data) == (width, height) == (900, height) and 150 < height < 400
    trace_path = tmp_path / "step.json"
    timeline.to_chrome_trace(trace_path)
    trace = json.loads(trace_path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(timeline.events)
    assert {e["cat"] for e in complete} >= {"forward", "backward", "weight", "communication"}
    assert all(e["dur"] >= 0 and e["pid"] in (0, 1) for e in complete)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"pp 0", "pp 1"}
    assert trace["otherData"]["bubble_fraction"] == pytest.approx(timeline.bubble_fraction)


def test_cli_draws_the_timeline_and_refuses_one_stage(tmp_path, capsys) -> None:
    small = ["plan", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16"]
    small += ["--vocab", "64", "--batch", "8", "--mode", "data_parallel", "--devices", "2"]
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    code = main(
        [*small, "--pipeline-stages", "2", "--micro-batches", "4", "--schedule",
         "interleaved_1f1b", "--virtual-stages", "2", "--timeline", str(png), "--trace", str(trace)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and f"pipeline timeline drawn to {png} (1200 x " in out
    assert _png_size(png.read_bytes())[0] == 1200
    assert json.loads(trace.read_text())["traceEvents"]
    assert main([*small, "--timeline", str(tmp_path / "none.png")]) != 0
    err = capsys.readouterr().err
    assert "--timeline: plan for TinyGPT has 1 pipeline stage" in err
    assert not (tmp_path / "none.png").exists()


# --------------------------------------------------------------------------- measured


class _FakeStage:
    """Stands in for torch's _PipelineStageBase: the three pass methods, a stage index."""

    def __init__(self, index: int) -> None:
        self.stage_index = index
        self.calls: list[str] = []

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.calls.append(f"F{fwd_chunk_id}")
        return fwd_chunk_id

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self.calls.append(f"B{bwd_chunk_id}")

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        self.calls.append(f"W{bwd_chunk_id}")


def test_stage_timer_records_passes_for_a_measured_timeline(tmp_path) -> None:
    ticks = iter(range(100))
    timer = StageTimer(rank=1, clock=lambda: float(next(ticks)))  # t0 = 0
    stage = _FakeStage(3)
    timer.wrap(stage)
    timer.wrap(stage)  # a second wrap changes nothing
    timer.begin_step()  # t0 = 1
    assert stage.forward_one_chunk(0, (), {}) == 0
    stage.backward_one_chunk(0, loss=None, full_backward=False)
    stage.backward_weight_one_chunk(bwd_chunk_id=0)
    assert stage.calls == ["F0", "B0", "W0"]
    assert timer.records() == [
        (1, "forward", 3, 0, 1.0, 2.0),
        (1, "backward", 3, 0, 3.0, 4.0),
        (1, "weight", 3, 0, 5.0, 6.0),
    ]
    records = [(0, "forward", 0, 0, 0.0, 1.0), *timer.records()]
    timeline = timeline_from_records(records, title="measured")
    assert timeline.measured and timeline.labels == ("pp 0", "pp 1")
    assert timeline.order(1) == ["F0", "B0", "W0"]
    assert timeline.idle(1) == [(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)]
    assert _png_size(timeline.png(width=600))[0] == 600
    timer.stop()  # an evaluation's forwards after the step are not part of it
    stage.forward_one_chunk(1, ())
    assert len(timer.records()) == 3
    timer.begin_step()
    assert timer.records() == []
    timer.unwrap(stage)
    stage.forward_one_chunk(1, ())
    assert timer.records() == []


def test_timeline_refuses_unknown_kinds_and_rows() -> None:
    with pytest.raises(PlanError, match="kind 'sleep'"):
        Timeline((TimelineEvent(0, "sleep", 0.0, 1.0),), ("pp 0",))
    with pytest.raises(PlanError, match="rank 2"):
        Timeline((TimelineEvent(2, "forward", 0.0, 1.0),), ("pp 0",))


# --------------------------------------------------------------------------- copies


def test_a_plan_with_copies_draws_their_turns(tmp_path) -> None:
    """``interleave_num=2`` without stages: ``plan.timeline()`` is the copies' turns on the
    device (:func:`copies_timeline`): forward turns, then backward, the copies alternating,
    each op's collectives in flight while the other copy computes; the device waits less
    than the same plan's pieces run one after another (one copy), and every op collective of
    a micro-step is drawn once a copy. One copy and no stages: nothing to draw, by name; a
    plan file without per-op compute: plan again."""
    gpt = GPTConfig(vocab=256, seq=64, width=128, heads=4, layers=2)
    model = TinyGPT(gpt)
    annotate_megatron(model, tp=2)
    batch = (torch.randint(0, 256, (16, 64)), torch.randint(0, 256, (16, 64)))
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, hardware="a100-80g")
    two = plan_graph(capture(model, tuple(x[:8] for x in batch), gpt_loss),
                     dataclasses.replace(cfg, interleave_num=2), model=model)  # fmt: skip
    timeline = two.timeline()
    assert timeline.labels == ("device",) and "2 copies interleaved" in timeline.title
    forward = [e.micro_batch for e in timeline.compute(0) if e.kind == "forward"]
    assert forward[:4] == [0, 1, 0, 1] and len(forward) % 2 == 0
    assert max(e.end_s for e in timeline.events if e.kind == "forward") <= min(
        e.start_s for e in timeline.events if e.kind == "backward"
    )
    params = {p.name for p in two.parameters}
    per_copy = sum(
        c.seconds * c.count / 2 for c in two.collectives if c.op not in params and c.op != "loss"
        and c.phase in ("forward", "backward")
    )  # fmt: skip
    comm = [e for e in timeline.events if e.kind == "communication"]
    assert sum(e.seconds for e in comm) == pytest.approx(2 * per_copy)
    assert {e.micro_batch for e in comm} == {0, 1}
    compute = sum(op.compute_s for op in two.ops)
    assert timeline.busy_s(0) == pytest.approx(2 * compute)
    one = copies_timeline(two, copies=1)
    assert 0 < timeline.bubble_s < one.bubble_s
    png = tmp_path / "copies.png"
    timeline.to_png(png)
    assert _png_size(png.read_bytes())[0] == 1200
    with pytest.raises(PlanError, match=r"1 pipeline stage.*--interleave-num 2"):
        dataclasses.replace(two, interleave_num=1).timeline()
    old = dataclasses.replace(two, ops=tuple(dataclasses.replace(o, compute_s=0.0) for o in two.ops))
    with pytest.raises(PlanError, match=r"no per-op compute.*plan again"):
        old.timeline()
