"""Planning time for GPTs from 2 to 96 layers, hidden sizes up to 12288, 8 to 1024 devices.

    .venv/bin/python bench/plan_scale.py            # the full table
    .venv/bin/python bench/plan_scale.py --quick    # the three smallest rows

Each row builds a GPT on the meta device (no parameter memory), captures it, and runs
sharding propagation from Megatron annotations (tp = 8 or fewer) and the batch, then builds
the Plan (every collective with its cost) and writes its JSON. Target (issue 5): the 96-layer
GPT-3-size model at 1024 devices planned end to end in under 10 s on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import plait
from plait.graph import capture
from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
from plait.planning import plan_graph

# layers, hidden, heads, devices, tp
ROWS = [
    (2, 768, 12, 8, 2),
    (12, 768, 12, 8, 8),
    (24, 2048, 16, 64, 8),
    (48, 4096, 32, 256, 8),
    (96, 12288, 96, 1024, 8),
]
SEQ, VOCAB, BATCH_PER_DP = 2048, 50304, 1


def plan_row(layers: int, hidden: int, heads: int, devices: int, tp: int) -> dict[str, object]:
    dp = devices // tp
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=VOCAB, seq=SEQ, width=hidden, heads=heads, layers=layers))
        ids = torch.zeros(dp * BATCH_PER_DP, SEQ, dtype=torch.long)
    annotate_megatron(model, tp=tp)
    t1 = time.perf_counter()
    graph = capture(model, (ids, ids), gpt_loss)
    t2 = time.perf_counter()
    cfg = plait.ParallelConfig(mode="auto", mesh={"dp": dp, "tp": tp}, hardware="a100-80g")
    plan = plan_graph(graph, cfg, model=model)
    t3 = time.perf_counter()
    text = plan.to_json()
    t4 = time.perf_counter()
    return {
        "layers": layers,
        "hidden": hidden,
        "devices": devices,
        "mesh": f"dp={dp},tp={tp}",
        "ops": len(graph.ops),
        "params_B": sum(p.meta.numel for p in graph.parameters().values()) / 1e9,
        "build_s": t1 - t0,
        "capture_s": t2 - t1,
        "search_s": t3 - t2,
        "json_s": t4 - t3,
        "json_MB": len(text) / 1e6,
        "total_s": t4 - t0,
        "step_s": plan.predicted.step_time_s,
        "mem_GiB": plan.predicted.memory_bytes / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the three smallest rows")
    args = parser.parse_args()
    rows = ROWS[:3] if args.quick else ROWS
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads; hardware profile a100-80g, seq {SEQ}, vocab {VOCAB}"
    )
    header = (
        f"{'layers':>6} {'hidden':>6} {'devices':>7} {'mesh':>13} {'ops':>6} {'params':>8} "
        f"{'build':>7} {'capture':>8} {'search':>7} {'json':>6} {'total':>7} {'pred step':>10} {'mem/dev':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        r = plan_row(*row)
        print(
            f"{r['layers']:>6} {r['hidden']:>6} {r['devices']:>7} {r['mesh']:>13} {r['ops']:>6} "
            f"{r['params_B']:>7.2f}B {r['build_s']:>6.2f}s {r['capture_s']:>7.2f}s "
            f"{r['search_s']:>6.2f}s {r['json_s']:>5.2f}s {r['total_s']:>6.2f}s "
            f"{r['step_s']:>9.3f}s {r['mem_GiB']:>6.1f}GiB"
        )


if __name__ == "__main__":
    main()
