"""The GPT example's --calibrate (make demo): which saved calibration a run reuses, and where a
new one goes (plait.demo.calibration). The measurement is stubbed here; tests/dist/
test_gpt_example.py runs it for real on 2 workers."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.cost import (
    HardwareProfile,
    default_profile_path,
    get_profile,
    local_defaults,
    save_profile,
)
from plait.demo import calibration
from plait.demo.calibration import calibrate_for_run


def _profile(world_size: int, when: str = "then") -> HardwareProfile:
    """A saved calibration of ``world_size`` processes on this machine, at this run's threads."""
    measured = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "all_reduce": {"world_size": world_size},
        "threads_per_rank": torch.get_num_threads(),
        "when": when,
    }
    fields = {f: getattr(local_defaults(), f) for f in HardwareProfile.__dataclass_fields__}
    return HardwareProfile(**{**fields, "source": f"measured {when}", "measured": measured})


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """PLAIT_HOME in a temporary folder; the stubbed measurement records where it wrote."""
    monkeypatch.setenv("PLAIT_HOME", str(tmp_path))
    written: list[Path] = []

    def measure(settings: Any, out: Path, how: str) -> HardwareProfile:
        profile = _profile(4, when=f"measured {len(written)}")
        save_profile(profile, out)
        written.append(Path(out))
        return profile

    monkeypatch.setattr(calibration, "calibrate_in_world", measure)
    return written


def test_a_run_measures_into_its_own_cache_and_plans_on_it(home, tmp_path) -> None:
    save_profile(_profile(4), default_profile_path())  # plait calibrate's: measured anyway
    first = calibrate_for_run(4)
    assert not first.reused and home == [tmp_path / "world4" / "local.json"] == [first.path]
    # never the profile other commands read
    assert get_profile("local", tmp_path / "local.json").source == "measured then"
    # this process now plans with it: `local` is read from the cache's folder
    assert os.environ["PLAIT_HOME"] == str(tmp_path / "world4")
    assert get_profile("local").source == "measured measured 0"
    assert "calibrated this machine in" in first.message() and str(first.path) in first.message()


def test_reuse_takes_plait_calibrate_profile_when_it_describes_the_run(home, tmp_path) -> None:
    save_profile(_profile(4), default_profile_path())
    run = calibrate_for_run(4, reuse=True)
    assert run.reused and run.path == tmp_path / "local.json" and home == []
    assert os.environ["PLAIT_HOME"] == str(tmp_path)  # unchanged: it is the default already
    assert f"reused the calibration of this machine at {run.path}" in run.message()


def test_reuse_passes_over_another_world_size_then_takes_the_cache(home, tmp_path) -> None:
    save_profile(_profile(2), default_profile_path())
    run = calibrate_for_run(4, reuse=True)  # nothing fits: measured
    assert not run.reused and home == [tmp_path / "world4" / "local.json"]
    assert "measured by 2 processes, this job runs 4" in run.message()
    assert get_profile("local", tmp_path / "local.json").measured["all_reduce"]["world_size"] == 2
    os.environ["PLAIT_HOME"] = str(tmp_path)  # the next run's process
    again = calibrate_for_run(4, reuse=True)
    assert again.reused and again.path == run.path and len(home) == 1
