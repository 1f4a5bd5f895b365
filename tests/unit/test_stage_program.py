"""A compiled pipeline stage's ways back to its eager forward (plait.runtime.pipeline.stage_program).

A stage with axes inside runs as its traced per-rank program; a call it was not traced for
(another batch shape, a parameter no longer laid out as traced) and a stage it cannot trace
(random numbers, a failed trace) run the stage's eager forward on DTensors instead. Each test
checks the fallback is taken, says why where it refuses, and gives the eager stage's outputs
and gradients. One rank (a fake process group): the DTensor ops desugar as on any mesh.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from plait._compat import FakeStore
from plait.runtime.pipeline.stage_program import StageProgram, compile_stage


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


class _Stage(nn.Module):
    """Two linear layers with Megatron's layouts, taking and returning plain tensors as a
    pipeline wraps a stage."""

    def __init__(self, mesh: DeviceMesh, dropout: float = 0.0, extra: bool = False) -> None:
        super().__init__()
        self.mesh, self.extra = mesh, extra
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(dropout)
        for fc, dims in ((self.fc1, (0, 0)), (self.fc2, (1, None))):
            fc.weight = nn.Parameter(distribute_tensor(fc.weight.detach(), mesh, [Shard(dims[0])]))
            bias = [Shard(0)] if dims[1] == 0 else [Replicate()]
            fc.bias = nn.Parameter(distribute_tensor(fc.bias.detach(), mesh, bias))

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        h = self.drop(nn.functional.gelu(self.fc1(DTensor.from_local(x, self.mesh, [Replicate()]))))
        out = self.fc2(h).redistribute(self.mesh, [Replicate()]).to_local()
        return (out, 1) if self.extra else out


def _pair(mesh: DeviceMesh, **kw: object) -> tuple[_Stage, _Stage, StageProgram]:
    """The same stage twice: one compiled, one eager (the reference)."""
    torch.manual_seed(0)
    stage = _Stage(mesh, **kw)  # type: ignore[arg-type]
    reference = copy.deepcopy(stage)
    return stage, reference, compile_stage(stage)


def _step(stage: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = stage(x)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    grads = [p.grad.full_tensor() for p in stage.parameters()]  # type: ignore[union-attr]
    return out.detach(), grads


def _same(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[torch.Tensor, list[torch.Tensor]]):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    for got, want in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_batch_of_another_shape_runs_the_eager_forward(mesh: DeviceMesh) -> None:
    """The program is traced for the first micro-batch's shapes; a micro-batch of another
    shape (the last, smaller one of an epoch) runs eagerly, and the next of the traced shape
    runs the program again. Gradients add up as the eager stage's do."""
    stage, reference, program = _pair(mesh)
    torch.manual_seed(1)
    batches = [torch.randn(5, 8), torch.randn(3, 8), torch.randn(5, 8)]
    calls = []
    for x in batches:
        _same(_step(stage, x), _step(reference, x))
        calls.append(program.calls)
    assert program.refused is None and program.forward is not None
    assert calls == [1, 1, 2]  # the 3-row batch ran eagerly


def test_a_stage_that_draws_random_numbers_stays_eager(mesh: DeviceMesh) -> None:
    """Dropout draws random numbers, which eager DTensor keeps apart per piece: the stage is
    not traced, says so, and runs eagerly with the eager stage's random stream."""
    stage, reference, program = _pair(mesh, dropout=0.5)
    x = torch.randn(5, 8)
    torch.manual_seed(2)
    got = _step(stage, x)
    torch.manual_seed(2)
    want = _step(reference, x)
    _same(got, want)
    assert program.refused is not None and "random numbers" in program.refused
    assert "aten.native_dropout" in program.refused or "bernoulli" in program.refused
    assert program.calls == 0 and program.forward is None


def test_a_failed_trace_leaves_the_stage_eager(mesh: DeviceMesh) -> None:
    """A stage whose outputs are not all tensors cannot be traced into graphs: the stage says
    why and keeps running eagerly, outputs untouched."""
    stage, reference, program = _pair(mesh, extra=True)
    x = torch.randn(5, 8)
    assert stage(x)[1] == 1
    assert program.refused is not None
    assert program.refused.startswith("its trace failed: TypeError")
    assert "plain tensors" in program.refused
    stage.zero_grad()
    _same(_step(stage, x), _step(reference, x))
    assert program.calls == 0


def test_a_parameter_laid_out_anew_runs_the_eager_forward(mesh: DeviceMesh) -> None:
    """A parameter replaced by one of another layout (a load that reshards it) no longer
    matches the traced graphs: the stage runs eagerly; replaced by one of the same layout
    (a load in place), the program runs on the new values."""
    stage, reference, program = _pair(mesh)
    x = torch.randn(5, 8)
    _same(_step(stage, x), _step(reference, x))
    assert program.calls == 1
    for target in (stage, reference):
        w = target.fc1.weight.detach().full_tensor() * 0.5
        target.fc1.weight = nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))
    _same(_step(stage, x), _step(reference, x))
    assert program.calls == 1  # other layout: eager
    for target in (stage, reference):
        w = target.fc1.weight.detach().full_tensor() * 2.0
        target.fc1.weight = nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
        target.zero_grad()
    _same(_step(stage, x), _step(reference, x))
    assert program.calls == 2  # the traced layout again: the program, with the new values
