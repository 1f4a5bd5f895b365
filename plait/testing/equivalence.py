"""Train a model on one device and in parallel, and compare the two runs.

The reference is plain PyTorch on a deep copy of the same model (same initial weights), fed
the same global batches. A parallel run equals it when every step's loss and every final
parameter agree within tolerance. Users can check their own models with the same helpers.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.config import ParallelConfig
from plait.runtime.engine.job import Job, LossFn, OptimizerFactory
from plait.runtime.parallelize import parallelize
from plait.testing.simulate import simulate

__all__ = ["Run", "assert_same_run", "reference_run", "simulated_run"]


@dataclass
class Run:
    """Losses per step and the final unsharded state of one training run."""

    losses: list[float]
    state: dict[str, torch.Tensor]


def reference_run(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    batches: Sequence[Any],
    *,
    autocast: torch.dtype | None = None,
) -> Run:
    """Single-device training of a copy of ``model`` on ``batches``; with ``autocast`` (a
    dtype) every forward and loss under ``torch.autocast`` on the CPU, as mixed precision's
    ``precision="bf16"`` runs them (the parameters and their update stay fp32)."""
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters())
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return Run(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def parallel_steps(job: Job, batches: Sequence[Any]) -> Run:
    """Train ``job`` on ``batches``; the final state is gathered (every rank must call this)."""
    losses = [job.step(b) for b in batches]
    return Run(losses, job.full_state_dict())


def simulated_run(
    model: nn.Module,
    config: ParallelConfig,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    batches: Sequence[Any],
    world_size: int,
) -> Run:
    """The same training under ``simulate(world_size)`` on a copy of ``model``."""
    model = copy.deepcopy(model)
    with simulate(world_size):
        job = parallelize(model, config, optimizer=optimizer, loss_fn=loss_fn)
        return parallel_steps(job, batches)


def assert_same_run(expected: Run, actual: Run, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every loss and every final parameter agree (``atol`` guards values near zero)."""
    torch.testing.assert_close(
        torch.tensor(actual.losses),
        torch.tensor(expected.losses),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"losses differ: {actual.losses} vs reference {expected.losses}\n{m}",
    )
    assert actual.state.keys() == expected.state.keys(), (
        f"state keys differ: {sorted(set(actual.state) ^ set(expected.state))}"
    )
    for key, ref in expected.state.items():
        torch.testing.assert_close(
            actual.state[key], ref, rtol=rtol, atol=atol, msg=functools.partial(_about, key)
        )


def _about(name: str, message: str) -> str:
    """assert_close's message for a parameter or buffer ``name`` that differs."""
    return f"parameter {name}: {message}"
