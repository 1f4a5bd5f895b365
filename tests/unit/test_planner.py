"""plait.plan end to end on small models: layouts, collectives with reasons, errors, files.

Planning needs no process group: every test here runs in one process on the meta device.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch import nn

import plait
from plait.config import CommFusion, ParallelConfig
from plait.errors import ConfigError, ShardingError
from plait.graph import capture
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.planning import plan_graph

# One gradient bucket per parameter: these tests read per-parameter reductions.
NO_FUSION = CommFusion(bucket_mb=1e-9)

CFG = GPTConfig(vocab=64, seq=16, width=32, heads=4, layers=2)


def _gpt(
    megatron: bool = False, layers: int = 2
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=64, seq=16, width=32, heads=4, layers=layers))
        ids = torch.zeros(8, 16, dtype=torch.long)
    if megatron:
        annotate_megatron(model, tp=2)
    return model, (ids, ids)


def _count(plan, phase: str | None = None) -> Counter[tuple[str, tuple[str, ...]]]:
    return Counter(
        (c.kind, c.axes)
        for c in plan.collectives
        for _ in range(c.count)
        if phase is None or c.phase == phase
    )


def test_megatron_semi_auto_gives_megatron_layouts_and_collectives() -> None:
    """dp=2 x tp=2 with Megatron annotations, as the runtime runs it (tests/sim/test_collectives).

    Per block, forward: the attention output projection and fc2 are row parallel, so each leaves
    a partial sum over tp that the residual add needs whole: 2 tp all-reduces. Backward: the
    inputs of q, k, v and fc1 are replicated over tp while the ops split their work over tp,
    so each input gradient is a partial sum over tp; q, k and v read one value, whose summed
    gradient is reduced once: 2 tp all-reduces. Every parameter's
    gradient is summed over dp (the batch is split over dp); none over tp (each tp rank owns
    its slice, and replicated parameters see replicated inputs on tp).
    """
    model, batch = _gpt(megatron=True)
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, comm_fusion=NO_FUSION)
    plan = plait.plan(model, cfg, example_batch=batch, loss_fn=gpt_loss)
    layouts = {p.name: p.layout.describe() for p in plan.parameters}
    for b in range(2):
        for name in ("attn.q", "attn.k", "attn.v", "fc1"):
            assert layouts[f"blocks.{b}.{name}.weight"] == "[tp, None]"
        for name in ("attn.out", "fc2"):
            assert layouts[f"blocks.{b}.{name}.weight"] == "[None, tp]"
        assert layouts[f"blocks.{b}.ln1.weight"] == "[None]"
    fwd = _count(plan, "forward")
    bwd = _count(plan, "backward")
    assert fwd[("all_reduce", ("tp",))] == 2 * 2
    assert bwd[("all_reduce", ("tp",))] == 2 * 2
    grads = [
        c
        for c in plan.collectives
        if c.phase == "backward" and c.axes == ("dp",) and c.op != "cross_entropy_loss"
    ]
    # The position ids (an arange) are not split, so the position embedding runs replicated;
    # its output gradient, summed over dp where it meets the batch, stays pending into its
    # weight (a learned table read once): reduced as the weight's, nothing at "add".
    expected = {p.name for p in plan.parameters}
    assert plan.parameter("pos.weight").grad_reduce_axes == ("dp",)
    assert {c.op for c in grads} == expected
    assert len(grads) == len(expected)
    assert all(c.kind == "all_reduce" for c in grads)
    assert not any(k == "all_gather" or k == "all_to_all" for k, _ in _count(plan))


def test_data_parallel_plan_replicates_every_parameter() -> None:
    """Pure data parallel: parameters whole, batch split, one gradient all-reduce per parameter."""
    model, batch = _gpt()
    plan = plait.plan(
        model,
        ParallelConfig(mode="data_parallel", devices=4, comm_fusion=NO_FUSION),
        example_batch=batch,
        loss_fn=gpt_loss,
    )
    assert all(not any(p.layout.dims) for p in plan.parameters)
    counts = _count(plan)
    n_params = len(plan.parameters)
    # + the loss value, + the cross entropy's token count (nll_loss_backward needs it global)
    assert counts[("all_reduce", ("dp",))] == n_params + 2
    assert sum(counts.values()) == n_params + 2
    assert plan.predicted.communication_s > 0
    predicted = plan.predicted
    assert predicted.optimizer_s > 0  # AdamW over every (whole) parameter
    assert predicted.step_time_s == pytest.approx(
        predicted.compute_s + predicted.communication_s + predicted.bubble_s + predicted.optimizer_s
    )


def test_plan_file_is_deterministic_and_lossless(tmp_path) -> None:
    model, batch = _gpt(megatron=True)
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2})
    first = plait.plan(model, cfg, example_batch=batch, loss_fn=gpt_loss).to_json()
    model2, batch2 = _gpt(megatron=True)
    second = plait.plan(model2, cfg, example_batch=batch2, loss_fn=gpt_loss).to_json()
    assert first == second
    again = plait.Plan.from_json(first)
    assert again.to_json() == first
    path = tmp_path / "plan.json"
    again.save(path)
    assert plait.Plan.load(path) == again


def test_plan_explains_parameters_and_ops() -> None:
    model, batch = _gpt(megatron=True)
    plan = plait.plan(
        model,
        ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
        example_batch=batch,
        loss_fn=gpt_loss,
    )
    text = plan.explain("blocks.0.attn.q.weight")
    assert "[tp, None]" in text
    assert "blocks.0" in plan.summary()


def test_auto_propagation_from_annotation_reaches_every_op() -> None:
    """In auto mode only the annotated linears are fixed; everything else is propagated.

    The attention internals between the column-parallel q/k/v and the row-parallel output
    projection are reached from them and keep the heads split over tp with no redistribution
    (the cheapest choice): the score matmuls and softmax run on tp-split heads and no
    all-to-all appears. Every op is decided by propagation or annotation, none by fallback.
    """
    model, batch = _gpt(megatron=True)
    plan = plait.plan(
        model,
        ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2}),
        example_batch=batch,
        loss_fn=gpt_loss,
    )
    assert not any(k == "all_to_all" for k, _ in _count(plan))
    inner = [op for op in plan.ops if op.target.split(".")[1] in ("softmax", "matmul")]
    assert len(inner) == 3 * 2
    assert all(op.outputs[0].dims[:2] == (("dp",), ("tp",)) for op in inner)
    assert not any("not reached" in op.reason for op in plan.ops)


def test_conflicting_annotations_name_both_ops() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    with torch.device("meta"):
        model = Two()
        x = torch.zeros(4, 8)
    plait.shard(model.a, out_strategy=((2, 1),))
    plait.shard(model.b, in_strategy=((1, 2),))
    with pytest.raises(ShardingError, match=r"output 0 of a.*input 0 of b") as err:
        plait.plan(
            model,
            ParallelConfig(mode="auto", devices=2),
            example_batch=(x,),
            loss_fn=lambda m, b: m(*b).sum(),
        )
    assert "a" in str(err.value) and "b" in str(err.value)


def test_plan_refuses_what_it_cannot_do_yet() -> None:
    model, batch = _gpt()
    with pytest.raises(ConfigError, match="devices"):
        plait.plan(model, ParallelConfig(mode="auto"), example_batch=batch, loss_fn=gpt_loss)


def test_planning_allocates_no_parameter_memory() -> None:
    model, batch = _gpt(layers=3)
    plait.plan(model, ParallelConfig(mode="auto", devices=8), example_batch=batch, loss_fn=gpt_loss)
    assert all(p.is_meta for p in model.parameters())


def test_pipeline_plan_cuts_at_layers_and_prices_the_bubble() -> None:
    """4 layers on 2 stages x 2 dp: each stage holds whole layers, the boundary value (the
    residual stream) is sent once per micro-batch forward and its gradient once backward, and
    the bubble is (stages - 1) / micro_batches of the busiest stage's time (1F1B)."""
    model, batch = _gpt(layers=4)
    cfg = ParallelConfig(mode="data_parallel", devices=4, pipeline_stages=2, micro_batches=4)
    plan = plait.plan(model, cfg, example_batch=batch, loss_fn=gpt_loss)
    assert plan.mesh.as_dict() == {"pp": 2, "dp": 2}
    assert len(plan.stages) == 2
    layers_of = [{plan.op(n).layer for n in stage} - {None} for stage in plan.stages]
    assert layers_of == [{"blocks.0", "blocks.1"}, {"blocks.2", "blocks.3"}]
    sends = [c for c in plan.collectives if c.kind == "send_recv"]
    assert [(c.phase, c.count, c.axes) for c in sends] == [
        ("forward", 4, ("pp",)),
        ("backward", 4, ("pp",)),
    ]
    assert sends[0].nbytes == 8 // 2 // 4 * 16 * 32 * 4  # batch/dp/micro x seq x width x fp32
    p = plan.predicted
    assert p.bubble_s == pytest.approx((p.compute_s + p.communication_s) * (2 - 1) / 4)
    assert not any(c.axes == ("pp",) and c.kind != "send_recv" for c in plan.collectives)


def test_optimizer_shard_levels_change_collectives_and_memory() -> None:
    """ZeRO over dp (reference cost-model.md 2.iv): level 1 keeps the gradient all-reduce and
    gathers updated parameter shards after the optimizer; level 2 reduce-scatters gradients;
    level 3 also gathers parameters in forward and backward. Memory falls level by level."""
    model, batch = _gpt()
    plans = {
        level: plait.plan(
            model,
            ParallelConfig(
                mode="data_parallel",
                devices=4,
                optimizer_shard=level,
                optimizer_shard_threshold=0,
                comm_fusion=NO_FUSION,
            ),
            example_batch=batch,
            loss_fn=gpt_loss,
        )
        for level in (None, 1, 2, 3)
    }
    n = sum(1 for p in plans[None].parameters if p.grad_reduce_axes)  # pos.weight: see above

    def kinds(level):
        return Counter(
            (c.kind, c.phase)
            for c in plans[level].collectives
            if c.op in {p.name for p in plans[level].parameters}
        )

    # one bucket per parameter (NO_FUSION): each split parameter is reduce-scattered (2, 3)
    # and gathered after the update (1, 2) or before forward and, when backward reads it (not
    # a bias or an embedding table), before backward (3); the others stay all-reduced
    split = [p for p in plans[3].parameters if p.optimizer_shard_dim is not None]
    s, read = len(split), kinds(3)[("all_gather", "backward")]
    assert 0 < read < s <= n  # linear biases and the token table are not read by backward
    gathered_again = {
        c.op for c in plans[3].collectives if c.kind == "all_gather" and c.phase == "backward"
    }
    assert "tok.weight" not in gathered_again and "blocks.0.fc1.bias" not in gathered_again
    assert "blocks.0.fc1.weight" in gathered_again
    assert kinds(None) == {("all_reduce", "backward"): n}
    assert kinds(1) == {("all_reduce", "backward"): n, ("all_gather", "optimizer"): s}
    whole = {("all_reduce", "backward"): n - s} if n > s else {}
    assert kinds(2) == {("reduce_scatter", "backward"): s, ("all_gather", "optimizer"): s, **whole}
    assert kinds(3) == {
        ("reduce_scatter", "backward"): s,
        ("all_gather", "forward"): s,
        ("all_gather", "backward"): read,
        **whole,
    }
    mem = [plans[level].predicted.memory_bytes for level in (None, 1, 2, 3)]
    assert mem[0] > mem[1] > mem[2] > mem[3]


def test_plan_validates_against_its_model() -> None:
    model, batch = _gpt(megatron=True)
    plan = plait.plan(
        model,
        ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
        example_batch=batch,
        loss_fn=gpt_loss,
    )
    plan.validate(model, world_size=4)
    other, _ = _gpt(layers=3)
    with pytest.raises(plait.PlanError, match=r"blocks\.2"):
        plan.validate(other, world_size=4)
    with pytest.raises(plait.PlanError, match="world"):
        plan.validate(model, world_size=8)


def test_full_batch_plans_the_batch_split_over_dp_like_the_runtime() -> None:
    """With full_batch every rank loads the global batch and keeps its dp slice before any op
    runs (Job.shard_batch): the plan's batch layouts and gradient reductions are those of
    data_parallel."""
    model, batch = _gpt()
    plans = [
        plait.plan(
            model,
            ParallelConfig(mode="data_parallel", devices=4, dataset_strategy=strategy),
            example_batch=batch,
            loss_fn=gpt_loss,
        )
        for strategy in ("data_parallel", "full_batch")
    ]
    assert plans[0].collectives == plans[1].collectives
    assert any(c.kind == "all_reduce" and c.phase == "backward" for c in plans[1].collectives)
    assert [op.inputs for op in plans[0].ops] == [op.inputs for op in plans[1].ops]


def test_plan_takes_parallelize_argument_order_and_reads_the_old_one() -> None:
    """plan(model, config, *, example_batch, loss_fn) as parallelize; the older order still works."""
    import importlib
    import inspect

    assert inspect.isfunction(plait.plan)  # no module plait.plan hides the function
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("plait.plan")
    model, batch = _gpt()
    cfg = ParallelConfig(mode="data_parallel", devices=2)
    new = plait.plan(model, cfg, example_batch=batch, loss_fn=gpt_loss)
    assert plait.plan(model, batch, cfg, loss_fn=gpt_loss) == new
    assert plait.plan(model, batch, cfg, gpt_loss) == new
    with pytest.raises(ConfigError, match="needs example_batch"):
        plait.plan(model, cfg, loss_fn=gpt_loss)
    with pytest.raises(ConfigError, match=r"expects a plait\.ParallelConfig"):
        plait.plan(model, {"mode": "auto"}, example_batch=batch)
    with pytest.raises(ConfigError, match="by name"):
        plait.plan(model, cfg, batch, gpt_loss)


def test_recompute_auto_takes_the_cheapest_policy_that_fits() -> None:
    """recompute='auto' outside mode auto: none if it fits memory_limit, else selective, else
    full; the plan records the choice and says why."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2)
    model = TinyGPT(cfg)
    # 64 sequences per rank: activations make the peak (with 2, the peak is the gradient
    # bucket's reduction, which no recompute policy lowers)
    ids = torch.randint(0, cfg.vocab, (256, cfg.seq))
    graph = capture(model, (ids, ids), gpt_loss)
    base = ParallelConfig(mode="data_parallel", devices=4, recompute="none")
    sizes = {
        r: plan_graph(graph, dataclasses.replace(base, recompute=r)).predicted.memory_bytes
        for r in ("none", "selective", "full")
    }
    assert sizes["full"] < sizes["selective"] < sizes["none"]
    for limit, chosen in [
        (sizes["none"], "none"),
        (sizes["selective"], "selective"),
        (sizes["full"], "full"),
        (sizes["full"] - 1, "full"),  # nothing fits: full, and the notes say so
    ]:
        plan = plan_graph(graph, dataclasses.replace(base, recompute="auto", memory_limit=limit))
        assert plan.recompute == chosen, (limit, plan.recompute)
        assert any("recompute='auto'" in n for n in plan.notes)
