"""``--calibrate``: the example plans on this machine's numbers, not the uncalibrated defaults.

Before planning, every rank of the run calls :func:`calibrate_for_run`. It reuses a saved
``local`` profile that describes this run (measured on this host, same CPU count and torch, by
as many processes with as many torch threads: :func:`plait.cost.calibrate.mismatch`), looking
first at the profile every plait command reads (``$PLAIT_HOME/local.json``, else
``~/.cache/plait/local.json``: ``plait calibrate`` writes it), then at the example's own cache
beside it (``.../world<N>/local.json``). When neither describes the run, the run's own workers
measure this machine together for a few seconds
(:func:`plait.cost.calibrate.calibrate_in_world` with
:meth:`~plait.cost.calibrate.CalibrationSettings.brief`: every figure ``plait calibrate``
measures, on small sizes and a tenth of a second each) and write the example's cache, never
the profile other commands read. A profile from the cache is made this process's ``local``
by pointing ``$PLAIT_HOME`` at its folder (this process only: the planner reads ``local``
from there).

The calibration measures the machine as it is at the time (a busy machine measures slower);
a cached profile keeps the numbers of when it was made: ``--recalibrate`` measures again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from plait.cost import CostError, HardwareProfile, default_profile_path, load_profile
from plait.cost.calibrate import CalibrationSettings, calibrate_in_world, mismatch

__all__ = ["Calibration", "cache_path", "calibrate_for_run"]


@dataclass(frozen=True)
class Calibration:
    """The profile a run plans with and where it came from."""

    profile: HardwareProfile
    path: Path
    reused: bool
    """True: a saved profile described the run; False: the run's workers measured it."""
    seconds: float
    """Seconds the measurement took (0 when reused)."""
    passed_over: tuple[str, ...] = ()
    """The saved profiles looked at and not taken, each with why."""

    def message(self) -> str:
        """One line for the console: calibrated or reused, with the path."""
        when = self.profile.measured.get("when", "?")
        if self.reused:
            return (
                f"hardware: reused the calibration of this machine at {self.path} (measured "
                f"{when}; --recalibrate measures again)"
            )
        ranks = self.profile.measured.get("all_reduce", {}).get("world_size", "?")
        why = f" ({'; '.join(self.passed_over)})" if self.passed_over else ""
        return (
            f"hardware: calibrated this machine in {self.seconds:.1f} s on the {ranks} workers"
            f"{why}; written to {self.path}, reused by the next run "
            f"(`plait calibrate --world-size {ranks}` measures longer)"
        )


def cache_path(world_size: int) -> Path:
    """The example's own calibration for ``world_size`` processes, beside the ``local``
    profile every plait command reads (and moved with it by ``$PLAIT_HOME``)."""
    return default_profile_path().parent / f"world{world_size}" / "local.json"


def calibrate_for_run(
    world_size: int,
    *,
    fresh: bool = False,
    settings: CalibrationSettings | None = None,
) -> Calibration:
    """The ``local`` profile this run plans with (module docstring); every rank calls it,
    after ``plait.init()`` and before planning. ``fresh``: measure even when a saved profile
    describes the run. ``settings``: the measurement's sizes (default
    :meth:`CalibrationSettings.brief`). Once a process: it may move ``$PLAIT_HOME``."""
    threads = torch.get_num_threads()
    shared, own = default_profile_path(), cache_path(world_size)
    passed_over = []
    # Every rank reads the same files before any rank writes (the write follows the ranks'
    # measuring together), so every rank takes the same branch.
    for path in () if fresh else (shared, own):
        if not path.exists():
            continue
        try:
            profile = load_profile(path)
        except CostError as e:
            passed_over.append(f"{path} unreadable: {e}")
            continue
        why = mismatch(profile, world_size, threads)
        if why is None:
            _plan_with(path)
            return Calibration(profile, path, reused=True, seconds=0.0)
        passed_over.append(f"{path} does not describe this run: {why}")
    start = time.perf_counter()
    how = f"the GPT example's --calibrate (brief, on its {world_size} workers)"
    profile = calibrate_in_world(settings, out=own, how=how)
    seconds = time.perf_counter() - start
    _plan_with(own)
    return Calibration(profile, own, False, seconds, tuple(passed_over))


def _plan_with(path: Path) -> None:
    """Make ``path`` the ``local`` profile this process plans with."""
    if path != default_profile_path():
        os.environ["PLAIT_HOME"] = str(path.parent)
