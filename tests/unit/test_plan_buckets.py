"""Plans list the gradient reductions the runtime runs: fused dp buckets, none for frozen params.

Pure planning (no process group): a tiny Megatron GPT captured once on the meta device,
planned under several ``comm_fusion`` settings; frozen parameters are either captured from the
model (``requires_grad=False``) or marked on the graph directly.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from plait.config import CommFusion, ParallelConfig
from plait.errors import CaptureError
from plait.fusion import plan_buckets
from plait.graph import GraphInput, OpGraph, TensorMeta, capture
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.planning import Plan, PlannedCollective, plan_graph
from plait.planning.setup import prepare

GPT = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=3)
DP_TP = {"dp": 2, "tp": 2}
NO_FUSION = CommFusion(bucket_mb=1e-9)


def _model(frozen: tuple[str, ...] = ()) -> torch.nn.Module:
    with torch.device("meta"):
        model = annotate_megatron(TinyGPT(GPT), 2)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(8, GPT.seq, dtype=torch.long)
    return ids, ids


@pytest.fixture(scope="module")
def gpt() -> tuple[torch.nn.Module, OpGraph]:
    model = _model()
    return model, capture(model, _batch(), gpt_loss)


def _frozen(graph: OpGraph, names: set[str]) -> OpGraph:
    """``graph`` with parameters ``names`` marked frozen (as capture marks them)."""
    inputs = tuple(
        dataclasses.replace(g, requires_grad=False) if g.target in names else g
        for g in graph.inputs
    )
    return OpGraph(inputs, graph.ops, graph.outputs, graph.layers)


def _plan(model, graph, fusion=None, mode="semi_auto", **extra) -> Plan:
    if mode == "semi_auto":
        cfg = ParallelConfig(mode=mode, mesh=DP_TP, comm_fusion=fusion, **extra)
        return plan_graph(graph, cfg, model=model)
    # pure data parallel on 4 devices: the Megatron annotations do not apply (no tp axis)
    cfg = ParallelConfig(mode=mode, devices=4, comm_fusion=fusion, **extra)
    return plan_graph(graph, cfg)


def _buckets(plan: Plan) -> list[PlannedCollective]:
    return [c for c in plan.collectives if c.reason.startswith("gradients of")]


def _local_bytes(p) -> int:
    n = 4  # float32
    for size in p.shape:
        n *= size
    for axes in p.layout.dims:
        for a in axes:
            n //= DP_TP[a]
    return n


# --------------------------------------------------------------------------- frozen parameters


def test_capture_records_requires_grad_on_both_paths() -> None:
    frozen = (*(f"blocks.{b}.attn.q.weight" for b in range(GPT.layers)), "pos.weight")
    model = _model(frozen)
    fast = capture(model, _batch(), gpt_loss)  # 3 identical blocks: the repeated-layer path
    full = capture(model, _batch(), gpt_loss, repeat=False)
    assert fast == full
    assert [g.target for g in fast.inputs if g.kind == "parameter" and not g.requires_grad] == [
        "pos.weight",
        *frozen[:-1],
    ]
    assert set(fast.trainable_parameters()) == set(fast.parameters()) - set(frozen)
    assert [m for group in fast.layers for m in group.members] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
    ]


def test_graph_input_refuses_a_frozen_non_parameter() -> None:
    with pytest.raises(CaptureError, match="only parameters can be frozen"):
        GraphInput("b_x", "buffer", TensorMeta((2,)), "x", requires_grad=False)
    with pytest.raises(CaptureError, match="not a bool"):
        GraphInput("p_x", "parameter", TensorMeta((2,)), "x", requires_grad=1)  # type: ignore[arg-type]


def test_frozen_parameter_gets_no_gradient_work(gpt) -> None:
    model, graph = gpt
    # pos.weight feeds only its embedding, whose output then needs no gradient either;
    # blocks.0.attn.q.weight is split over tp (column parallel)
    frozen = {"pos.weight", "blocks.0.attn.q.weight"}
    graph = _frozen(graph, frozen)
    before = _plan(model, gpt[1], NO_FUSION)
    plan = _plan(model, graph, NO_FUSION)
    params = {p.name: p for p in plan.parameters}
    assert all(params[n].grad_reduce_axes == () and "frozen" in params[n].reason for n in frozen)
    assert params["blocks.0.attn.q.weight"].layout.describe() == "[tp, None]"  # layout kept
    assert not any(c.op in frozen for c in plan.collectives)
    assert any(c.op == "blocks.0.attn.q.weight" for c in before.collectives)
    # trained, the positional table's gradient stays pending over dp from where its output met
    # the batch (no collective at that add) into its own reduction in the dp buckets
    assert before.parameter("pos.weight").grad_reduce_axes == ("dp",)
    assert any(c.op == "pos.weight" and c.axes == ("dp",) for c in before.collectives)
    assert not any(c.op == "add" and c.phase == "backward" for c in before.collectives)
    assert not any(c.op == "add" and c.phase == "backward" for c in plan.collectives)
    # no gradient and no optimizer state for them: 16 + 8 = 24 bytes less per local element
    local = 8 * 16 + 16 * 16 // 2
    mem, mem0 = plan.predicted.memory_by_kind, before.predicted.memory_by_kind
    assert mem["parameters"] == mem0["parameters"]
    assert mem0["gradients"] - mem["gradients"] == 4 * local
    assert mem0["optimizer"] - mem["optimizer"] == 8 * local


def test_needs_grad_follows_trainable_parameters_only(gpt) -> None:
    model, graph = gpt
    cfg = ParallelConfig(mode="semi_auto", mesh=DP_TP)
    live = prepare(graph, cfg, model=model).problem
    frozen = prepare(_frozen(graph, {"pos.weight"}), cfg, model=model).problem
    pos_embedding = next(
        op.name
        for op in graph.ops
        if "p_pos_weight" in op.inputs and op.target.endswith("embedding.default")
    )
    assert live.needs_grad("p_pos_weight") and live.needs_grad(pos_embedding)
    assert not frozen.needs_grad("p_pos_weight") and not frozen.needs_grad(pos_embedding)
    assert frozen.needs_grad("p_tok_weight")  # the token embedding still trains


# --------------------------------------------------------------------------- fused buckets


def test_plan_buckets_is_one_pure_function() -> None:
    from plait.runtime.program import grad_sync

    assert grad_sync.plan_buckets is plan_buckets
    assert plan_buckets([10, 10, 10], CommFusion(bucket_mb=25e-6)) == [[2, 1], [0]]
    assert plan_buckets([10, 10, 10], CommFusion(mode="index", boundaries=(1,))) == [[1, 2], [0]]


def test_default_fusion_puts_all_dp_reductions_of_a_tiny_gpt_in_one_bucket(gpt) -> None:
    model, graph = gpt
    fused, alone = _plan(model, graph), _plan(model, graph, NO_FUSION)
    [bucket] = _buckets(fused)
    per_param = _buckets(alone)
    reduced = [p for p in fused.parameters if p.grad_reduce_axes == ("dp",)]
    assert len(per_param) == len(reduced) > 10
    assert (bucket.kind, bucket.axes, bucket.phase, bucket.count) == (
        "all_reduce",
        ("dp",),
        "backward",
        1,
    )
    assert bucket.nbytes == sum(c.nbytes for c in per_param) == sum(map(_local_bytes, reduced))
    assert bucket.op == reduced[0].name and f"{len(reduced)} parameters" in bucket.reason
    # everything else is unchanged, and the step got cheaper (one start-up instead of many)
    rest = [c for c in fused.collectives if c is not bucket]
    assert rest == [c for c in alone.collectives if c not in per_param]
    assert fused.predicted.communication_s < alone.predicted.communication_s
    Plan.from_json(fused.to_json()).validate(model, 4)


def test_tiny_buckets_give_one_all_reduce_per_parameter(gpt) -> None:
    model, graph = gpt
    plan = _plan(model, graph, NO_FUSION)
    got = sorted((c.op, c.nbytes) for c in _buckets(plan))
    expected = sorted(
        (p.name, _local_bytes(p)) for p in plan.parameters if p.grad_reduce_axes == ("dp",)
    )
    assert got == expected


@pytest.mark.parametrize(
    "fusion",
    [CommFusion(bucket_mb=0.004), CommFusion(mode="index", boundaries=(5, 9, 20))],
    ids=["size", "index"],
)
def test_buckets_are_plan_buckets_of_the_local_sizes(gpt, fusion) -> None:
    """As plan_exec's GradSync forms them: trainable parameters not split over dp, model order,
    local piece sizes; a bucket's all-reduce carries its members pending over dp alone."""
    model, graph = gpt
    graph = _frozen(graph, {"blocks.1.fc1.weight"})
    plan = _plan(model, graph, fusion)
    frozen = {"blocks.1.fc1.weight"}
    synced = [
        p
        for p in plan.parameters
        if p.name not in frozen and not any("dp" in axes for axes in p.layout.dims)
    ]
    buckets = plan_buckets([_local_bytes(p) for p in synced], fusion)
    expected = []
    for bucket in buckets:
        members = [synced[i] for i in sorted(bucket) if synced[i].grad_reduce_axes == ("dp",)]
        if members:
            expected.append((members[0].name, sum(map(_local_bytes, members))))
    assert len(expected) > 2
    assert [(c.op, c.nbytes) for c in _buckets(plan)] == expected


def test_data_parallel_plan_fuses_full_sizes(gpt) -> None:
    model, graph = gpt
    plan = _plan(model, graph, CommFusion(bucket_mb=0.01), mode="data_parallel")
    assert all(not any(p.layout.dims) for p in plan.parameters)  # all whole: full sizes
    sizes = [4 * math.prod(p.shape) for p in plan.parameters]
    buckets = plan_buckets(sizes, CommFusion(bucket_mb=0.01))
    reduced = {p.name for p in plan.parameters if p.grad_reduce_axes}
    expected = [
        sum(sizes[i] for i in b if plan.parameters[i].name in reduced)
        for b in buckets
        if any(plan.parameters[i].name in reduced for i in b)
    ]
    assert [c.nbytes for c in _buckets(plan)] == expected and len(expected) > 1


def test_zero_buckets_reduce_scatter_split_parameters_and_all_reduce_the_rest(gpt) -> None:
    """ZeRO-2: each bucket's split parameters are reduce-scattered in one collective and their
    updated shards all-gathered in one; its whole parameters keep one all-reduce. ZeRO-1 keeps
    whole gradients: one all-reduce per bucket, plus the gathers."""
    model, graph = gpt
    fusion = CommFusion(bucket_mb=0.01)
    kw = {"optimizer_shard_threshold": 2048}  # splits the MLP weights and the token table
    plan = _plan(model, graph, fusion, mode="data_parallel", optimizer_shard=2, **kw)
    split = {p.name for p in plan.parameters if p.optimizer_shard_dim is not None}
    whole = {p.name for p in plan.parameters if p.grad_reduce_axes and p.name not in split}
    assert split and whole  # the threshold keeps small parameters whole
    sizes = [4 * math.prod(p.shape) for p in plan.parameters]
    buckets = plan_buckets(sizes, fusion)
    names = [[plan.parameters[i].name for i in b] for b in buckets]
    expect_rs = [sum(sizes[i] for i in b if plan.parameters[i].name in split) for b in buckets]
    expect_ar = [sum(sizes[i] for i in b if plan.parameters[i].name in whole) for b in buckets]
    rs = [c.nbytes for c in plan.collectives if c.kind == "reduce_scatter"]
    gathers = [c.nbytes for c in plan.collectives if c.kind == "all_gather"]
    assert rs == [n for n in expect_rs if n] and gathers == [n // 4 for n in rs]
    all_reduces = [c.nbytes for c in _buckets(plan) if c.kind == "all_reduce"]
    assert all_reduces == [n for n in expect_ar if n]
    assert len(names) > 1
    zero1 = _plan(model, graph, fusion, mode="data_parallel", optimizer_shard=1, **kw)
    assert not any(c.kind == "reduce_scatter" for c in zero1.collectives)
    assert sum(c.phase == "optimizer" for c in zero1.collectives) == len(rs)
