"""Pipeline stage assignment and settings, refused by name before any process waits."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

import plait
from plait import ConfigError, NotBuiltError, ParallelConfig
from plait.mesh import MeshSpec
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.runtime.pipeline.job import (
    check_pipeline_config,
    check_pipeline_optimizer,
    model_inputs,
    stage_starts,
)

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=6)


def test_even_split_puts_extra_layers_in_the_middle() -> None:
    assert stage_starts(TinyGPT(CFG), 2) == ["blocks.3"]
    assert stage_starts(TinyGPT(CFG), 4) == ["blocks.1", "blocks.3", "blocks.5"]
    assert stage_starts(TinyGPT(CFG), 6) == [f"blocks.{i}" for i in range(1, 6)]


def test_marks_decide_the_stages() -> None:
    model = TinyGPT(CFG)
    for i, block in enumerate(model.blocks):
        plait.pipeline_stage(block, 0 if i < 2 else 1)
    assert stage_starts(model, 2) == ["blocks.2"]


@pytest.mark.parametrize(
    ("marks", "says"),
    [
        ({0: 0, 1: 0}, "stage 1 of 2 has no module"),
        ({0: 1, 1: 0}, "'blocks.1' (stage 0) comes after 'blocks.0' (stage 1)"),
        ({0: 0, 1: 2}, "'blocks.1' is in stage 2, but the job has 2 stages"),
    ],
)
def test_bad_marks_are_refused_by_name(marks: dict[int, int], says: str) -> None:
    model = TinyGPT(CFG)
    for i, k in marks.items():
        plait.pipeline_stage(model.blocks[i], k)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        stage_starts(model, 2)


def test_a_module_in_two_stages_is_refused() -> None:
    model = TinyGPT(CFG)
    plait.pipeline_stage(model.blocks[0], 0)
    plait.pipeline_stage(model.blocks[0].attn, 1)
    plait.pipeline_stage(model.blocks[1], 1)
    with pytest.raises(
        ConfigError, match=r"'blocks\.0\.attn' is marked stage 1 inside 'blocks\.0'"
    ):
        stage_starts(model, 2)


def test_too_few_layers_and_no_layer_list() -> None:
    with pytest.raises(ConfigError, match="'blocks', has 6; a stage would have no layer"):
        stage_starts(TinyGPT(CFG), 8)
    with pytest.raises(ConfigError, match=r"no nn\.ModuleList or nn\.Sequential"):
        stage_starts(nn.Linear(4, 4), 2)
    with pytest.raises(ConfigError, match="the stage is an int >= 0"):
        plait.pipeline_stage(nn.Linear(4, 4), -1)


def test_settings_refused_by_name() -> None:
    mesh = MeshSpec.from_dict({"pp": 2, "dp": 2})
    pipe = {"mode": "data_parallel", "mesh": {"pp": 2, "dp": 2}}
    with pytest.raises(ConfigError, match="needs at least 2 micro-batches"):
        check_pipeline_config(ParallelConfig(**pipe), mesh)
    check_pipeline_config(ParallelConfig(**pipe, schedule="gpipe"), mesh)  # 1 is fine there
    check_pipeline_config(ParallelConfig(**pipe, micro_batches=2, optimizer_shard=1), mesh)
    check_pipeline_config(ParallelConfig(**pipe, micro_batches=2, precision="bf16"), mesh)
    check_pipeline_config(ParallelConfig(**pipe, micro_batches=2, precision="fp16"), mesh)
    with pytest.raises(NotBuiltError, match="optimizer parallel with a zero-bubble schedule"):
        check_pipeline_config(
            ParallelConfig(**pipe, micro_batches=2, optimizer_shard=3, schedule="zero_bubble"),
            mesh,
        )
    tp = MeshSpec.from_dict({"pp": 2, "tp": 2})
    with pytest.raises(
        NotBuiltError, match=r"mesh \{'pp': 2, 'tp': 2\}, mode='data_parallel'\) with pipeline_s"
    ):
        check_pipeline_config(
            ParallelConfig(mode="data_parallel", mesh={"pp": 2, "tp": 2}, micro_batches=2), tp
        )
    semi = {"mode": "semi_auto", "mesh": {"pp": 2, "tp": 2}, "micro_batches": 2}
    check_pipeline_config(ParallelConfig(**semi), tp)  # tensor parallel in the stages runs
    # zero bubble with tp runs on compiled stages (their backward split in two); where the
    # stages would run on DTensors it stays refused
    check_pipeline_config(ParallelConfig(**semi, schedule="zero_bubble"), tp)
    for precision in ("bf16", "fp16"):  # the stages are traced under autocast
        check_pipeline_config(
            ParallelConfig(**semi, schedule="zero_bubble", precision=precision), tp
        )
    for recompute in ("full", "selective", "auto"):  # a pass over the traced graph
        check_pipeline_config(
            ParallelConfig(**semi, schedule="zero_bubble", recompute=recompute), tp
        )
    for compiled in (
        {"offload": "activations"},
        {"offload": "activations", "recompute": "selective"},
        {"recompute_modules": {"blocks.0": "selective"}},
    ):
        check_pipeline_config(ParallelConfig(**semi, schedule="zero_bubble", **compiled), tp)
    with pytest.raises(NotBuiltError, match="zero-bubble schedule with tensor parallel in st"):
        check_pipeline_config(
            ParallelConfig(**semi, schedule="zero_bubble", stage_programs=False), tp
        )  # fmt: skip
    with pytest.raises(NotBuiltError, match="optimizer parallel with a zero-bubble schedule"):
        check_pipeline_config(
            ParallelConfig(**semi, schedule="zero_bubble", optimizer_shard=3), tp
        )  # fmt: skip
    check_pipeline_config(ParallelConfig(**semi, schedule="zero_bubble_v"), tp)
    with pytest.raises(NotBuiltError, match="inside pipeline stages outside mode 'semi_auto'"):
        check_pipeline_config(ParallelConfig(**{**semi, "mode": "auto"}), tp)
    with pytest.raises(NotBuiltError, match="searched plan"):
        check_pipeline_config(ParallelConfig(**{**pipe, "mode": "auto", "micro_batches": 2}), mesh)
    check_pipeline_config(ParallelConfig(**pipe, micro_batches=2, recompute="full"), mesh)
    check_pipeline_config(ParallelConfig(**pipe, micro_batches=2, recompute="selective"), mesh)
    check_pipeline_config(ParallelConfig(**pipe, micro_batches=2, recompute="auto"), mesh)

    with pytest.raises(ConfigError, match="1f1b runs one stage a rank"):
        ParallelConfig(**pipe, virtual_stages=2)
    with pytest.raises(ConfigError, match="V schedule runs exactly 2 stages"):
        ParallelConfig(**pipe, schedule="zero_bubble_v", virtual_stages=3)
    assert ParallelConfig(**pipe, schedule="interleaved_1f1b").virtual_stages == 2
    check_pipeline_config(ParallelConfig(**pipe, schedule="zero_bubble_v", micro_batches=2), mesh)


def test_model_inputs_are_what_the_loss_function_passes() -> None:
    ids = torch.zeros(2, 8, dtype=torch.long)
    args, kwargs = model_inputs(TinyGPT(CFG), gpt_loss, (ids, ids))
    assert args[0] is ids and kwargs == {}
    with pytest.raises(plait.ShardingError, match="must call model"):
        model_inputs(TinyGPT(CFG), lambda m, b: b[0].sum(), (ids, ids))


def test_selective_recompute_keeps_products_and_recomputes_the_cheap_ops() -> None:
    """The stage policy is the program pass's rule (plait.runtime.program.remat.kept_by_selective)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from plait.runtime.pipeline.stage_wrappers import selective_policy

    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.embedding.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):  # fmt: skip
        assert selective_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten._softmax.default):
        assert selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


@pytest.mark.parametrize("limit_of", ["none", "selective", "full"])
def test_recompute_auto_in_a_pipeline_takes_the_planners_choice(limit_of: str) -> None:
    """recompute="auto" in a pipeline without a plan: the planner's choice, the cheapest
    policy whose predicted peak per device (the schedule's micro-batches in flight included,
    the stages cut to fit the limit where they can) fits memory_limit."""
    from plait.runtime.parallelize import _pipeline_recompute

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq=64, width=32, heads=4, layers=4))
    ids = torch.randint(0, 64, (16, 64), generator=torch.Generator().manual_seed(1))
    batch = (ids, torch.roll(ids, -1, dims=1))
    pipe = {"mode": "data_parallel", "mesh": {"pp": 2, "dp": 2}, "micro_batches": 2}

    def planned(**kw: object) -> plait.Plan:
        return plait.plan(
            model, ParallelConfig(**pipe, **kw), example_batch=batch, loss_fn=gpt_loss
        )

    peak = {r: planned(recompute=r).predicted.memory_bytes for r in ("none", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["none"]  # each policy saves memory here
    config = ParallelConfig(**pipe, recompute="auto", memory_limit=peak[limit_of])
    chosen = _pipeline_recompute(model, config, gpt_loss, batch).recompute
    assert chosen == planned(recompute="auto", memory_limit=peak[limit_of]).recompute
    if limit_of != "selective":  # "none" fits its own peak; only full recompute fits full's
        assert chosen == limit_of


def _tanh_between(offload: bool, min_bytes: int = 0) -> tuple[list[torch.Tensor], int, bool]:
    """Linear -> tanh -> linear on CPU, its forward under SavedOnHost or not: (the gradients,
    the tensors copied to the host, whether tanh's output outlived the forward)."""
    from plait.runtime.pipeline.stage_wrappers import SavedOnHost

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    host = SavedOnHost(torch.device("cpu"), min_bytes=min_bytes)
    if offload:
        host.wrap(module)
    seen: list[weakref.ref[torch.Tensor]] = []
    module[1].register_forward_hook(lambda m, i, out: seen.append(weakref.ref(out)))
    x = torch.randn(3, 4, requires_grad=True)
    loss = module(x).square().sum()
    gc.collect()
    alive = seen[0]() is not None
    loss.backward()
    grads = [x.grad, *(p.grad for p in module.parameters())]
    return [g for g in grads if g is not None], host.moved, alive


def test_activation_offload_keeps_a_copy_on_the_host_and_frees_the_device_value() -> None:
    """offload="activations" in a stage: tanh's output, saved by tanh and by the next linear,
    is copied to the host once and the value forward made dies with the forward (on this CPU
    machine the host is the device: the copy and the release are what can be seen); the
    input and the parameters stay, and the gradients are exactly the plain ones."""
    plain, _, kept = _tanh_between(offload=False)
    moved_grads, moved, alive = _tanh_between(offload=True)
    assert kept and not alive and moved == 1
    for a, b in zip(plain, moved_grads, strict=True):
        assert torch.equal(a, b)
    _, moved, alive = _tanh_between(offload=True, min_bytes=1 << 20)  # the 1 MiB default
    assert moved == 0 and alive


def test_offload_settings_in_a_pipeline() -> None:
    """Optimizer and activation offload run in the stages; parameters stay refused, and
    activation offload is refused beside selective recompute on eager stages
    (``stage_programs=False``: torch's checkpoint holds the products it keeps where
    saved-tensor hooks cannot move them), not on compiled ones."""
    mesh = MeshSpec.from_dict({"pp": 2, "dp": 2})
    pipe = {"mode": "data_parallel", "mesh": {"pp": 2, "dp": 2}, "micro_batches": 2}
    for offload in ("optimizer", "activations"):
        check_pipeline_config(ParallelConfig(**pipe, offload=offload), mesh)
        check_pipeline_config(ParallelConfig(**pipe, offload=offload, schedule="zero_bubble"), mesh)
        check_pipeline_config(ParallelConfig(**pipe, offload=offload, optimizer_shard=3), mesh)
        check_pipeline_config(ParallelConfig(**pipe, offload=offload, recompute="full"), mesh)
    check_pipeline_config(ParallelConfig(**pipe, offload="optimizer", recompute="selective"), mesh)
    with pytest.raises(NotBuiltError, match="offloading parameters"):  # on every engine:
        plait.support.check(ParallelConfig(**pipe, offload="parameters"))  # before stages
    for selective in ({"recompute": "selective"}, {"recompute_modules": {"blocks.1": "selective"}}):
        eager = ParallelConfig(**pipe, offload="activations", stage_programs=False, **selective)
        with pytest.raises(NotBuiltError, match="activation offload beside selective recompute"):
            check_pipeline_config(eager, mesh)
        # compiled stages (the default, tp inside or not) recompute as a graph pass and
        # offload what it keeps
        check_pipeline_config(ParallelConfig(**pipe, offload="activations", **selective), mesh)
    tp = MeshSpec.from_dict({"pp": 2, "tp": 2})
    semi = {"mode": "semi_auto", "mesh": {"pp": 2, "tp": 2}, "micro_batches": 2}
    check_pipeline_config(ParallelConfig(**semi, offload="activations", recompute="selective"), tp)
    check_pipeline_config(
        ParallelConfig(**semi, offload="activations", recompute_modules={"blocks.1": "selective"}),
        tp,
    )
    # the offloaded optimizer updates each piece apart: it must be elementwise (checked on
    # the model's parameters, meta ones too, before any process waits)
    with torch.device("meta"):
        model = TinyGPT(CFG)
    host = ParallelConfig(**pipe, offload="optimizer")
    check_pipeline_optimizer(model, host, lambda ps: torch.optim.AdamW(ps))
    with pytest.raises(ConfigError, match=r"offload=.optimizer.*with optimizer LBFGS"):
        check_pipeline_optimizer(model, host, lambda ps: torch.optim.LBFGS(ps))
    check_pipeline_optimizer(model, ParallelConfig(**pipe), lambda ps: torch.optim.LBFGS(ps))


# torch's pipeline split deep-copies tree specs, which warns from copyreg (not torch.*)
@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")
def test_activation_offload_moves_what_the_plan_moves() -> None:
    """What a stage copies to the host per micro-batch is what the plan's stage walk takes
    off the device (``StepTrace.hold``: kept bytes without offload less kept bytes with it),
    value for value at the 1 MiB default. The value a stage receives and saves (here the
    residual stream into stage 1's first norm) stays on the device in both: torch's pipeline
    stage holds its input for the input gradient."""
    from plait.comm import pipeline as pp_comm
    from plait.cost.step_memory import StepTrace
    from plait.runtime.pipeline.job import _Returns
    from plait.runtime.pipeline.stage_wrappers import SavedOnHost

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=512, seq=256, width=256, heads=4, layers=4))
    ids = torch.randint(0, 512, (8, 256), generator=torch.Generator().manual_seed(1))
    batch, micro = (ids, torch.roll(ids, -1, dims=1)), 2
    moved_by_plan: list[int] = []
    hold = StepTrace.hold

    def both(self: StepTrace, **kw: object) -> object:
        held = hold(self, **kw)
        if kw.get("offload_min") is not None:
            plain = hold(self, **{**kw, "offload_min": None})
            moved_by_plan[:] = [a.kept - b.kept for a, b in zip(plain, held, strict=True)]
        return held

    config = ParallelConfig(
        mode="data_parallel", mesh={"pp": 2}, micro_batches=micro, offload="activations"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepTrace, "hold", both)
        plan = plait.plan(model, config, example_batch=batch, loss_fn=gpt_loss)
    one = tuple(x[: len(ids) // micro] for x in batch)
    args, kwargs = model_inputs(model, gpt_loss, one)
    split = pp_comm.split_model(model, args, kwargs, stage_starts(model, 2)).split_gm
    assert [s[0] for s in plan.stages] == ["embedding", "layer_norm_4"]  # the same cut
    first, last = SavedOnHost(torch.device("cpu")), SavedOnHost(torch.device("cpu"))
    first.wrap(split.submod_pp_0)
    last.wrap(split.submod_pp_1)
    received = split.submod_pp_0(*args).detach().requires_grad_()
    out = split.submod_pp_1(received)
    with last.saving((out, one)):
        gpt_loss(_Returns(model, out), one)  # type: ignore[arg-type]
    received_bytes = received.numel() * received.element_size()
    assert received_bytes >= 1 << 20 and first.moved_bytes > 0
    assert moved_by_plan == [first.moved_bytes * micro, last.moved_bytes * micro]


def test_stages_run_as_compiled_programs_where_built() -> None:
    """Every pipeline stage, tensor parallel inside or not, runs as its traced per-rank program
    (fp32 or mixed precision, every schedule, recompute, offload, optimizer parallel); only
    optimizer parallel beside mixed precision, and ``stage_programs=False``, keep the eager
    stage."""
    from plait.runtime.pipeline import stage_program

    for mesh in ({"pp": 2, "dp": 2, "tp": 2}, {"pp": 2, "dp": 2}):
        mode = "semi_auto" if "tp" in mesh else "data_parallel"
        base = ParallelConfig(mode=mode, mesh=mesh, micro_batches=4)
        assert stage_program.compiles(base)
        assert stage_program.compiles(dataclasses.replace(base, offload="optimizer"))
        for schedule in ("interleaved_1f1b", "zero_bubble", "zero_bubble_v"):
            assert stage_program.compiles(
                dataclasses.replace(base, schedule=schedule, virtual_stages=None)
            ), schedule  # zero bubble: the backward split into input- and weight-gradient graphs
        for precision in ("bf16", "fp16"):  # traced under the stage's autocast
            assert stage_program.compiles(dataclasses.replace(base, precision=precision))
        for recompute in ("full", "selective"):  # a pass over the traced joint graph
            assert stage_program.compiles(dataclasses.replace(base, recompute=recompute))
        assert stage_program.compiles(dataclasses.replace(base, offload="activations"))
        per_module = dataclasses.replace(base, recompute_modules={"blocks.0": "full"})
        assert stage_program.compiles(per_module)  # regions of the same pass
        for level in (1, 2, 3):  # FSDP2 gathers before the program's call, reduces after
            assert stage_program.compiles(dataclasses.replace(base, optimizer_shard=level))
            low = dataclasses.replace(base, optimizer_shard=level, precision="bf16")
            assert not stage_program.compiles(low)  # bf16 gathers beside autocast: eager
        assert not stage_program.compiles(dataclasses.replace(base, stage_programs=False))
        with pytest.raises(ConfigError, match=r"stage_programs='no': give True or False"):
            dataclasses.replace(base, stage_programs="no")


def test_a_traced_backward_splits_into_input_and_weight_gradient_passes() -> None:
    """Zero bubble's two passes of a compiled stage (``split_backward``): the input-gradient
    graph gives the input's gradient and hands the weight-gradient graph what it reads; the
    two together give the whole backward's gradients, no matrix product computed twice."""
    from plait._compat import aot_joint_graph, partition_joint_graph
    from plait.runtime.pipeline.stage_program import split_backward

    torch.manual_seed(0)
    w1, w2, b2 = torch.randn(6, 4), torch.randn(3, 6), torch.randn(3)
    x, grad_out = torch.randn(5, 4), torch.randn(5, 3)

    def stage(w1, w2, b2, x):
        return (torch.nn.functional.linear(torch.relu(x @ w1.t()), w2, b2),)

    example = tuple(t.clone().requires_grad_() for t in (w1, w2, b2, x))
    forward, backward = partition_joint_graph(aot_joint_graph(stage, example), example, 1)
    out, *saved = forward(w1, w2, b2, x)
    whole = backward(*saved, grad_out)
    first, second, reads = split_backward(backward, 3, 3)
    args = (*saved, grad_out)
    dx, *handed = first(*args)
    weights = second(*handed, *(args[i] for i in reads))
    for got, want in zip((*weights, dx), whole, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(out, stage(w1, w2, b2, x)[0])

    def products(graph):
        return sum(n.target == torch.ops.aten.mm.default for n in graph.graph.nodes)

    # dx: 2 products (through w2 and w1); the weight pass: one for each weight
    assert (products(first), products(second)) == (2, 2) == (products(backward) - 2, 2)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_is_a_pass_over_a_traced_stage(mode: str) -> None:
    """A compiled stage's recompute (``recompute_in_backward``) rewrites its joint graph so
    the backward computes the forward again from less: the gradients are bit for bit those
    of the stage without it, the forward saves fewer bytes for backward (full: only the
    products' inputs it needs; selective: the products' results too), and zero bubble's split
    of the rewritten backward still gives the same gradients."""
    from plait._compat import aot_joint_graph, partition_joint_graph
    from plait.runtime.pipeline.stage_program import recompute_in_backward, split_backward

    torch.manual_seed(0)
    w1, w2, b2 = torch.randn(64, 32), torch.randn(32, 64), torch.randn(32)
    x, grad_out = torch.randn(16, 32), torch.randn(16, 32)

    def stage(w1, w2, b2, x):
        h = torch.nn.functional.gelu(torch.layer_norm(x, (32,)) @ w1.t())
        return (torch.nn.functional.linear(torch.tanh(h) * h, w2, b2),)

    def run(recompute: str):
        example = tuple(t.clone().requires_grad_() for t in (w1, w2, b2, x))
        joint = aot_joint_graph(stage, example)
        saved = recompute_in_backward(joint, recompute)
        forward, backward = partition_joint_graph(joint, example, 1)
        out, *kept = forward(w1, w2, b2, x)
        grads = backward(*kept, grad_out)
        first, second, reads = split_backward(backward, 3, 3)
        args = (*kept, grad_out)
        dx, *handed = first(*args)
        split = (*second(*handed, *(args[i] for i in reads)), dx)
        kept_bytes = sum(t.numel() * t.element_size() for t in kept)
        products = sum(n.target == torch.ops.aten.mm.default for n in backward.graph.nodes)
        return out, grads, split, saved, kept_bytes, products

    out, grads, _, (before, after), kept_bytes, products = run("none")
    assert before == after > 0
    got, recomputed, split, (before_r, after_r), kept_r, products_r = run(mode)
    assert before_r == before and after_r < before and kept_r < kept_bytes, (after_r, kept_r)
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    for a, b, c in zip(recomputed, grads, split, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(c, b, rtol=0, atol=0)
    # full recomputes the first product in backward (the second's result is the output's
    # input, read there anyway); selective keeps products and recomputes the rest
    assert products_r == products + (1 if mode == "full" else 0), (products, products_r)


def test_a_compiled_stage_is_checked_against_the_plan(caplog: pytest.LogCaptureFixture) -> None:
    """After the first step a planned pipeline compares, stage by stage, the collectives its
    compiled program issues with those the plan lists for the stage's ops (over the axes
    inside the stages, a micro-batch); a difference is kept in ``job.plan_mismatches`` and
    logged, naming the stage and both counts."""
    from types import SimpleNamespace

    from plait.planning.entries import PlannedCollective
    from plait.runtime.pipeline.job import PipelineJob
    from plait.runtime.pipeline.stage_program import StageProgram, planned_stage_collectives

    def reduce(op: str, phase: str, axes: tuple[str, ...] = ("tp",)) -> PlannedCollective:
        return PlannedCollective(
            kind="all_reduce", axes=axes, nbytes=4096, seconds=1e-4, count=1, phase=phase,
            op=op, reason="",
        )  # fmt: skip

    plan = SimpleNamespace(
        stages=(("linear", "add_2"), ("linear_4", "add_3")),
        collectives=(
            reduce("linear", "backward"), reduce("add_2", "forward"),
            reduce("linear_4", "backward"), reduce("add_3", "forward"),
            reduce("add_3", "forward", ("pp",)),  # a stage boundary's: not inside a stage
        ),
    )  # fmt: skip
    assert planned_stage_collectives(plan, 1, ("tp",)) == {
        ("backward", "all_reduce"): 1, ("forward", "all_reduce"): 1,
    }  # fmt: skip

    def traced(reduces: int) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        for _ in range(reduces):
            x = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
            x = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (x,))
        graph.output((x,))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    program = StageProgram.__new__(StageProgram)  # its graphs only, no module traced
    program.forward, program.backward = traced(2), traced(1)
    assert program.collectives() == {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 1}
    job = SimpleNamespace(plan=plan, stage_indices=[1], stage_programs=[program], _inner=("tp",))
    with caplog.at_level("WARNING", logger="plait.runtime.pipeline.job"):
        found = PipelineJob._check_against_plan(job)  # type: ignore[arg-type]
    assert len(found) == 1 and "pipeline stage 1 issues" in found[0], found
    assert "('forward', 'all_reduce'): 2" in found[0] and "('forward', 'all_reduce'): 1" in found[0]
    assert found[0] in caplog.text
    program.forward = traced(1)  # as the plan says: nothing to report
    assert PipelineJob._check_against_plan(job) == []  # type: ignore[arg-type]
    job.plan = None  # marks and even splits have no plan to check against
    assert PipelineJob._check_against_plan(job) == []  # type: ignore[arg-type]


def _tiny_hf_llama(layers: int = 2) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_hugging_face_model_splits_without_its_cache() -> None:
    """torch's export cannot carry a DynamicCache out of the graph: the split is traced with
    ``use_cache=False`` (training never reads the cache), and the config is left as it was."""
    from plait.comm.pipeline import CarriedInputs, carry_late_inputs, split_model

    model = _tiny_hf_llama()
    ids = torch.randint(0, 64, (2, 8))
    pipe = split_model(model, (), {"input_ids": ids}, ["model.layers.1"])
    assert model.config.use_cache is True
    assert carry_late_inputs(pipe) == CarriedInputs()  # nothing read past the first stage


def _run_split(pipe, *inputs):
    """The split graph run whole, stage after stage, as the schedules hand values on."""
    return torch.fx.Interpreter(pipe.split_gm).run(*inputs)


def test_labels_read_by_the_last_stage_are_carried_through_every_stage() -> None:
    """``model(**batch).loss``: the loss inside the model reads ``labels`` on the last stage;
    after the rewrite the first stage takes it and each stage hands it on (a middle stage
    that does not read it included), and the split computes the model's own loss."""
    from plait.comm.pipeline import CarriedInputs, carry_late_inputs, split_model

    model = _tiny_hf_llama(layers=3)
    ids, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    expected = model(input_ids=ids, labels=labels).loss
    pipe = split_model(model, (), {"input_ids": ids, "labels": labels}, ["model.layers.1", "model.layers.2"])  # fmt: skip
    assert carry_late_inputs(pipe) == CarriedInputs(carried=("labels",))
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    root = {n.name: n for n in pipe.split_gm.graph.nodes if n.op == "placeholder"}
    assert root["labels"] in calls[0].args  # enters at the first stage ...
    assert all(root["labels"] not in call.args for call in calls[1:])  # ... and only there
    middle = [n.name for n in pipe.split_gm.submod_pp_1.graph.nodes if n.op == "placeholder"]
    assert middle[-1] == "carried_labels"  # the middle stage takes it to hand it on
    loss, _logits = _run_split(pipe, ids, labels)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_an_input_that_is_another_inputs_tensor_reaches_the_stages_once() -> None:
    """``labels=input_ids`` (one tensor, as Hugging Face's docs write it): the trace keeps one
    input, which the first stage reads as the ids and hands on to the loss; the other reaches
    no stage, and the first stage is not given it."""
    from plait.comm.pipeline import CarriedInputs, carry_late_inputs, split_model

    model = _tiny_hf_llama()
    ids = torch.randint(0, 64, (2, 8))
    expected = model(input_ids=ids, labels=ids).loss
    pipe = split_model(model, (), {"input_ids": ids, "labels": ids}, ["model.layers.1"])
    assert carry_late_inputs(pipe) == CarriedInputs(carried=("labels",), unread=("input_ids",))
    loss, _logits = _run_split(pipe, ids, ids)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_values_handed_on_without_a_gradient_are_found() -> None:
    """A Llama's first stage hands on its hidden states (a gradient comes back for them), and
    the rotary tables, the mask and the carried labels, which carry none: the receiving
    stage takes no gradient for those, and the first stage waits for none."""
    from plait.comm.pipeline import carry_late_inputs, constant_handovers, split_model

    model = _tiny_hf_llama()
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids, "labels": ids.clone()}
    pipe = split_model(model, (), batch, ["model.layers.1"])
    carry_late_inputs(pipe)
    found = constant_handovers(pipe, (), batch)
    hidden = 0  # the first output: the layers' residual stream
    first_outputs = next(n for n in pipe.split_gm.submod_pp_0.graph.nodes if n.op == "output")
    count = len(first_outputs.args[0])
    assert found.outputs[0] == frozenset(range(count)) - {hidden}
    assert found.inputs[1] == found.outputs[0]  # the same values, as the next stage takes them
    assert found.outputs[1] == frozenset()  # the last stage's loss and logits


class _Block(nn.Module):
    """A stage of plain parameters, taking and returning plain tensors."""

    def __init__(self, branchy: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.branchy = branchy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branchy and bool(x.sum() > 0):  # data-dependent: a trace on fake tensors fails
            x = x * 1.0
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _saved_count(fn) -> int:
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return count[0]


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_a_stage_of_plain_parameters_runs_as_its_program(recompute: str) -> None:
    """A stage without axes inside (pp x dp) is a program too: the forward and backward graphs
    of its own ops, its parameters' gradients added as autograd would, equal to the eager
    module's bit for bit over two micro-batches; recompute a pass over the joint graph that
    keeps less for backward."""
    from plait.runtime.pipeline.stage_program import compile_stage

    torch.manual_seed(0)
    eager, stage = _Block(), _Block()
    stage.load_state_dict(eager.state_dict())
    program = compile_stage(stage, recompute=recompute)
    xs = [torch.randn(4, 16, requires_grad=True) for _ in range(2)]
    for x in xs:
        ours, theirs = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        stage(ours).square().sum().backward()
        eager(theirs).square().sum().backward()
        assert torch.equal(ours.grad, theirs.grad)
    assert program.refused is None and program.calls == 2 and program.plain
    for (name, p), q in zip(stage.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    before, after = program.saved_bytes
    # full keeps the input alone; selective keeps the products (here as much as it frees:
    # tanh's output, recomputed from fc1's kept one, against fc1's kept one)
    assert {"none": after == before, "full": after < before, "selective": after <= before}[
        recompute
    ], (before, after)
    with torch.no_grad():  # evaluation: a forward graph of its own, the same numbers
        assert torch.equal(stage(xs[0]), eager(xs[0]))
    assert program.forward_calls == 1


def test_a_stage_whose_trace_is_refused_still_recomputes() -> None:
    """A compiled stage whose trace fails runs eagerly, and a recompute asked of it runs as
    torch's checkpoint there (it used to be dropped silently): backward keeps the stage's
    input alone, where without recompute it keeps every activation."""
    from plait.runtime.pipeline.stage_program import compile_stage
    from plait.runtime.pipeline.stage_wrappers import recompute_eagerly

    def saved(recompute: str) -> tuple[int, str | None]:
        stage = _Block(branchy=True)
        program = compile_stage(stage, recompute=recompute)
        program.on_eager = lambda: recompute_eagerly(program, stage, recompute, ())
        x = torch.randn(4, 16, requires_grad=True)
        stage(x).sum().backward()  # the first call traces, fails, runs eagerly
        count = _saved_count(lambda: stage(x).sum().backward())
        return count, program.refused

    kept, why = saved("none")
    recomputed, _ = saved("full")
    assert why is not None and "trace failed" in why
    assert recomputed < kept, (recomputed, kept)
