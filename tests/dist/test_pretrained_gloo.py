"""Real processes: each of 2 gloo ranks reads only its own slices of a safetensors file.

A meta-initialised MLP laid out over tp=2 (hybrid mode: placement only, no plan to compile)
is filled by ``job.load_pretrained``; on a real process the loader finds its piece from its
own mesh coordinate (simulated worlds ask for every rank from one process instead). Each rank
must hold exactly its slice of the file, have read no more than that, and train one step
exactly as a single process does from the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import plait
from plait import ParallelConfig
from plait.models import MLP, mlp_loss
from plait.runtime.engine import pretrained
from plait.runtime.engine.meta_init import is_uninitialised
from plait.testing import run_workers
from plait.testing.equivalence import reference_run

pytestmark = pytest.mark.dist

DIMS = (16, 32, 8)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, DIMS[0], generator=gen), torch.randn(8, DIMS[-1], generator=gen)


def _worker(path: str) -> dict:
    import torch.distributed as dist

    with torch.device("meta"):
        model = MLP(DIMS)
    plait.shard(model.layers[0], parameter_strategy={"weight": (2, 1), "bias": (2,)})
    plait.shard(model.layers[1], parameter_strategy={"weight": (1, 2)})
    job = plait.parallelize(
        model, ParallelConfig(mode="hybrid", mesh={"tp": 2}), optimizer=_sgd, loss_fn=mlp_loss
    )
    uninitialised = is_uninitialised(job.model)
    reads: list[int] = []
    read = pretrained._Reader.read

    def counting(reader, source, where):
        value = read(reader, source, where)
        reads.append(value.numel())
        return value

    pretrained._Reader.read = counting  # type: ignore[method-assign]
    job.load_pretrained(path)
    pieces = {n: p.detach().to_local().clone() for n, p in job.model.state_dict().items()}
    loss = job.step(_batch())
    state = job.full_state_dict()
    return {
        "rank": dist.get_rank(),
        "uninitialised": (uninitialised, is_uninitialised(job.model)),
        "read": sum(reads),
        "pieces": pieces,
        "loss": loss,
        "state": state,
    }


def test_each_process_reads_only_its_slices(tmp_path: Path):
    torch.manual_seed(0)
    source = MLP(DIMS)
    path = tmp_path / "mlp.safetensors"
    save_file(source.state_dict(), str(path))
    expected = reference_run(source, mlp_loss, _sgd, [_batch()])
    results = run_workers(_worker, 2, str(path))
    full = source.state_dict()
    split = {"layers.0.weight": 0, "layers.0.bias": 0, "layers.1.weight": 1}
    per_rank = sum(v.numel() // (2 if k in split else 1) for k, v in full.items())
    for result in results:
        r = result["rank"]
        assert result["uninitialised"] == (True, False)
        assert result["read"] == per_rank  # its slices, never a whole split tensor
        for name, value in full.items():
            want = value.chunk(2, split[name])[r] if name in split else value
            assert torch.equal(result["pieces"][name], want), (r, name)
        assert result["loss"] == pytest.approx(expected.losses[0], rel=1e-6)
        for name, value in expected.state.items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-6, atol=1e-7)
