"""Run a function on N local processes joined by a gloo process group.

Used by tests, benchmarks and ``plait calibrate`` (which times collectives between real
processes); :mod:`plait.testing` re-exports it.

Each worker gets ``RANK``/``WORLD_SIZE`` set, a gloo default group through a ``FileStore`` in a
temporary directory, and a timeout on collectives, so a missing rank fails instead of hanging.
The function's return values come back to the caller in rank order; an exception in any rank
is re-raised here with the rank and its traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from plait.errors import WorkerFailed

__all__ = ["WorkerFailed", "run_workers"]


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float,
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    result: tuple[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = ("ok", fn(*args))
    except BaseException:  # report every failure to the parent (its result file)
        result = ("error", traceback.format_exc())
    # The result is on disk before teardown, so a crash there cannot hide what the rank did.
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized() and result[0] == "ok":
        # Leave together: a rank that exits while a peer still reads from its gloo pairs can
        # abort that peer. Best effort: a peer that failed may never come (its error is in
        # its result file, which the parent reports).
        with contextlib.suppress(Exception):
            dist.barrier()
    # Exit without interpreter teardown: gloo's threads, destroyed there, can abort a process
    # whose work is done ("terminate called without an active exception", SIGABRT), which
    # the parent would report as a failure although every result is on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` gloo processes; return each rank's result.

    ``fn`` must be importable (defined at module level) so the spawned processes can find it.
    """
    with tempfile.TemporaryDirectory(prefix="plait-workers-") as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _worker,
            args=(world_size, init_file, tmp, fn, args, timeout_s),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise WorkerFailed(f"rank {rank} of {world_size} failed:\n{value}")
            results.append(value)
        return results
