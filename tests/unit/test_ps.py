"""Parameter-server pieces without processes: table splits, rows made on servers, the
checks a table and a config meet before anything is sent, the launcher's roles."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from torch import nn

import plait
from plait import ConfigError, ParallelConfig, ShardingError, SparseOptimizer
from plait.errors import LaunchError
from plait.launch.command import add_run_arguments, config_from_args
from plait.launch.config import RunConfig
from plait.launch.environment import LauncherKind, ProcessEnv
from plait.launch.runner import worker_command
from plait.launch.world import ServerRoles, server_count, server_roles
from plait.ps.table import TableSpec, initial_rows, initial_table, table_module
from plait.ps.worker import PsClient, ServerEmbedding, _spec


def _spec_of(rows: int = 10, servers: int = 3, split: str = "hash", **kw) -> TableSpec:
    fields = dict(
        name="t",
        rows=rows,
        dim=4,
        servers=servers,
        split=split,
        optimizer=SparseOptimizer(),
        workers=2,
        mode="sync",
        max_staleness=0,
        init_in_server=True,
        seed=5,
        padding_idx=None,
    )
    fields.update(kw)
    return TableSpec(**fields)


@pytest.mark.parametrize(("split", "rows", "servers"), [("hash", 10, 3), ("range", 12, 3)])
def test_every_row_has_one_server_and_one_local_index(split, rows, servers):
    spec = _spec_of(rows, servers, split)
    seen = torch.cat([spec.global_ids(s) for s in range(servers)])
    assert sorted(seen.tolist()) == list(range(rows))
    for s in range(servers):
        ids = spec.global_ids(s)
        assert len(ids) == spec.local_rows(s)
        assert (spec.owner(ids) == s).all()
        assert spec.local_index(ids).tolist() == list(range(len(ids)))


def test_rows_made_on_servers_do_not_depend_on_the_server_count():
    whole = initial_table(9000, 4, seed=5, padding_idx=7)  # three init blocks
    assert whole[7].abs().sum() == 0 and whole[8].abs().sum() > 0
    for servers in (1, 2, 3):
        spec = _spec_of(9000, servers, padding_idx=7)
        for s in range(servers):
            ids = spec.global_ids(s)
            assert torch.equal(initial_rows(spec, ids), whole[ids])
    assert not torch.equal(initial_table(9000, 4, seed=6), initial_table(9000, 4, seed=5))


def test_parameter_server_fields_elsewhere_would_do_nothing():
    with pytest.raises(
        ConfigError, match=r"server_modules=\('emb',\)\) with mode='data_parallel' would do nothing"
    ):
        ParallelConfig(server_modules=("emb",))
    with pytest.raises(ConfigError, match=r"ps_mode='async'.*would do nothing"):
        ParallelConfig(ps_mode="async")
    with pytest.raises(ConfigError, match=r"max_staleness=2.*ps_mode='sync' would do nothing"):
        ParallelConfig(mode="parameter_server", max_staleness=2)
    with pytest.raises(ConfigError, match=r"max_staleness=-1"):
        ParallelConfig(mode="parameter_server", ps_mode="async", max_staleness=-1)
    with pytest.raises(ConfigError, match=r"ps_split='rows' is not allowed"):
        ParallelConfig(mode="parameter_server", ps_split="rows")


def test_sparse_optimizer_is_checked_and_read_from_a_dict():
    cfg = ParallelConfig(mode="parameter_server", server_optimizer={"kind": "sgd", "lr": 0.5})
    assert cfg.server_optimizer == SparseOptimizer(kind="sgd", lr=0.5)
    with pytest.raises(ConfigError, match=r"'sgd' has no betas"):
        SparseOptimizer(kind="sgd", betas=(0.5, 0.5))
    with pytest.raises(ConfigError, match=r"SparseOptimizer.kind='lamb' is not allowed"):
        SparseOptimizer(kind="lamb")
    with pytest.raises(ConfigError, match=r"lr=0"):
        SparseOptimizer(lr=0)
    with pytest.raises(ConfigError, match=r"give a plait.SparseOptimizer"):
        ParallelConfig(mode="parameter_server", server_optimizer="adam")
    with pytest.raises(ConfigError, match=r"did you mean|mode='parameter_server'"):
        ParallelConfig(parameter_server=True)


class _NoSends:
    """A worker-and-server group that fails the test if anything is sent."""

    rank, workers, servers = 0, 2, 3

    def send(self, *args, **kwargs):
        raise AssertionError("sent a message before refusing bad input")

    def server_rank(self, s):
        return 2 + s


def test_ids_out_of_range_are_refused_before_anything_is_sent():
    table = ServerEmbedding(_spec_of(10, 3), PsClient(_NoSends()), torch.device("cpu"))
    with pytest.raises(ShardingError, match=r"table 't'.*given id 10, outside its rows 0..9"):
        table(torch.tensor([1, 10, 2]))
    with pytest.raises(ShardingError, match=r"given id -1"):
        table(torch.tensor([-1]))
    with pytest.raises(ShardingError, match=r"ids of dtype torch.float32"):
        table(torch.tensor([1.0]))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 10)
        self.norm = nn.Embedding(10, 4, max_norm=1.0)


def test_only_plain_embedding_tables_go_to_servers():
    model = _Model()
    with pytest.raises(ConfigError, match=r"'fc' \(Linear\) cannot live on the parameter servers"):
        table_module(model, "fc")
    with pytest.raises(ConfigError, match=r"'nope', which is not a module of _Model"):
        table_module(model, "nope")
    with pytest.raises(ConfigError, match=r"max_norm=1.0"):
        table_module(model, "norm")
    model.fc.weight = model.emb.weight  # tied: [10, 4] both
    with pytest.raises(ConfigError, match=r"also 'fc.weight' \(a tied weight\)"):
        table_module(model, "emb")


def test_range_split_needs_a_server_count_dividing_the_rows_and_meta_tables_init_on_servers():
    model = _Model()
    cfg = ParallelConfig(mode="parameter_server")
    with pytest.raises(
        ConfigError, match=r"10 rows, which 3 servers cannot split.*ps_split='hash'"
    ):
        _spec("emb", model.emb, cfg, _NoSends())
    hashed = dataclasses.replace(cfg, ps_split="hash")
    assert _spec("emb", model.emb, hashed, _NoSends()).servers == 3
    meta = nn.Embedding(10, 4, device="meta")
    with pytest.raises(ConfigError, match=r"meta device.*init_in_server=True"):
        _spec("emb", meta, hashed, _NoSends())
    plait.on_server(meta, init_in_server=True, seed=9)
    spec = _spec("emb", meta, hashed, _NoSends())
    assert spec.init_in_server and spec.seed == 9


def test_a_server_mark_outside_parameter_server_mode_is_refused():
    from plait.runtime.parallelize import _with_model_marks

    model = _Model()
    plait.on_server(model.emb)
    with pytest.raises(ConfigError, match=r"on_server marks 'emb'.*would do nothing"):
        _with_model_marks(model, ParallelConfig())
    cfg = _with_model_marks(model, ParallelConfig(mode="parameter_server"))
    assert cfg.server_modules == ("emb",)
    plait.on_server(model.emb, server=False)
    assert _with_model_marks(model, ParallelConfig()).server_modules == ()


def _run_args(*argv: str) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return config_from_args(parser.parse_args([*argv, "train.py"]))


def test_plait_run_starts_servers_after_the_workers_and_tells_them():
    cfg = _run_args("--worker-num", "4", "--server-num", "2")
    assert (cfg.worker_num, cfg.local_worker_num, cfg.server_num) == (6, 6, 2)
    _, args = worker_command(cfg)
    assert "PLAIT_SERVER_NUM=2" in args and "PLAIT_LOCAL_SERVER_NUM=2" in args
    # several nodes: each starts its share of the servers after its workers
    cfg = _run_args("--nnodes", "2", "--local-worker-num", "3", "--server-num", "4")
    assert (cfg.worker_num, cfg.local_worker_num, cfg.server_num) == (10, 5, 4)
    assert cfg.local_server_num == 2 and cfg.num_nodes == 2
    _, args = worker_command(cfg)
    assert "PLAIT_LOCAL_SERVER_NUM=2" in args
    with pytest.raises(LaunchError, match=r"--server-num 3 over 2 nodes.*multiple of 2"):
        _run_args("--nnodes", "2", "--local-worker-num", "2", "--server-num", "3")
    with pytest.raises(LaunchError, match=r"elastic --nnodes 1:2.*fixed --nnodes N"):
        _run_args("--nnodes", "1:2", "--local-worker-num", "2", "--server-num", "2")
    with pytest.raises(LaunchError, match=r"--server-num -1 must be >= 0"):
        _run_args("--worker-num", "2", "--server-num", "-1")


def _penv(rank: int, world_size: int = 6, local_world_size: int = 3) -> ProcessEnv:
    return ProcessEnv(
        launcher=LauncherKind.TORCHRUN, rank=rank, world_size=world_size,
        local_rank=rank % local_world_size, local_world_size=local_world_size,
        node_rank=rank // local_world_size, master_addr="127.0.0.1", master_port=29500,
        device_index=rank % local_world_size,
    )  # fmt: skip


def test_server_roles_on_several_nodes(monkeypatch):
    """Two nodes of 2 workers + 1 server: ranks 0 1 [2] | 3 4 [5]; workers numbered 0-3 in
    rank order, servers 4-5; a worker sees the workers' world alone."""
    monkeypatch.setenv("PLAIT_SERVER_NUM", "2")
    monkeypatch.setenv("PLAIT_LOCAL_SERVER_NUM", "1")
    roles = [server_roles(_penv(r)) for r in range(6)]
    assert all(r == ServerRoles(2, 1, 3) for r in roles)
    assert [roles[r].serves(_penv(r)) for r in range(6)] == [False, False, True] * 2
    assert [roles[r].ps_rank(_penv(r)) for r in range(6)] == [0, 1, 4, 2, 3, 5]
    env = roles[3].worker_env(_penv(3))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (2, 4, 0, 2)
    monkeypatch.delenv("PLAIT_LOCAL_SERVER_NUM")  # the job's last ranks serve
    last = server_roles(_penv(4))
    assert last is not None and last.serves(_penv(4)) and not last.serves(_penv(3))
    monkeypatch.setenv("PLAIT_LOCAL_SERVER_NUM", "2")  # 2 a node x 2 nodes is not 2
    with pytest.raises(LaunchError, match=r"PLAIT_LOCAL_SERVER_NUM='2' with PLAIT_SERVER_NUM=2"):
        server_roles(_penv(0))


def test_server_count_is_read_and_checked(monkeypatch):
    penv = ProcessEnv(
        launcher=LauncherKind.TORCHRUN,
        rank=0,
        world_size=4,
        local_rank=0,
        local_world_size=4,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        device_index=0,
    )
    monkeypatch.delenv("PLAIT_SERVER_NUM", raising=False)
    monkeypatch.delenv("MS_SERVER_NUM", raising=False)
    assert server_count(penv) == 0
    monkeypatch.setenv("MS_SERVER_NUM", "1")
    assert server_count(penv) == 1
    monkeypatch.setenv("PLAIT_SERVER_NUM", "4")
    with pytest.raises(
        LaunchError, match=r"PLAIT_SERVER_NUM='4'.*0..3.*at least one must be a worker"
    ):
        server_count(penv)


def test_a_table_read_anywhere_steps_every_servers_optimizer():
    """One device's table steps its optimizer whenever it is read; a server whose rows no
    batch named steps too (an empty gradient), so Adam's step count is the table's on every
    server; a table nobody read does not step."""
    from plait.ps.server import Shard

    spec = _spec_of(10, 2, "range", optimizer=SparseOptimizer(kind="adam"), workers=2)
    shard = Shard(spec, server=1)
    empty = torch.empty(0, dtype=torch.int64), torch.empty(0, 4)
    shard.push(0, 0, *empty, used=True)  # worker 0 read rows of server 0 only
    shard.push(1, 0, *empty, used=False)
    assert shard.applied == 1 and shard.optimizer.state[shard.weight]["step"] == 1
    before = shard.weight.detach().clone()
    shard.push(0, 1, *empty, used=False)
    shard.push(1, 1, *empty, used=False)
    assert shard.applied == 2 and shard.optimizer.state[shard.weight]["step"] == 1
    assert torch.equal(before, shard.weight.detach())
    with pytest.raises(RuntimeError, match="worker 0 pushed step 5 but 2 was next"):
        shard.push(0, 5, *empty, used=False)


def test_cached_rows_serve_while_fresh_and_the_hottest_stay():
    from plait.ps.cache import RowCache

    cache = RowCache(capacity=3, dim=2)
    ids = torch.tensor([1, 4, 7])
    cache.put(ids, torch.arange(6.0).view(3, 2), torch.tensor([5, 5, 4]), step=5)
    hit, pos = cache.find(torch.tensor([1, 2, 7]), fresh_from=5)
    assert hit.tolist() == [True, False, False]  # 2 never cached; 7's version 4 too old
    assert torch.equal(cache.read(pos[hit], step=6), torch.tensor([[0.0, 1.0]]))
    hit, _ = cache.find(torch.tensor([7]), fresh_from=4)
    assert hit.tolist() == [True]  # a staleness bound of one more step lets it serve
    # rows 1 and 4 were read in two steps, 7 and 9 in one: 9 evicts the coldest, 7 (older)
    cache.read(cache.find(torch.tensor([4]), 0)[1], step=6)
    cache.put(torch.tensor([9]), torch.ones(1, 2), torch.tensor([6]), step=7)
    assert cache.ids.tolist() == [1, 4, 9]
    # a row pulled again replaces its copy and keeps its count
    cache.put(torch.tensor([1]), torch.full((1, 2), 8.0), torch.tensor([7]), step=8)
    assert cache.uses[0] == 3 and torch.equal(cache.rows[0], torch.tensor([8.0, 8.0]))
    cache.clear()
    assert len(cache) == 0


def test_the_cache_always_returns_the_rows_last_put_and_never_grows_past_capacity():
    from plait.ps.cache import RowCache

    g = torch.Generator().manual_seed(0)
    cache, truth = RowCache(capacity=50, dim=3), {}
    for step in range(40):
        ids = torch.unique(torch.randint(0, 120, (30,), generator=g))
        hit, pos = cache.find(ids, fresh_from=0)
        got = cache.read(pos[hit], step)
        for i, row in zip(ids[hit].tolist(), got, strict=True):
            assert torch.equal(row, truth[i])
        rows = torch.randn(len(ids), 3, generator=g)
        cache.put(ids, rows, torch.full((len(ids),), step), step)
        truth.update({i: r for i, r in zip(ids.tolist(), rows, strict=True)})
        assert len(cache) <= 50 and len(set(cache.slot.tolist())) == len(cache)
        assert torch.equal(cache.ids, torch.sort(cache.ids).values)


def test_a_read_that_waits_on_a_worker_who_left_is_named_not_waited_for():
    from plait.ps.server import Shard

    sync = Shard(_spec_of(10, 2, "range", workers=2), server=0)
    empty = torch.empty(0, dtype=torch.int64), torch.empty(0, 4)
    sync.push(1, 0, *empty, used=True)  # worker 1 pushed step 0, then left
    assert sync.waits_on(1, gone={1}) is None  # step 1 needs step 0 only: it is there
    assert sync.waits_on(2, gone={1}) == 1  # step 2 needs worker 1's step 1: never
    assert sync.waits_on(2, gone=set()) is None  # still coming
    lazy = Shard(_spec_of(10, 2, "range", workers=2, mode="async", max_staleness=2), server=0)
    assert lazy.waits_on(2, gone={1}) is None  # async: step 2 needs nothing yet
    assert lazy.waits_on(3, gone={1}) == 1
    assert lazy.waits_on(1, gone={1}, whole=True) == 1  # a save waits for every push
