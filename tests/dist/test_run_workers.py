"""plait.testing.run_workers: results come back in rank order; a rank's error is reported with
its rank and traceback, and the other ranks neither hang nor hide it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from plait.testing import WorkerFailed, run_workers

pytestmark = pytest.mark.dist


def _rank_or_fail(fail: bool) -> int:
    rank = dist.get_rank()
    if fail and rank == 1:
        raise ValueError("rank one broke")
    return rank * 10


def test_results_in_rank_order_and_an_error_names_its_rank():
    assert run_workers(_rank_or_fail, 2, False) == [0, 10]
    with pytest.raises(WorkerFailed, match=r"rank 1 of 2 failed:(.|\n)*ValueError: rank one broke"):
        run_workers(_rank_or_fail, 2, True, timeout_s=30)
