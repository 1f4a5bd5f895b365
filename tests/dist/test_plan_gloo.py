"""Real processes: a mode-auto plan, and the same plan replayed from a file, on 4 gloo workers.

The plan executor (plait/runtime/engine/plan_exec.py) is otherwise tested on simulated ranks
(tests/sim/test_auto_parallelize.py); here its DTensors, redistributions and gradient
reductions run over real gloo collectives. One spawn does both checks (a spawn costs ~15 s):

1. ``ParallelConfig(mode="auto", mesh={"dp": 2, "tp": 2})`` on a Megatron-annotated TinyGPT:
   each rank plans (the same plan everywhere), runs 3 SGD steps on its dp slice of every global
   batch, and the losses and gathered parameters equal single-device training.
2. Rank 0 saves that plan; every rank loads it through ``ParallelConfig(plan=path)`` on a fresh
   copy of the model and trains the same 3 steps: the same result again.
3. The saved plan once more with ``compile=True``: the per-rank program runs through
   ``torch.compile`` (inductor, CPU): the same result again.
4. Memory passes over real collectives: ZeRO-3 with full recompute, and ZeRO-2 with gradient
   accumulation (one reduce-scatter per step), semi_auto on the same mesh; and HSDP (ZeRO-3 in
   shard groups of 2 on a dp=4 mesh, data_parallel): the same result.
5. A new batch shape plans again (plait.runtime.engine.replan) from each rank's own slice: semi_auto
   planned at its first step, then a batch of 4 sequences of 6 tokens: equal to one device.

SGD, not Adam: a wrong gradient scale (a missing or doubled reduction) shows in the parameters.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import plait
from plait import ParallelConfig
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.testing import run_workers
from plait.testing.equivalence import Run, assert_same_run, parallel_steps, reference_run

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)
MESH = {"dp": 2, "tp": 2}
STEPS = 3

Batch = tuple[torch.Tensor, torch.Tensor]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _model_and_batches() -> tuple[TinyGPT, list[Batch]]:
    torch.manual_seed(0)
    model = annotate_megatron(TinyGPT(CFG), 2)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, CFG.vocab, (8, CFG.seq), generator=gen)
        batches.append((ids, torch.roll(ids, -1, dims=1)))
    return model, batches


def _shorter_batch() -> Batch:
    """A batch of another shape (4 sequences of 6 tokens): the job plans again for it."""
    ids = torch.randint(0, CFG.vocab, (4, 6), generator=torch.Generator().manual_seed(2))
    return ids, torch.roll(ids, -1, dims=1)


def _train(job: plait.Job, batches: list[Batch]) -> Run:
    """Steps on this rank's dp slice of each global batch (dataset_strategy data_parallel)."""
    dp = job.device_mesh.get_coordinate()[job.mesh.axis_index("dp")]
    local = [(ids.chunk(2)[dp], targets.chunk(2)[dp]) for ids, targets in batches]
    return parallel_steps(job, local)


def _auto_then_replay(plan_path: str) -> dict:
    model, batches = _model_and_batches()
    job = plait.parallelize(
        copy.deepcopy(model),
        ParallelConfig(mode="auto", mesh=MESH),
        optimizer=_sgd,
        loss_fn=gpt_loss,
        example_batch=batches[0],
    )
    plan = job.loss_fn.plan
    auto = _train(job, batches)
    if dist.get_rank() == 0:
        plan.save(plan_path)
    dist.barrier()  # the file is complete before anyone reads it
    replay_job = plait.parallelize(
        copy.deepcopy(model),
        ParallelConfig(mode="auto", mesh=MESH, plan=plan_path),
        optimizer=_sgd,
        loss_fn=gpt_loss,
        example_batch=batches[0],
    )
    replay = _train(replay_job, batches)
    compiled_job = plait.parallelize(
        copy.deepcopy(model),
        ParallelConfig(mode="auto", mesh=MESH, plan=plan_path, compile=True),
        optimizer=_sgd,
        loss_fn=gpt_loss,
        example_batch=batches[0],
    )
    memory = {}
    for name, extra in {
        "zero3_full_recompute": {"optimizer_shard": 3, "recompute": "full"},
        "zero2_accumulation": {"optimizer_shard": 2, "grad_accumulation": 2},
    }.items():
        memory_job = plait.parallelize(
            copy.deepcopy(model),
            ParallelConfig(mode="semi_auto", mesh=MESH, optimizer_shard_threshold=0, **extra),
            optimizer=_sgd,
            loss_fn=gpt_loss,
            example_batch=batches[0],
        )
        memory[name] = _train(memory_job, batches)
    # HSDP over real collectives: ZeRO-3 in shard groups of 2 on dp=4 (the model unannotated,
    # the same weights: mode data_parallel takes no annotations)
    torch.manual_seed(0)
    hsdp_job = plait.parallelize(
        TinyGPT(CFG),
        ParallelConfig(
            mode="data_parallel", mesh={"dp": 4}, optimizer_shard=3,
            optimizer_weight_shard_size=2, optimizer_shard_threshold=0,
        ),
        optimizer=_sgd, loss_fn=gpt_loss, example_batch=batches[0],
    )  # fmt: skip
    rank = dist.get_rank()
    memory["hsdp_zero3"] = parallel_steps(
        hsdp_job, [(ids.chunk(4)[rank], targets.chunk(4)[rank]) for ids, targets in batches]
    )
    lazy_job = plait.parallelize(
        copy.deepcopy(model), ParallelConfig(mode="semi_auto", mesh=MESH), optimizer=_sgd,
        loss_fn=gpt_loss,
    )  # fmt: skip
    return {
        "new_shape": _train(lazy_job, [*batches, _shorter_batch()]),
        "auto": auto,
        "replay": replay,
        "memory": memory,
        "compiled": _train(compiled_job, batches),
        "is_compiled": compiled_job.program.compiled,
        "split_ops": sum(op.label != "replicate" for op in plan.ops),
        "ops": len(plan.ops),
        "mesh": plan.mesh.as_dict(),
        "replayed_saved_plan": replay_job.loss_fn.plan == plan,
        "mismatches": [m.describe() for m in job.loss_fn.mismatches],
    }


# nightly: auto plans on real processes are in make test through tests/dist/test_engine_parity_gloo.py
@pytest.mark.nightly
@pytest.mark.dist
def test_auto_plan_and_its_saved_file_train_like_one_device_on_gloo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plan on the uncalibrated `local` defaults, whatever `plait calibrate` left in the home
    # directory (the spawned workers inherit the environment).
    monkeypatch.setenv("PLAIT_HOME", str(tmp_path / "plait-home"))
    model, batches = _model_and_batches()
    expected = reference_run(model, gpt_loss, _sgd, batches)
    shapes = reference_run(model, gpt_loss, _sgd, [*batches, _shorter_batch()])
    results = run_workers(_auto_then_replay, 4, str(tmp_path / "gpt.plan.json"), timeout_s=300.0)
    for rank, r in enumerate(results):
        assert r["mesh"] == MESH, f"rank {rank} planned on {r['mesh']}"
        # the searcher really splits ops around the annotations, so collectives really run
        assert r["split_ops"] > r["ops"] // 3, f"rank {rank}: {r['split_ops']}/{r['ops']} split"
        assert r["mismatches"] == [], f"rank {rank}: DTensor layouts differ from the plan"
        assert r["replayed_saved_plan"], f"rank {rank} did not run the saved plan as saved"
        assert_same_run(expected, r["auto"], rtol=1e-4, atol=1e-5)
        assert_same_run(expected, r["replay"], rtol=1e-4, atol=1e-5)
        for name, run in r["memory"].items():  # ZeRO and recompute over real collectives
            try:
                assert_same_run(expected, run, rtol=1e-4, atol=1e-5)
            except AssertionError as e:
                raise AssertionError(f"rank {rank}, {name}: {e}") from None
        assert_same_run(shapes, r["new_shape"], rtol=1e-4, atol=1e-5)
        assert r["is_compiled"], f"rank {rank} did not run the program through torch.compile"
        assert_same_run(expected, r["compiled"], rtol=1e-4, atol=1e-5)
