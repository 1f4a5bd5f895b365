"""Unit tests of the failure exchange between nodes (`plait.launch.node_reports`)."""

from __future__ import annotations

import torch.distributed as dist

from plait.launch.node_reports import NodeReport, format_across_nodes, gather, peer_address, publish

GLOO_CLOSED = (
    "[rank1]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection"
    " closed by peer [10.77.0.2]:14985. This is typically caused by a remote worker crashing."
)
GLOO_RESET = (
    "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [10.0.0.7]:7301: Connection"
    " reset by peer. This is typically caused by a remote worker hanging."
)


def _report(node: int, rank: int, *, lost_peer: str | None = None, at: float = 100.0) -> NodeReport:
    return NodeReport(
        node_rank=node, rank=rank, how="exit code 1", timestamp=at,
        log_file=f"/logs/worker_{rank}.log", tail=(f"rank {rank} says hello",),
        lost_peer=lost_peer,
    )  # fmt: skip


def test_peer_address_reads_gloos_lost_connection_errors() -> None:
    assert peer_address(["READY", GLOO_CLOSED]) == "10.77.0.2"
    assert peer_address([GLOO_RESET, "later line"]) == "10.0.0.7"
    assert peer_address(["RuntimeError: rank 3 broke at step 10"]) is None


def test_first_failure_on_another_node_is_named_with_its_lines() -> None:
    mine = _report(0, 1, lost_peer="10.77.0.2", at=99.0)  # earlier, but only a consequence
    lines = format_across_nodes(mine, {1: _report(1, 3)})
    assert lines[0] == (
        "plait run: the job's first failure was on node 1: worker rank 3 failed with exit code"
        " 1; this node's failure followed from it."
    )
    assert lines[1:] == [
        "plait run: last 1 lines of /logs/worker_3.log (on node 1):",
        "    rank 3 says hello",
    ]


def test_this_nodes_crash_needs_no_pointer_elsewhere() -> None:
    assert format_across_nodes(_report(0, 1), {1: _report(1, 3, lost_peer="10.0.0.1")}) == []


def test_two_crashes_the_earlier_is_first() -> None:
    lines = format_across_nodes(_report(0, 0, at=105.0), {1: _report(1, 2, at=101.0)})
    assert "first failure was on node 1: worker rank 2" in lines[0]


def test_silent_node_is_named_with_the_lost_peer() -> None:
    lines = format_across_nodes(_report(0, 1, lost_peer="10.77.0.2"), {1: None, 2: _report(2, 5)})
    assert lines[-1].startswith(
        "plait run: node(s) [1] sent no report within 15 s (this node's worker lost its"
        " connection to 10.77.0.2): their launcher is gone"
    )


def test_gather_reads_published_reports_and_marks_the_missing() -> None:
    store = dist.HashStore()
    publish(store, "job", _report(1, 3))
    found = gather(store, "job", node_rank=2, num_nodes=3, grace=0.2)
    assert found == {0: None, 1: _report(1, 3)}
    assert store.add("plait.failed.job.read", 0) == 1
