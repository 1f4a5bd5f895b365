"""plait.runtime.engine.measure: one step's memory by kind, on one device and on simulated ranks.

A stand-alone step is measured exactly (the kinds are the tensors' bytes; the peak is the one
PyTorch's own MemTracker records); on 2 simulated ranks ZeRO-3's parameters are their local
shards, and full recompute holds fewer activations than none.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import plait
from plait.comm.dtensor import local_piece
from plait.config import ParallelConfig
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.runtime.engine.measure import (
    ComparisonRow,
    MemoryMeasurement,
    compare,
    format_bytes,
    measure_step_memory,
    plan_of,
)

# Activations dominate (seq 64, width 32), so recompute shows.
GPT = GPTConfig(vocab=32, seq=64, width=32, heads=4, layers=2)
DP = 2


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


@pytest.fixture(scope="module")
def model_and_batch():
    torch.manual_seed(0)
    ids = torch.randint(0, GPT.vocab, (8, GPT.seq))
    return TinyGPT(GPT), (ids, torch.roll(ids, -1, dims=1))


def test_a_stand_alone_step_is_measured_exactly(model_and_batch):
    model, batch = model_and_batch
    job = plait.parallelize(
        copy.deepcopy(model),
        ParallelConfig(mode="stand_alone"),
        optimizer=adamw,
        loss_fn=gpt_loss,
    )
    job.step(batch)  # warm-up: AdamW makes its states
    m = measure_step_memory(job, batch)
    params = list(job.model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    assert (m.parameters, m.gradients) == (nbytes, nbytes)
    assert m.optimizer == 2 * nbytes + 4 * len(params)  # exp_avg, exp_avg_sq, a float step each
    assert m.peak == m.states_at_peak + m.activations
    assert m.activations > m.model_states  # seq 64: activations dominate this model
    tracker = MemTracker()  # PyTorch's own count of the same step
    tracker.track_external(job.model, job.optimizer, *batch)
    with tracker:
        job.step(batch)
    assert m.peak == tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _zero3(model, batch, recompute: str) -> tuple[MemoryMeasurement, int, list]:
    """A ZeRO-3 job's first step on DP simulated ranks (no warm-up: the states the optimizer
    makes during it count as well): its measurement, the bytes of its parameters' shards (from
    the plan's split dims) and its plan's comparison rows."""
    cfg = ParallelConfig(
        mode="data_parallel", optimizer_shard=3, optimizer_shard_threshold=0, recompute=recompute
    )
    with plait.testing.simulate(DP):
        job = plait.parallelize(
            copy.deepcopy(model), cfg, optimizer=adamw, loss_fn=gpt_loss, example_batch=batch
        )
        m = measure_step_memory(job, batch)
    shards = sum(
        (spec.shard_numel(DP) if spec is not None else math.prod(local_piece(p).shape)) * 4
        for p, _, spec in job.optimizer._plait_shadows.pairs
    )
    return m, shards, compare(m, plan_of(job))


@pytest.fixture(scope="module")
def measured(model_and_batch):
    model, batch = model_and_batch
    return {"none": _zero3(model, batch, "none"), "full": _zero3(model, batch, "full")}


def test_zero3_parameters_are_the_local_shards(model_and_batch, measured):
    model, _ = model_and_batch
    m, shards, rows = measured["none"]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m.parameters == shards  # the DTensors' local pieces, each 1/dp but for one
    assert m.parameters < 0.6 * whole  # 1/2, but the position embedding stays whole
    assert m.gradients == m.parameters  # reduce-scattered: shards too
    assert [r.kind for r in rows] == ["parameters", "gradients", "optimizer", "activations", "peak"]
    assert rows[0].measured == m.parameters and rows[-1].measured == m.peak
    assert m.activations > 0 and m.peak == m.states_at_peak + m.activations


def test_full_recompute_holds_fewer_activations(measured):
    none, full = measured["none"][0], measured["full"][0]
    assert full.model_states == none.model_states
    assert full.activations < 0.8 * none.activations
    assert full.peak < none.peak


def test_compare_rows_and_formatting():
    m = MemoryMeasurement(100, 50, 200, 400, 700, 300, "tracker")
    predicted = types.SimpleNamespace(
        memory_by_kind={"parameters": 100, "gradients": 100, "optimizer": 200},
        memory_bytes=500,
    )
    rows = compare(m, types.SimpleNamespace(predicted=predicted))
    assert rows[1] == ComparisonRow("gradients", 100, 50) and rows[1].ratio == 2.0
    assert rows[3].predicted == 0 and rows[3].ratio == 0.0
    assert rows[4] == ComparisonRow("peak", 500, 700)
    assert ComparisonRow("x", 0, 0).ratio == 1.0 and ComparisonRow("x", 1, 0).ratio == math.inf
    assert m.table_row("a") == "| a | 100 B | 50 B | 200 B | 400 B | 700 B |"
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**20) == "3 MiB"
    assert plan_of(types.SimpleNamespace(loss_fn=len)) is None
