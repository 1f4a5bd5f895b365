"""A parameter server: the loop a server rank runs instead of the user's script.

``plait.init()`` on a server rank (:mod:`plait.launch.world`) calls :func:`serve`, which
answers workers until every one has left, then the process exits: the user's training code
after ``plait.init()`` never runs there.

A server holds, for each table, the rows the split gives it (:class:`Shard`) with the sparse
optimizer's state for them. Messages (:mod:`plait.comm.ps`):

- CREATE: a worker's :class:`~plait.ps.table.TableSpec`; the first makes the shard, the others
  must agree with it (every worker built the same model);
- INIT: worker 0's initial rows (unless the table is made on the servers);
- PULL: rows by local index, answered once the table may be read at the worker's step;
- PUSH: a worker's row gradients of one step (the loss already weighted by 1 / workers, so
  the sum over workers is the step's gradient);
- DONE: a worker left.

When may a pull at step ``t`` be answered? ``ps_mode="sync"``: once steps ``0..t-1`` are
applied (each applied when every worker has pushed it, as one sparse gradient: one device's
update). ``"async"``: pushes are applied as they come, and the pull waits only for every
worker's pushes up to step ``t - 1 - max_staleness``.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.comm.ps import Header, Kind, PsGroup, wait_all
from plait.errors import ConfigError
from plait.ps.table import TableSpec, initial_rows, sparse_optimizer

__all__ = ["Shard", "serve"]

logger = logging.getLogger(__name__)


@dataclass
class Shard:
    """One table's rows on this server, their optimizer, and how far training has come."""

    spec: TableSpec
    server: int
    weight: nn.Parameter = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    loaded: int = 0
    """Initial rows received (worker 0's INIT messages)."""
    pushed: list[int] = field(init=False)
    """Per worker, the steps whose pushes this server has received."""
    applied: int = 0
    """Sync: steps applied."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Sync: the pushes of the step being gathered (local ids, gradient rows)."""

    def __post_init__(self) -> None:
        n = self.spec.local_rows(self.server)
        if self.spec.init_in_server:
            rows = initial_rows(self.spec, self.spec.global_ids(self.server))
            self.loaded = n
        else:
            rows = torch.empty(n, self.spec.dim)
        self.weight = nn.Parameter(rows)
        self.optimizer = sparse_optimizer(self.spec.optimizer, [self.weight])
        self.pushed = [0] * self.spec.workers

    @property
    def ready(self) -> bool:
        return self.loaded == self.weight.shape[0]

    def readable_at(self, step: int) -> bool:
        """May a pull of a worker at ``step`` be answered now?"""
        if not self.ready:
            return False
        if self.spec.mode == "sync":
            return self.applied >= step
        return min(self.pushed) >= step - self.spec.max_staleness

    def push(self, worker: int, step: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Take worker ``worker``'s gradient rows of ``step``."""
        if step != self.pushed[worker]:
            raise RuntimeError(
                f"parameter server {self.server}, table {self.spec.name!r}: worker {worker} "
                f"pushed step {step} but {self.pushed[worker]} was next (a step skipped or "
                "pushed twice: every worker runs job.step the same number of times)"
            )
        self.pushed[worker] = step + 1
        if self.spec.mode == "async":
            self._apply([(ids, grads)])
            return
        self.pending.append((ids, grads))
        if min(self.pushed) > self.applied:  # every worker pushed this step
            self._apply(self.pending)
            self.pending = []
            self.applied += 1

    def _apply(self, pushes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        ids = torch.cat([i for i, _ in pushes])
        if ids.numel() == 0:
            return  # no row of this table was read: its optimizer is not stepped
        grads = torch.cat([g for _, g in pushes])
        # ids are in range by construction (workers check theirs): no invariant checks, said
        # explicitly (torch warns when they are off implicitly, its optimizers' too)
        self.weight.grad = torch.sparse_coo_tensor(
            ids.unsqueeze(0), grads, self.weight.shape, check_invariants=False
        )
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            self.optimizer.step()
        self.weight.grad = None


@dataclass
class _Pull:
    src: int
    table: int
    step: int
    ids: torch.Tensor


class _Server:
    """The state of :func:`serve`'s loop."""

    def __init__(self, ps: PsGroup) -> None:
        self.ps = ps
        self.index = ps.rank - ps.workers
        self.shards: dict[int, Shard] = {}
        self.waiting: list[_Pull] = []
        self.left = 0

    def handle(self, src: int, h: Header) -> None:
        ps = self.ps
        if h.kind == Kind.CREATE:
            blob = ps.recv_payload(src, torch.empty(h.count, dtype=torch.uint8))
            self._create(src, pickle.loads(blob.numpy().tobytes()))
        elif h.kind == Kind.INIT:
            shard = self.shards[h.table]
            rows = ps.recv_payload(src, torch.empty(h.count, shard.spec.dim))
            with torch.no_grad():
                shard.weight[h.extra : h.extra + h.count] = rows
            shard.loaded += h.count
        elif h.kind == Kind.PULL:
            ids = ps.recv_payload(src, torch.empty(h.count, dtype=torch.int64))
            self.waiting.append(_Pull(src, h.table, h.step, ids))
        elif h.kind == Kind.PUSH:
            shard = self.shards[h.table]
            ids = ps.recv_payload(src, torch.empty(h.count, dtype=torch.int64))
            grads = ps.recv_payload(src, torch.empty(h.count, shard.spec.dim))
            shard.push(src, h.step, ids, grads)
        elif h.kind == Kind.DONE:
            self.left += 1
        self._answer()

    def _create(self, src: int, spec: TableSpec) -> None:
        have = self.shards.get(spec.id)
        if have is None:
            self.shards[spec.id] = Shard(spec, self.index)
            logger.info(
                "parameter server %d: table %r, %d of its %d rows x %d (%s split)",
                self.index, spec.name, spec.local_rows(self.index), spec.rows, spec.dim,
                spec.split,
            )  # fmt: skip
        elif have.spec != spec:
            raise ConfigError(
                f"parameter server {self.index}: worker {src} describes table {spec.name!r} as "
                f"{spec} but an earlier worker as {have.spec}; every worker must build the same "
                "model and ParallelConfig"
            )

    def _answer(self) -> None:
        """Answer every waiting pull that may be answered now."""
        still: list[_Pull] = []
        works = []
        for pull in self.waiting:
            shard = self.shards.get(pull.table)
            if shard is None or not shard.readable_at(pull.step):
                still.append(pull)
                continue
            with torch.no_grad():
                rows = shard.weight[pull.ids]
            works += self.ps.reply(pull.src, rows)
        self.waiting = still
        wait_all(works)


def serve(ps: PsGroup) -> None:
    """Answer the workers until every one has left."""
    server = _Server(ps)
    logger.info("parameter server %d (rank %d): serving %d workers", server.index, ps.rank,
                ps.workers)  # fmt: skip
    while server.left < ps.workers:
        src, header = ps.recv_header()
        server.handle(src, header)
    logger.info("parameter server %d: every worker left", server.index)
