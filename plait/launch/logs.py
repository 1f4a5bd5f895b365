"""Per-rank log files for `plait run`, as a torch elastic `LogsSpecs`.

Layout of `--log-dir`:

    launcher.log                 the launcher's own log (rendezvous, restarts, failures)
    worker_<rank>.log            stdout and stderr of global rank <rank>, first attempt
    worker_<rank>.restart<k>.log the same after the k-th group restart (or re-forming)
    worker_<rank>.error.json     torch elastic's error file, when the script uses @record

Each worker writes stdout and stderr into one file (the exec shim merges them), so a log reads
in the order things happened. The console echoes the files of `RunConfig.echoed_ranks`, each
line prefixed with `[rank<r>]:` by torch's `TailLog`.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

__all__ = ["RankLogsSpecs", "last_lines", "worker_log_name"]

LOG_LINE_PREFIX = "[rank${rank}]: "
"""torch elastic template for console lines echoed from worker logs."""


def worker_log_name(rank: int, restart: int) -> str:
    """File name of global rank `rank`'s log in attempt `restart` (0 = first)."""
    return f"worker_{rank}.log" if restart == 0 else f"worker_{rank}.restart{restart}.log"


class RankLogsSpecs(LogsSpecs):
    """Write each worker's output to `<log_dir>/worker_<rank>.log`; echo chosen ranks.

    Unlike torch's `DefaultLogsSpecs` (`<dir>/<run>/attempt_<k>/<local_rank>/stdout.log`),
    files are named by global rank, flat, and one per worker.
    """

    def __init__(self, log_dir: str | Path, echoed_ranks: frozenset[int]) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(log_dir=str(log_dir))
        self._echoed = echoed_ranks
        self._starts = 0
        self.paths: dict[int, str] = {}
        """Global rank -> its current log file, updated at every (re)start."""

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        # numbered by this node's own starts, not TORCHELASTIC_RESTART_COUNT: an elastic
        # group that re-forms for a node joining restarts without counting a restart, and its
        # logs would overwrite the previous formation's
        self._starts += 1
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            restart = self._starts - 1
            path = os.path.join(self.root_log_dir, worker_log_name(rank, restart))
            self.paths[rank] = path
            dest.stdouts[local_rank] = path
            # stderr is merged into stdout by the exec shim; "" leaves it on the console for
            # the moment before the shim runs, so a broken interpreter is still visible.
            dest.stderrs[local_rank] = ""
            if rank in self._echoed:
                dest.tee_stdouts[local_rank] = path
            error_file = os.path.join(self.root_log_dir, f"worker_{rank}.error.json")
            dest.error_files[local_rank] = error_file
            env["TORCHELASTIC_ERROR_FILE"] = error_file
        dest.filtered_stdout = os.path.join(self.root_log_dir, "filtered_stdout.log")
        dest.filtered_stderr = os.path.join(self.root_log_dir, "filtered_stderr.log")
        return dest

    def __repr__(self) -> str:
        return f"RankLogsSpecs(log_dir={self.root_log_dir!r}, echoed={sorted(self._echoed)})"


def last_lines(path: str | Path, count: int = 20) -> list[str]:
    """The last `count` lines of a text file (empty when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return tail.splitlines()[-count:]
