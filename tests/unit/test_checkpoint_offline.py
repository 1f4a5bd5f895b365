"""`plait checkpoint inspect` and `plait checkpoint merge` on checkpoints saved in this process.

One TinyGPT job (stand_alone, one AdamW step) is saved once for the module; tests that damage
or add files work on copies. A tiny Hugging Face GPT-2 checks that a merged file loads through
``from_pretrained``. Everything runs in one process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import plait
from plait.checkpoint import offline
from plait.cli import main
from plait.errors import CheckpointError
from plait.models import GPTConfig, TinyGPT, gpt_loss

CFG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2)
STATES = ("step", "exp_avg", "exp_avg_sq")  # AdamW's per-parameter states


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CFG)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A directory holding ``step-00000001`` of a TinyGPT job, and the job's full state."""
    root = tmp_path_factory.mktemp("runs")
    job = plait.parallelize(
        _tiny_gpt(), plait.ParallelConfig(mode="stand_alone"), optimizer=_adamw, loss_fn=gpt_loss
    )
    ids = torch.randint(0, CFG.vocab, (4, CFG.seq), generator=torch.Generator().manual_seed(1))
    job.step((ids, torch.roll(ids, -1, dims=1)))
    job.save(root / "step-00000001")
    return root, job.full_state_dict()


def _copy(saved_root: Path, tmp_path: Path) -> Path:
    """A private copy of the saved checkpoint (to damage, or to add files to)."""
    dest = tmp_path / "step-00000001"
    shutil.copytree(saved_root / "step-00000001", dest)
    return dest


def _flip_byte(file: Path, offset: int = 100) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


# -------------------------------------------------------------------------------- inspect


def test_tensor_kind() -> None:
    assert offline.tensor_kind("model.blocks.0.fc1.weight") == "model"
    assert offline.tensor_kind("optim.blocks.0.fc1.weight.exp_avg_sq") == "optim.exp_avg_sq"


def test_inspect_reports_step_tensors_and_files(saved) -> None:
    root, state = saved
    report = offline.inspect(root, verify=True)  # the directory: its latest step-* is read
    assert report["path"] == str(root / "step-00000001")
    assert (report["step"], report["world_size"], report["mode"]) == (1, 1, "stand_alone")
    assert (report["model"], report["optimizer"]) == ("TinyGPT", "AdamW")
    assert report["plan"] is None
    assert report["extras"]["optimizer_groups"][0]["lr"] == pytest.approx(1e-2)

    tensors = {t["name"]: t for t in report["tensors"]}
    params = list(state)  # TinyGPT has no buffers: every entry is a trained parameter
    want = {f"model.{k}" for k in state} | {f"optim.{k}.{s}" for k in params for s in STATES}
    assert set(tensors) == want
    fc1 = tensors["model.blocks.0.fc1.weight"]
    assert (tuple(fc1["shape"]), fc1["dtype"], fc1["pieces"]) == ((64, 16), "float32", 1)
    assert fc1["bytes"] == 64 * 16 * 4

    model = report["totals"]["model"]
    assert model["tensors"] == len(state)
    assert model["bytes"] == sum(v.numel() * v.element_size() for v in state.values())
    assert report["totals"]["optim.step"]["elements"] == len(params)  # scalars
    assert {f["name"] for f in report["files"]} >= {".metadata", "extra/rank0.pt"}
    assert all(f["algorithm"] == "xxh3_64" and len(f["checksum"]) == 16 for f in report["files"])
    assert (report["verified"], report["problems"], report["unlisted"]) == (True, [], [])


def test_inspect_and_verify_a_checkpoint_with_crc32_checksums(
    saved, tmp_path: Path, capsys
) -> None:
    """A checkpoint written before XXH3-64 (its manifest lists CRC-32s) reports them as such,
    verifies with zlib, and names a flipped byte as a CRC-32 mismatch."""
    import zlib

    from plait.checkpoint import files

    ck = _copy(saved[0], tmp_path)
    manifest = json.loads((ck / files.MANIFEST).read_text())
    for name in manifest["files"]:
        data = (ck / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    files.write_manifest(ck, manifest)

    report = offline.inspect(ck, verify=True)
    assert report["problems"] == []
    assert all(f["algorithm"] == "crc32" and len(f["checksum"]) == 8 for f in report["files"])
    assert main(["checkpoint", "inspect", str(ck), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"crc32 {report['files'][0]['checksum']}" in out and "checksums OK" in out

    data_file = next(ck.glob("*.distcp"))
    _flip_byte(data_file)
    found = offline.problems(ck)
    assert len(found) == 1 and data_file.name in found[0] and "has CRC-32 " in found[0]


def test_verify_names_a_flipped_byte(saved, tmp_path: Path, capsys) -> None:
    ck = _copy(saved[0], tmp_path)
    data_file = next(ck.glob("*.distcp"))
    _flip_byte(data_file)

    found = offline.inspect(ck, verify=True)["problems"]
    assert len(found) == 1 and data_file.name in found[0] and "XXH3-64" in found[0]
    assert offline.inspect(ck)["problems"] == []  # without --verify nothing is read

    assert main(["checkpoint", "inspect", str(ck), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and data_file.name in out

    # merge refuses it by name, writes nothing, and the CLI says damaged (1), not misuse (2)
    with pytest.raises(CheckpointError, match=data_file.name):
        offline.merge(ck, tmp_path / "m.safetensors")
    assert main(["checkpoint", "merge", str(ck), str(tmp_path / "m.safetensors")]) == 1
    assert data_file.name in capsys.readouterr().err
    assert not list(tmp_path.glob("m.safetensors*"))


def test_unreadable_metadata_is_damage_not_a_crash(saved, tmp_path: Path, capsys) -> None:
    ck = _copy(saved[0], tmp_path)
    (ck / ".metadata").write_bytes(b"not a pickle")
    report = offline.inspect(ck, verify=True)
    assert report["tensors"] == []
    assert len(report["problems"]) == 2  # its size, and that it cannot be read
    assert all(".metadata" in p for p in report["problems"])
    assert main(["checkpoint", "inspect", str(ck)]) == 1  # unreadable even without --verify
    assert "cannot be read" in capsys.readouterr().out


def test_inspect_shows_the_plan(saved, tmp_path: Path, capsys) -> None:
    from tests.unit.test_plan import toy_plan

    ck = _copy(saved[0], tmp_path)
    toy_plan().save(ck / "plan.json")
    plan = offline.inspect(ck)["plan"]
    assert (plan["mode"], plan["precision"], plan["mesh"]) == (
        "semi_auto",
        "bf16",
        {"dp": 2, "tp": 2},
    )
    assert main(["checkpoint", "inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "plan: " in out and "mode semi_auto" in out
    assert "not in the manifest" in out and "plan.json" in out  # added after the save

    (ck / "plan.json").write_text("{}")
    assert "error" in offline.inspect(ck)["plan"]  # another plait's plan: reported, no failure


# ---------------------------------------------------------------------------------- merge


def test_merge_loads_into_a_fresh_model(saved, tmp_path: Path) -> None:
    root, state = saved
    out = tmp_path / "model.safetensors"
    names = offline.merge(root, out)
    assert names == list(state)
    loaded = load_file(out)
    fresh = TinyGPT(CFG)
    fresh.load_state_dict(loaded)  # strict: the same names, nothing more
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, state[k]), k
    with safe_open(out, "pt") as f:
        assert f.metadata()["format"] == "pt"
    assert not list(tmp_path.glob("*.partial"))


def test_merge_casts_floating_point(saved, tmp_path: Path) -> None:
    root, state = saved
    out = tmp_path / "bf16.safetensors"
    offline.merge(root, out, dtype="bf16", verify=False)
    loaded = load_file(out)
    for k, v in state.items():
        assert loaded[k].dtype == torch.bfloat16
        assert torch.equal(loaded[k], v.to(torch.bfloat16)), k
    with pytest.raises(CheckpointError, match="bf16, fp16 or fp32"):
        offline.merge(root, out, dtype="int8")


def test_merge_into_hugging_face_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    job = plait.parallelize(
        model,
        plait.ParallelConfig(mode="stand_alone"),
        optimizer=_adamw,
        loss_fn=lambda m, b: m(**b).loss,
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    job.step({"input_ids": ids, "labels": ids})
    job.save(tmp_path / "ck")

    hf = tmp_path / "hf"  # lm_head.weight is tied to transformer.wte.weight: both are written
    offline.merge(tmp_path / "ck", hf / "model.safetensors")
    model.config.save_pretrained(hf)
    back = transformers.GPT2LMHeadModel.from_pretrained(hf)
    want = job.full_state_dict()
    have = back.state_dict()
    for k, v in want.items():
        assert torch.equal(have[k], v), k


def test_tensors_sharing_storage_are_written_apart(tmp_path: Path) -> None:
    """Tied weights, or pieces returned as views of one buffer: safetensors refuses tensors
    that share storage, so each is made to own its own."""
    from safetensors.torch import save_file

    base = torch.arange(16.0).reshape(4, 4)
    views = {"a": base, "tied": base, "t": base.t(), "row": base[1]}
    seen: set[int] = set()
    apart = {k: offline._standalone(v, None, seen) for k, v in views.items()}
    save_file(apart, tmp_path / "x.safetensors")
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], v) for k, v in views.items())


# ------------------------------------------------------------------------------------ CLI


def test_cli_inspect_text_json_and_all(saved, capsys) -> None:
    root, state = saved
    assert main(["checkpoint", "inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step 1, world size 1" in out and "optimizer AdamW" in out
    assert "largest 10 (--all for every tensor)" in out and "checksums not checked" in out
    digest = offline.inspect(root)["files"][0]["checksum"]
    assert f"xxh3_64 {digest}" in out  # each file's checksum with its algorithm

    assert main(["checkpoint", "inspect", str(root), "--verify", "--json", "--top", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 1 and report["problems"] == [] and report["verified"]
    assert len(report["tensors"]) == 3
    assert report["tensors"][0]["bytes"] >= report["tensors"][-1]["bytes"]

    assert main(["checkpoint", "inspect", str(root), "--all"]) == 0
    out = capsys.readouterr().out
    assert "every tensor" in out
    assert all(f"model.{k} " in out for k in state)


def test_cli_merge(saved, tmp_path: Path, capsys) -> None:
    root, state = saved
    out = tmp_path / "sub" / "m.safetensors"
    assert main(["checkpoint", "merge", str(root), str(out), "--dtype", "fp16"]) == 0
    assert f"{len(state)} tensors written" in capsys.readouterr().out
    assert load_file(out)["head.weight"].dtype == torch.float16


def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err and len(err.splitlines()) == 1

    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "m.safetensors")
    assert main(["checkpoint", "merge", str(tmp_path / "empty"), out]) == 2
    assert "no checkpoint in" in capsys.readouterr().err

    with pytest.raises(SystemExit) as e:  # argparse: a dtype merge does not write
        main(["checkpoint", "merge", str(tmp_path), out, "--dtype", "int8"])
    assert e.value.code == 2
