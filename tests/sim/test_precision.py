"""Mixed precision: bf16/fp16 compute with fp32 master weights and optimizer states.

Reference: single-device training of the same model under the same ``torch.autocast`` (and,
for fp16, ``torch.amp.GradScaler`` with the same initial scale). Low-precision matmuls sum in
a different order when split, so the tolerance is that of the compute dtype, not fp32's.
"""

import copy

import torch

import plait
from plait import ParallelConfig
from plait.models import annotate_megatron, gpt_loss, mlp_loss
from tests.sim.conftest import adamw


def _reference(model, loss_fn, batches, dtype, scaler=None):
    model = copy.deepcopy(model)
    opt = adamw(model.parameters())
    losses = []
    for batch in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model, batch)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses, model.state_dict()


def _parallel(model, config, loss_fn, batches, world):
    model = copy.deepcopy(model)
    with plait.testing.simulate(world):
        job = plait.parallelize(model, config, optimizer=adamw, loss_fn=loss_fn)
        losses = [job.step(b) for b in batches]
        dtypes = {p.dtype for p in job.model.parameters()}
        states = {
            v.dtype
            for s in job.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.numel() > 1
        }
        return losses, job.full_state_dict(), dtypes | states, job


def _close(a_losses, a_state, b_losses, b_state, rtol, atol):
    torch.testing.assert_close(torch.tensor(a_losses), torch.tensor(b_losses), rtol=rtol, atol=atol)
    for k, v in b_state.items():
        torch.testing.assert_close(
            a_state[k], v, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}"
        )


def test_bf16_megatron_gpt_matches_single_device_bf16(gpt_and_batches):
    model, batches = gpt_and_batches
    ref = _reference(model, gpt_loss, batches[:5], torch.bfloat16)
    annotate_megatron(model, 2)
    cfg = ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, precision="bf16")
    losses, state, dtypes, _ = _parallel(model, cfg, gpt_loss, batches[:5], 4)
    assert dtypes == {torch.float32}  # master weights and Adam states stay fp32
    _close(losses, state, *ref, rtol=2e-2, atol=2e-3)


def test_fp16_data_parallel_matches_single_device_with_grad_scaler(mlp_and_batches):
    model, batches = mlp_and_batches
    ref = _reference(model, mlp_loss, batches, torch.float16, torch.amp.GradScaler("cpu"))
    losses, state, dtypes, job = _parallel(
        model, ParallelConfig(precision="fp16"), mlp_loss, batches, 4
    )
    assert dtypes == {torch.float32}
    assert job.loss_scaler.scale == 2.0**16 and job.loss_scaler.skipped_steps == 0
    _close(losses, state, *ref, rtol=1e-2, atol=1e-3)


def test_fp16_overflow_skips_the_step_on_every_rank(mlp_and_batches):
    model, batches = mlp_and_batches
    with plait.testing.simulate(4):
        job = plait.parallelize(
            copy.deepcopy(model),
            ParallelConfig(precision="fp16"),
            optimizer=adamw,
            loss_fn=mlp_loss,
        )
        before = job.full_state_dict()
        job.loss_scaler.scale = 2.0**120  # the scaled fp16 gradients overflow
        job.step(batches[0])
        after = job.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert job.loss_scaler.skipped_steps == 1 and job.loss_scaler.scale == 2.0**119
