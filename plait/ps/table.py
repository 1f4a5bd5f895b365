"""A server-held table: its spec, how its rows are split over servers, its initial rows.

Row ``i`` of a table of ``R`` rows on ``S`` servers lives on

- ``"range"`` split: server ``i // (R / S)``, local row ``i % (R / S)`` (``S`` divides ``R``);
- ``"hash"`` split: server ``i % S``, local row ``i // S`` (server ``s`` holds rows
  ``s, s + S, s + 2S, ...``: consecutive hot ids land on different servers).

Initial rows made on the servers (``plait.on_server(..., init_in_server=True)``) are
``nn.Embedding``'s default, N(0, 1), drawn block by block of :data:`INIT_BLOCK` rows, block
``b`` from a generator seeded by ``(seed, b)`` (:func:`block_seed`): the table is the same whatever the server
count, and :func:`initial_table` builds it whole for one device.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from plait.config import SparseOptimizer
from plait.errors import ConfigError

__all__ = [
    "INIT_BLOCK",
    "TableSpec",
    "check_split",
    "initial_rows",
    "initial_table",
    "sparse_optimizer",
    "table_id",
    "table_module",
]

INIT_BLOCK = 4096
"""Rows drawn from one generator when a server initialises its rows."""

ROWS_MESSAGE_VALUES = 1 << 24
"""Most values in one message of whole-table rows (64 MiB of fp32): worker 0's initial rows,
a whole table read back."""


def table_id(name: str) -> int:
    """The id a table's messages carry (from its module path, the same on every rank)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class TableSpec:
    """What a server needs to hold one table (sent pickled by every worker)."""

    name: str
    """The table module's path in the model."""
    rows: int
    dim: int
    servers: int
    split: Literal["range", "hash"]
    optimizer: SparseOptimizer
    workers: int
    mode: Literal["sync", "async"]
    max_staleness: int
    init_in_server: bool
    seed: int
    padding_idx: int | None

    @property
    def id(self) -> int:
        return table_id(self.name)

    @property
    def rows_per_message(self) -> int:
        """Most rows one message carries (:data:`ROWS_MESSAGE_VALUES` values)."""
        return max(1, ROWS_MESSAGE_VALUES // max(self.dim, 1))

    def local_rows(self, server: int) -> int:
        """How many rows server ``server`` holds."""
        if self.split == "range":
            return self.rows // self.servers
        return len(range(server, self.rows, self.servers))

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The server of each global row id."""
        if self.split == "range":
            return torch.div(ids, self.rows // self.servers, rounding_mode="floor")
        return torch.remainder(ids, self.servers)

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Each global row id's index on its server."""
        if self.split == "range":
            return torch.remainder(ids, self.rows // self.servers)
        return torch.div(ids, self.servers, rounding_mode="floor")

    def global_ids(self, server: int) -> torch.Tensor:
        """The global ids of server ``server``'s rows, in local order."""
        if self.split == "range":
            per = self.rows // self.servers
            return torch.arange(server * per, (server + 1) * per)
        return torch.arange(server, self.rows, self.servers)


def table_module(model: nn.Module, path: str) -> nn.Embedding | nn.EmbeddingBag:
    """The table module at ``path`` of ``model``: an ``nn.Embedding`` or ``nn.EmbeddingBag``
    a server can hold (ConfigError naming the path and the rule otherwise)."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise ConfigError(
            f"ParallelConfig.server_modules names {path!r}, which is not a module of "
            f"{type(model).__name__}; name a module path as model.named_modules() gives it"
        ) from None
    if type(module).forward not in (nn.Embedding.forward, nn.EmbeddingBag.forward):
        raise ConfigError(
            f"{path!r} ({type(module).__name__}) cannot live on the parameter servers: only "
            "nn.Embedding and nn.EmbeddingBag tables can (a worker pulls the rows its ids "
            "name); keep it on the workers, or on the host with plait.on_host"
        )
    table: nn.Embedding | nn.EmbeddingBag = module  # type: ignore[assignment]
    for attr, off in (("max_norm", None), ("scale_grad_by_freq", False)):
        if getattr(table, attr) != off:
            raise ConfigError(
                f"{path!r} has {attr}={getattr(table, attr)!r}, which a server-held table "
                f"cannot honour yet (it would renormalise or rescale rows across workers); "
                f"build it with {attr}={off!r} or keep it on the workers"
            )
    shared = [
        n
        for n, p in model.named_parameters(remove_duplicate=False)
        if p is table.weight and not n.startswith(f"{path}.")
    ]
    if shared:
        raise ConfigError(
            f"{path!r}'s weight is also {shared[0]!r} (a tied weight); a server-held table is "
            "read by id only, so it cannot be shared with a dense layer; untie them or keep "
            "the table on the workers"
        )
    return table


def check_split(path: str, rows: int, servers: int, split: str) -> None:
    """ConfigError unless ``servers`` can split a table of ``rows`` rows as ``split`` says."""
    if split == "range" and rows % servers:
        raise ConfigError(
            f"table {path!r} has {rows} rows, which {servers} servers cannot split in equal "
            f"ranges (ps_split='range'); use ParallelConfig(ps_split='hash'), or a server "
            "count that divides the rows"
        )


def initial_rows(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """The initial values of rows ``ids`` (global ids, ascending) of a table made on its servers."""
    out = torch.empty(len(ids), spec.dim)
    if len(ids) == 0:
        return out
    first, last = int(ids[0]) // INIT_BLOCK, int(ids[-1]) // INIT_BLOCK
    edges = torch.searchsorted(ids, torch.arange(first, last + 2) * INIT_BLOCK).tolist()
    for b in range(first, last + 1):
        lo, hi = edges[b - first], edges[b - first + 1]
        if lo == hi:
            continue
        start = b * INIT_BLOCK
        generator = torch.Generator().manual_seed(block_seed(spec.seed, b))
        block = torch.randn(min(INIT_BLOCK, spec.rows - start), spec.dim, generator=generator)
        out[lo:hi] = block[ids[lo:hi] - start]
    if spec.padding_idx is not None:
        out[ids == spec.padding_idx] = 0.0
    return out


def block_seed(seed: int, block: int) -> int:
    """The generator seed of init block ``block`` of a table seeded ``seed``: 32 bits, as
    torch's CPU generator keeps (Knuth's multiplicative hash of the seed, plus the block)."""
    return (seed * 0x9E3779B1 + block) & 0xFFFFFFFF


def initial_table(
    rows: int, dim: int, *, seed: int = 0, padding_idx: int | None = None
) -> torch.Tensor:
    """The whole table ``plait.on_server(..., init_in_server=True, seed=seed)`` starts from
    (for a one-device run to compare with, or to inspect)."""
    spec = TableSpec(
        name="", rows=rows, dim=dim, servers=1, split="range", optimizer=SparseOptimizer(),
        workers=1, mode="sync", max_staleness=0, init_in_server=True, seed=seed,
        padding_idx=padding_idx,
    )  # fmt: skip
    return initial_rows(spec, torch.arange(rows))


def sparse_optimizer(
    config: SparseOptimizer, params: list[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """Torch's optimizer of ``config.kind`` over ``params`` (a server's rows; on one device,
    an ``nn.Embedding(..., sparse=True)`` table's weight: the same update)."""
    if config.kind == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    if config.kind == "adagrad":
        return torch.optim.Adagrad(
            params, lr=config.lr, lr_decay=config.lr_decay, eps=config.eps,
            initial_accumulator_value=config.initial_accumulator_value,
        )  # fmt: skip
    return torch.optim.SparseAdam(params, lr=config.lr, betas=config.betas, eps=config.eps)
