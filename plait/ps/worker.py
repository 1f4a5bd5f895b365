"""A worker's side of a parameter-server job: tables read by id from the servers.

:func:`serve_tables` replaces each table module of the model (``ParallelConfig.server_modules``
and modules marked by ``plait.on_server``) with a :class:`ServerEmbedding` or
:class:`ServerEmbeddingBag`, which holds no parameter: its forward deduplicates the batch's
ids, pulls those rows from their servers (:class:`PsClient`) and looks them up as the module
would; backward leaves each pulled row's gradient on the pulled rows. After the step's last
backward, :meth:`PsClient.flush` pushes every table's row gradients to their servers (rows
read by several forwards of a step summed into one) and the step counter moves on. The dense
rest of the model trains data parallel over the workers as any other job.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.comm.ps import REPLY_TAGS, Header, Kind, PsGroup, agree, request, wait_all
from plait.config import ParallelConfig
from plait.errors import CheckpointError, ConfigError, LaunchError, ShardingError
from plait.ps.cache import RowCache
from plait.ps.ops import register
from plait.ps.table import TableSpec, check_split, table_module

__all__ = ["PsClient", "ServerEmbedding", "ServerEmbeddingBag", "serve_tables"]

logger = logging.getLogger(__name__)


@dataclass
class PsTraffic:
    """What a worker moved to and from the servers since the job began."""

    pulls: int = 0
    rows_pulled: int = 0
    """Rows asked of the servers (prefetched ones included)."""
    rows_read: int = 0
    """Rows the tables' forwards read (each distinct row once a forward)."""
    cache_hits: int = 0
    """Of ``rows_read``, those the worker's cache served."""
    bytes_pulled: int = 0
    bytes_pushed: int = 0
    steps: int = 0
    pull_s: float = 0.0
    """Seconds the tables' forwards waited for their rows (cache reads included)."""
    push_s: float = 0.0
    """Seconds the step's pushes took (coalescing the gradients and sending them)."""

    @property
    def hit_rate(self) -> float:
        """Share of the rows read that the cache served (0 without a cache)."""
        return self.cache_hits / self.rows_read if self.rows_read else 0.0


@dataclass
class _Read:
    """A backward's gradients of a table's rows: one row of ``grads`` per id of ``ids``."""

    ids: torch.Tensor
    grads: torch.Tensor


@dataclass(eq=False)
class _Pending:
    """A pull on its way: the rows of ``ids`` from each server they live on."""

    ids: torch.Tensor
    out: torch.Tensor
    step: int
    """The step the rows are for (a sync server answers once the steps before it are
    applied: waiting for it earlier would wait on this worker's own push)."""
    works: list[Any] = field(default_factory=list)
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(which of ``ids``, the server's version, its rows)."""

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows, and each row's version."""
        wait_all(self.works)
        version = torch.empty(len(self.ids), dtype=torch.int64)
        for mask, v, rows in self.pieces:
            if int(v) < 0:  # the server's word that a worker it needs has left
                raise LaunchError(
                    f"rows for step {self.step} cannot come: worker {-1 - int(v)} left the job "
                    "before pushing the steps they need; every worker must run job.step the "
                    "same number of times (give each worker as many batches)"
                )
            self.out[mask] = rows
            version[mask] = v
        return self.out, version


@dataclass
class PsClient:
    """A worker's link to the servers: pulls, the step's reads, pushes."""

    ps: PsGroup
    name: str = "parameter_server"
    """Its folder in a checkpoint's ``parts`` (a checkpoint part of the job)."""
    step: int = 0
    """Steps pushed so far (the step the next pull and push belong to)."""
    traffic: PsTraffic = field(default_factory=PsTraffic)
    cache_rows: int = 0
    """Rows of each table cached on this worker (``vocab_cache_size``; 0: none)."""
    _reads: dict[str, list[_Read]] = field(default_factory=dict)
    _specs: dict[str, TableSpec] = field(default_factory=dict)
    _caches: dict[str, RowCache] = field(default_factory=dict)
    _prefetched: dict[str, list[_Pending]] = field(default_factory=dict)
    _tags: int = 0

    def create(self, spec: TableSpec, weight: torch.Tensor | None) -> None:
        """Tell every server about ``spec``; worker 0 sends ``weight``'s rows (None: the
        servers make them)."""
        self._specs[spec.name] = spec
        if self.cache_rows:
            self._caches[spec.name] = RowCache(self.cache_rows, spec.dim)
        blob = torch.frombuffer(bytearray(pickle.dumps(spec)), dtype=torch.uint8)
        works: list[Any] = []
        for s in range(spec.servers):
            dst = self.ps.server_rank(s)
            works += self.ps.send(dst, Header(Kind.CREATE, spec.id, count=blob.numel()), [blob])
            if weight is None:
                continue
            mine = weight.detach()[spec.global_ids(s)].float().cpu()
            per = spec.rows_per_message
            for start in range(0, mine.shape[0], per):
                chunk = mine[start : start + per]
                head = Header(Kind.INIT, spec.id, count=chunk.shape[0], extra=start)
                works += self.ps.send(dst, head, [chunk])
        wait_all(works)

    def pull(self, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (ascending unique global ids) of table ``spec`` for a read at this
        step: from the cache where fresh enough, the rest from their servers (a prefetch
        of them waited for first)."""
        start = time.perf_counter()
        try:
            return self._pull(spec, ids)
        finally:
            self.traffic.pull_s += time.perf_counter() - start

    def _pull(self, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        cache = self._caches.get(spec.name)
        self._land_prefetches(spec.name)
        self.traffic.rows_read += len(ids)
        if cache is None:
            rows, _ = self._request(spec, ids, self.step).wait()
            return rows
        hit, pos = cache.find(ids, self.step - spec.max_staleness)
        out = torch.empty(len(ids), spec.dim)
        out[hit] = cache.read(pos[hit], self.step)
        missing = ids[~hit]
        if len(missing):
            rows, version = self._request(spec, missing, self.step).wait()
            cache.put(missing, rows, version, self.step)
            out[~hit] = rows
        self.traffic.cache_hits += int(hit.sum())
        return out

    def prefetch(self, ids: Mapping[str, torch.Tensor]) -> None:
        """Start pulling the next step's rows now (``{table: ids}``, the ids the next batch
        gives each table), so they arrive while this step computes; the next step's reads
        find them in the cache. Needs ``vocab_cache_size``; rows cached and fresh for the next
        step are not asked again. Call it before ``job.step`` of the current batch."""
        for name, given in ids.items():
            spec = self._specs.get(name)
            cache = self._caches.get(name)
            if spec is None or cache is None:
                raise ConfigError(
                    f"prefetch({name!r}): "
                    + (
                        f"no table {name!r} on the parameter servers (the tables are "
                        f"{sorted(self._specs)})"
                        if spec is None
                        else "the rows would have nowhere to wait: give ParallelConfig("
                        "vocab_cache_size=N), the rows each worker caches a table"
                    )
                )
            wanted = torch.unique(_checked_ids(spec, given).cpu().long())
            hit, _ = cache.find(wanted, self.step + 1 - spec.max_staleness)
            if not bool(hit.all()):
                self._prefetched.setdefault(name, []).append(
                    self._request(spec, wanted[~hit], self.step + 1)
                )

    def _land_prefetches(self, name: str) -> None:
        """Wait for table ``name``'s prefetches of this step and cache their rows; later
        steps' stay on their way."""
        pending = self._prefetched.pop(name, [])
        cache = self._caches.get(name)
        for pull in (p for p in pending if p.step <= self.step):
            rows, version = pull.wait()
            if cache is not None:
                cache.put(pull.ids, rows, version, self.step)
        later = [p for p in pending if p.step > self.step]
        if later:
            self._prefetched[name] = later

    def _request(self, spec: TableSpec, ids: torch.Tensor, step: int) -> _Pending:
        """Ask each server for its rows of ``ids`` as readable at ``step``; the answer is
        waited for by :meth:`_Pending.wait`."""
        owner = spec.owner(ids)
        local = spec.local_index(ids)
        pending = _Pending(ids, torch.empty(len(ids), spec.dim), step)
        for s in range(spec.servers):
            mask = owner == s
            count = int(mask.sum())
            if count == 0:
                continue
            dst = self.ps.server_rank(s)
            tag = REPLY_TAGS[self._tags % len(REPLY_TAGS)]
            self._tags += 1
            head = Header(Kind.PULL, spec.id, step, count, extra=tag)
            pending.works += self.ps.send(dst, head, [local[mask]])
            version = torch.empty(1, dtype=torch.int64)
            rows = torch.empty(count, spec.dim)
            pending.works.append(self.ps.start_recv(dst, version, tag))
            pending.works.append(self.ps.start_recv(dst, rows, tag))
            pending.pieces.append((mask, version, rows))
        self.traffic.pulls += 1
        self.traffic.rows_pulled += len(ids)
        self.traffic.bytes_pulled += len(ids) * (spec.dim * 4 + 8)
        return pending

    def table(self, name: str) -> torch.Tensor:
        """The whole of table ``name`` as the servers hold it now (every row pulled into this
        worker's memory, past its cache: for inspection and small tables; nothing is recorded
        or trained, and the rows are not counted as read, only as pulled)."""
        spec = self._specs.get(name)
        if spec is None:
            raise ConfigError(
                f"no table {name!r} on the parameter servers; the tables are {sorted(self._specs)}"
            )
        per = spec.rows_per_message
        chunks = [
            self._request(spec, torch.arange(a, min(a + per, spec.rows)), self.step).wait()[0]
            for a in range(0, spec.rows, per)
        ]
        return torch.cat(chunks)

    def save(self, directory: Path) -> None:
        """Have every server write its rows and their optimizer states under ``directory``
        once this step is applied (every worker calls it; worker 0 asks)."""
        self._ask(Kind.SAVE, directory, "save")

    def load(self, directory: Path) -> None:
        """Have every server read its rows and optimizer states from ``directory``, written
        by :meth:`save` under any server count and split (every worker calls it)."""
        if self.ps.rank == 0 and not directory.is_dir():
            error: str | None = (
                f"the checkpoint has no parameter-server tables ({directory} is missing): it "
                "was saved by a job without servers; export tables with "
                "job.parameter_server.export(...) there, or load it into such a job"
            )
        else:
            error = None
        if any(self._prefetched.values()):
            # a sync server answers them after this step's push: waiting here would hang
            error = error or (
                "job.load with rows prefetched for the next step on their way; load before "
                "job.parameter_server.prefetch(...), or after the step it prefetched for"
            )
        agreed = agree(error)
        if agreed is not None:
            raise CheckpointError(agreed)
        self._ask(Kind.LOAD, directory, "load")
        for cache in self._caches.values():
            cache.clear()

    def _ask(self, kind: Kind, directory: Path, verb: str) -> None:
        error = None
        if self.ps.rank == 0:
            text = str(Path(directory).resolve())
            head = Header(kind, step=self.step, count=len(text.encode()))
            errors = request(self.ps, head, text)
            error = "; ".join(errors) if errors else None
        error = agree(error)
        if error is not None:
            raise CheckpointError(f"the parameter servers could not {verb} the tables: {error}")

    def export(self, path: str | os.PathLike[str]) -> Path:
        """Write every table whole to the safetensors file ``path`` as ``<table>.weight``
        (a one-device model with the same tables loads it with ``load_state_dict(...,
        strict=False)``); worker 0 writes, every worker calls it. Returns the path."""
        from safetensors.torch import save_file

        target = Path(path)
        if self.ps.rank == 0:
            save_file({f"{name}.weight": self.table(name) for name in self._specs}, str(target))
        agree(None)  # the file is there when any worker returns
        return target

    def accumulate(self, spec: TableSpec, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Keep a backward's gradients of rows ``ids`` (one per id, repeats included): the
        step's are summed per row and pushed at flush."""
        self._reads.setdefault(spec.name, []).append(_Read(ids, grads))

    def forget(self) -> None:
        """Drop the reads of a step that will not be pushed (a new step begins)."""
        self._reads.clear()

    def flush(self) -> None:
        """Push this step's row gradients of every table to every server (an empty push
        where no row was read: sync servers count one per worker and step)."""
        start = time.perf_counter()
        works: list[Any] = []
        for name, spec in self._specs.items():
            reads = self._reads.get(name, [])
            used = bool(reads)
            ids, grads = _coalesced(reads, spec)
            owner = spec.owner(ids)
            local = spec.local_index(ids)
            for s in range(spec.servers):
                mask = owner == s
                head = Header(Kind.PUSH, spec.id, self.step, int(mask.sum()), extra=int(used))
                works += self.ps.send(self.ps.server_rank(s), head, [local[mask], grads[mask]])
            self.traffic.bytes_pushed += grads.numel() * grads.element_size() + ids.numel() * 8
        wait_all(works)
        self._reads.clear()
        self.step += 1
        self.traffic.steps += 1
        self.traffic.push_s += time.perf_counter() - start


def _coalesced(reads: list[_Read], spec: TableSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's gradients of a table as unique ids and their summed gradients (the padding
    row left out: ``nn.Embedding`` never trains it)."""
    if not reads:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, spec.dim)
    ids = torch.cat([r.ids for r in reads])
    grads = torch.cat([r.grads for r in reads])
    ids, where = torch.unique(ids, return_inverse=True)
    grads = torch.zeros(len(ids), spec.dim).index_add_(0, where, grads)
    if spec.padding_idx is not None:
        keep = ids != spec.padding_idx
        ids, grads = ids[keep], grads[keep]
    return ids, grads


def _checked_ids(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """``ids``, refused by name unless they are integer rows of ``spec``'s table."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise ShardingError(
            f"table {spec.name!r} (on the parameter servers) was given ids of dtype "
            f"{ids.dtype}; give integer ids (torch.long), as nn.Embedding needs"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.rows):
        bad = ids[(ids < 0) | (ids >= spec.rows)][0]
        raise ShardingError(
            f"table {spec.name!r} (on the parameter servers) was given id {int(bad)}, "
            f"outside its rows 0..{spec.rows - 1}; check the batch's ids or the "
            "table's num_embeddings"
        )
    return ids


class _ServerTable(nn.Module):
    """What both table kinds share: ids checked, deduplicated, pulled, recorded."""

    def __init__(self, spec: TableSpec, client: PsClient, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.client = client
        self.device = device
        self.num_embeddings, self.embedding_dim = spec.rows, spec.dim
        self.padding_idx = spec.padding_idx
        # Zero and never changed: it makes a lookup's output need a gradient, so backward
        # (eager or the program's traced one) hands the rows' gradient over (plait.ps.ops).
        self.anchor = nn.Parameter(torch.zeros((), device=device))
        self.handle = register(self)

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.rows}, {s.dim}, on {s.servers} servers ({s.split} split)"

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids``: checked, deduplicated, pulled, gathered (``plait::ps_lookup``)."""
        _checked_ids(self.spec, ids)
        unique, inverse = torch.unique(ids.reshape(-1).cpu().long(), return_inverse=True)
        rows = self.client.pull(self.spec, unique)
        return rows[inverse].view(*ids.shape, self.spec.dim).to(self.device)

    def accumulate(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Keep the gradient of a lookup's rows for the step's push (``plait::ps_grad``)."""
        flat = grad.detach().reshape(-1, self.spec.dim).float().cpu()
        self.client.accumulate(self.spec, ids.reshape(-1).cpu().long(), flat)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.plait.ps_lookup(ids, self.anchor, self.handle, self.spec.dim)
        return out


class ServerEmbedding(_ServerTable):
    """``nn.Embedding`` whose rows live on the parameter servers."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._rows(input)


class ServerEmbeddingBag(_ServerTable):
    """``nn.EmbeddingBag`` whose rows live on the parameter servers: each id's row looked
    up, then bagged as ``nn.EmbeddingBag`` would (the padding id's entries left out)."""

    def __init__(
        self, spec: TableSpec, client: PsClient, device: torch.device, bag: nn.EmbeddingBag
    ) -> None:
        super().__init__(spec, client, device)
        self.mode = bag.mode
        self.include_last_offset = bag.include_last_offset

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = self._rows(input.reshape(-1))
        index = torch.arange(input.numel(), device=input.device).view(input.shape)
        pad = self.spec.padding_idx
        if pad is not None:  # a bag skips the padding id: index one zero row past the rest
            index = torch.where(input == pad, input.numel(), index)
            rows = torch.cat([rows, rows.new_zeros(1, self.spec.dim)])
            pad = input.numel()
        return F.embedding_bag(
            index, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset, padding_idx=pad,
        )  # fmt: skip


def serve_tables(
    model: nn.Module, config: ParallelConfig, ps: PsGroup, device: torch.device
) -> PsClient:
    """Move ``config.server_modules`` of ``model`` to the servers (in place): each checked,
    described to every server, its rows sent by worker 0 (or made there), and replaced by
    its server-backed module. Returns the worker's client."""
    if not config.server_modules:
        raise ConfigError(
            "ParallelConfig(mode='parameter_server') with no table on the servers: mark the "
            "embedding tables with plait.on_server(model.table) or name them in "
            "ParallelConfig(server_modules=('table',))"
        )
    client = PsClient(ps, cache_rows=config.vocab_cache_size)
    for path in config.server_modules:
        module = table_module(model, path)
        spec = _spec(path, module, config, ps)
        weight = None if spec.init_in_server or ps.rank != 0 else module.weight
        client.create(spec, weight)
        if isinstance(module, nn.EmbeddingBag):
            table: nn.Module = ServerEmbeddingBag(spec, client, device, module)
        else:
            table = ServerEmbedding(spec, client, device)
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, table)
        logger.info(
            "parameter server: table %r (%d x %d) on %d servers, %s split, %s",
            path, spec.rows, spec.dim, spec.servers, spec.split,
            "made on the servers" if spec.init_in_server else "sent by worker 0",
        )  # fmt: skip
    return client


def _spec(
    path: str, module: nn.Embedding | nn.EmbeddingBag, config: ParallelConfig, ps: PsGroup
) -> TableSpec:
    mark = getattr(module, "_plait_server", None)
    init_in_server = bool(getattr(mark, "init_in_server", False))
    rows, dim = module.num_embeddings, module.embedding_dim
    check_split(path, rows, ps.servers, config.ps_split)
    if not init_in_server and module.weight.is_meta:
        raise ConfigError(
            f"table {path!r} was built on the meta device, so worker 0 has no rows to send; "
            "make it on the servers with plait.on_server(module, init_in_server=True), or "
            "build it on a real device"
        )
    return TableSpec(
        name=path, rows=rows, dim=dim, servers=ps.servers, split=config.ps_split,
        optimizer=config.server_optimizer, workers=ps.workers, mode=config.ps_mode,
        max_staleness=config.max_staleness, init_in_server=init_in_server,
        seed=int(getattr(mark, "seed", 0)), padding_idx=module.padding_idx,
    )  # fmt: skip
