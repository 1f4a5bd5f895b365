"""The run-time timer of pipeline stages: each pass a rank's stages run, timed, for the
measured :class:`~plait.planning.timeline.Timeline` (:func:`plait.planning.timeline.
timeline_from_records` draws it beside the predicted one)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from plait.planning.timeline import Record

__all__ = ["StageTimer"]


class StageTimer:
    """Times the passes of a real run's pipeline stages, for :func:`timeline_from_records`.

    torch's schedules call ``forward_one_chunk``, ``backward_one_chunk`` and
    ``backward_weight_one_chunk`` on each stage object (``_PipelineStageBase``), with the
    micro-batch index first; :meth:`wrap` replaces those on the object with timed calls
    (the class is left alone). :meth:`begin_step` starts a step's record and :meth:`stop`
    ends it (an evaluation's forwards after it are not recorded); :meth:`records` is what a
    rank hands to the gather. ``sync`` (e.g. ``torch.cuda.synchronize``) runs before and after
    each timed pass, so that a GPU's asynchronous work is timed and not its launch.
    """

    _METHODS = (
        ("forward_one_chunk", "forward", "fwd_chunk_id"),
        ("backward_one_chunk", "backward", "bwd_chunk_id"),
        ("backward_weight_one_chunk", "weight", "bwd_chunk_id"),
    )

    def __init__(
        self,
        rank: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        self._clock, self._sync = clock, sync
        self._records: list[Record] = []
        self._t0 = clock()
        self._recording = False  # passes outside a step (none yet) are not timed

    def wrap(self, stage: Any) -> None:
        """Time ``stage``'s passes from now on (once per stage object; again does nothing)."""
        if getattr(stage, "_plait_stage_timer", None) is self:
            return
        for method, kind, key in self._METHODS:
            original = getattr(stage, method, None)
            if original is not None:
                setattr(stage, method, self._timed(original, kind, key, stage))
        stage._plait_stage_timer = self

    def unwrap(self, stage: Any) -> None:
        """Undo :meth:`wrap`: the stage's own methods again."""
        for method, _, _ in self._METHODS:
            vars(stage).pop(method, None)
        vars(stage).pop("_plait_stage_timer", None)

    def begin_step(self) -> None:
        """Forget the last step and record this one; its times are from this instant."""
        self._records = []
        self._t0 = self._clock()
        self._recording = True

    def stop(self) -> None:
        """Record nothing more until the next :meth:`begin_step` (the step's records stay)."""
        self._recording = False

    def records(self) -> list[Record]:
        """This rank's passes since :meth:`begin_step` (plain tuples: they pickle)."""
        return list(self._records)

    def _timed(
        self, method: Callable[..., Any], kind: str, key: str, stage: Any
    ) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._recording:
                return method(*args, **kwargs)
            micro_batch = args[0] if args else kwargs.get(key, -1)
            if self._sync is not None:
                self._sync()
            start = self._clock()
            try:
                return method(*args, **kwargs)
            finally:
                if self._sync is not None:
                    self._sync()
                end = self._clock()
                stage_index = int(getattr(stage, "stage_index", -1))
                self._records.append(
                    (self.rank, kind, stage_index, int(micro_batch), start - self._t0,
                     end - self._t0)
                )  # fmt: skip

        return timed
