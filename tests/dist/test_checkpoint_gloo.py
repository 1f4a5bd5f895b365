"""Checkpoints on real gloo processes: reshard across plans, exact resume, async save.

One spawn of 4 workers (a spawn costs ~15 s) runs both checks:

1. **Reshard chain.** This process trains a TinyGPT for 2 AdamW steps on one process and
   saves. The workers then hand the training along a chain of plans, each loading the last
   checkpoint, taking one step and saving: dp=2 x tp=2 (semi_auto, Megatron, planned at its
   first step: the load waits for the plan) -> ZeRO-3 on
   dp=4 -> ZeRO-3 in shard groups of 2 (HSDP) -> plain data parallel dp=4 -> pipeline pp=2 x tp=2 (semi_auto: tensor parallel inside
   the stages) -> dp=2 x tp=2 with ZeRO-1 -> ZeRO-2 on dp=4 with activations recomputed. Back here, one process loads the last checkpoint and takes the
   final step. Every step's loss and the final parameters equal 10 steps of single-device
   training (optimizer states included: AdamW's moments and step count travel through every
   layout).
2. **Exact resume.** On plain data parallel over 4 processes, a job trains 3 steps from a ShardedLoader,
   saves in the background (``async_save``) and goes on; a fresh job loads that checkpoint
   (model, optimizer, loader position, RNG) and trains the remaining steps: losses and final
   weights are bitwise equal to an uninterrupted run.
3. **Damage found by one rank refuses the load on all.** A flipped byte in the data file
   whose checksum only rank 3 checks (in DCP's plan step), and one in rank 2's small-state
   file (which only rank 2 reads): every rank raises the same error naming the file, and no
   rank's model or optimizer state changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import plait
from plait import CheckpointError, ParallelConfig
from plait.data import ShardedLoader
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.runtime.engine.checkpoint import _shares, tensor_state
from plait.testing import run_workers
from plait.testing.equivalence import reference_run

pytestmark = pytest.mark.dist

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2)
STEPS = 10
SHARD_ALL = {"optimizer_shard_threshold": 0}  # the tiny model's parameters are all small

CHAIN = [
    ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}),
    ParallelConfig(mode="data_parallel", mesh={"dp": 4}, optimizer_shard=3, **SHARD_ALL),
    ParallelConfig(
        mode="data_parallel", mesh={"dp": 4}, optimizer_shard=3, optimizer_weight_shard_size=2,
        **SHARD_ALL,
    ),  # fmt: skip
    ParallelConfig(mode="data_parallel", mesh={"dp": 4}),
    ParallelConfig(mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=2),
    ParallelConfig(mode="semi_auto", mesh={"dp": 2, "tp": 2}, optimizer_shard=1, **SHARD_ALL),
    ParallelConfig(
        mode="data_parallel", mesh={"dp": 4}, optimizer_shard=2, recompute="full", **SHARD_ALL
    ),
]
FIRST = 2  # steps taken on one process before the chain


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _model(megatron: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    return annotate_megatron(model, 2) if megatron else model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, CFG.vocab, (8, CFG.seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _local(job: plait.Job, batch):
    """This rank's slice of a global batch (dataset_strategy data_parallel)."""
    mesh = job.mesh
    if "dp" not in mesh.axis_names:
        return batch
    dp = mesh.axis_size("dp")
    coord = job.device_mesh.get_coordinate()[mesh.axis_index("dp")]
    return tuple(x.chunk(dp)[coord] for x in batch)


def _job(config: ParallelConfig, example=None) -> plait.Job:
    model = _model(megatron=config.mode == "semi_auto")
    return plait.parallelize(
        model, config, optimizer=_adamw, loss_fn=gpt_loss, example_batch=example
    )


def _chain(root: str) -> list[float]:
    batches = _batches()
    losses = []
    previous = Path(root) / "one"
    for i, config in enumerate(CHAIN):
        # The first leg plans at its first step (no example batch): its load waits for that.
        job = _job(config, batches[0] if i else None)
        assert job.load(previous) == FIRST + i
        losses.append(job.step(_local(job, batches[FIRST + i])))
        previous = Path(root) / f"leg{i}"
        job.save(previous)
    return losses


def _exact_resume(root: str) -> dict:
    config = CHAIN[2]
    ids, targets = (torch.cat(x) for x in zip(*_batches(), strict=True))
    dataset = list(zip(ids, targets, strict=True))

    def fresh():
        job = _job(config, _batches()[0])
        loader = ShardedLoader.for_job(dataset, job, global_batch_size=8, seed=3)
        return job, loader

    whole, loader = fresh()
    expected = [whole.step(b) for _, b in zip(range(6), loader, strict=False)]
    expected_state = whole.full_state_dict()

    job, loader = fresh()
    batches = iter(loader)
    first = [job.step(next(batches)) for _ in range(3)]
    handle = job.save(Path(root) / "resume", loader=loader, async_save=True)
    job.step(next(batches))  # training goes on while the save is written
    handle.wait()
    after_save = torch.rand(3)

    job, loader = fresh()
    assert job.load(Path(root) / "resume", loader=loader) == 3
    rng_restored = torch.equal(torch.rand(3), after_save)
    rest = [job.step(b) for _, b in zip(range(3), loader, strict=False)]
    state = job.full_state_dict()
    return {
        "losses_equal": first + rest == expected,
        "bitwise": all(torch.equal(state[k], expected_state[k]) for k in expected_state),
        "rng": rng_restored,
        "rank": dist.get_rank(),
    }


def _local_copy(job: plait.Job) -> dict[str, torch.Tensor]:
    """This rank's pieces of every saved tensor (model and optimizer), copied."""
    out = {}
    for k, v in tensor_state(job).items():
        piece = v.to_local() if hasattr(v, "to_local") else v
        out[k] = piece.detach().clone()
    return out


def _damaged_loads(root: str) -> dict:
    """Load a damaged copy of the ZeRO-3 leg's checkpoint into a trained dp=4 job."""
    rank = dist.get_rank()
    good = Path(root) / "leg1"
    manifest = json.loads((good / "plait.json").read_text())
    cases = {"shard": _shares(manifest, 4)[3][0], "extras": "extra/rank2.pt"}
    job = _job(CHAIN[2], _batches()[0])
    job.step(_local(job, _batches()[0]))
    out = {}
    for case, name in cases.items():
        bad = Path(root) / f"bad-{case}"
        if rank == 0:
            shutil.copytree(good, bad)
            data = bytearray((bad / name).read_bytes())
            data[len(data) // 2] ^= 0x10
            (bad / name).write_bytes(bytes(data))
        dist.barrier()
        before = _local_copy(job)
        try:
            job.load(bad)
            message = "loaded"
        except CheckpointError as e:
            message = str(e)
        after = _local_copy(job)
        unchanged = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before
        )
        out[case] = {"file": str(bad / name), "error": message, "unchanged": unchanged,
                     "steps": job.steps_taken}  # fmt: skip
    return out


def _workers(root: str) -> dict:
    return {"chain": _chain(root), "resume": _exact_resume(root), "damaged": _damaged_loads(root)}


def test_reshard_chain_and_exact_resume(tmp_path: Path) -> None:
    batches = _batches()
    reference = reference_run(_model(), gpt_loss, _adamw, batches)

    one = plait.parallelize(
        _model(), ParallelConfig(mode="stand_alone"), optimizer=_adamw, loss_fn=gpt_loss
    )
    first = [one.step(b) for b in batches[:FIRST]]
    one.save(tmp_path / "one")

    results = run_workers(_workers, 4, str(tmp_path), timeout_s=240.0)

    last = plait.parallelize(
        _model(), ParallelConfig(mode="stand_alone"), optimizer=_adamw, loss_fn=gpt_loss
    )
    assert last.load(tmp_path / f"leg{len(CHAIN) - 1}") == STEPS - 1
    final = last.step(batches[-1])
    losses = first + results[0]["chain"] + [final]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses))
    state = last.full_state_dict()
    for name, value in reference.state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for r in results:
        assert r["resume"] == {"losses_equal": True, "bitwise": True, "rng": True,
                               "rank": r["resume"]["rank"]}  # fmt: skip
    for case, says in (("shard", "XXH3-64"), ("extras", "XXH3-64")):
        seen = [r["damaged"][case] for r in results]
        assert len({s["error"] for s in seen}) == 1, seen  # the same error on every rank
        first = seen[0]
        assert "nothing was loaded" in first["error"] and says in first["error"], first
        assert repr(first["file"]) in first["error"], first  # it names the file
        assert all(s["unchanged"] and s["steps"] == 1 for s in seen), seen
