"""Plans of parameter-server jobs (plait.plan(..., servers=S), plait plan --server-num)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import plait
from plait import ParallelConfig, SparseOptimizer
from plait.cli import main
from plait.errors import ConfigError, NotBuiltError
from plait.planning import Plan
from plait.planning.servers import ID_BYTES

ROWS, DIM, WORKERS = 1000, 8, 2


class Recommender(nn.Module):
    def __init__(self, rows: int = ROWS, dim: int = DIM) -> None:
        super().__init__()
        self.users = nn.Embedding(rows, dim)
        self.items = nn.EmbeddingBag(rows, dim, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.users(users), self.items(items)], -1)).squeeze(-1)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(batch["users"], batch["items"])
    return nn.functional.binary_cross_entropy_with_logits(out, batch["label"])


def batch_of(n: int = 16, bag: int = 4, device: str | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    users = (ROWS * torch.rand(n, generator=g) ** 3).long()
    items = (ROWS * torch.rand(n, bag, generator=g) ** 3).long()
    out = {"users": users, "items": items, "label": torch.rand(n, generator=g)}
    return {k: v.to(device) for k, v in out.items()} if device else out


def config(**kw: object) -> ParallelConfig:
    base: dict[str, object] = {
        "mode": "parameter_server", "devices": WORKERS, "server_modules": ("users", "items"),
        "server_optimizer": SparseOptimizer(kind="adam"),
    }  # fmt: skip
    return ParallelConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_tables_placed_and_their_rows_counted_on_the_batch() -> None:
    model, batch = Recommender(), batch_of()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    plan = plait.plan(model, config(), example_batch=batch, loss_fn=loss_fn, servers=2)
    assert plan.mode == "parameter_server" and plan.servers == 2
    tables = {t.name: t for t in plan.server_tables}
    assert set(tables) == {"users", "items"}
    # each worker's slice of the batch, deduplicated; the busier worker counts
    for name, key in (("users", "users"), ("items", "items")):
        slices = batch[key].chunk(WORKERS)
        expected = max(int(s.unique().numel()) for s in slices)
        t = tables[name]
        assert t.measured and t.pulled_rows == t.pushed_rows == expected
        assert t.ids_per_step == slices[0].numel()
        assert t.pull_bytes == t.push_bytes == expected * (ID_BYTES + DIM * 4)
        assert t.rows_per_server == (ROWS // 2, ROWS // 2)
        # rows, Adam's two states: on the servers, not on the workers
        assert t.server_bytes == ROWS // 2 * DIM * 4 * 3
        assert t.seconds > 0
    # the dense part holds no table: no parameter of it, no gradient reduction of its size
    assert {p.name for p in plan.parameters} == {n for n, _ in model.mlp.named_parameters(
        prefix="mlp")}  # fmt: skip
    dense_bytes = sum(p.numel() * 4 for p in model.mlp.parameters())
    assert all(c.nbytes <= dense_bytes for c in plan.collectives)
    # the step is the dense part's plus the tables' traffic
    dense = plait.plan(
        model, ParallelConfig(mode="data_parallel", devices=WORKERS), example_batch=batch,
        loss_fn=loss_fn,
    )  # fmt: skip
    added = sum(t.seconds for t in plan.server_tables)
    assert plan.predicted.communication_s >= added and plan.predicted.step_time_s > added
    # the model is the user's again, untouched
    assert type(model.users) is nn.Embedding and type(model.items) is nn.EmbeddingBag
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(not p.is_meta for p in model.parameters())
    # the placements weighed: the servers, data parallel, mode auto's sharding, the host
    notes = [o.note for o in plan.options]
    assert len(notes) == 4 and any("this plan" in n for n in notes)
    assert any("data parallel on the devices" in n for n in notes)
    dp = next(o for o in plan.options if "data parallel on the devices" in o.note)
    assert dp.step_time_s == pytest.approx(dense.predicted.step_time_s, rel=0.5)
    host = next(o for o in plan.options if "host" in o.note)
    assert host.memory_bytes < dp.memory_bytes and host.step_time_s == dp.step_time_s
    assert any("fastest placement" in n or "faster than the servers" in n for n in plan.notes)


def test_plan_file_round_trip_and_summary() -> None:
    plan = plait.plan(
        Recommender(), config(ps_split="hash"), example_batch=batch_of(), loss_fn=loss_fn,
        servers=3,
    )  # fmt: skip
    assert Plan.from_json(plan.to_json()) == plan
    users = next(t for t in plan.server_tables if t.name == "users")
    assert users.rows_per_server == (334, 333, 333)
    text = plan.summary()
    assert "parameter servers: 3" in text and "hash: 334, 333, 333" in text
    with pytest.raises(plait.errors.PlanError, match="server_tables"):
        dataclasses.replace(plan, servers=0)


def test_meta_model_takes_every_id_as_distinct() -> None:
    with torch.device("meta"):
        model = Recommender()
    batch = batch_of(device="meta")
    plan = plait.plan(
        model, config(grad_accumulation=2), example_batch=batch, loss_fn=loss_fn, servers=2
    )
    items = next(t for t in plan.server_tables if t.name == "items")
    # a worker's 8 samples of 4 ids, in 2 micro-batches: 16 ids each, pulled twice
    assert not items.measured and items.ids_per_step == 32
    assert items.pulled_rows == 32 and items.pushed_rows == 32
    assert any("upper bound" in n for n in plan.notes)
    assert "32 (at most)" in plan.summary()


def test_the_dense_part_plans_with_zero() -> None:
    plan = plait.plan(
        Recommender(), config(optimizer_shard=3), example_batch=batch_of(), loss_fn=loss_fn,
        servers=2,
    )  # fmt: skip
    assert plan.mode == "parameter_server" and plan.optimizer_shard == 3
    assert {p.name for p in plan.parameters} == {
        "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"
    }  # fmt: skip


def test_async_leaves_the_servers_update_off_the_step() -> None:
    model, batch = Recommender(), batch_of()
    sync = plait.plan(model, config(), example_batch=batch, loss_fn=loss_fn, servers=2)
    fast = plait.plan(
        model, config(ps_mode="async", max_staleness=1), example_batch=batch, loss_fn=loss_fn,
        servers=2,
    )  # fmt: skip
    assert sum(t.seconds for t in fast.server_tables) < sum(t.seconds for t in sync.server_tables)


@pytest.mark.parametrize(
    ("make", "servers", "match"),
    [
        (lambda: config(), None, r"servers=None.*int >= 1.*--server-num"),
        (lambda: config(), 0, r"servers=0"),
        (lambda: ParallelConfig(mode="data_parallel", devices=2), 2, r"would do nothing"),
        (lambda: ParallelConfig(mode="auto", devices=2), 0, r"mode=.auto., servers=0"),
        (lambda: config(server_modules=("mlp.0",)), 2, r"'mlp.0' \(Linear\) cannot live"),
        (lambda: config(server_modules=("nope",)), 2, r"'nope', which is not a module"),
        (lambda: config(), 3, r"1000 rows, which 3 servers cannot split.*ps_split='hash'"),
        (lambda: config(server_modules=()), 2, r"no table on the servers"),
        (lambda: config(mesh={"dp": 1, "tp": 2}), 2, r"mesh=.*parameter-server job's dense"),
    ],
)
def test_bad_input_is_refused_by_name(make, servers, match) -> None:
    # ConfigError, or NotBuiltError for what is not built yet (the dense part beyond plain DP)
    with pytest.raises((ConfigError, NotBuiltError), match=match):
        plait.plan(Recommender(), make(), example_batch=batch_of(), loss_fn=loss_fn,
                   servers=servers)  # fmt: skip


def factory() -> tuple[nn.Module, dict[str, torch.Tensor], object]:
    """For `plait plan --factory`: built under torch.device('meta')."""
    return Recommender(), batch_of(device="meta"), loss_fn


def test_plait_plan_cli(tmp_path, capsys) -> None:
    out = tmp_path / "ps.json"
    code = main([
        "plan", "--factory", f"{__name__}:factory", "--mode", "parameter_server",
        "--devices", "2", "--server-num", "2", "--server-modules", "users", "items",
        "--server-optimizer", "adagrad", "--json", str(out),
    ])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    assert "parameter servers: 2" in text and "adagrad on the servers" in text
    plan = Plan.load(out)
    assert plan.servers == 2 and {t.name for t in plan.server_tables} == {"users", "items"}
    # Adagrad keeps one state a row on its server
    assert plan.server_tables[0].server_bytes == ROWS // 2 * DIM * 4 * 2
    code = main(["plan", "--factory", f"{__name__}:factory", "--mode", "data_parallel",
                 "--devices", "2", "--server-num", "2"])  # fmt: skip
    assert code == 2 and "would do nothing" in capsys.readouterr().err


def test_mode_auto_weighs_the_tables_on_servers() -> None:
    """Mode auto with servers: big tables go to the servers when that is faster; small ones
    stay on the devices, the note saying what the servers would have taken."""
    with torch.device("meta"):
        big = Recommender(rows=1_000_000, dim=64)
    auto = ParallelConfig(mode="auto", devices=WORKERS)
    plan = plait.plan(big, auto, example_batch=batch_of(), loss_fn=loss_fn, servers=2)
    assert plan.mode == "parameter_server" and plan.servers == 2
    assert {t.name for t in plan.server_tables} == {"users", "items"}
    assert "the servers win" in plan.notes[-1] and "--server-num 2" in plan.notes[-1]
    small = plait.plan(Recommender(), auto, example_batch=batch_of(), loss_fn=loss_fn, servers=2)
    assert small.mode == "auto" and not small.server_tables
    assert "the tables stay on the devices" in small.notes[-1]
    with pytest.raises(ConfigError, match=r"has no nn.Embedding or nn.EmbeddingBag"):
        plait.plan(nn.Linear(4, 4), auto, example_batch=torch.randn(4, 4),
                   loss_fn=lambda m, b: m(b).sum(), servers=2)  # fmt: skip
