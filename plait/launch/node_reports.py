"""Failures across nodes: every node's launcher tells the others how its workers ended.

On one node the launcher sees the worker that failed first. On several nodes it does not: a
worker that crashes on node 1 shows up on node 0 as gloo's "Connection closed by peer" in a
worker that was fine. So, when a multi-node job fails, each node's launcher

1. publishes its own root failure (rank, how it ended, the last lines of its log, whether those
   lines are only a lost peer) in the rendezvous store -> `publish()`;
2. waits up to `REPORT_GRACE` seconds for every other node's report -> `gather()`; node 0,
   which hosts the store, also waits (as long) for the others to have read before it leaves;
3. names the job's first failure: the earliest that is not merely a lost peer (a crash, not a
   consequence of one), and every node that sent nothing (its launcher is gone: the node was
   killed or lost its network) -> `format_across_nodes()`.

A worker log that only shows a lost connection still says where to look: `peer_address()`
reads the address gloo or NCCL names.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta

from torch.distributed import Store

__all__ = [
    "REPORT_GRACE",
    "NodeReport",
    "format_across_nodes",
    "gather",
    "peer_address",
    "publish",
]

REPORT_GRACE = 15.0
"""Seconds a node waits for the others' reports (the wait ends when all have arrived)."""

_PEER = re.compile(
    r"(?:Connection closed by peer|Read error|Write error|Connection reset by peer)"
    r"\s*\[([^\]]+)\]:\d+"
)
"""gloo's lost-connection errors: `Connection closed by peer [10.0.0.2]:14985`,
`Read error [10.0.0.2]:7301: Connection reset by peer`."""


def peer_address(lines: Sequence[str]) -> str | None:
    """The peer address a lost-connection error names in `lines` (gloo, NCCL), if any."""
    for line in reversed(lines):
        match = _PEER.search(line)
        if match:
            return match.group(1)
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeReport:
    """One node's first failed worker, as the other nodes read it."""

    node_rank: int
    rank: int
    """Global rank of the failed worker."""
    how: str
    """"exit code 3", "signal SIGKILL (9)"."""
    timestamp: float
    """When the launcher saw it fail (seconds since the epoch)."""
    log_file: str | None
    tail: tuple[str, ...]
    lost_peer: str | None
    """The peer address its log names when its error is a lost connection (a consequence)."""


def _key(run_id: str, node_rank: int) -> str:
    return f"plait.failed.{run_id}.node{node_rank}"


def publish(store: Store, run_id: str, report: NodeReport) -> None:
    """Put this node's report where the others read it."""
    store.set(_key(run_id, report.node_rank), json.dumps(asdict(report)))


def gather(
    store: Store, run_id: str, node_rank: int, num_nodes: int, grace: float = REPORT_GRACE
) -> dict[int, NodeReport | None]:
    """Every other node's report, None for a node that sent none within `grace` seconds."""
    deadline = time.monotonic() + grace
    found: dict[int, NodeReport | None] = {}
    for r in range(num_nodes):
        if r == node_rank:
            continue
        left = timedelta(seconds=max(0.1, deadline - time.monotonic()))
        try:
            store.wait([_key(run_id, r)], left)  # raises when the time is up
            data = json.loads(store.get(_key(run_id, r)))
        except (RuntimeError, TimeoutError, ValueError):  # c10d raises DistStoreError
            found[r] = None
            continue
        data["tail"] = tuple(data["tail"])
        found[r] = NodeReport(**data)
    read = f"plait.failed.{run_id}.read"
    store.add(read, 1)
    if node_rank == 0:  # it hosts the store: leaving ends it for the nodes still reading
        alive = num_nodes - sum(report is None for report in found.values())
        while int(store.add(read, 0)) < alive and time.monotonic() < deadline + grace:
            time.sleep(0.05)
    return found


def _first(reports: Sequence[NodeReport]) -> NodeReport:
    # a crash comes before the lost connections it causes; among equals, the earliest
    return min(reports, key=lambda r: (r.lost_peer is not None, r.timestamp, r.node_rank))


def format_across_nodes(mine: NodeReport, others: dict[int, NodeReport | None]) -> list[str]:
    """Lines naming the job's first failure (when on another node) and the silent nodes."""
    lines: list[str] = []
    reports = [mine, *(r for r in others.values() if r is not None)]
    first = _first(reports)
    if first.node_rank != mine.node_rank:
        lines.append(
            f"plait run: the job's first failure was on node {first.node_rank}: worker rank"
            f" {first.rank} failed with {first.how}; this node's failure followed from it."
        )
        if first.tail:
            where = f" of {first.log_file} (on node {first.node_rank})" if first.log_file else ""
            lines.append(f"plait run: last {len(first.tail)} lines{where}:")
            lines += [f"    {line}" for line in first.tail]
    silent = sorted(r for r, report in others.items() if report is None)
    if silent:
        lost = ""
        if mine.lost_peer:
            lost = f" (this node's worker lost its connection to {mine.lost_peer})"
        lines.append(
            f"plait run: node(s) {silent} sent no report within {REPORT_GRACE:g} s{lost}: their"
            " launcher is gone (the node was killed, lost its network or hung); look there"
            " first."
        )
    elif first.node_rank == mine.node_rank and mine.lost_peer is not None:
        lines.append(
            f"plait run: this node's worker lost its connection to {mine.lost_peer}; no node"
            " reported an earlier failure."
        )
    return lines
