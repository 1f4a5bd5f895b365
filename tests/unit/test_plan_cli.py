"""`plait plan` on the command line: flags for every ParallelConfig field, files, errors."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from plait.cli import main
from plait.cli.plan import add_plan_arguments
from plait.config import ParallelConfig

SMALL = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--seq",
    "16",
    "--vocab",
    "64",
    "--batch",
    "8",
]
REQUIRED_KEYS = {
    "schema_version",
    "mesh",
    "micro_batches",
    "optimizer_shard",
    "recompute",
    "precision",
    "ops",
    "parameters",
    "collectives",
    "predicted",
}
PREDICTED_KEYS = {
    "step_time_s",
    "compute_s",
    "communication_s",
    "bubble_s",
    "memory_bytes",
    "flops_per_step",
}


def test_every_config_field_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    dests = {a.dest for a in parser._actions}
    fields = {f.name for f in dataclasses.fields(ParallelConfig) if not f.name.startswith("_")}
    # `plait plan` makes plans: it does not read one, and compile and stage_programs are how
    # a job runs its programs, which no plan depends on; nor does it train (log_dir: metrics);
    # (mode parameter_server's fields are flags: --server-modules, --ps-mode, ...)
    assert fields - dests == {"plan", "compile", "stage_programs", "log_dir", "log_formats"}


def test_plan_writes_the_documented_file(tmp_path, capsys) -> None:
    out = tmp_path / "gpt.json"
    code = main(
        [
            "plan",
            "--model",
            "gpt",
            *SMALL,
            "--mesh",
            "dp=2,tp=2",
            "--megatron",
            "--mode",
            "semi_auto",
            "--precision",
            "bf16",
            "--json",
            str(out),
            "--explain",
            "blocks.0.fc1.weight",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "plan for TinyGPT on mesh dp=2 x tp=2" in text
    assert "blocks.0.fc1.weight" in text and "[tp, None]" in text
    data = json.loads(out.read_text())
    assert set(data) >= REQUIRED_KEYS
    assert set(data["predicted"]) >= PREDICTED_KEYS
    assert data["mesh"] == {"dp": 2, "tp": 2}
    assert data["precision"] == "bf16"
    first = out.read_text()
    main(
        [
            "plan",
            "--model",
            "gpt",
            *SMALL,
            "--mesh",
            "dp=2,tp=2",
            "--megatron",
            "--mode",
            "semi_auto",
            "--precision",
            "bf16",
            "--json",
            str(out),
        ]
    )
    assert out.read_text() == first  # byte-identical for identical inputs


@pytest.mark.parametrize("model", ["llama", "bert", "mlp", "cnn"])
def test_plan_builtin_models(model, capsys) -> None:
    args = ["plan", "--model", model, "--devices", "4", "--batch", "8"]
    if model in ("llama", "bert"):
        args += ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64"]
    assert main(args) == 0
    assert "predicted" in capsys.readouterr().out


def test_plan_on_the_uncalibrated_local_defaults_says_so(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PLAIT_HOME", str(tmp_path))  # no `plait calibrate` file
    args = ["plan", "--model", "mlp", "--devices", "4", "--batch", "8", "--mode", "auto"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "predicted on hardware local (UNCALIBRATED: " in text
    assert "run `plait calibrate --world-size N`" in text
    assert main([*args, "--hardware", "h100"]) == 0
    assert "UNCALIBRATED" not in capsys.readouterr().out


def test_factory_model(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def build():\n"
        "    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))\n"
        "    x = torch.zeros(8, 16)\n"
        "    return model, (x,), lambda m, b: m(*b).square().mean()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--factory", "mymodels:build", "--devices", "2"]) == 0
    assert "Sequential" in capsys.readouterr().out


def test_bad_input_is_a_clear_error(capsys) -> None:
    assert main(["plan", "--model", "gpt", *SMALL, "--mesh", "dp=3"]) == 2
    assert "does not divide" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--mesh", "dp:2"])
    assert "NAME=SIZE" in capsys.readouterr().err
    assert main(["plan", "--factory", "nosuchmodule:build", "--devices", "2"]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_a_plan_that_does_not_fit_exits_non_zero(capsys) -> None:
    """The summary is printed (it says what came closest), the exit status says it failed."""
    small = ["plan", "--model", "gpt", *SMALL, "--devices", "2"]
    assert main([*small, "--mode", "semi_auto", "--memory-limit", "1KB"]) == 3
    out = capsys.readouterr()
    assert "DOES NOT FIT" in out.out
    assert "does not fit: the plan needs" in out.err and "over memory_limit" in out.err
    assert main([*small, "--mode", "auto", "--memory-limit", "1KB"]) == 3
    assert "none of the" in capsys.readouterr().err
    assert main([*small, "--mode", "auto", "--memory-limit", "8GiB"]) == 0
    assert "does not fit" not in capsys.readouterr().err
