"""``search="ilp"``: Alpa's integer program over the whole graph, solved by CBC through PuLP.

The yardstick for the other searchers (Alpa: Zheng et al., OSDI 2022). On the cost graph of
:func:`plait.search.dynamic.cost_graph` (the objective :meth:`SearchProblem.evaluate` as
unary and pairwise terms, shared parameters included):

- per op ``v`` a one-hot vector ``s_v`` over its allowed candidates (binary, ``sum = 1``);
- per pair term ``(u, v)`` with cost matrix ``R``, Alpa's linearised product ``e_uv`` over
  ``(s_u, s_v)`` with ``sum_j e_ij = s_u,i`` and ``sum_i e_ij = s_v,j``. ``e`` needs no
  integrality: with both marginals one-hot, these sums leave it a single 1 (row ``i*``,
  column ``j*``), so only the ``s`` are integer;
- minimise ``sum_v c_v . s_v + sum_(u,v) R_uv . e_uv``;
- with ``memory_limit``, ``sum_v m_v . s_v <= memory_limit`` (Alpa bounds memory at each
  liveness point; plait's memory measure is the one dynamic_programming filters on, the sum
  of :func:`plait.rules.op_memory` over ops, so both solve the same constrained problem).

Ops with one allowed candidate are constants: their pair terms fold into their neighbours'
cost vectors. Costs are scaled so the largest is ``COST_SCALE`` before solving (seconds are
1e-9 to 1e-1, below CBC's tolerances) and the answer is the problem's own ``evaluate``.
CBC runs single-threaded with no relative gap, so the result is deterministic and optimal
unless ``time_limit_s`` stops it: then the best assignment found is returned, each Decision's
reason says so, and a warning with the gap is logged.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.errors import ConfigError, PlanError
from plait.search.dynamic import STATE_FACTOR, CostGraph, cost_graph, decisions_for
from plait.search.problem import SearchProblem
from plait.search.propagation import Decision

__all__ = ["IlpResult", "ilp", "solve_cost_graph"]

log = logging.getLogger(__name__)

COST_SCALE = 1e6  # the largest cost coefficient after scaling


@dataclass(frozen=True)
class IlpResult:
    """Picks (positions in each op's choices) and how the solve ended."""

    picks: tuple[int, ...]
    optimal: bool
    objective: float  # seconds of the picks, from the cost graph
    bound: float | None  # best lower bound CBC proved (seconds), when it stopped early
    seconds: float  # solver wall time reported in CBC's log, or the limit

    @property
    def gap(self) -> float | None:
        """Relative gap between the picks and the proved bound (None when unknown)."""
        if self.optimal:
            return 0.0
        if self.bound is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective)


def _pulp() -> Any:
    try:
        import pulp
    except ImportError:
        raise ConfigError(
            "ParallelConfig.search='ilp' needs the PuLP package (it bundles the CBC solver), "
            "which is not installed; install it with `pip install pulp` (or `pip install "
            "plait`), or use search='dynamic_programming'"
        ) from None
    return pulp


def _solver_path(pulp: Any) -> str:
    """A CBC binary: one on PATH, else the one PuLP bundles."""
    found = shutil.which("cbc")
    if found:
        return found
    from pulp.apis import coin_api

    bundled = coin_api.COIN_CMD.executableExtension(coin_api.pulp_cbc_path)
    if os.path.exists(bundled):
        return bundled
    raise ConfigError(
        "search='ilp': PuLP is installed but no CBC solver was found (none on PATH, none "
        f"bundled at {bundled}); install one with `pip install pulp` on a platform PuLP "
        "ships CBC for, or your system's `coinor-cbc` package"
    )


def _fold_fixed(graph: CostGraph) -> tuple[list[np.ndarray], list[tuple[int, int, np.ndarray]]]:
    """Unary vectors and pair matrices with single-choice ops folded into their neighbours."""
    unary = [u.copy() for u in graph.unary]
    pairs = []
    single = [len(c) == 1 for c in graph.choices]
    for p in graph.pairs:
        if single[p.u]:
            unary[p.v] += p.matrix[0, :]
        elif single[p.v]:
            unary[p.u] += p.matrix[:, 0]
        else:
            pairs.append((p.u, p.v, p.matrix))
    return unary, pairs


def _variable(pulp: Any, model: Any, name: str, cat: str = "Continuous") -> Any:
    """A 0/1 variable of ``model`` (PuLP >= 3.3 wants ``add_variable``; older PuLP lacks it)."""
    if hasattr(model, "add_variable"):
        return model.add_variable(name, 0, 1, cat=cat)
    return pulp.LpVariable(name, 0, 1, cat=cat)


def _model(
    pulp: Any, graph: CostGraph, memory_limit: float | None
) -> tuple[Any, list[list[Any] | None]]:
    unary, pairs = _fold_fixed(graph)
    scale = _scale_of(graph)
    model = pulp.LpProblem("plait_strategy_search", pulp.LpMinimize)
    chosen: list[list[Any] | None] = []
    terms: list[tuple[Any, float]] = []
    for k, costs in enumerate(unary):
        if len(costs) == 1:
            chosen.append(None)
            continue
        s = [_variable(pulp, model, f"s_{k}_{a}", "Binary") for a in range(len(costs))]
        model += pulp.lpSum(s) == 1, f"one_{k}"
        terms.extend((x, float(c) * scale) for c, x in zip(costs, s, strict=True) if c != 0)
        chosen.append(s)
    for u, v, matrix in pairs:
        su, sv = chosen[u], chosen[v]
        assert su is not None and sv is not None
        terms.extend(_product(pulp, model, f"{u}_{v}", su, sv, matrix, scale))
    model += pulp.LpAffineExpression(terms)
    if memory_limit is not None:
        _memory_row(pulp, model, graph, chosen, memory_limit)
    return model, chosen


def _product(
    pulp: Any, model: Any, tag: str, su: list[Any], sv: list[Any], matrix: np.ndarray, scale: float
) -> list[tuple[Any, float]]:
    """Alpa's ``e_uv`` for one pair term, over classes of candidates with equal costs.

    Candidates of ``u`` with equal rows of ``matrix`` (the same output layout, typically) pay
    the same against every candidate of ``v``, so ``e`` needs one row per class, whose
    marginal is the sum of the class's ``s``; likewise for columns. Exact, and far smaller.
    """
    rows, row_of = np.unique(matrix, axis=0, return_inverse=True)
    cols, col_of = np.unique(rows, axis=1, return_inverse=True)
    row_of, col_of = row_of.reshape(-1), col_of.reshape(-1)
    e = [
        [_variable(pulp, model, f"e_{tag}_{r}_{c}") for c in range(cols.shape[1])]
        for r in range(cols.shape[0])
    ]
    for r, row in enumerate(e):
        members = [x for x, k in zip(su, row_of, strict=True) if k == r]
        model += pulp.lpSum(row) == pulp.lpSum(members), f"row_{tag}_{r}"
    for c in range(cols.shape[1]):
        members = [x for x, k in zip(sv, col_of, strict=True) if k == c]
        model += pulp.lpSum(row[c] for row in e) == pulp.lpSum(members), f"col_{tag}_{c}"
    return [
        (e[r][c], float(cols[r, c]) * scale)
        for r in range(cols.shape[0])
        for c in range(cols.shape[1])
        if cols[r, c] != 0
    ]


def _memory_row(
    pulp: Any, model: Any, graph: CostGraph, chosen: list[list[Any] | None], limit: float
) -> None:
    """Summed op memory at most ``limit`` (coefficients divided by it, so the bound is 1)."""
    if graph.memory is None:
        raise PlanError("ilp: a memory_limit needs a CostGraph built with_memory=True")
    fixed = sum(float(m[0]) for m, s in zip(graph.memory, chosen, strict=True) if s is None)
    terms = [
        (x, float(c) / limit)
        for m, s in zip(graph.memory, chosen, strict=True)
        if s is not None
        for c, x in zip(m, s, strict=True)
        if c != 0
    ]
    model += pulp.LpAffineExpression(terms) <= 1.0 - fixed / limit, "memory"


def _read_log(path: str) -> tuple[float | None, float]:
    """(lower bound in scaled units, seconds) from CBC's log, where it says them."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None, math.nan
    bound = re.search(r"Lower bound:\s*([-+0-9.eE]+)", text)
    wall = re.search(
        r"Total time \(CPU seconds\):\s*[-+0-9.eE]+\s*\(Wallclock seconds\):\s*([0-9.eE+-]+)", text
    )
    return (float(bound.group(1)) if bound else None), (float(wall.group(1)) if wall else math.nan)


def solve_cost_graph(
    graph: CostGraph, *, time_limit_s: float = 60.0, memory_limit: float | None = None
) -> IlpResult:
    """Solve ``graph`` exactly with CBC (see the module doc); raises PlanError if no answer."""
    if not time_limit_s > 0:
        raise ConfigError(f"ilp: time_limit_s={time_limit_s!r}; give a positive number of seconds")
    if memory_limit is not None and not memory_limit > 0:
        raise ConfigError(f"ilp: memory_limit={memory_limit!r}; give a positive number of bytes")
    if memory_limit is not None:
        _check_memory(graph, memory_limit)
    pulp = _pulp()
    model, chosen = _model(pulp, graph, memory_limit)
    scale = _scale_of(graph)
    with tempfile.TemporaryDirectory(prefix="plait_ilp_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        solver = pulp.COIN_CMD(
            path=_solver_path(pulp),
            msg=False,
            timeLimit=time_limit_s,
            gapRel=0.0,
            gapAbs=0.0,
            threads=1,
            logPath=log_path,
        )
        model.solve(solver)
        bound_scaled, wall = _read_log(log_path)
    # An "infeasible" status here is CBC's preprocessing cut short by the time limit: the
    # program always has a solution once the memory row passed _check_memory.
    found = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    picks = _picks(chosen) if model.sol_status in found else None
    if picks is None:
        raise PlanError(
            f"search='ilp': CBC found no assignment within time_limit_s={time_limit_s:g} "
            f"({len(graph.names)} ops, {sum(len(c) for c in graph.choices)} candidates); raise "
            "time_limit_s, or use search='dynamic_programming' (exact on series-parallel "
            "graphs and far faster)"
        )
    optimal = model.sol_status == pulp.LpSolutionOptimal
    bound = None if bound_scaled is None or optimal else bound_scaled / scale + _constant(graph)
    return IlpResult(tuple(picks), optimal, graph.total(picks), bound, wall)


def _check_memory(graph: CostGraph, limit: float) -> None:
    """Memory is a sum over ops, so the least any assignment needs is the sum of minima."""
    if graph.memory is None:
        raise PlanError("ilp: a memory_limit needs a CostGraph built with_memory=True")
    least = sum(float(m.min()) for m in graph.memory)
    if least > limit:
        raise PlanError(
            f"search='ilp': no choice of strategies keeps the summed op memory under "
            f"memory_limit={limit:.4g} bytes per device (the least any choice could need "
            f"is {least:.4g}); raise memory_limit, use more devices, or allow more strategies"
        )


def _scale_of(graph: CostGraph) -> float:
    unary, pairs = _fold_fixed(graph)
    top = max([float(np.abs(u).max()) for u in unary if u.size] + [0.0])
    top = max([top] + [float(np.abs(m).max()) for _, _, m in pairs if m.size])
    return COST_SCALE / top if top > 0 else 1.0


def _constant(graph: CostGraph) -> float:
    """Seconds of single-choice ops (and pairs of them), which the model leaves out."""
    unary, _ = _fold_fixed(graph)
    total = sum(float(u[0]) for u in unary if len(u) == 1)
    return total + sum(
        float(p.matrix[0, 0])
        for p in graph.pairs
        if len(graph.choices[p.u]) == 1 and len(graph.choices[p.v]) == 1
    )


def _picks(chosen: list[list[Any] | None]) -> list[int] | None:
    picks = []
    for s in chosen:
        if s is None:
            picks.append(0)
            continue
        values = [x.value() for x in s]
        if any(v is None for v in values):
            return None
        picks.append(int(np.argmax(values)))
    return picks


def ilp(
    problem: SearchProblem,
    allowed: Mapping[str, Sequence[int]] | None = None,
    configured: Mapping[str, str] | None = None,
    *,
    time_limit_s: float = 60.0,
    memory_limit: float | None = None,
    state_factor: float = STATE_FACTOR,
) -> dict[str, Decision]:
    """Choose one candidate per op by solving Alpa's integer program (see the module doc).

    Args:
        problem: the graph, candidates and costs.
        allowed: per op, the candidate indices it may take (annotations, mode defaults).
        configured: ops whose strategy is fixed (one allowed candidate), with their reason.
        time_limit_s: CBC's wall-clock limit. When reached, the best assignment found is
            returned (reasons and a logged warning say so, with the gap); when none was
            found, :class:`~plait.errors.PlanError` says how to proceed.
        memory_limit: bytes per device for the summed op memory (as in dynamic_programming).
        state_factor: model-state bytes per parameter byte (as in dynamic_programming).
    """
    allowed = dict(allowed or {})
    graph = cost_graph(
        problem, allowed, with_memory=memory_limit is not None, state_factor=state_factor
    )
    result = solve_cost_graph(graph, time_limit_s=time_limit_s, memory_limit=memory_limit)
    how = (
        f"ilp (Alpa's integer program, CBC): optimal over the whole graph; plan total "
        f"{result.objective:.4g} s"
    )
    if not result.optimal:
        gap = result.gap
        gap_text = f"{gap:.2%}" if gap is not None else "unknown"
        how = (
            f"ilp: WARNING time limit time_limit_s={time_limit_s:g} reached: best assignment "
            f"found, NOT proven optimal (gap to the proved bound {gap_text}); plan total "
            f"{result.objective:.4g} s; raise time_limit_s or use dynamic_programming"
        )
        log.warning(
            "search='ilp' reached time_limit_s=%g before proving optimality; returning the "
            "best assignment found (%.6g s, gap %s to the bound); raise time_limit_s",
            time_limit_s,
            result.objective,
            gap_text,
        )
    return decisions_for(problem, graph, result.picks, configured or {}, allowed, how)
