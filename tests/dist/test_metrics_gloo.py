"""Metrics on real processes (#35 item 4): 2 gloo workers, every rank given ``log_dir``, only
global rank 0 writes. Plain data parallel on dp=2 (each rank passes its own slice: samples
count the global batch) and two pipeline stages (pp=2, the loss on the last stage's rank, the
records on rank 0's): the event files, read back by TensorBoard's reader, and the JSON lines
equal the losses every rank's ``step`` returned, which equal one device's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import plait
from plait import ParallelConfig
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.testing import run_workers
from plait.testing.equivalence import reference_run
from tests.sim.test_metrics import read_events, read_jsonl

pytestmark = pytest.mark.dist

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CFG)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        ids = torch.randint(0, CFG.vocab, (8, CFG.seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _workers(root: str) -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    plain = plait.parallelize(
        _model(), ParallelConfig(mesh={"dp": 2}, log_dir=Path(root) / "plain"), optimizer=_sgd,
        loss_fn=gpt_loss,
    )  # fmt: skip
    out["plain"] = [plain.step(tuple(x.chunk(2)[rank] for x in b)) for b in _batches()]
    plain.close()
    batches = _batches()
    pipe = plait.parallelize(
        _model(),
        ParallelConfig(mesh={"pp": 2}, micro_batches=2, log_dir=Path(root) / "pipe"),
        optimizer=_sgd, loss_fn=gpt_loss, example_batch=batches[0],
    )  # fmt: skip
    out["pipe"] = [pipe.step(b) for b in batches]
    pipe.close()
    out["writes"] = {"plain": plain.metrics is not None, "pipe": pipe.metrics is not None}
    return out


def test_only_rank_zero_writes_metrics_of_plain_and_pipeline_jobs(tmp_path: Path) -> None:
    results = run_workers(_workers, 2, str(tmp_path), timeout_s=120.0)
    assert [r["writes"] for r in results] == [
        {"plain": True, "pipe": True}, {"plain": False, "pipe": False}
    ]  # fmt: skip
    reference = reference_run(_model(), gpt_loss, _sgd, _batches())
    for name in ("plain", "pipe"):
        losses = results[0][name]
        assert results[1][name] == losses  # the global loss, on every rank
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses))
        records = read_jsonl(tmp_path / name)  # one writer: three records, not six
        assert [(r["step"], r["loss"]) for r in records] == [(1, losses[0]), (2, losses[1]),
                                                             (3, losses[2])]  # fmt: skip
        scalars = read_events(tmp_path / name)  # (one event file: asserted there)
        assert [s for s, _ in scalars["loss/train"]] == [1, 2, 3]
        for (_, value), loss in zip(scalars["loss/train"], losses, strict=True):
            assert value == pytest.approx(loss, rel=1e-6)
        for r in records:  # the global batch: 8 sequences of 8 tokens, from 2 slices of 4
            assert r["samples_per_s"] * r["step_time_s"] == pytest.approx(8), name
            assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(64), name
            assert r["predicted_step_time_s"] is None  # neither job runs a plan
