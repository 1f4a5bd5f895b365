"""Hangs named: a watchdog on every rank that stops a job stuck in (or short of) a collective
and says where each rank was.

``plait.init(hang_timeout=S)`` (or ``plait run --hang-timeout S``, which sets
``PLAIT_HANG_TIMEOUT`` for every worker) turns on torch's flight recorder for the job's process
groups (``TORCH_FR_BUFFER_SIZE``: every collective each rank issues, with its process group,
sequence number, sizes and the Python frames that called it; gloo and NCCL both keep one) and
starts a daemon thread that reads it every ``S / 8`` seconds. A rank is hung when a collective
it issued has not finished ``S`` seconds after it was issued (it waits for a peer). It then says
so in the job's store (``plait/hang``), which every rank's watchdog reads: a rank with no
collective pending when a peer waits is the one that never arrived (stuck in its own code, or
waiting on something else), and reports itself at once; the waiting ranks report two reads
later, so the culprit's report is written first.

Each report (:func:`report_text`) gives the collective the rank waits in (kind, process group,
sequence number within that group, sizes, the frames that issued it) or, for the rank that
never arrived, the last one it finished; where the rank stands in a plan's per-rank program,
the program's node and the plan's op, module and reason for that collective
(:func:`program_position`); and the Python stack of each of its threads. It goes
to the rank's log (stderr) and, where ``PLAIT_LOG_DIR`` is set (``plait run`` sets it), to
``hang_rank<r>.txt`` there. Then the rank exits with :data:`HANG_EXIT_CODE`, so the launcher
stops the job instead of waiting: comparing the reports' sequence numbers (:func:`summarize`)
names who stopped where.

The timeout must exceed the longest time a rank may legitimately wait in a collective for its
peers (the others' first-step tracing, rank 0 writing a checkpoint while the others wait at a
barrier): the watchdog cannot tell that from a hang. A rank doing long work of its own while
nobody waits is never stopped.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from plait.errors import ConfigError

__all__ = [
    "HANG_EXIT_CODE",
    "HangWatchdog",
    "PendingCollective",
    "program_position",
    "report_text",
    "summarize",
]

logger = logging.getLogger(__name__)

HANG_EXIT_CODE = 86
"""Exit code of a rank its watchdog stopped (the launcher reports it as hung)."""
ENV_TIMEOUT = "PLAIT_HANG_TIMEOUT"
ENV_BUFFER = "TORCH_FR_BUFFER_SIZE"
RECORDED = 2000
"""Collectives each rank's flight recorder keeps (the newest)."""


@dataclass(frozen=True, slots=True)
class PendingCollective:
    """One collective as the flight recorder saw it."""

    kind: str
    """``gloo:all_reduce``, ``nccl:all_gather`` and so on."""
    group: str
    """The process group's name (its description where torch has one: a mesh dim's name)."""
    sequence: int
    """Its number among the collectives of that group on this rank (1 for the first)."""
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    issued_s: float
    """When it was issued, ``time.time()`` seconds."""
    finished: bool
    frames: tuple[str, ...]
    """Where it was called, innermost first (``file:line in function``)."""

    def describe(self, now: float) -> str:
        state = "finished" if self.finished else f"waiting {now - self.issued_s:.1f} s"
        sizes = ", ".join(f"{list(s)} {d}" for s, d in zip(self.sizes, self.dtypes, strict=False))
        return f"{self.kind} #{self.sequence} of process group {self.group!r} ({sizes}; {state})"


def recorded_collectives() -> list[PendingCollective]:
    """This process's flight-recorder entries, oldest first ([] where none is kept)."""
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return []
    try:
        entries = pickle.loads(dump()).get("entries", [])
    except Exception as e:  # no group yet, or a torch without the recorder
        logger.debug("flight recorder not readable: %s", e)
        return []
    return [_entry(e) for e in entries]


def _entry(e: dict[str, Any]) -> PendingCollective:
    group = e.get("process_group") or ("?", "?")
    frames = tuple(
        f"{f.get('filename')}:{f.get('line')} in {f.get('name')}" for f in e.get("frames", [])
    )
    finished = bool(e.get("retired")) or e.get("state") == "completed"
    return PendingCollective(
        kind=str(e.get("profiling_name", "?")),
        group=str(group[1] if len(group) > 1 and group[1] else group[0]),
        sequence=int(e.get("collective_seq_id") or e.get("p2p_seq_id") or 0),
        sizes=tuple(tuple(s) for s in e.get("input_sizes", [])),
        dtypes=tuple(str(d) for d in e.get("input_dtypes", [])),
        issued_s=int(e.get("time_created_ns", 0)) / 1e9,
        finished=finished,
        frames=frames,
    )


def program_position(frame: FrameType | None) -> str | None:
    """Where a stack stands in an FX program (a plan's per-rank program), innermost first:
    the node, and the plan's op, module and reason its trace tagged it with; None outside one.

    The program is a ``torch.fx.GraphModule`` whose generated ``forward`` is on the stack: its
    line maps to a node (FX's line map); a ``wait_tensor`` stands for the collective it waits
    on. Read without importing torch (the watchdog may run before it is imported).
    """
    while frame is not None:
        module: Any = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        lines = getattr(module, "_lineno_map", None)
        if module is not None and lines is not None and hasattr(module, "graph"):
            index = lines.get(frame.f_lineno - getattr(module, "_prologue_start", 0))
            nodes = list(module.graph.nodes)
            if index is not None and 0 <= index < len(nodes):
                return _describe_node(nodes[index])
        frame = frame.f_back
    return None


def _describe_node(node: Any) -> str:
    if "wait_tensor" in str(node.target) and node.args and hasattr(node.args[0], "meta"):
        node = node.args[0]  # the collective it waits for
    tags = node.meta.get("custom") or {}
    text = f"node {node.name!r} ({getattr(node.target, '__name__', node.target)})"
    if "plait_op" in tags:
        text += f", the plan's op {tags['plait_op']!r} (module {tags.get('plait_module', '?')!r})"
    if tags.get("plait_phase") == "backward":
        text += ", in backward"
    if "plait_reason" in tags:
        text += f": {tags['plait_reason']}"
    return text


def report_text(
    rank: int,
    timeout: float,
    waiting: PendingCollective | None,
    last: PendingCollective | None,
    now: float,
    stacks: str,
    peer: str | None = None,
    program: str | None = None,
) -> str:
    """What a hung rank says: where it waits (or, while ``peer`` waits for it, the last
    collective it finished), where it stands in the plan's program and the Python stacks of
    its threads."""
    if waiting is not None:
        lines = [f"plait: rank {rank} is hung: no progress for {timeout:g} s (hang_timeout)"]
        lines.append(f"  waiting in {waiting.describe(now)}")
        lines += [f"    called from {f}" for f in waiting.frames[:6]]
    else:
        lines = [f"plait: rank {rank} never arrived: {peer}"]
        if last is not None:
            lines.append(
                f"  no collective pending; the last one it finished: {last.describe(now)}, "
                f"issued {now - last.issued_s:.1f} s ago"
            )
            lines += [f"    called from {f}" for f in last.frames[:3]]
        else:
            lines.append("  no collective issued yet")
    if program is not None:
        lines.append(f"  in the plan's per-rank program at {program}")
    lines.append(f"  Python stacks of rank {rank}'s threads (innermost last):")
    lines.append(stacks.rstrip())
    return "\n".join(lines) + "\n"


def _stacks(skip: int) -> str:
    """Every thread's stack but the watchdog's own (``skip``: its thread id)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        out.append(f"  thread {names.get(ident, ident)}:")
        out += ["    " + line for line in "".join(traceback.format_stack(frame)).splitlines()]
    return "\n".join(out)


class HangWatchdog:
    """The watchdog thread of one rank (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        timeout: float,
        *,
        report_dir: str | None = None,
        exit_process: bool = True,
    ) -> None:
        if not timeout > 0:
            raise ConfigError(
                f"hang_timeout={timeout!r}: give the seconds a rank may go without progress "
                "before it is stopped as hung (> 0), or None to keep no watchdog"
            )
        self.rank = rank
        self.timeout = float(timeout)
        self.interval = max(0.05, self.timeout / 8)
        self.report_dir = report_dir
        self.exit_process = exit_process
        self.report: str | None = None
        """The report, once the rank was found hung."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="plait-hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        store = _default_store()
        while not self._stop.wait(self.interval):
            entries = recorded_collectives()
            now = time.time()
            waiting = next((e for e in entries if not e.finished), None)
            if waiting is not None and now - waiting.issued_s > self.timeout:
                # the report is written before the others hear of it: the launcher stops
                # every rank once one exits
                self._report(waiting, None, now, None)
                _say(store, f"rank {self.rank} waits in {waiting.describe(now)}")
                # the rank that never arrived reports and exits first (it reads the store)
                if not self._stop.wait(2 * self.interval):
                    self._exit()
                return
            if waiting is None and store is not None:
                peer = _heard(store)
                if peer is not None:
                    self._report(None, entries[-1] if entries else None, now, peer)
                    self._exit()
                    return

    def _report(
        self,
        waiting: PendingCollective | None,
        last: PendingCollective | None,
        now: float,
        peer: str | None,
    ) -> None:
        own = threading.get_ident()
        positions = (
            program_position(frame)
            for ident, frame in sys._current_frames().items()
            if ident != own
        )
        text = report_text(
            self.rank, self.timeout, waiting, last, now, _stacks(own), peer,
            program=next((p for p in positions if p is not None), None),
        )  # fmt: skip
        self.report = text
        sys.stderr.write(text)
        sys.stderr.flush()
        if self.report_dir:
            try:
                path = Path(self.report_dir) / f"hang_rank{self.rank}.txt"
                path.write_text(text)
            except OSError as e:
                sys.stderr.write(f"plait: could not write the hang report: {e}\n")

    def _exit(self) -> None:
        if self.exit_process:
            os._exit(HANG_EXIT_CODE)


_KEY = "plait/hang"


def _default_store() -> Any:
    """The default process group's store (every rank's), or None."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception as e:  # no default group: the watchdog reads its own recorder only
        logger.debug("no store for the hang watchdog: %s", e)
        return None


def _say(store: Any, what: str) -> None:
    """Tell every rank's watchdog that this rank waits (the first to say it is kept)."""
    if store is None:
        return
    try:
        store.compare_set(_KEY, "", what)
    except Exception as e:
        logger.debug("hang watchdog: store write failed: %s", e)


def _heard(store: Any) -> str | None:
    """What a waiting peer said, if one did."""
    try:
        if store.check([_KEY]):
            return bytes(store.get(_KEY)).decode()
    except Exception as e:
        logger.debug("hang watchdog: store read failed: %s", e)
    return None


def timeout_from(value: Any) -> float | None:
    """``hang_timeout`` as seconds: the argument, else ``PLAIT_HANG_TIMEOUT``, else None."""
    if value is None:
        value = os.environ.get(ENV_TIMEOUT) or None
        if value is None:
            return None
        try:
            return float(value)
        except ValueError:
            raise ConfigError(
                f"{ENV_TIMEOUT}={value!r} is not a number of seconds; set it to e.g. 300, or "
                "unset it to keep no watchdog"
            ) from None
    seconds = value.total_seconds() if hasattr(value, "total_seconds") else value
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ConfigError(
            f"hang_timeout={value!r}: give seconds (a number or a timedelta), or None"
        )
    return float(seconds)


def record_collectives() -> None:
    """Turn on the flight recorder for process groups made from now on (kept as set where the
    user set it)."""
    os.environ.setdefault(ENV_BUFFER, str(RECORDED))


def summarize(reports: Iterable[str]) -> list[str]:
    """The ranks' reports in brief: each one's first two lines (who never arrived, or where
    it waits; then the last collective the former finished) and its place in the plan's
    program, the rank that never arrived visible by its lower sequence number. ``plait run``
    prints them after a hang."""
    out: list[str] = []
    for text in reports:
        lines = text.splitlines()
        out += lines[:2]
        out += [line for line in lines if line.startswith("  in the plan's per-rank program")]
    return out
