"""plait's exception hierarchy.

User input errors derive from ``ValueError`` through :class:`PlaitError`, so a caller can catch
plait's errors alone or treat them as the ordinary Python errors they are. Every message says
what was given, where, which rule it breaks and how to fix it. :class:`WorkerFailed` is the one
error that is not about input: a worker process of :func:`plait.testing.run_workers` raised.
Every class is defined here and exported from :mod:`plait`.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "CheckpointError",
    "ConfigError",
    "CostError",
    "DamagedCheckpointError",
    "LaunchError",
    "LayoutError",
    "MissingExtraError",
    "NotBuiltError",
    "PlaitError",
    "PlanError",
    "ShardingError",
    "WorkerFailed",
]


class PlaitError(ValueError):
    """Base class of every error plait raises for bad user input."""


class ConfigError(PlaitError):
    """A :class:`plait.ParallelConfig` field holds an invalid value."""


class LayoutError(PlaitError):
    """A layout or strategy is malformed or does not fit its tensor or mesh."""


class ShardingError(PlaitError):
    """A sharding annotation does not fit the module, op or world it is applied to."""


class NotBuiltError(PlaitError):
    """A configured feature exists in the config surface but is not implemented yet."""


class MissingExtraError(PlaitError, ImportError):
    """A feature needs an optional extra that is not installed (e.g. pictures need
    matplotlib: ``pip install 'plait[plot]'``); an ``ImportError`` too."""


class PlanError(PlaitError):
    """A plan (or plan file) is malformed, from another schema version, or does not fit a model."""


class CaptureError(PlaitError):
    """A model, example batch or loss function cannot be captured into an OpGraph."""


class CheckpointError(PlaitError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the job loading it.

    Raised before anything is loaded: a failed load leaves the job as it was.
    """


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated or corrupted (a size or checksum that is
    not the manifest's), or its manifest cannot be read.

    A :class:`CheckpointError`: nothing was loaded. :meth:`plait.checkpoint.Checkpoints.resume`
    catches this one (and only this one) to fall back to the previous checkpoint.
    """


class CostError(PlaitError):
    """A hardware profile, profile file or cost-model argument is invalid."""


class LaunchError(PlaitError):
    """A launch cannot start: bad flags, environment, rank table or rendezvous.

    Raised before any worker process starts.
    """


class WorkerFailed(RuntimeError):
    """A worker process raised; the message holds its rank and traceback.

    Not an input error (hence not a :class:`PlaitError`): the failure happened inside the
    function the workers ran.
    """
