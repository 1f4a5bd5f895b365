"""A directory of checkpoints: save every N steps, keep the last K, resume from the newest.

``plait run --checkpoint-dir DIR`` sets ``PLAIT_CHECKPOINT_DIR`` for every worker, so a
script that builds ``Checkpoints()`` without a directory resumes where the previous attempt
stopped after ``--max-restarts`` restarts it. A damaged newest checkpoint (a file missing,
truncated or corrupted: :class:`plait.DamagedCheckpointError`) is passed over for the one
before it, with a warning naming the damage.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from plait.checkpoint import files
from plait.errors import CheckpointError, ConfigError, DamagedCheckpointError

__all__ = ["ENV_DIR", "Checkpoints", "Stateful"]


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)`` (a data loader, an LR
    scheduler...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Job(Protocol):
    """What a directory of checkpoints asks of a job (:class:`plait.runtime.engine.job.Job` is one;
    this module sits below the runtime and does not import it)."""

    @property
    def steps_taken(self) -> int: ...

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        loader: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
        async_save: bool = False,
    ) -> Any: ...

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        loader: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
    ) -> int: ...

    def wait_for_save(self) -> None: ...


logger = logging.getLogger(__name__)

ENV_DIR = "PLAIT_CHECKPOINT_DIR"


@dataclass
class Checkpoints:
    """Periodic checkpoints of a job in one directory (``step-00000040``, ...).

    Args:
        directory: where they go; ``None`` takes ``$PLAIT_CHECKPOINT_DIR`` (set by
            ``plait run --checkpoint-dir``).
        every: save after every ``every``-th step (``maybe_save``).
        keep: how many of the newest to keep (older ones are deleted after a save commits).
        async_save: write in a background thread while training goes on.

    Example::

        ckpt = plait.checkpoint.Checkpoints("ckpt", every=100, keep=2)
        start = ckpt.resume(job, loader=loader)      # 0 on a fresh start
        for batch in loader:
            job.step(batch)
            ckpt.maybe_save(job, loader=loader)
    """

    directory: str | os.PathLike[str] | None = None
    every: int = 100
    keep: int = 2
    async_save: bool = False
    _path: Path = field(init=False, repr=False)

    def __post_init__(self) -> None:
        directory = self.directory if self.directory is not None else os.environ.get(ENV_DIR)
        if not directory:
            raise ConfigError(
                "Checkpoints() got no directory and $PLAIT_CHECKPOINT_DIR is not set; pass "
                "Checkpoints('ckpt', ...) or run under plait run --checkpoint-dir DIR"
            )
        for name in ("every", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Checkpoints({name}={value!r}): must be an int >= 1")
        self._path = Path(directory)

    @property
    def path(self) -> Path:
        return self._path

    def latest(self) -> Path | None:
        """The newest complete checkpoint here (None if there is none)."""
        return files.latest(self._path)

    def resume(
        self,
        job: Job,
        *,
        loader: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
    ) -> int:
        """Load the newest complete checkpoint into ``job``; return its step (0 if none).

        A damaged one (:class:`plait.DamagedCheckpointError`: every rank finds the same
        damage, and nothing is loaded) is passed over for the next older one, with a warning
        naming the damage; when every checkpoint here is damaged this raises, naming each.
        Any other refusal (another model, optimizer...) is raised as it is.
        """
        found = files.complete_checkpoints(self._path)
        if not found:
            logger.info("no checkpoint in %s: starting at step 0", self._path)
            return 0
        damage: list[str] = []
        for _step, path in reversed(found):
            try:
                step = job.load(path, loader=loader, stateful=stateful)
            except DamagedCheckpointError as e:
                logger.warning("passing over damaged checkpoint %s: %s", path, e)
                damage.append(str(e))
                continue
            if damage:
                logger.warning(
                    "resumed from %s (step %d), the newest undamaged checkpoint: %d newer "
                    "one(s) passed over",
                    path,
                    step,
                    len(damage),
                )
            return step
        raise CheckpointError(
            f"every checkpoint in {str(self._path)!r} is damaged ({len(found)}: "
            f"{', '.join(p.name for _, p in found)}), nothing was loaded: "
            + " | ".join(damage)
            + ". Restore one from a copy, or move them aside to start again at step 0"
        )

    def save(
        self,
        job: Job,
        *,
        loader: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
    ) -> Any:
        """Save now, as ``step-<steps taken>``; then delete all but the newest ``keep``."""
        # The previous background save commits before its older siblings are pruned.
        job.wait_for_save()
        self._prune()
        handle = job.save(
            self._path / files.step_name(job.steps_taken),
            loader=loader,
            stateful=stateful,
            async_save=self.async_save,
        )
        if not self.async_save:
            self._prune()
        return handle

    def maybe_save(
        self,
        job: Job,
        *,
        loader: Stateful | None = None,
        stateful: Mapping[str, Stateful] | None = None,
    ) -> Any:
        """Save when the job's step count is a multiple of ``every``; else nothing (None)."""
        if job.steps_taken % self.every:
            return None
        return self.save(job, loader=loader, stateful=stateful)

    def _prune(self) -> None:
        from plait.comm.checkpoint_io import rank

        if rank() == 0:
            for gone in files.prune(self._path, self.keep):
                logger.info("deleted old checkpoint %s", gone)
