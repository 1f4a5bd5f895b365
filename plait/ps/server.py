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

import functools
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.comm.ps import Header, Kind, PsGroup, answer, decode, wait_all
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
    used: bool = False
    """Sync: some worker read the table in the step being gathered."""

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

    @property
    def version(self) -> int:
        """Steps whose pushes from every worker these rows hold (a pull's stamp: a worker's
        cache keeps a row while it is fresh enough, :mod:`plait.ps.cache`)."""
        return self.applied if self.spec.mode == "sync" else min(self.pushed)

    def waits_on(self, step: int, gone: set[int], *, whole: bool = False) -> int | None:
        """A worker that has left whose pushes a read at ``step`` (``whole``: a save of
        ``step``) still waits for: it never will push them (None: no such worker)."""
        need = step if whole or self.spec.mode == "sync" else step - self.spec.max_staleness
        return next((w for w in sorted(gone) if self.pushed[w] < need), None)

    def complete_at(self, step: int) -> bool:
        """Has every worker's push of the steps before ``step`` been applied?"""
        if self.spec.mode == "sync":
            return self.applied >= step
        return min(self.pushed) >= step

    def saved(self) -> dict[str, Any]:
        """This shard as a checkpoint file holds it: global ids, rows, optimizer states (per
        row where a state is as large as the rows, else as it is)."""
        state = self.optimizer.state.get(self.weight, {})
        return {
            "table": self.spec.name,
            "rows": self.spec.rows,
            "dim": self.spec.dim,
            "optimizer": self.spec.optimizer.kind,
            "ids": self.spec.global_ids(self.server),
            "weight": self.weight.detach().clone(),
            "per_row": {k: v.clone() for k, v in state.items() if _per_row(v, self.weight)},
            "scalars": {k: v for k, v in state.items() if not _per_row(v, self.weight)},
        }

    def load(self, pieces: list[dict[str, Any]]) -> None:
        """Take this shard's rows (and their optimizer states) from every saved piece of the
        table, whatever server count and split wrote them."""
        spec = self.spec
        for piece in pieces:
            if (piece["rows"], piece["dim"]) != (spec.rows, spec.dim):
                raise ValueError(
                    f"table {spec.name!r} is {piece['rows']} x {piece['dim']} in the checkpoint "
                    f"and {spec.rows} x {spec.dim} in this model"
                )
            if piece["optimizer"] != spec.optimizer.kind:
                raise ValueError(
                    f"table {spec.name!r} was trained with the {piece['optimizer']!r} sparse "
                    f"optimizer and this job's is {spec.optimizer.kind!r}; give "
                    f"server_optimizer=SparseOptimizer(kind={piece['optimizer']!r}, ...)"
                )
        weight = torch.empty_like(self.weight)
        found = torch.zeros(weight.shape[0], dtype=torch.bool)
        per_row: dict[str, torch.Tensor] = {}
        for piece in pieces:
            ids = piece["ids"]
            mine = spec.owner(ids) == self.server
            where = spec.local_index(ids[mine])
            weight[where] = piece["weight"][mine]
            found[where] = True
            for k, v in piece["per_row"].items():
                per_row.setdefault(k, torch.zeros_like(weight))[where] = v[mine]
        if not bool(found.all()):
            raise ValueError(f"table {spec.name!r}: the checkpoint lacks some of its rows")
        with torch.no_grad():
            self.weight.copy_(weight)
        self.loaded = weight.shape[0]
        if per_row or pieces[0]["scalars"]:
            self.optimizer.state[self.weight] = {**pieces[0]["scalars"], **per_row}

    def push(
        self, worker: int, step: int, ids: torch.Tensor, grads: torch.Tensor, used: bool
    ) -> None:
        """Take worker ``worker``'s gradient rows of ``step`` (``used``: its step read the
        table at all, perhaps no row of this server's)."""
        if step != self.pushed[worker]:
            raise RuntimeError(
                f"parameter server {self.server}, table {self.spec.name!r}: worker {worker} "
                f"pushed step {step} but {self.pushed[worker]} was next (a step skipped or "
                "pushed twice: every worker runs job.step the same number of times)"
            )
        self.pushed[worker] = step + 1
        if self.spec.mode == "async":
            self._apply([(ids, grads)], used)
            return
        self.pending.append((ids, grads))
        self.used = self.used or used
        if min(self.pushed) > self.applied:  # every worker pushed this step
            self._apply(self.pending, self.used)
            self.pending, self.used = [], False
            self.applied += 1

    def _apply(self, pushes: list[tuple[torch.Tensor, torch.Tensor]], used: bool) -> None:
        """One optimizer step over the pushed rows. A table some worker read steps its
        optimizer even when no row of this server's was read (an empty gradient), as one
        device's table does when it is used: its step count (Adam's bias correction,
        Adagrad's decay) is the table's, the same on every server."""
        if not used:
            return  # the table was not read this step: one device's has no gradient either
        ids = torch.cat([i for i, _ in pushes])
        grads = torch.cat([g for _, g in pushes])
        # ids are in range by construction (workers check theirs): no invariant checks, said
        # explicitly (torch warns when they are off implicitly, its optimizers' too)
        self.weight.grad = torch.sparse_coo_tensor(
            ids.unsqueeze(0), grads, self.weight.shape, check_invariants=False
        )
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            self.optimizer.step()
        self.weight.grad = None


def _per_row(value: Any, weight: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == weight.shape


@dataclass
class _Pull:
    src: int
    table: int
    step: int
    ids: torch.Tensor
    tag: int


@dataclass
class _Save:
    src: int
    step: int
    directory: Path


class _Server:
    """The state of :func:`serve`'s loop."""

    def __init__(self, ps: PsGroup) -> None:
        self.ps = ps
        self.index = ps.rank - ps.workers
        self.shards: dict[int, Shard] = {}
        self.waiting: list[_Pull] = []
        self.saves: list[_Save] = []
        self.gone: set[int] = set()
        """Workers that have left (DONE)."""

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
            self.waiting.append(_Pull(src, h.table, h.step, ids, h.extra))
        elif h.kind == Kind.PUSH:
            shard = self.shards[h.table]
            ids = ps.recv_payload(src, torch.empty(h.count, dtype=torch.int64))
            grads = ps.recv_payload(src, torch.empty(h.count, shard.spec.dim))
            shard.push(src, h.step, ids, grads, used=bool(h.extra))
        elif h.kind == Kind.SAVE:
            path = decode(ps.recv_payload(src, torch.empty(h.count, dtype=torch.uint8)))
            self.saves.append(_Save(src, h.step, Path(path)))
        elif h.kind == Kind.LOAD:
            path = decode(ps.recv_payload(src, torch.empty(h.count, dtype=torch.uint8)))
            answer(ps, src, self._guarded(lambda: self._load(Path(path))))
        elif h.kind == Kind.DONE:
            self.gone.add(src)
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

    def _guarded(self, action: Callable[[], None]) -> str | None:
        """Run ``action``; its error as a message for the worker that asked (None: done)."""
        try:
            action()
        except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as e:
            return f"parameter server {self.index} (rank {self.ps.rank}): {e}"
        return None

    def _save(self, directory: Path) -> None:
        servers = self.ps.servers
        for shard in self.shards.values():
            folder = directory / shard.spec.name
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(shard.saved(), folder / f"server{self.index}-of-{servers}.pt")

    def _load(self, directory: Path) -> None:
        for shard in self.shards.values():
            folder = directory / shard.spec.name
            files = sorted(folder.glob("server*-of-*.pt"))
            if not files:
                raise ValueError(f"the checkpoint at {directory} has no table {shard.spec.name!r}")
            shard.load([torch.load(f, weights_only=False) for f in files])

    def _answer(self) -> None:
        """Answer every waiting pull that may be answered now, then every save whose step
        every table has applied."""
        self._answer_pulls()
        for save in list(self.saves):
            shards = self.shards.values()
            stuck = [
                w for t in shards if (w := t.waits_on(save.step, self.gone, whole=True)) is not None
            ]
            if stuck:
                self.saves.remove(save)
                answer(self.ps, save.src, self._left_early(stuck[0], save.step))
            elif all(t.complete_at(save.step) for t in shards):
                self.saves.remove(save)
                answer(
                    self.ps, save.src, self._guarded(functools.partial(self._save, save.directory))
                )

    def _left_early(self, worker: int, step: int) -> str:
        return (
            f"parameter server {self.index}: worker {worker} left the job after pushing "
            f"step {min(t.pushed[worker] for t in self.shards.values()) - 1}, and step {step} "
            "needs its pushes; every worker must run job.step the same number of times (give "
            "each worker as many batches)"
        )

    def _answer_pulls(self) -> None:
        still: list[_Pull] = []
        works = []
        for pull in self.waiting:
            shard = self.shards.get(pull.table)
            stuck = None if shard is None else shard.waits_on(pull.step, self.gone)
            if shard is not None and stuck is not None:
                # never answerable: the worker is told who left (a negative version), with
                # the rows it waits for left empty
                version = torch.tensor([-1 - stuck], dtype=torch.int64)
                rows = torch.zeros(len(pull.ids), shard.spec.dim)
                works += self.ps.reply(pull.src, version, rows, tag=pull.tag)
                continue
            if shard is None or not shard.readable_at(pull.step):
                still.append(pull)
                continue
            with torch.no_grad():
                rows = shard.weight[pull.ids]
            version = torch.tensor([shard.version], dtype=torch.int64)
            works += self.ps.reply(pull.src, version, rows, tag=pull.tag)
        self.waiting = still
        wait_all(works)


def serve(ps: PsGroup) -> None:
    """Answer the workers until every one has left."""
    server = _Server(ps)
    logger.info("parameter server %d (rank %d): serving %d workers", server.index, ps.rank,
                ps.workers)  # fmt: skip
    while len(server.gone) < ps.workers:
        src, header = ps.recv_header()
        server.handle(src, header)
    logger.info("parameter server %d: every worker left", server.index)
