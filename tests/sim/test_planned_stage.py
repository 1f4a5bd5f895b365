"""Pipeline stages that follow the plan (:mod:`plait.runtime.pipeline.planned_stage`), on
simulated ranks: the stage of mode auto's pp=2 x dp=2 x tp=2 plan for a small Llama, run on the
tp sub-mesh as a pipeline job runs it, computes what the same stage computes on one device,
with the collectives the plan lists for its ops; without the pass DTensor's propagation
reached ``rms_norm`` with a pending mean and died (the 8-process engine matrix case).

Reference: the same split stage run on one device, plain tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import plait
from plait import ParallelConfig
from plait.comm import pipeline as pp_comm
from plait.comm.dtensor import build_device_mesh
from plait.comm.pipeline import lay_out
from plait.layout import TensorLayout
from plait.mesh import MeshSpec
from plait.models import Llama, ModelSpec, lm_loss
from plait.planning import plan as make_plan
from plait.runtime.pipeline.job import (
    distribute_stage,
    inner_layouts,
    model_inputs,
    plan_stage_starts,
)
from plait.runtime.pipeline.planned_stage import follow_plan, placement_code
from plait.runtime.pipeline.stage_program import planned_stage_collectives
from plait.testing.comm import CollectiveLog

SPEC = ModelSpec(kind="llama", vocab=32, seq=8, hidden=16, heads=4, kv_heads=2, layers=4)
CONFIG = dict(mode="auto", mesh={"pp": 2, "dp": 2, "tp": 2}, micro_batches=4)


def _planned_stages() -> tuple[Llama, object, object, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = Llama(SPEC)
    ids = torch.randint(0, SPEC.vocab, (8, SPEC.seq + 1))
    batch = (ids[:, :-1], ids[:, 1:])
    plan = make_plan(model, ParallelConfig(**CONFIG), example_batch=batch, loss_fn=lm_loss)
    args, kwargs = model_inputs(model, lm_loss, (batch[0][:1], batch[1][:1]))
    pipe = pp_comm.split_model(model, args, kwargs, plan_stage_starts(plan))
    return model, plan, pipe, args


def test_a_planned_stage_computes_one_devices_values_with_the_plans_collectives() -> None:
    _, plan, pipe, args = _planned_stages()
    stage = pipe.split_gm.submod_pp_0
    expected = stage(*args)
    mesh = MeshSpec.from_dict(CONFIG["mesh"])
    ops = {op.name: op for op in plan.ops}
    with plait.testing.simulate(2):
        submesh = build_device_mesh(MeshSpec.from_dict({"tp": 2}))
        ran = copy.deepcopy(stage)
        layouts = inner_layouts(plan.parameters, mesh, ParallelConfig(**CONFIG))
        assert any(layout.dims != ((),) * layout.ndim for layout in layouts.values())
        distribute_stage(ran, layouts, submesh, MeshSpec.from_dict({"tp": 2}))
        done = follow_plan(ran, [ops[n] for n in plan.stages[0]], ("tp",))
        pp_comm.stage_on_submesh(ran, submesh)
        # CollectiveLog, not CommDebugMode: the latter's module tracker hands a module's
        # input on as another tensor object, so one activation read in two modules' graphs
        # is moved twice under it (lay_out keeps the moved value on the activation object)
        with CollectiveLog(submesh) as log:
            out = ran(*args)
        got = out.to_local() if isinstance(out, DTensor) else out
    assert done.laid_out > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    planned = planned_stage_collectives(plan, 0, ("tp",))
    # the plan's forward moves (gathering the hidden-split embedding once) and no others;
    # the stage's outputs leave replicated (nothing for stage_on_submesh to gather)
    assert planned == {("forward", "all_gather"): 1}
    assert log.counts() == {("all_gather", "tp"): 1}


def test_lay_out_moves_an_activation_once_and_a_parameter_every_time() -> None:
    with plait.testing.simulate(2):
        mesh = build_device_mesh(MeshSpec.from_dict({"tp": 2}))
        x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(1)], run_check=False)
        w = torch.nn.Parameter(
            DTensor.from_local(torch.ones(2, 3), mesh, [Shard(1)], run_check=False)
        )
        with CommDebugMode() as comm:
            a, b = lay_out(x, ("tp=R",)), lay_out(x, ("tp=R",))
            lay_out(w, ("tp=R",))
            lay_out(w, ("tp=R",))
            same = lay_out(x, ("tp=S1",))
        assert a is b and same is x and a.placements == (Replicate(),)
        assert a.shape == (2, 6)
        assert comm.get_total_counts() == 3  # the activation once, the parameter twice
        x.add_(1)  # changed in place: moved again, never the stale copy
        assert lay_out(x, ("tp=R",)) is not a
    plain = torch.ones(3)
    assert lay_out(plain, ("tp=R",)) is plain


def test_lay_out_leaves_a_value_on_another_mesh_alone() -> None:
    """A DTensor on a mesh other than the stage's (optimizer parallel's dp mesh) is not the
    plan's to move here."""
    with plait.testing.simulate(2):
        dp = build_device_mesh(MeshSpec.from_dict({"dp": 2}))
        x = DTensor.from_local(torch.ones(2, 3), dp, [Shard(0)], run_check=False)
        with CollectiveLog(dp) as log:
            assert lay_out(x, ("tp=R",)) is x
        assert log.total() == 0


def test_placement_code_keeps_the_stage_axes_only() -> None:
    mesh = MeshSpec.from_dict({"pp": 2, "dp": 2, "tp": 2})
    layout = TensorLayout(mesh, (("dp",), (), ("tp",)))
    assert placement_code(layout, ("tp",)) == ("tp=S2",)
    assert placement_code(TensorLayout(mesh, (("dp",), (), ())), ("tp",)) == ("tp=R",)
    two = MeshSpec.from_dict({"pp": 2, "sp": 2, "tp": 2})
    assert placement_code(TensorLayout(two, (("sp", "tp"), ())), ("sp", "tp")) == ("sp=S0", "tp=S0")
    assert placement_code(TensorLayout(two, (("tp", "sp"), ())), ("sp", "tp")) is None


@pytest.mark.parametrize("stage_index", [0, 1])
def test_every_planned_op_of_a_stage_is_matched(stage_index: int) -> None:
    """Each op the plan lists for a stage is found in the stage's graphs (by module, target
    and order): nothing left to DTensor's propagation on this model."""
    _, plan, pipe, _ = _planned_stages()
    ops = {op.name: op for op in plan.ops}
    stage = getattr(pipe.split_gm, f"submod_pp_{stage_index}")
    done = follow_plan(copy.deepcopy(stage), [ops[n] for n in plan.stages[stage_index]], ("tp",))
    assert done.skipped == []
    assert done.laid_out > 0


class _AlibiAttention(torch.nn.Module):
    """Self-attention with ALiBi's per-head linear bias (BLOOM, MPT) passed to SDPA as its
    ``attn_mask``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (torch.nn.Linear(width, width, bias=False) for _ in range(3))
        self.out = torch.nn.Linear(width, width, bias=False)
        slopes = torch.tensor([2.0 ** -(i + 1) for i in range(heads)])
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = (
            f(x).view(b, s, self.heads, w // self.heads).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        pos = torch.arange(s, device=x.device)
        bias = self.slopes.view(-1, 1, 1) * (pos.view(1, s) - pos.view(s, 1)).float()
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.out(y.transpose(1, 2).reshape(b, s, w))


class _AlibiLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList([_AlibiAttention(16, 4) for _ in range(4)])
        self.head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_stage_with_a_per_head_attention_bias_runs_on_local_heads() -> None:
    """An ALiBi model's first stage, heads split over tp by a semi_auto plan of Megatron marks
    (the plan lays the bias out split by heads too): forward and backward equal to one
    device. (tests/sim/test_local_attention.py checks that such a bias runs in the attention
    kernel on local heads.)"""
    torch.manual_seed(0)
    model = _AlibiLM()
    for block in model.blocks:
        for linear in (block.q, block.k, block.v):
            plait.shard(linear, parameter_strategy={"weight": (2, 1)})
        plait.shard(block.out, parameter_strategy={"weight": (1, 2)})
    ids = torch.randint(0, 32, (8, 9))
    batch = (ids[:, :-1], ids[:, 1:])
    config = ParallelConfig(mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=4)
    plan = make_plan(model, config, example_batch=batch, loss_fn=lm_loss)
    heads = [op for op in plan.ops if "scaled_dot" in op.target]
    assert heads and all(op.inputs[0].dims[1] == ("tp",) for op in heads)
    args, kwargs = model_inputs(model, lm_loss, (batch[0][:2], batch[1][:2]))
    pipe = pp_comm.split_model(model, args, kwargs, plan_stage_starts(plan))
    stage = pipe.split_gm.submod_pp_0
    reference = copy.deepcopy(stage)
    expected = reference(*args)
    expected.square().sum().backward()
    ops = {op.name: op for op in plan.ops}
    with plait.testing.simulate(2):
        submesh = build_device_mesh(MeshSpec.from_dict({"tp": 2}))
        ran = copy.deepcopy(stage)
        layouts = inner_layouts(plan.parameters, MeshSpec.from_dict(config.mesh_dict), config)
        distribute_stage(ran, layouts, submesh, MeshSpec.from_dict({"tp": 2}))
        done = follow_plan(ran, [ops[n] for n in plan.stages[0]], ("tp",))
        pp_comm.stage_on_submesh(ran, submesh)
        out = ran(*args)
        out.square().sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in ran.named_parameters()}
    assert done.skipped == []
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
