"""Exact searchers: dynamic_programming (graph elimination) against ilp (CBC) and brute force.

Graphs are captured from small random series-parallel modules built from real ops (linear,
add, relu, gelu, layer_norm, softmax, matmul) and from MLP and attention blocks, on meshes of
2 to 8 devices (1-D and 2-D). The objective is always ``SearchProblem.evaluate``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ParallelConfig
from plait.errors import ConfigError, PlanError
from plait.graph import capture
from plait.models import MLP, Block, GPTConfig, mlp_loss
from plait.planning.setup import SearchSetup, prepare
from plait.search import get_searcher, sharding_propagation
from plait.search.dynamic import (
    CostGraph,
    PairTerm,
    cost_graph,
    dynamic_programming,
    eliminate,
)
from plait.search.ilp import IlpResult, ilp, solve_cost_graph

MESHES = (
    {"dp": 2},
    {"dp": 4},
    {"dp": 8},
    {"dp": 2, "tp": 2},
    {"dp": 2, "tp": 4},
    {"dp": 4, "tp": 2},
)
UNARY = ("linear", "relu", "gelu", "layer_norm", "softmax")
REL = 1e-9


# ------------------------------------------------------------------------ random modules


def _recipe(rng: random.Random, budget: int) -> tuple:
    """A random series-parallel recipe of about ``budget`` ops.

    ``("op", name)``; ``("series", a, b)``; ``("add", a, b)`` runs a and b on the same input
    and adds them; ``("attn", a, b)`` joins them as softmax(a @ b^T) @ b (matmul, transpose,
    softmax, matmul). ``None`` is the identity.
    """
    if budget <= 1:
        return ("op", rng.choice(UNARY))
    kind = rng.choice(("series", "parallel", "parallel"))
    if kind == "parallel" and budget >= 6 and rng.random() < 0.3:
        rest = budget - 4
        a = rng.randint(0, rest)
        return (
            "attn",
            _recipe(rng, a) if a else None,
            _recipe(rng, rest - a) if rest > a else None,
        )
    if kind == "parallel" and budget >= 3:
        a = rng.randint(1, budget - 2)
        return ("add", _recipe(rng, a), _recipe(rng, budget - 1 - a))
    a = rng.randint(1, budget - 1)
    return ("series", _recipe(rng, a), _recipe(rng, budget - a))


class RandomSP(nn.Module):
    """A module that runs a random series-parallel recipe on a [batch, width] input."""

    def __init__(self, seed: int, budget: int, width: int) -> None:
        super().__init__()
        self.recipe = _recipe(random.Random(seed), budget)
        self.mods = nn.ModuleList()
        self._build(self.recipe, width)

    def _build(self, node: tuple | None, width: int) -> None:
        if node is None:
            return
        if node[0] == "op":
            if node[1] == "linear":
                self.mods.append(nn.Linear(width, width))
            elif node[1] == "layer_norm":
                self.mods.append(nn.LayerNorm(width))
            return
        for sub in node[1:]:
            self._build(sub, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._next = 0
        return self._run(self.recipe, x)

    def _run(self, node: tuple | None, x: torch.Tensor) -> torch.Tensor:
        if node is None:
            return x
        if node[0] == "op":
            if node[1] in ("linear", "layer_norm"):
                module = self.mods[self._next]
                self._next += 1
                return module(x)
            return {"relu": torch.relu, "gelu": F.gelu}.get(node[1], lambda t: t.softmax(-1))(x)
        if node[0] == "series":
            return self._run(node[2], self._run(node[1], x))
        a, b = self._run(node[1], x), self._run(node[2], x)
        if node[0] == "add":
            return a + b
        return torch.softmax(a @ b.transpose(0, 1), dim=-1) @ b


class TiedMLP(nn.Module):
    """One linear applied twice: its weight is a parameter shared by two readers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.gelu(self.lin(x)))


class BlockOnly(nn.Module):
    """One pre-norm transformer block (attention + MLP) on [batch, seq, width]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block = Block(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _setup(model: nn.Module, batch: tuple, mesh: dict[str, int]) -> SearchSetup:
    graph = capture(model, batch, mlp_loss)
    return prepare(graph, ParallelConfig(mode="auto", mesh=mesh), model=model)


@functools.cache
def _random_setup(seed: int) -> SearchSetup:
    width, rows = ((16, 8), (256, 64), (2048, 16))[seed % 3]
    with torch.device("meta"):
        model = RandomSP(seed, 1 + seed % 11, width)
        batch = (torch.zeros(rows, width), torch.zeros(rows, width))
    return _setup(model, batch, MESHES[seed % len(MESHES)])


def _value(setup: SearchSetup, decisions) -> float:
    return setup.problem.evaluate({name: d.index for name, d in decisions.items()})


def _solve_all(setup: SearchSetup) -> tuple[float, float, float]:
    args = (setup.problem, setup.allowed, setup.configured)
    return (
        _value(setup, dynamic_programming(*args)),
        _value(setup, ilp(*args)),
        _value(setup, sharding_propagation(*args)),
    )


# ------------------------------------------------------------------- exactness on graphs


@pytest.mark.parametrize("seed", range(30))
def test_dp_equals_ilp_on_random_series_parallel_graphs(seed: int) -> None:
    """DP's eliminations are exact on series-parallel graphs, so it reaches ILP's optimum."""
    setup = _random_setup(seed)
    assert 2 <= len(setup.graph.ops) <= 13
    dp, opt, prop = _solve_all(setup)
    assert dp == pytest.approx(opt, rel=REL)
    assert opt <= prop * (1 + REL)


@pytest.mark.parametrize(
    ("kind", "mesh"),
    [
        ("mlp", {"dp": 8}),
        ("mlp", {"dp": 2, "tp": 4}),
        ("tied", {"dp": 2, "tp": 2}),
        ("tied", {"dp": 4}),
        ("block", {"dp": 2, "tp": 2}),
        ("block", {"dp": 4}),
    ],
)
def test_dp_equals_ilp_on_mlp_and_attention_blocks(kind: str, mesh: dict[str, int]) -> None:
    """MLPs, a weight read by two linears (a shared-parameter term) and a transformer block."""
    setup = _model_setup(kind, tuple(mesh.items()))
    dp, opt, prop = _solve_all(setup)
    assert dp == pytest.approx(opt, rel=REL)
    assert opt <= prop * (1 + REL)


@functools.cache
def _model_setup(kind: str, mesh: tuple[tuple[str, int], ...]) -> SearchSetup:
    with torch.device("meta"):
        if kind == "mlp":
            model = MLP((64, 256, 64, 32))
            batch = (torch.zeros(32, 64), torch.zeros(32, 32))
        elif kind == "tied":
            model = TiedMLP(128)
            batch = (torch.zeros(16, 128), torch.zeros(16, 128))
        else:
            model = BlockOnly(GPTConfig(seq=8, width=32, heads=4))
            batch = (torch.zeros(4, 8, 32), torch.zeros(4, 8, 32))
    return _setup(model, batch, dict(mesh))


def test_cost_graph_is_the_objective() -> None:
    """Unary + pairwise terms (shared parameters included) sum to evaluate() for any choice."""
    for setup in (_random_setup(9), _tied_setup()):
        graph = cost_graph(setup.problem, setup.allowed)
        rng = random.Random(0)
        for _ in range(20):
            picks = [rng.randrange(len(c)) for c in graph.choices]
            expected = setup.problem.evaluate(graph.choice(picks))
            assert graph.total(picks) == pytest.approx(expected, rel=1e-12)


@functools.cache
def _tied_setup() -> SearchSetup:
    with torch.device("meta"):
        model = TiedMLP(64)
        batch = (torch.zeros(8, 64), torch.zeros(8, 64))
    return _setup(model, batch, {"dp": 2, "tp": 2})


def test_tied_weight_pays_for_a_second_layout() -> None:
    """Both linears read one weight: the cost graph has a pair term between them whose cost
    is zero exactly when the second reader wants the layout the first one set."""
    setup = _tied_setup()
    graph = cost_graph(setup.problem)
    linears = [k for k, n in enumerate(graph.names) if n.startswith("linear")]
    assert len(linears) == 2
    (term,) = [p for p in graph.pairs if (p.u, p.v) == tuple(linears)]
    cands = [setup.problem.candidates[graph.names[k]] for k in linears]
    same, other = [], []
    for a, b in itertools.product(range(len(cands[0])), range(len(cands[1]))):
        weight_layouts_match = cands[0][a].inputs[1] == cands[1][b].inputs[1]
        (same if weight_layouts_match else other).append(float(term.matrix[a, b]))
    assert same and all(c == 0 for c in same)
    assert other and all(c > 0 for c in other)


@pytest.mark.parametrize("seed", [0, 1, 2, 11, 14, 22, 25, 26])
def test_dp_equals_brute_force_on_tiny_graphs(seed: int) -> None:
    """Every assignment of the smallest graphs, priced by evaluate(), none beats DP."""
    setup = _random_setup(seed)
    problem = setup.problem
    names = [op.name for op in setup.graph.ops]
    ranges = [range(len(problem.candidates[n])) for n in names]
    assert math.prod(len(r) for r in ranges) <= 1500
    best = min(
        problem.evaluate(dict(zip(names, c, strict=True))) for c in itertools.product(*ranges)
    )
    assert _value(setup, dynamic_programming(problem)) == pytest.approx(best, rel=REL)


# ------------------------------------------------------------- constraints and decisions


def test_allowed_and_configured_are_honoured() -> None:
    """Restricted ops take one of their allowed candidates; configured ops keep theirs."""
    setup = _random_setup(16)
    problem = setup.problem
    ops = [op.name for op in setup.graph.ops if len(problem.candidates[op.name]) > 2]
    free = dynamic_programming(problem)
    fixed, narrowed = ops[0], ops[1]
    other = next(i for i in range(len(problem.candidates[fixed])) if i != free[fixed].index)
    allowed = {fixed: [other], narrowed: [0, len(problem.candidates[narrowed]) - 1]}
    configured = {fixed: "annotated with plait.shard in the test"}
    dp = dynamic_programming(problem, allowed, configured)
    opt = ilp(problem, allowed, configured)
    for decisions in (dp, opt):
        assert decisions[fixed].index == other
        assert decisions[fixed].reason == configured[fixed]
        assert decisions[narrowed].index in allowed[narrowed]
        assert decisions[narrowed].reason.startswith("annotated (2 strategies")
    assert _value(setup, dp) == pytest.approx(_value(setup, opt), rel=REL)
    assert _value(setup, dp) >= _value(setup, free) * (1 - REL)


def test_decisions_are_deterministic_and_locally_optimal() -> None:
    """Same answer twice; no op's alternative is cheaper with the others held (an optimum)."""
    setup = _random_setup(28)
    first = dynamic_programming(setup.problem)
    assert dynamic_programming(setup.problem) == first
    for decision in first.values():
        assert "optimal" in decision.reason
        assert all(cost >= decision.cost_s * (1 - REL) for _, cost in decision.alternatives)
    assert get_searcher("dynamic_programming") is dynamic_programming
    assert get_searcher("ilp") is ilp


# ------------------------------------------------------------ synthetic graphs (not SP)


def _synthetic(
    seed: int, n: int, edges: list[tuple[int, int]], size: int = 3, memory: bool = False
) -> CostGraph:
    rng = np.random.default_rng(seed)
    return CostGraph(
        names=tuple(f"op{k}" for k in range(n)),
        choices=tuple(tuple(range(size)) for _ in range(n)),
        unary=tuple(rng.random(size) for _ in range(n)),
        pairs=tuple(PairTerm(u, v, rng.random((size, size))) for u, v in edges),
        memory=tuple(rng.integers(1, 10, size).astype(float) for _ in range(n)) if memory else None,
    )


def _brute(graph: CostGraph, limit: float | None = None) -> float:
    best = math.inf
    for picks in itertools.product(*(range(len(c)) for c in graph.choices)):
        memory = graph.memory or ()
        if limit is not None and sum(m[k] for m, k in zip(memory, picks, strict=False)) > limit:
            continue
        best = min(best, graph.total(picks))
    return best


K4_PLUS = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (3, 4), (4, 5), (2, 5)]


def test_graphs_beyond_series_parallel_are_exact_or_flagged() -> None:
    """A K4 (not series-parallel) is eliminated exactly with a table over three neighbours;
    with no room for that table the star heuristic fixes one op and says so."""
    graph = _synthetic(3, 6, K4_PLUS)
    best = _brute(graph)
    picks, stats = eliminate(graph)
    assert stats.higher_order >= 1 and stats.exact
    assert graph.total(picks) == pytest.approx(best, rel=REL)
    result = solve_cost_graph(graph)
    assert result.optimal and result.objective == pytest.approx(best, rel=REL)
    picks, stats = eliminate(graph, max_factor_cells=1)
    assert stats.star and not stats.exact
    assert graph.total(picks) >= best * (1 - REL)


def test_memory_filter_is_exact_on_small_graphs() -> None:
    """Pareto (time, memory) lists: the fastest assignment under the limit, as brute force."""
    for seed in range(2):
        graph = _synthetic(seed, 6, K4_PLUS, memory=True)
        for limit in (20.0, 30.0, 40.0):
            best = _brute(graph, limit)
            picks, stats = eliminate(graph, memory_limit=limit, pareto_points=64)
            assert stats.exact
            assert sum(m[k] for m, k in zip(graph.memory, picks, strict=True)) <= limit
            assert graph.total(picks) == pytest.approx(best, rel=REL)
    with pytest.raises(PlanError, match="memory_limit=5"):
        eliminate(_synthetic(0, 6, K4_PLUS, memory=True), memory_limit=5.0)


@functools.cache
def _mlp_setup() -> SearchSetup:
    with torch.device("meta"):
        model = MLP((512, 2048, 512))
        batch = (torch.zeros(4096, 512), torch.zeros(4096, 512))
    return _setup(model, batch, {"dp": 8})


def _weight_pieces(setup: SearchSetup, decisions) -> list[int]:
    """Into how many pieces each linear's weight is cut (1: replicated)."""
    return [
        math.prod(setup.problem.candidates[name][d.index].inputs[1].splits())
        for name, d in decisions.items()
        if name.startswith("linear")
    ]


def test_memory_limit_splits_replicated_weights() -> None:
    """MLP 512 -> 2048 -> 512 (two 4 MiB weights), batch 4096 on 8 devices. Unconstrained, pure
    data parallel is fastest: it all-reduces the two 4 MiB weight gradients, while Megatron
    column-then-row splits all-reduce the [4096, 512] output forward and its gradient backward
    (8 MiB each). So both weights are replicated, and each device holds them with their
    gradients and Adam moments (4x the weights; the DP memory measure). Under a
    limit 10% below that plan's memory, DP must cut the weights instead: the plan fits, is
    slower, equals the ILP with the same memory row, and an impossible limit raises."""
    setup = _mlp_setup()
    problem = setup.problem
    graph = cost_graph(problem, with_memory=True)

    def memory(decisions) -> float:
        return sum(
            float(m[graph.choices[k].index(decisions[n].index)])
            for k, (n, m) in enumerate(zip(graph.names, graph.memory, strict=True))
        )

    free = dynamic_programming(problem)
    assert _weight_pieces(setup, free) == [1, 1]
    limit = 0.9 * memory(free)
    tight = dynamic_programming(problem, memory_limit=limit)
    assert min(_weight_pieces(setup, tight)) > 1
    assert memory(tight) <= limit < memory(free)
    assert _value(setup, tight) > _value(setup, free)
    assert "optimal" in tight["linear"].reason and "memory filter" in tight["linear"].reason
    assert _value(setup, tight) == pytest.approx(
        _value(setup, ilp(problem, memory_limit=limit)), rel=REL
    )
    for search in (dynamic_programming, ilp):
        with pytest.raises(PlanError, match="raise memory_limit"):
            search(problem, memory_limit=0.5 * memory(free))


# ----------------------------------------------------------------------- ilp specifics


def test_ilp_time_limit_message() -> None:
    """A tiny limit on the largest random graph (13 ops, 1e10 assignments): CBC stops before
    proving optimality (CBC's clock decides which): either with no assignment (PlanError
    naming the limit and the fixes) or with the best found, flagged in the reasons."""
    setup = _random_setup(9)
    try:
        decisions = ilp(setup.problem, time_limit_s=0.01)
    except PlanError as e:
        assert "time_limit_s=0.01" in str(e)
        assert "raise time_limit_s" in str(e) and "dynamic_programming" in str(e)
    else:
        reason = next(iter(decisions.values())).reason
        assert "time limit" in reason or "optimal over the whole graph" in reason


def test_ilp_reports_a_reached_limit(monkeypatch, caplog) -> None:
    """When CBC stops with an assignment, every reason and a logged warning give the gap."""
    setup = _random_setup(3)
    graph = cost_graph(setup.problem)
    picks = tuple(0 for _ in graph.names)
    total = graph.total(picks)
    stopped = IlpResult(picks, False, total, 0.5 * total, 0.01)
    monkeypatch.setattr("plait.search.ilp.solve_cost_graph", lambda *a, **k: stopped)
    with caplog.at_level(logging.WARNING, logger="plait.search.ilp"):
        decisions = ilp(setup.problem, time_limit_s=0.01)
    assert all("time_limit_s=0.01 reached" in d.reason for d in decisions.values())
    assert all("gap to the proved bound 50.00%" in d.reason for d in decisions.values())
    assert "reached time_limit_s=0.01" in caplog.text and "50.00%" in caplog.text


def test_missing_pulp_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pulp", None)
    with pytest.raises(ConfigError, match="pip install pulp"):
        ilp(_random_setup(0).problem)
    with pytest.raises(ConfigError, match="time_limit_s=0"):
        ilp(_random_setup(0).problem, time_limit_s=0)
