"""Plans of parameter-server jobs (``mode="parameter_server"``): each table's place on the
servers, what a step moves to and from them, the predicted step, and the placements weighed.

``plait.plan(model, ParallelConfig(mode="parameter_server", devices=W, ...), servers=S,
example_batch=..., loss_fn=...)`` plans what :mod:`plait.ps` runs:

- the dense part: the model with every server table replaced by a stand-in that looks ids up
  in a buffer of the rows a worker pulls (no parameter, no gradient to all-reduce, no optimizer
  state on the worker), planned data parallel over the ``W`` workers as the job runs it;
- each table (:class:`PlannedServerTable`): the rows each server holds (``ps_split``), the
  bytes they take with the server optimizer's states, and per worker step the ids looked up,
  the distinct rows pulled and pushed, the bytes moved and the seconds (pull, push and the
  servers' sparse update) added to the step. Distinct rows are counted on the example batch's
  ids when they are real tensors and the model's dense part is not on the meta device (the
  worker's slice of each micro-batch looked up as the job does); otherwise every id is taken as
  distinct (at most the table's rows), an upper bound the plan's notes name;
- the placements a user could choose instead (``Plan.options``, in ``explain("mesh")``): the
  tables data parallel on the devices (mode ``data_parallel``), sharded by plait's search
  (mode ``auto`` on the same devices), and on the host (``host_modules``: the data-parallel
  step with the tables' states off the device). The notes name the fastest that fits.

The cost of a table's traffic (:func:`table_seconds`): a worker's pulls go to every server at
once and each server answers every worker, so a pull takes the busier end's bytes over the
link (a server sends ``W / S`` workers' shares) plus one round trip; a push the same the other
way; each round trip waits for its peer once (the profile's ``wait_latency``, what a transfer
between processes computing between transfers waits beyond its bytes); in sync mode each
server then applies the step's pushed rows (reading and writing each row with its optimizer
states once) at host memory bandwidth. The link is the profile's
intra-node link when workers and servers fit on one node, else the inter-node link.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from plait.annotate.marks import server_marks
from plait.config import ParallelConfig, parameter_server_defaults
from plait.cost.hardware import HardwareProfile
from plait.cost.link import Link
from plait.data import split_micro_batches
from plait.errors import ConfigError
from plait.graph import OpGraph
from plait.planning.entries import PlannedServerTable, PlanOption
from plait.planning.records import Plan
from plait.ps.table import check_split, table_module

__all__ = [
    "HOST_BANDWIDTH",
    "PlannedServerTable",
    "mesh_of_auto",
    "placement_options",
    "ps_config_for",
    "servable_tables",
    "server_tables",
    "stand_in_tables",
    "table_seconds",
    "weigh_servers",
]

HOST_BANDWIDTH = 10e9
"""Bytes a second a server's sparse optimizer reads and writes rows at (one host core's share
of memory bandwidth, measured order on this machine's CPU; the device profile describes the
accelerator, not the server's host)."""

ID_BYTES = 8
"""Bytes of one row id on the wire (int64)."""

_STATES = {"sgd": 0, "adagrad": 1, "adam": 2}
"""Optimizer states a row keeps on its server (each the row's size)."""


@dataclass(frozen=True, slots=True)
class _Table:
    """What planning reads of one server table before it is replaced."""

    path: str
    rows: int
    dim: int
    itemsize: int
    bag: bool


class _PulledRows(nn.Module):
    """A server table as the dense part's plan sees it: ids looked up in a buffer of the rows a
    worker pulls (no parameter, so no gradient to reduce and no optimizer state on the worker)."""

    def __init__(self, table: nn.Embedding | nn.EmbeddingBag, *, pulled: int) -> None:
        super().__init__()
        self.bag = isinstance(table, nn.EmbeddingBag)
        self.mode = getattr(table, "mode", "mean")
        self.include_last_offset = getattr(table, "include_last_offset", False)
        weight = table.weight
        self.register_buffer(
            "pulled", torch.empty(max(pulled, 1), table.embedding_dim, dtype=weight.dtype,
                                  device="meta"),
        )  # fmt: skip

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = cast(torch.Tensor, self.pulled)
        if not self.bag:
            return F.embedding(input, rows)
        return F.embedding_bag(
            input, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )  # fmt: skip


class _CountIds(nn.Module):
    """A table replaced while the example batch runs: it records the ids it is given and
    returns zeros of the table's output (the dense part's values do not matter)."""

    def __init__(self, table: nn.Embedding | nn.EmbeddingBag, seen: list[torch.Tensor]) -> None:
        super().__init__()
        self.table, self.seen = table, seen

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.seen.append(input.detach().reshape(-1).long())
        out = F.embedding if isinstance(self.table, nn.Embedding) else F.embedding_bag
        weight = torch.zeros(self.table.num_embeddings, self.table.embedding_dim)
        return out(torch.zeros_like(input), weight, *args, **kwargs)  # type: ignore[operator]


def server_table_paths(model: nn.Module, config: ParallelConfig) -> tuple[str, ...]:
    """The tables a parameter-server job puts on its servers: ``server_modules`` and the
    modules ``plait.on_server`` marks (ConfigError when there are none)."""
    paths = tuple(dict.fromkeys((*config.server_modules, *server_marks(model))))
    if not paths:
        raise ConfigError(
            "ParallelConfig(mode='parameter_server') with no table on the servers: mark the "
            "embedding tables with plait.on_server(model.table) or name them in "
            "ParallelConfig(server_modules=('table',))"
        )
    return paths


def read_tables(model: nn.Module, paths: Sequence[str], servers: int, split: str) -> list[_Table]:
    """Each table checked as ``parallelize`` checks it (an embedding module, a split the server
    count allows)."""
    out = []
    for path in paths:
        module = table_module(model, path)
        check_split(path, module.num_embeddings, servers, split)
        out.append(
            _Table(path, module.num_embeddings, module.embedding_dim,
                   module.weight.element_size(), isinstance(module, nn.EmbeddingBag))
        )  # fmt: skip
    return out


@contextlib.contextmanager
def replaced(model: nn.Module, make: Mapping[str, Callable[[Any], nn.Module]]) -> Iterator[None]:
    """``model`` with the module at each path replaced by ``make[path](module)``, put back
    after (the user's model is theirs)."""
    originals: dict[str, nn.Module] = {}
    try:
        for path, build in make.items():
            module = model.get_submodule(path)
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, build(module))
            originals[path] = module
        yield
    finally:
        for path, module in originals.items():
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, module)


@contextlib.contextmanager
def on_meta(model: nn.Module) -> Iterator[None]:
    """``model``'s parameters and buffers as meta tensors of their shapes while planning reads
    it (capture reads shapes only; a model with its tables on meta and its dense part real
    traces on one device), put back after. A tensor shared by several modules stays shared."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    metas: dict[int, Any] = {}
    try:
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if t is None or t.is_meta:
                        continue
                    if id(t) not in metas:
                        meta = torch.empty_like(t, device="meta")
                        if isinstance(t, nn.Parameter):
                            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
                        metas[id(t)] = meta
                    swapped.append((store, name, t))
                    store[name] = metas[id(t)]
        yield
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t


def ids_per_micro_batch(graph: OpGraph, tables: Sequence[_Table]) -> dict[str, int]:
    """Ids each table's lookups read in one (global) micro-batch, from the captured graph."""
    weights = {f"{t.path}.weight": t.path for t in tables}
    counts = dict.fromkeys(weights.values(), 0)
    for op in graph.ops:
        for name in op.params:
            if name in weights and len(op.input_metas) > 1:
                counts[weights[name]] += _numel(op.input_metas[1].shape)
    return counts


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _countable(model: nn.Module, paths: Sequence[str], batch: Any) -> bool:
    """Whether the example batch can run for real: real tensors in it, and no meta tensor in
    the model outside the tables."""
    leaves = torch.utils._pytree.tree_leaves(batch)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors or any(x.is_meta or type(x) is not torch.Tensor for x in tensors):
        return False
    inside = tuple(f"{p}." for p in paths)
    states = [*model.named_parameters(), *model.named_buffers()]
    return not any(t.is_meta for n, t in states if not n.startswith(inside))


def distinct_rows(
    model: nn.Module,
    tables: Sequence[_Table],
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    workers: int,
    micro: int,
) -> dict[str, tuple[int, int]] | None:
    """Per table, (rows pulled, rows pushed) a step by the busiest worker: the example batch
    cut as the job cuts it (a worker's slice, then its micro-batches) and each slice's ids
    deduplicated. None when the batch cannot run (:func:`_countable`)."""
    paths = [t.path for t in tables]
    if not _countable(model, paths, batch):
        return None
    seen: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    worst = dict.fromkeys(paths, (0, 0))
    builders = {p: (lambda m, p=p: _CountIds(m, seen[p])) for p in paths}
    with replaced(model, builders), torch.no_grad():
        for part in split_micro_batches(batch, workers):
            pulled = dict.fromkeys(paths, 0)
            step: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
            for mb in split_micro_batches(part, micro):
                for p in paths:
                    seen[p].clear()
                model(mb) if loss_fn is None else loss_fn(model, mb)
                for p in paths:
                    ids = torch.cat(seen[p]) if seen[p] else torch.empty(0, dtype=torch.long)
                    pulled[p] += int(ids.unique().numel())
                    step[p].append(ids)
            for p in paths:
                pushed = int(torch.cat(step[p]).unique().numel()) if step[p] else 0
                worst[p] = max(worst[p], (pulled[p], pushed))
    return worst


def table_seconds(
    *, pull_bytes: int, push_bytes: int, pulls: int, workers: int, servers: int,
    applied_rows: int, row_bytes: int, states: int, link: Link, sync: bool,
    wait_latency: float = 0.0,
) -> float:  # fmt: skip
    """Seconds a table adds to a worker's step (the module docstring's model): ``pulls``
    round trips of ``pull_bytes`` in all, one push of ``push_bytes``, each at the busier end
    (a server serves ``workers / servers`` workers' shares) and each waiting for its peer
    once (``wait_latency``, the profile's: a transfer between processes that compute between
    transfers), and in sync mode the busiest server's update of ``applied_rows`` rows of
    ``row_bytes`` with ``states`` optimizer states."""
    share = max(1.0, workers / servers)
    trips = pulls + 1
    wire = (pull_bytes + push_bytes) * share / link.bandwidth
    latency = trips * (2 * link.latency + link.overhead + wait_latency)
    update = applied_rows * row_bytes * (2 * (1 + states) + 1) / HOST_BANDWIDTH if sync else 0.0
    return wire + latency + update


def server_tables(
    tables: Sequence[_Table],
    config: ParallelConfig,
    *,
    servers: int,
    workers: int,
    ids: Mapping[str, int],
    counted: Mapping[str, tuple[int, int]] | None,
    hardware: HardwareProfile,
) -> tuple[PlannedServerTable, ...]:
    """Each table's :class:`PlannedServerTable` (``ids``: a global micro-batch's ids per
    table; ``counted``: :func:`distinct_rows`, or None for the bound)."""
    micro = config.grad_accumulation
    one_node = workers + servers <= hardware.devices_per_node
    link = hardware.intra_node if one_node else hardware.inter_node
    states = _STATES[config.server_optimizer.kind]
    out = []
    for t in tables:
        per_micro = -(-ids[t.path] // workers)
        if counted is not None:
            pulled, pushed = counted[t.path]
        else:
            pulled = micro * min(per_micro, t.rows)
            pushed = min(micro * per_micro, t.rows)
        row = t.dim * t.itemsize
        held = [len(range(s, t.rows, servers)) for s in range(servers)]
        if config.ps_split == "range":
            held = [t.rows // servers] * servers
        pull_bytes = pulled * (ID_BYTES + row)
        push_bytes = pushed * (ID_BYTES + row)
        applied = min(t.rows // servers + 1, -(-pushed * workers // servers))
        seconds = table_seconds(
            pull_bytes=pull_bytes, push_bytes=push_bytes, pulls=micro, workers=workers,
            servers=servers, applied_rows=applied, row_bytes=row, states=states, link=link,
            sync=config.ps_mode == "sync", wait_latency=hardware.wait_latency,
        )  # fmt: skip
        out.append(
            PlannedServerTable(
                name=t.path, rows=t.rows, dim=t.dim, split=config.ps_split,
                rows_per_server=tuple(held), server_bytes=max(held) * row * (1 + states),
                ids_per_step=micro * per_micro, pulled_rows=pulled, pushed_rows=pushed,
                measured=counted is not None, pull_bytes=pull_bytes, push_bytes=push_bytes,
                seconds=seconds,
            )
        )  # fmt: skip
    return tuple(out)


def stand_in_tables(
    tables: Sequence[_Table], planned: Sequence[PlannedServerTable], micro: int
) -> dict[str, Callable[[Any], nn.Module]]:
    """Builders of each table's stand-in for the dense part's capture (a micro-batch's rows)."""
    rows = {p.name: -(-p.pulled_rows // micro) for p in planned}
    return {t.path: functools.partial(_PulledRows, pulled=rows[t.path]) for t in tables}


def placement_options(
    ps_plan: Plan,
    *,
    data_parallel: Plan,
    auto: Plan,
    table_state_bytes: int,
    servers: int,
    limit: int,
) -> tuple[tuple[PlanOption, ...], str]:
    """The placements weighed (tables on the servers, data parallel, sharded by the search, on
    the host) as plan options, fastest first, and the note naming the fastest that fits."""

    def option(plan: Plan, memory: int, note: str) -> PlanOption:
        return PlanOption(
            mesh=plan.mesh.as_dict(), micro_batches=plan.micro_batches,
            optimizer_shard=plan.optimizer_shard, recompute=plan.recompute,
            step_time_s=plan.predicted.step_time_s, memory_bytes=memory,
            feasible=memory <= limit, note=note,
        )  # fmt: skip

    dp_memory = data_parallel.predicted.memory_bytes
    options = [
        option(ps_plan, ps_plan.predicted.memory_bytes, f"tables on {servers} servers (this plan)"),
        option(data_parallel, dp_memory, "tables data parallel on the devices"),
        option(auto, auto.predicted.memory_bytes, "tables as mode 'auto' shards them"),
        option(
            data_parallel,
            max(0, dp_memory - table_state_bytes),
            "tables on the host (host_modules: their gradients still all-reduced)",
        ),
    ]
    options.sort(key=lambda o: (not o.feasible, o.step_time_s if o.feasible else o.memory_bytes))
    best = options[0]
    mine = next(o for o in options if o.note.endswith("(this plan)"))
    if best is mine:
        note = (
            f"tables on {servers} servers is the fastest placement that fits: "
            f"{_ms(mine.step_time_s)} a step against {_ms(options[1].step_time_s)} for the next "
            f"({options[1].note})"
        )
    else:
        note = (
            f"faster than the servers ({_ms(mine.step_time_s)} a step): {best.note}, "
            f"{_ms(best.step_time_s)} predicted; consider it (plan.explain('mesh') lists all)"
        )
    return tuple(options), note


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def dense_config(config: ParallelConfig) -> ParallelConfig:
    """The config the dense part is planned under: mode data_parallel, the parameter-server
    fields at their defaults."""
    return dataclasses.replace(config, mode="data_parallel", **parameter_server_defaults())


def check_servers(config: ParallelConfig, servers: object) -> None:
    """ConfigError unless ``servers`` and ``config.mode`` agree: a server count >= 1 exactly
    when the mode is ``parameter_server``."""
    if config.mode not in ("parameter_server", "auto"):
        raise ConfigError(
            f"plait.plan(servers={servers!r}) with mode={config.mode!r} would do nothing: servers "
            "hold embedding tables in mode='parameter_server' (and mode='auto' weighs them); "
            "give one of those modes or leave servers out"
        )
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ConfigError(
            f"plait.plan(mode={config.mode!r}, servers={servers!r}): give the server ranks "
            "the job runs beside its workers as an int >= 1 (plait run --server-num S, "
            "PLAIT_SERVER_NUM), e.g. servers=2"
        )


def server_plan(
    dense: Plan,
    config: ParallelConfig,
    *,
    servers: int,
    tables: Sequence[PlannedServerTable],
    counted: bool,
    data_parallel: Plan,
    auto: Plan,
    table_states: int,
    limit: int,
) -> Plan:
    """The parameter-server plan: ``dense`` (the dense part, data parallel) with the tables'
    seconds on its step, its mode, servers and tables, and the placements weighed."""
    extra = sum(t.seconds for t in tables)
    p = dense.predicted
    predicted = dataclasses.replace(
        p, step_time_s=p.step_time_s + extra, communication_s=p.communication_s + extra
    )
    ps_plan = dataclasses.replace(
        dense, mode="parameter_server", servers=servers, server_tables=tuple(tables),
        predicted=predicted, options=(), notes=(),
    )  # fmt: skip
    options, verdict = placement_options(
        ps_plan, data_parallel=data_parallel, auto=auto, table_state_bytes=table_states,
        servers=servers, limit=limit,
    )  # fmt: skip
    rows = (
        "distinct rows counted on the example batch's ids (each worker's slice and micro-batch)"
        if counted
        else "distinct rows not counted (the example batch or the dense part is on the meta "
        "device, or holds no real tensor): every id taken as distinct, an upper bound on the "
        "traffic; plan with a real batch for the rows a step really reads"
    )
    notes: tuple[str, ...] = (
        f"{len(tables)} table{'s' if len(tables) > 1 else ''} on {servers} parameter server"
        f"{'s' if servers > 1 else ''} ({config.ps_split} split, {config.ps_mode} mode, "
        f"{config.server_optimizer.kind} on the servers): {_ms(extra)} of the step is their "
        "pulls, pushes and the servers' update; the dense part trains data parallel",
        rows,
        verdict,
    )
    if config.vocab_cache_size:
        notes += (
            f"vocab_cache_size={config.vocab_cache_size}: the cache is not priced (every row a "
            "step reads is counted as pulled)",
        )
    if config.ps_mode == "async":
        notes += (
            "async: the servers' update is off the worker's step (applied as pushes come); "
            "pulls and pushes are still on it",
        )
    return dataclasses.replace(ps_plan, options=options, notes=notes)


def servable_tables(model: nn.Module, servers: int) -> tuple[tuple[str, ...], str]:
    """Mode auto with servers: every embedding table of ``model`` a server could hold (the
    checks :func:`~plait.ps.table.table_module` makes), and the split: "range" where the
    server count divides every table's rows, else "hash"."""
    paths: list[tuple[str, int]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Embedding | nn.EmbeddingBag):
            continue
        try:
            table_module(model, name)
        except ConfigError:
            continue  # tied, max_norm, a subclass's own forward: stays on the devices
        paths.append((name, module.num_embeddings))
    if not paths:
        raise ConfigError(
            f"plait.plan(mode='auto', servers={servers}): {type(model).__name__} has no "
            "nn.Embedding or nn.EmbeddingBag a parameter server can hold (untied, without "
            "max_norm or scale_grad_by_freq); leave servers out"
        )
    split = "range" if all(rows % servers == 0 for _, rows in paths) else "hash"
    return tuple(name for name, _ in paths), split


def mesh_of_auto(config: ParallelConfig) -> int:
    """The workers of mode auto's config: its ``devices``, or its mesh's size."""
    if config.devices is not None:
        return int(config.devices)
    if config.mesh is not None:
        return math.prod(config.mesh_dict.values())
    raise ConfigError(
        "plait.plan(mode='auto', servers=S) needs ParallelConfig(devices=N) (or a mesh): the "
        "workers beside the servers"
    )


def ps_config_for(
    config: ParallelConfig, workers: int, tables: Sequence[str], split: str
) -> ParallelConfig:
    """The parameter-server config mode auto weighs: ``tables`` on the servers, the dense part
    data parallel over ``workers`` with the auto config's precision, hardware, memory limit,
    gradient accumulation and dataset strategy."""
    return ParallelConfig(
        mode="parameter_server", devices=workers, server_modules=tuple(tables),
        ps_split=split,  # type: ignore[arg-type]
        precision=config.precision, hardware=config.hardware, memory_limit=config.memory_limit,
        grad_accumulation=config.grad_accumulation, dp_axis=config.dp_axis,
        dataset_strategy=config.dataset_strategy,
    )  # fmt: skip


def weigh_servers(auto: Plan, ps_plan: Plan, servers: int, limit: int) -> Plan:
    """The faster of mode auto's plan and the parameter-server plan among those whose memory
    fits ``limit`` (when neither fits, the smaller), its notes saying what the other takes."""

    def key(p: Plan) -> tuple[bool, float]:
        fits = p.predicted.memory_bytes <= limit
        return (not fits, p.predicted.step_time_s if fits else p.predicted.memory_bytes)

    winner = min((auto, ps_plan), key=key)
    tables = ", ".join(t.name for t in ps_plan.server_tables)
    weighed = (
        f"mode auto weighed {tables} on {servers} parameter servers: "
        f"{_ms(ps_plan.predicted.step_time_s)} a step against {_ms(auto.predicted.step_time_s)} "
        f"for its best plan on the devices (mesh {auto.mesh.as_dict()})"
    )
    if winner is ps_plan:
        names = tuple(t.name for t in ps_plan.server_tables)
        note = (
            f"{weighed}: the servers win; run it with ParallelConfig(mode='parameter_server', "
            f"server_modules={names!r}) and plait run --server-num {servers}"
        )
    else:
        note = f"{weighed}: the tables stay on the devices"
    return dataclasses.replace(winner, notes=(*winner.notes, note))
