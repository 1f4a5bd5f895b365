"""``--calibrate``: the example plans on this machine's numbers, not the uncalibrated defaults.

Before planning, every rank of the run calls :func:`calibrate_for_run`. The run's own workers
measure this machine together for a few seconds (:func:`plait.cost.calibrate.
calibrate_in_world` with :meth:`~plait.cost.calibrate.CalibrationSettings.brief`: every
figure ``plait calibrate`` measures, on small sizes, the host and latency ones in three
rounds) and write the profile to the example's own cache (``world<N>/local.json`` beside the
``local`` profile every plait command reads, ``$PLAIT_HOME/local.json`` else
``~/.cache/plait/local.json``; never that file itself). The run plans on it: the cache's
folder becomes this process's ``$PLAIT_HOME`` (this process only: the planner reads ``local``
from there).

On a shared machine the numbers are the load of the moment: measured now, they are the
load the training then meets. ``--reuse-calibration`` skips the measurement when a saved
profile describes the run (measured on this host, same CPU count and torch, by as many
processes with as many torch threads: :func:`plait.cost.calibrate.mismatch`), looking first
at the profile every plait command reads (``plait calibrate --world-size N`` writes it), then
at the example's cache; it keeps the load of when it was made.
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
                f"{when}, under that moment's load; --calibrate measures now)"
            )
        ranks = self.profile.measured.get("all_reduce", {}).get("world_size", "?")
        why = f" ({'; '.join(self.passed_over)})" if self.passed_over else ""
        return (
            f"hardware: calibrated this machine in {self.seconds:.1f} s on the {ranks} workers"
            f"{why}; written to {self.path} (--reuse-calibration plans on it without measuring; "
            f"`plait calibrate --world-size {ranks}` measures longer)"
        )


def cache_path(world_size: int) -> Path:
    """The example's own calibration for ``world_size`` processes, beside the ``local``
    profile every plait command reads (and moved with it by ``$PLAIT_HOME``)."""
    return default_profile_path().parent / f"world{world_size}" / "local.json"


def calibrate_for_run(
    world_size: int,
    *,
    reuse: bool = False,
    settings: CalibrationSettings | None = None,
) -> Calibration:
    """The ``local`` profile this run plans with (module docstring); every rank calls it,
    after ``plait.init()`` and before planning. ``reuse``: take a saved profile that describes
    the run instead of measuring. ``settings``: the measurement's sizes (default
    :meth:`CalibrationSettings.brief`). Once a process: it may move ``$PLAIT_HOME``."""
    threads = torch.get_num_threads()
    shared, own = default_profile_path(), cache_path(world_size)
    passed_over = []
    # Every rank reads the same files before any rank writes (the write follows the ranks'
    # measuring together), so every rank takes the same branch.
    for path in (shared, own) if reuse else ():
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
