"""Real processes: Megatron dp=2 x tp=2 on 4 gloo workers equals single-device training.

Reference: plain PyTorch in the test process on the same model and global batches. Each
worker passes only its own slice of every batch (``dataset_strategy="data_parallel"``, the
default): ranks with the same dp coordinate get the same slice.
"""

import pytest
import torch

import plait
from plait import ParallelConfig
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.testing import run_workers
from plait.testing.equivalence import Run, assert_same_run, parallel_steps, reference_run

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
STEPS = 10


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _model_and_batches():
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, CFG.vocab, (8, CFG.seq))
        batches.append((ids, torch.roll(ids, -1, dims=1)))
    return model, batches


def _train_megatron() -> Run:
    model, batches = _model_and_batches()
    annotate_megatron(model, 2)
    job = plait.parallelize(model, ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
                            optimizer=_adamw, loss_fn=gpt_loss)
    dp_index = job.device_mesh.get_coordinate()[0]
    local = [tuple(t.chunk(2)[dp_index] for t in batch) for batch in batches]
    return parallel_steps(job, local)


@pytest.mark.dist
def test_megatron_on_four_gloo_processes_matches_single_device():
    model, batches = _model_and_batches()
    expected = reference_run(model, gpt_loss, _adamw, batches)
    runs = run_workers(_train_megatron, 4)
    for run in runs:
        assert_same_run(expected, run)
