"""Checkpoints on one process: exact resume, every bad checkpoint refused by name with nothing
loaded, an interrupted save leaving the previous checkpoint, the Checkpoints manager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import plait
from plait import CheckpointError, ConfigError, DamagedCheckpointError, ParallelConfig
from plait.checkpoint import Checkpoints, files
from plait.data import ShardedLoader
from plait.models import GPTConfig, TinyGPT, gpt_loss
from plait.testing import simulate

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=1)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _dataset():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab, (48, CFG.seq), generator=gen)
    return list(zip(ids, torch.roll(ids, -1, dims=1), strict=True))


def _job(cfg: GPTConfig = CFG, optimizer=_adamw) -> plait.Job:
    torch.manual_seed(0)
    return plait.parallelize(
        TinyGPT(cfg), ParallelConfig(mode="stand_alone"), optimizer=optimizer, loss_fn=gpt_loss
    )


def _state(job: plait.Job) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in job.full_state_dict().items()}


def _optimizer_state(job: plait.Job) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in job.model.named_parameters()}
    return {
        f"{names[id(p)]}.{k}": v.clone()
        for p, state in job.optimizer.state.items()
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint after 2 steps, with a loader position and an LR scheduler."""
    path = tmp_path_factory.mktemp("ck") / "step2"
    job = _job()
    loader = ShardedLoader(_dataset(), global_batch_size=8, seed=5)
    sched = torch.optim.lr_scheduler.StepLR(job.optimizer, step_size=1, gamma=0.5)
    batches = iter(loader)
    for _ in range(2):
        job.step(next(batches))
        sched.step()
    job.save(path, loader=loader, stateful={"sched": sched})
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(saved, out)
    return out


def test_exact_resume_with_loader_and_scheduler(tmp_path: Path) -> None:
    def run(stop: int | None):
        job = _job()
        loader = ShardedLoader(_dataset(), global_batch_size=8, seed=5)
        sched = torch.optim.lr_scheduler.StepLR(job.optimizer, step_size=1, gamma=0.5)
        losses = []
        if stop is None:
            steps = range(5)
        else:
            batches = iter(loader)
            for _ in range(stop):
                losses.append(job.step(next(batches)))
                sched.step()
            job.save(tmp_path / "mid", loader=loader, stateful={"sched": sched})
            job = _job()
            loader = ShardedLoader(_dataset(), global_batch_size=8, seed=5)
            sched = torch.optim.lr_scheduler.StepLR(job.optimizer, step_size=1, gamma=0.5)
            assert job.load(tmp_path / "mid", loader=loader, stateful={"sched": sched}) == stop
            steps = range(stop, 5)
        batches = iter(loader)
        for _ in steps:
            losses.append(job.step(next(batches)))
            sched.step()
        return losses, _state(job), job.optimizer.param_groups[0]["lr"], job.steps_taken

    whole, resumed = run(None), run(3)
    assert whole[0] == resumed[0]
    assert _same(whole[1], resumed[1])
    assert whole[2] == resumed[2] and whole[3] == resumed[3] == 5


@pytest.mark.parametrize(
    "damage, file, says",
    [
        ("flip", "__0_0.distcp", "XXH3-64"),  # checked in DCP's plan step, before it reads
        ("truncate", "__0_0.distcp", "bytes, the manifest says"),
        ("metadata", ".metadata", "' is missing"),
        ("extra", "extra/rank0.pt", "' is missing"),
        ("flip_metadata", ".metadata", "XXH3-64"),  # checked as it is read, before unpickling
        ("flip_extra", "extra/rank0.pt", "XXH3-64"),
    ],
)
def test_damaged_checkpoint_is_refused_by_file_and_nothing_loads(
    saved: Path, tmp_path: Path, damage: str, file: str, says: str
) -> None:
    path = _copy(saved, tmp_path)
    target = path / file
    if damage.startswith("flip"):
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    else:
        target.unlink()
    job = _job()
    job.step(next(iter(ShardedLoader(_dataset(), global_batch_size=8, shuffle=False))))
    before, moments = _state(job), _optimizer_state(job)
    with pytest.raises(CheckpointError, match="nothing was loaded") as err:
        job.load(path)
    assert says in str(err.value) and repr(str(target)) in str(err.value)
    assert isinstance(err.value, DamagedCheckpointError)  # what Checkpoints.resume passes over
    assert _same(before, _state(job)) and job.steps_taken == 1
    assert _same(moments, _optimizer_state(job))


def test_damage_found_before_reading_into_a_fresh_job(saved: Path, tmp_path: Path) -> None:
    """A job with no optimizer state yet: still nothing is created or loaded."""
    path = _copy(saved, tmp_path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-200] ^= 0x80
    shard.write_bytes(bytes(data))
    job = _job()
    before = _state(job)
    listed = json.loads((path / files.MANIFEST).read_text())["files"]["__0_0.distcp"]["xxh3_64"]
    have = files.checksum(shard)["xxh3_64"]
    # the file, the algorithm and both digests
    with pytest.raises(
        CheckpointError,
        match=rf"__0_0\.distcp' has XXH3-64 {have}, the manifest says {listed} \(corrupted\)",
    ):
        job.load(path)
    assert have != listed and len(have) == len(listed) == 16
    assert _same(before, _state(job)) and job.steps_taken == 0 and not job.optimizer.state


def _as_crc32(path: Path) -> dict:
    """Rewrite the manifest of the checkpoint at ``path`` as plait wrote it before XXH3-64:
    every file's ``{"bytes", "crc32": "%08x"}`` (zlib's CRC-32). Returns the manifest."""
    import zlib

    manifest = json.loads((path / files.MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "xxh3_64": entry["xxh3_64"]}
        manifest["files"][name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    files.write_manifest(path, manifest)
    return manifest


def test_a_checkpoint_with_crc32_checksums_loads(saved: Path, tmp_path: Path) -> None:
    """Checkpoints written before XXH3-64 list CRC-32s: they load, verified with zlib."""
    path = _copy(saved, tmp_path)
    manifest = _as_crc32(path)
    assert files.verify(path, manifest, sorted(manifest["files"])) == []
    job = _job()
    assert job.load(path) == 2
    reference = _job()
    assert reference.load(saved) == 2
    assert _same(_state(reference), _state(job))
    assert _same(_optimizer_state(reference), _optimizer_state(job))


@pytest.mark.parametrize("file", ["__0_0.distcp", ".metadata", "extra/rank0.pt"])
def test_a_flipped_byte_under_crc32_checksums_is_refused(
    saved: Path, tmp_path: Path, file: str
) -> None:
    """In a checkpoint with CRC-32s, damage is found with CRC-32 and named as such, on every
    path a load checks a file (DCP's plan step, the metadata and the small state as read)."""
    path = _copy(saved, tmp_path)
    manifest = _as_crc32(path)
    target = path / file
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    have = files.checksum(target, "crc32")["crc32"]
    listed = manifest["files"][file]["crc32"]
    job = _job()
    before = _state(job)
    with pytest.raises(CheckpointError, match="nothing was loaded") as err:
        job.load(path)
    said = f"{str(target)!r} has CRC-32 {have}, the manifest says {listed} (corrupted)"
    assert said in str(err.value) and have != listed
    assert _same(before, _state(job)) and job.steps_taken == 0


def test_a_manifest_entry_without_a_known_checksum_is_refused(saved: Path, tmp_path: Path) -> None:
    """An entry with no checksum this plait knows (a newer algorithm, say) is not taken as
    checked: the load names the file and the algorithms it knows."""
    path = _copy(saved, tmp_path)
    manifest = json.loads((path / files.MANIFEST).read_text())
    entry = manifest["files"]["__0_0.distcp"]
    manifest["files"]["__0_0.distcp"] = {"bytes": entry["bytes"], "blake9": "00"}
    files.write_manifest(path, manifest)
    with pytest.raises(CheckpointError, match="no checksum in the manifest that this plait knows"):
        _job().load(path)


def test_every_file_is_checked_by_some_rank_on_load() -> None:
    """The load splits the checksums: each rank checks what it reads itself (DCP's metadata,
    its small state) and a share of the rest, balanced by size; together they cover every
    listed file, whatever world saved and whatever world loads."""
    from plait.runtime.engine.checkpoint import _extras_name, _shares

    for saved_world in range(1, 6):
        listed = {".metadata": {"bytes": 10}, "plan.json": {"bytes": 5}}
        for r in range(saved_world):
            listed[f"__{r}_0.distcp"] = {"bytes": 1000 + 7 * r}
            listed[f"extra/rank{r}.pt"] = {"bytes": 50}
        manifest = {"files": listed}
        for world in range(1, 6):
            shares = _shares(manifest, world)
            own = {".metadata"} | {_extras_name(manifest, r) for r in range(world)}
            flat = [n for share in shares for n in share]
            assert len(flat) == len(set(flat))  # no file checked twice
            assert set(flat) | own == set(listed), (saved_world, world)
            data = [sum(listed[n]["bytes"] for n in share if n.endswith(".distcp"))
                    for share in shares]  # fmt: skip
            if world <= saved_world:
                assert max(data) - min(data) <= 1000 + 7 * saved_world


def test_manifest_checksums_made_while_writing_equal_the_files(saved: Path) -> None:
    """The save checksums the bytes as it writes them (no second read of the data): every file
    is listed, and each size and XXH3-64 equals a read of the file."""
    manifest = json.loads((saved / files.MANIFEST).read_text())
    assert sorted(manifest["files"]) == files.files_of(saved)
    assert any(name.endswith(".distcp") for name in manifest["files"])
    for name, listed in manifest["files"].items():
        assert set(listed) == {"bytes", "xxh3_64"} and len(listed["xxh3_64"]) == 16, listed
        assert files.checksum(saved / name) == listed, name


@pytest.mark.parametrize("numel", [1000, 300_000])
def test_dcp_files_are_checksummed_as_written(tmp_path: Path, numel: int) -> None:
    from plait.comm import checkpoint_io

    state = {"x": torch.arange(float(numel)), "y": torch.ones(7), "z": torch.randn(numel)}
    written = checkpoint_io.save_tensors(state, tmp_path)
    assert sorted(written) == [".metadata", "__0_0.distcp"]  # not left to a second read
    for name, (size, digest) in written.items():
        assert files.checksum(tmp_path / name) == files.entry(size, digest)
        assert files.entry(size, digest) == {"bytes": size, "xxh3_64": f"{digest:016x}"}


def test_a_file_the_stream_cannot_vouch_for_is_read_at_commit(tmp_path: Path, monkeypatch) -> None:
    """A file whose checksum the write stream could not make (a seek) is left out of what the rank
    reports, and the commit reads it: the manifest still lists every file, right."""
    from plait.comm import checkpoint_io

    monkeypatch.setattr(checkpoint_io._HashingStream, "result", lambda self: None)
    job = _job()
    job.step(next(iter(ShardedLoader(_dataset(), global_batch_size=8))))
    job.save(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / files.MANIFEST).read_text())
    assert sorted(manifest["files"]) == files.files_of(tmp_path / "c")
    for name, listed in manifest["files"].items():
        assert files.checksum(tmp_path / "c" / name) == listed, name
    assert _job().load(tmp_path / "c") == 1


def test_missing_manifest_names_an_unfinished_save(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / files.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"no plait\.json: the save that wrote it did not"):
        _job().load(path)


def test_other_format_is_refused(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    manifest = json.loads((path / files.MANIFEST).read_text())
    (path / files.MANIFEST).write_text(json.dumps({**manifest, "format": "other/9"}))
    with pytest.raises(CheckpointError, match="format 'other/9'"):
        _job().load(path)


def test_wrong_model_is_refused_with_names_and_shapes(saved: Path) -> None:
    job = _job(GPTConfig(vocab=32, seq=8, width=32, heads=4, layers=1))
    before = _state(job)
    with pytest.raises(CheckpointError, match=r"shapes differ: .*saved \(32, 16\), this model"):
        job.load(saved)
    assert _same(before, _state(job))
    deeper = _job(GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: blocks\.1"):
        deeper.load(saved)


def test_other_optimizer_is_refused_unless_model_only(saved: Path) -> None:
    job = _job(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    before = _state(job)
    with pytest.raises(CheckpointError, match="AdamW's; this job's optimizer is SGD"):
        job.load(saved)
    assert _same(before, _state(job))
    assert job.load(saved, optimizer=False) == 2
    assert not _same(before, _state(job)) and not job.optimizer.state


def test_loader_or_object_not_saved_is_refused(saved: Path) -> None:
    job = _job()
    with pytest.raises(CheckpointError, match="holds no object 'ema'"):
        job.load(saved, stateful={"ema": torch.optim.SGD([torch.zeros(1)], lr=1)})
    assert job.steps_taken == 0


@pytest.mark.parametrize("where", ["commit", "small files"])
def test_interrupted_save_keeps_the_previous_checkpoint(
    saved: Path, tmp_path: Path, monkeypatch, where: str
) -> None:
    from plait.comm import checkpoint_io

    path = _copy(saved, tmp_path)
    job = _job()
    job.step(next(iter(ShardedLoader(_dataset(), global_batch_size=8))))

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    if where == "commit":
        monkeypatch.setattr(files, "commit", crash)
    else:  # a rank's small state cannot be written: the save fails in DCP's write step
        monkeypatch.setattr(checkpoint_io._Writer, "_write_files", crash)
    with pytest.raises(OSError, match="disk full"):
        job.save(path)
    assert (tmp_path / "copy.partial").is_dir()  # what the crashed save wrote
    fresh = _job()
    assert fresh.load(path) == 2  # the previous checkpoint, whole


def test_missing_and_empty_paths(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        _job().load(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no complete step-\\* checkpoint"):
        _job().load(tmp_path)


def test_manager_saves_every_n_keeps_k_and_resumes(tmp_path: Path, monkeypatch) -> None:
    ckpt = Checkpoints(tmp_path / "run", every=2, keep=2)
    job = _job()
    loader = ShardedLoader(_dataset(), global_batch_size=8)
    assert ckpt.resume(job, loader=loader) == 0
    for batch in loader:  # 6 batches
        job.step(batch)
        ckpt.maybe_save(job, loader=loader)
    kept = [p.name for _, p in files.complete_checkpoints(ckpt.path)]
    assert kept == ["step-00000004", "step-00000006"]
    monkeypatch.setenv("PLAIT_CHECKPOINT_DIR", str(tmp_path / "run"))
    again = Checkpoints(every=2)
    fresh = _job()
    assert again.resume(fresh, loader=ShardedLoader(_dataset(), global_batch_size=8)) == 6
    assert _same(_state(job), _state(fresh))


def _flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.fixture
def run_of_6(tmp_path: Path) -> tuple[Checkpoints, dict[str, torch.Tensor]]:
    """Checkpoints at steps 4 and 6 of a 6-step run, and that run's final weights."""
    ckpt = Checkpoints(tmp_path / "run", every=2, keep=2)
    job = _job()
    loader = ShardedLoader(_dataset(), global_batch_size=8)
    for batch in loader:  # 6 batches
        job.step(batch)
        ckpt.maybe_save(job, loader=loader)
    return ckpt, _state(job)


def _train_on(job: plait.Job, loader: ShardedLoader, steps: int) -> None:
    batches = iter(loader)
    while job.steps_taken < steps:
        job.step(next(batches))


@pytest.mark.parametrize("damage", ["shard byte", "manifest byte", "shard deleted"])
def test_resume_passes_over_a_damaged_newest_checkpoint(
    run_of_6: tuple[Checkpoints, dict[str, torch.Tensor]], damage: str, caplog
) -> None:
    ckpt, final = run_of_6
    newest = ckpt.path / "step-00000006"
    if damage == "shard byte":
        _flip(newest / "__0_0.distcp", 100)
    elif damage == "manifest byte":  # the manifest is no longer JSON
        _flip(newest / files.MANIFEST, 0)
    else:
        (newest / "__0_0.distcp").unlink()
    job, loader = _job(), ShardedLoader(_dataset(), global_batch_size=8)
    with caplog.at_level("WARNING", logger="plait.checkpoint.manager"):
        assert ckpt.resume(job, loader=loader) == 4
    said = caplog.text
    assert "passing over damaged checkpoint" in said and str(newest) in said
    assert "newest undamaged checkpoint: 1 newer one(s) passed over" in said
    # the loader's position came from step 4 too: two more steps end where the run ended
    _train_on(job, loader, 6)
    assert _same(final, _state(job))


def test_resume_raises_when_every_checkpoint_is_damaged(
    run_of_6: tuple[Checkpoints, dict[str, torch.Tensor]],
) -> None:
    ckpt, _ = run_of_6
    for step in (4, 6):
        _flip(ckpt.path / f"step-{step:08d}" / "__0_0.distcp", 100)
    job = _job()
    before = _state(job)
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged") as err:
        ckpt.resume(job)
    said = str(err.value)
    assert "step-00000004, step-00000006" in said and said.count("(corrupted)") == 2
    assert not isinstance(err.value, DamagedCheckpointError)  # a caller must not skip it too
    assert _same(before, _state(job)) and job.steps_taken == 0


def test_resume_does_not_pass_over_a_checkpoint_of_another_model(
    run_of_6: tuple[Checkpoints, dict[str, torch.Tensor]],
) -> None:
    ckpt, _ = run_of_6
    other = _job(GPTConfig(vocab=32, seq=8, width=32, heads=4, layers=1))
    other.step(next(iter(ShardedLoader(_dataset(), global_batch_size=8))))
    with pytest.raises(CheckpointError, match="does not fit this model") as err:
        ckpt.resume(other)
    assert not isinstance(err.value, DamagedCheckpointError)
    assert "step-00000006" in str(err.value)  # the newest was tried, and the error kept


def test_manager_config_errors(monkeypatch) -> None:
    monkeypatch.delenv("PLAIT_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ConfigError, match="PLAIT_CHECKPOINT_DIR is not set"):
        Checkpoints()
    with pytest.raises(ConfigError, match="every=0"):
        Checkpoints("x", every=0)


def test_simulated_world_refuses_by_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with simulate(2):
        job = plait.parallelize(
            TinyGPT(CFG),
            ParallelConfig(mode="data_parallel", mesh={"dp": 2}),
            optimizer=_adamw,
            loss_fn=gpt_loss,
        )
        with pytest.raises(CheckpointError, match="simulated world"):
            job.save(tmp_path / "x")


def test_async_save_writes_the_state_of_its_step(tmp_path: Path) -> None:
    job = _job()
    batches = list(ShardedLoader(_dataset(), global_batch_size=8, shuffle=False))
    job.step(batches[0])
    at_save = _state(job)
    handle = job.save(tmp_path / "a", async_save=True)
    job.step(batches[1])  # changes the live tensors while the copy is written
    assert handle.wait() == tmp_path / "a" and handle.done()
    fresh = _job()
    assert fresh.load(tmp_path / "a") == 1
    assert _same(at_save, _state(fresh))


@pytest.mark.parametrize("size", [0, 1, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_checksum_of_a_mapped_file_equals_a_read_of_it(
    tmp_path: Path, monkeypatch, size: int, algorithm: str
) -> None:
    """files.checksum hashes a file mapped from the page cache (no copy); an empty file, or one
    that cannot be mapped, is read in chunks instead: the same size and digest every way."""
    import zlib

    import xxhash

    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator()).numpy()
    target = tmp_path / "f.bin"
    target.write_bytes(data.tobytes())
    digest = (
        f"{xxhash.xxh3_64_intdigest(data.tobytes()):016x}"
        if algorithm == "xxh3_64"
        else f"{zlib.crc32(data.tobytes()):08x}"
    )
    want = {"bytes": size, algorithm: digest}
    assert files.checksum(target, algorithm) == want
    monkeypatch.setattr(files, "_mapped", lambda fd, size: None)  # e.g. no mmap there
    assert files.checksum(target, algorithm) == want


def test_a_sync_save_leaves_torch_saves_zip_crc_out_and_loads_with_plain_dcp(
    tmp_path: Path, monkeypatch
) -> None:
    """A synchronous save writes DCP's pieces without torch.save's per-record zip CRC-32 (the
    XXH3-64 of each file covers the bytes; torch.load never reads the CRC) and puts torch's
    setting back; a background save keeps the CRC. Both load with plain DCP as with plait."""
    import torch.distributed.checkpoint as dcp

    from plait.runtime.engine.checkpoint import tensor_state

    seen: list[bool] = []
    real_save = torch.save

    def spy(*args, **kwargs):
        seen.append(torch.serialization.get_crc32_options())
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    job = _job()
    job.step(next(iter(ShardedLoader(_dataset(), global_batch_size=8))))
    for async_save in (False, True):
        seen.clear()
        path = tmp_path / f"async-{async_save}"
        job.save(path, async_save=async_save).wait()
        assert torch.serialization.get_crc32_options()  # put back
        pieces = len(tensor_state(job))
        # one torch.save per piece in DCP's write, and the small state's (outside it, with CRC)
        assert len(seen) == pieces + 1 and seen.count(False) == (0 if async_save else pieces)
        plain = {k: torch.zeros_like(v) for k, v in tensor_state(job).items()}
        dcp.load(plain, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        assert _same(plain, {k: v.detach() for k, v in tensor_state(job).items()})
        fresh = _job()
        assert fresh.load(path) == 1
        assert _same(_state(job), _state(fresh))


def test_torch_setting_is_put_back_when_a_save_fails(tmp_path: Path, monkeypatch) -> None:
    """A save that fails while DCP writes still restores torch's zip-CRC setting."""
    from plait.comm import checkpoint_io

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        checkpoint_io.save_tensors({"x": torch.ones(3)}, tmp_path / "c", zip_crc=False)
    assert torch.serialization.get_crc32_options()


def test_python_rng_state_restores_from_either_saved_form() -> None:
    """The small state keeps Python's RNG words as a tensor (quicker to unpickle); checkpoints
    written before hold them as a tuple (a list after some round trips): all three restore."""
    import random

    from plait.runtime.engine.checkpoint import _rng_state, _set_rng_state

    random.seed(7)
    old_tuple = random.getstate()
    state = _rng_state()
    assert isinstance(state["python"][1], torch.Tensor)
    want = [random.random() for _ in range(3)]
    version, words, gauss = old_tuple
    for python in (state["python"], old_tuple, [version, list(words), gauss]):
        random.seed(99)
        _set_rng_state({**state, "python": python})
        assert [random.random() for _ in range(3)] == want


def test_write_streams_coalesce_small_writes_and_sync_what_they_hold(
    tmp_path: Path, monkeypatch
) -> None:
    """DCP writes each file through a buffer above the hashing stream: torch.save's many small
    writes reach the hash as a few; what the buffer holds is flushed before ``fileno()`` (DCP
    fsyncs its metadata through it without a flush); the recorded size and XXH3-64 are the
    file's."""
    import os
    import pickle

    from plait.comm import checkpoint_io

    calls = {"hashing": 0, "buffered": 0}
    hashing_write = checkpoint_io._HashingStream.write

    def count(self, data):
        calls["hashing"] += 1
        return hashing_write(self, data)

    monkeypatch.setattr(checkpoint_io._HashingStream, "write", count)
    fs = checkpoint_io._ChecksummingFileSystem(tmp_path)
    with fs.create_stream(tmp_path / "piece", "wb") as stream:
        real = stream.write

        class Counting:  # what torch.save sees: counts its calls
            def write(self, data):
                calls["buffered"] += 1
                return real(data)

            def flush(self):
                stream.flush()

        torch.save(torch.arange(5000.0), Counting())
    assert calls["buffered"] >= 10 and calls["hashing"] <= 3, calls
    with fs.create_stream(tmp_path / "meta", "wb") as stream:
        pickle.dump({"k": list(range(30))}, stream)  # smaller than the buffer
        synced = os.fstat(stream.fileno()).st_size  # what an fsync through fileno() covers
    assert synced == (tmp_path / "meta").stat().st_size
    for name in ("piece", "meta"):
        size, digest = fs.written[name]
        assert files.checksum(tmp_path / name) == files.entry(size, digest)


def test_an_offloaded_optimizer_over_plain_parameters_names_its_states_by_parameter() -> None:
    """A pipeline stage's plain parameters under ``offload="optimizer"``: the optimizer
    updates ZeroOptimizer's shadows (host copies of whole tensors), so their states are saved
    as plain tensors under the parameter's name, the entries a job without offload saves;
    a load makes fresh states like the shadow (on the host), not like the parameter."""
    from types import SimpleNamespace

    from torch import nn

    from plait.comm.checkpoint_io import SavedTensor
    from plait.runtime.engine.checkpoint import _destination, _Slot, _slots, tensor_state
    from plait.runtime.program.zero import ZeroOptimizer

    torch.manual_seed(0)
    stage = nn.Linear(4, 3)
    zero = ZeroOptimizer(
        list(stage.named_parameters()), [], level=None, buckets=[],
        device_mesh=SimpleNamespace(mesh_dim_names=("pp",)), axis="dp", host=True,
    )  # fmt: skip
    optimizer = torch.optim.SGD(zero.shadows, lr=0.1, momentum=0.9)
    optimizer._plait_shadows = zero  # type: ignore[attr-defined]
    job = SimpleNamespace(model=stage, optimizer=optimizer, state_modules=lambda: [stage])
    stage(torch.ones(2, 4)).sum().backward()
    zero.load_grads()
    optimizer.step()
    zero.after_step()
    assert [(s.name, s.placements) for s in _slots(job)] == [("weight", None), ("bias", None)]
    state = tensor_state(job)
    for slot in _slots(job):
        saved = state[f"{files.OPTIM}{slot.name}.momentum_buffer"]
        assert type(saved) is torch.Tensor and saved.shape == slot.param.shape
        assert saved is optimizer.state[slot.key]["momentum_buffer"]
    # a parameter on the device (meta here), its shadow on the host: the state goes to the host
    param = nn.Parameter(torch.empty(3, 4, device="meta"))
    slot = _Slot("weight", param, nn.Parameter(torch.zeros(3, 4)), None)
    held, target = _destination(slot, SavedTensor((3, 4), torch.float32, 1), None)
    assert held is target and held.device.type == "cpu" and held.shape == (3, 4)
