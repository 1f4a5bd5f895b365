"""Search time and predicted step cost of every searcher, MLPs and transformers, 8 to 1024 devices.

    .venv/bin/python bench/search.py            # the full table
    .venv/bin/python bench/search.py --quick    # small rows only

Each row captures a model on the meta device once, builds the search problem once
(``plait.planner.prepare``, profile a100-80g), then runs each searcher on it and prints its
wall time and the objective every searcher minimises (``SearchProblem.evaluate``: predicted
seconds of compute and communication per step) with its ratio to the best found. ``ilp`` runs
only where the graph has at most ILP_MAX_OPS ops (time limit 60 s). Targets (issue 6), 96
transformer layers at 1024 devices: recursive_programming < 1 s, dynamic_programming < 60 s.
"""

from __future__ import annotations

import argparse
import time

import torch

from plait.config import ParallelConfig
from plait.graph import capture
from plait.models import MLP, GPTConfig, TinyGPT, gpt_loss, mlp_loss
from plait.planning.setup import prepare
from plait.search import get_searcher

SEARCHERS = ("sharding_propagation", "recursive_programming", "dynamic_programming", "ilp")
ILP_MAX_OPS = 60
DEVICES = (8, 64, 1024)


def _mesh(devices: int) -> dict[str, int]:
    tp = 4 if devices == 8 else 8
    return {"dp": devices // tp, "tp": tp}


def _mlp(layers: int, devices: int):
    with torch.device("meta"):
        model = MLP((1024,) * (layers + 1))
        x = torch.zeros(devices * 8, 1024)
    return model, (x, x), mlp_loss


def _gpt(layers: int, devices: int):
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=50304, seq=2048, width=12288, heads=96, layers=layers))
        ids = torch.zeros(_mesh(devices)["dp"], 2048, dtype=torch.long)
    return model, (ids, ids), gpt_loss


def run_row(kind: str, layers: int, devices: int) -> list[str]:
    model, batch, loss = (_mlp if kind == "mlp" else _gpt)(layers, devices)
    graph = capture(model, batch, loss)
    cfg = ParallelConfig(mode="auto", mesh=_mesh(devices), hardware="a100-80g")
    setup = prepare(graph, cfg, model=model)
    results: dict[str, tuple[float, float] | None] = {}
    for name in SEARCHERS:
        if name == "ilp" and len(graph.ops) > ILP_MAX_OPS:
            results[name] = None
            continue
        searcher = get_searcher(name)
        t0 = time.perf_counter()
        decisions = searcher(setup.problem, setup.allowed, setup.configured)
        seconds = time.perf_counter() - t0
        objective = setup.problem.evaluate({n: d.index for n, d in decisions.items()})
        results[name] = (seconds, objective)
    best = min(r[1] for r in results.values() if r is not None)
    mesh = ",".join(f"{k}={v}" for k, v in _mesh(devices).items())
    cells = [f"{kind} x{layers}", str(devices), mesh, str(len(graph.ops))]
    for name in SEARCHERS:
        r = results[name]
        cells.append("-" if r is None else f"{r[0]:.2f} s / {r[1]:.3g} s ({r[1] / best:.2f})")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = [("mlp", n, d) for n in (2, 16, 64) for d in DEVICES]
    rows += [("transformer", n, d) for n in (1, 12, 96) for d in DEVICES]
    if args.quick:
        rows = [r for r in rows if r[1] <= 2 and r[2] <= 64]
    print(
        f"torch {torch.__version__}; profile a100-80g; cell: search time / objective (ratio to best)"
    )
    header = ["model", "devices", "mesh", "ops", *SEARCHERS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(run_row(*row)) + " |", flush=True)


if __name__ == "__main__":
    main()
