"""A Llama pipeline stage in Megatron's layout, on 2 gloo processes (tp=2), as a compiled
per-rank program (plait.runtime.pipeline.stage_program) and on DTensors, against one device.

The stage is the first of a pipeline cut: the vocabulary-split token embedding and one Llama
block (RMSNorm, rotary positions, SwiGLU, grouped-query attention through SDPA), run as
``plait.comm.pipeline.stage_on_submesh`` wraps a stage. DTensor's ``rms_norm`` backward,
unlike ``layer_norm``'s, passes a pending sum on, so without the stage reducing the gradient
of a replicated value where it arrives pending (Megatron's place, the norm's output), that sum
reached the row-parallel weights (a whole-sized pending gradient: the trace refused, the stage
ran eagerly) and the vocabulary-split embedding (DTensor refused its backward: the step
failed). Now the stage compiles and its output and every parameter's gradient equal one
device's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from plait.comm.dtensor import implicit_replication
from plait.comm.pipeline import stage_on_submesh
from plait.models import Llama, ModelSpec
from plait.runtime.pipeline.stage_program import compile_stage
from plait.testing import run_workers

pytestmark = pytest.mark.dist

SPEC = ModelSpec(kind="llama", vocab=32, seq=8, hidden=16, heads=4, kv_heads=2, layers=1)
COLUMN = ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")
ROW = ("attn.o", "mlp.down")


class _FirstStage(nn.Module):
    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.tok, self.rope, self.block = model.tok, model.rope, model.blocks[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(ids.shape[1])
        return self.block(self.tok(ids), cos, sin)


def _placement(name: str) -> list:
    owner = name.rpartition(".")[0].removeprefix("block.")
    if owner == "tok" or owner in COLUMN:
        return [Shard(0)]
    return [Shard(1)] if owner in ROW else [Replicate()]


def _worker() -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return {side: _run(mesh, side == "compiled") for side in ("compiled", "dtensors")}


def _run(mesh, compiled: bool) -> dict:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    reference = _FirstStage(Llama(SPEC))
    stage = copy.deepcopy(reference)
    for name, p in list(stage.named_parameters()):
        owner, _, attr = name.rpartition(".")
        piece = distribute_tensor(p.detach(), mesh, _placement(name))
        setattr(stage.get_submodule(owner), attr, nn.Parameter(piece))
    stage_on_submesh(stage, mesh)
    program = compile_stage(stage) if compiled else None
    ids = torch.randint(0, SPEC.vocab, (4, SPEC.seq), generator=torch.Generator().manual_seed(1))
    out: dict = {"outputs": [], "grads": [], "want": []}
    for model in (stage, reference):
        with implicit_replication():  # as the job runs its schedule (rotary tables are plain)
            y = model(ids)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if model is stage:
            grads = {n: g.full_tensor() for n, g in grads.items()}
        out["outputs"].append(y.detach())
        out["grads" if model is stage else "want"] = grads
    out["refused"] = None if program is None else program.refused
    out["calls"] = None if program is None else program.calls
    return out


def test_llama_stage_with_a_vocabulary_split_embedding_equals_one_device() -> None:
    results = run_workers(_worker, 2, timeout_s=300.0)
    for r in (rank[side] for rank in results for side in ("compiled", "dtensors")):
        if r["calls"] is not None:
            assert r["refused"] is None and r["calls"] == 1
        torch.testing.assert_close(r["outputs"][0], r["outputs"][1], rtol=1e-5, atol=1e-6)
        assert r["grads"].keys() == r["want"].keys()
        for name, want in r["want"].items():
            torch.testing.assert_close(r["grads"][name], want, rtol=1e-5, atol=1e-6, msg=name)
