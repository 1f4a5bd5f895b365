"""Planning at scale: `plait.plan` times over model sizes and device counts, and search alone.

    .venv/bin/python bench/plan_scale.py                    # both tables (about a minute)
    .venv/bin/python bench/plan_scale.py --quick            # 1.3B and 13B, small network
    .venv/bin/python bench/plan_scale.py --rows 175b --runs 3
    .venv/bin/python bench/plan_scale.py --before /tmp/old  # also time another checkout's plait
    .venv/bin/python bench/plan_scale.py --issue5           # the fixed-mesh table of issue 5

Table 1, model sizes: GPTs of Megatron-LM's scaling study (Narayanan et al., SC21: 1.3B on
32 GPUs with batch 512, 13B/256/1024, 175B/1024/1536, 1T/3072/3072; sequence 2048, vocab
50304), built on the meta device, planned on the a100-80g profile with sharding_propagation,
mode auto:

- fixed mesh: ``mesh={dp: N/8, tp: 8}``, Megatron-annotated (the settings ZeRO, recompute and
  micro-batches still weighed);
- free mesh: ``devices=N``, the outer planner weighs every mesh ``pp x dp x tp`` too.

Each cell runs in a fresh process (cold caches, as ``plait plan`` runs) and is the best of
``--runs``: total seconds from model to Plan (capture included), with, where the code
reports it (``PlanTiming``), capture / candidates / search / estimate / assemble and the
mesh options searched, pruned and reused. ``--before DIR`` runs the same cells against the
``plait`` package under DIR (e.g. ``git archive <commit> plait | tar -x -C DIR``) and checks
that both choose the same plan: "file" when the plan files are byte-identical, "plan" when
they differ only in ``Plan.options`` and ``notes`` (meshes pruned), by SHA-256.

Table 2, small network: an 8-layer GPT of width 256 (8 heads, sequence 256, vocab 8192,
batch 16) on 8 devices. Search alone on ``dp=2 x tp=4`` for each searcher: cold (the first
search of a fresh process: every redistribution priced for the first time) and warm (the
same search again on a new problem of the same graph: the layout module's redistribution
plans cached). End to end: ``plait.plan`` with capture, fixed mesh and free mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROWS = {
    # name: layers, hidden, heads, devices, batch
    "1.3b": (24, 2048, 16, 32, 512),
    "13b": (40, 5120, 40, 256, 1024),
    "175b": (96, 12288, 96, 1024, 1536),
    "1t": (128, 25600, 160, 3072, 3072),
}
SEQ, VOCAB, TP = 2048, 50304, 8
SMALL = {"layers": 8, "width": 256, "heads": 8, "seq": 256, "vocab": 8192, "batch": 16}
SEARCHERS = ("sharding_propagation", "recursive_programming", "dynamic_programming")
HERE = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- one cell


def _sha(plan) -> str:
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:12]


def _timing_kw():
    """``{"timing": PlanTiming()}`` where the plait imported reports where time goes."""
    try:
        from plait.planning.timing import PlanTiming
    except ImportError:
        return {}
    return {"timing": PlanTiming()}


def cell_scale(row: str, mode: str) -> dict[str, object]:
    import torch

    import plait
    from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss

    layers, hidden, heads, devices, batch = ROWS[row]
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=VOCAB, seq=SEQ, width=hidden, heads=heads, layers=layers))
        ids = torch.zeros(batch, SEQ, dtype=torch.long)
    if mode == "fixed":
        annotate_megatron(model, tp=TP)
        cfg = plait.ParallelConfig(
            mode="auto", mesh={"dp": devices // TP, "tp": TP}, hardware="a100-80g"
        )
    else:
        cfg = plait.ParallelConfig(mode="auto", devices=devices, hardware="a100-80g")
    kw = _timing_kw()
    start = time.perf_counter()
    plan = plait.plan(model, cfg, example_batch=(ids, ids), loss_fn=gpt_loss, **kw)
    total = time.perf_counter() - start
    out: dict[str, object] = {
        "total_s": total,
        "mesh": "x".join(f"{k}={v}" for k, v in plan.mesh.as_dict().items()),
        "settings": f"m={plan.micro_batches} zero={plan.optimizer_shard} rc={plan.recompute}",
        "step_s": plan.predicted.step_time_s,
        "plan_sha": _sha(plan),
        "chosen_sha": _sha(dataclasses.replace(plan, options=(), notes=())),
        "options": sum(1 for _ in plan.options),
    }
    if kw:
        out["timing"] = kw["timing"].as_dict()
    return out


def cell_small(searcher: str, mode: str) -> dict[str, object]:
    import torch

    import plait
    from plait.graph import capture
    from plait.models import GPTConfig, TinyGPT, gpt_loss

    with torch.device("meta"):
        model = TinyGPT(
            GPTConfig(
                vocab=SMALL["vocab"],
                seq=SMALL["seq"],
                width=SMALL["width"],
                heads=SMALL["heads"],
                layers=SMALL["layers"],
            )
        )
        ids = torch.zeros(SMALL["batch"], SMALL["seq"], dtype=torch.long)
    if mode == "search":
        from plait.planning.setup import prepare
        from plait.search import get_searcher

        graph = capture(model, (ids, ids), gpt_loss)
        cfg = plait.ParallelConfig(
            mode="auto", mesh={"dp": 2, "tp": 4}, search=searcher, hardware="a100-80g"
        )
        search = get_searcher(searcher)
        times = []
        for _ in range(4):  # the first cold, the others warm
            setup = prepare(graph, cfg, model=model)
            start = time.perf_counter()
            search(setup.problem, setup.allowed, setup.configured)
            times.append(time.perf_counter() - start)
        return {"cold_s": times[0], "warm_s": min(times[1:]), "ops": len(graph.ops)}
    mesh = {"mesh": {"dp": 2, "tp": 4}} if mode == "fixed" else {"devices": 8}
    cfg = plait.ParallelConfig(mode="auto", search=searcher, hardware="a100-80g", **mesh)
    start = time.perf_counter()
    plan = plait.plan(model, cfg, example_batch=(ids, ids), loss_fn=gpt_loss)
    return {
        "total_s": time.perf_counter() - start,
        "mesh": "x".join(f"{k}={v}" for k, v in plan.mesh.as_dict().items()),
        "plan_sha": _sha(plan),
        "chosen_sha": _sha(dataclasses.replace(plan, options=(), notes=())),
    }


# --------------------------------------------------------------------------- driver


def run_cell(kind: str, a: str, b: str, pythonpath: str | None) -> dict[str, object]:
    """One cell in a fresh process (``pythonpath``: another checkout's plait first)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cell", kind, a, b]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/", check=False)
    if done.returncode:
        raise RuntimeError(f"cell {kind} {a} {b} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best_of(runs: int, kind: str, a: str, b: str, pythonpath: str | None) -> dict[str, object]:
    found = [run_cell(kind, a, b, pythonpath) for _ in range(runs)]
    key = "total_s" if "total_s" in found[0] else "warm_s"
    return min(found, key=lambda r: r[key])  # type: ignore[arg-type, return-value]


def _phases(r: dict[str, object]) -> str:
    t = r.get("timing")
    if not isinstance(t, dict):
        return "-"
    return " / ".join(
        f"{t[f'{p}_s']:.2f}" for p in ("capture", "candidates", "search", "estimate", "assemble")
    )


def _counts(r: dict[str, object]) -> str:
    t = r.get("timing")
    if not isinstance(t, dict):
        return "-"
    return f"{t['meshes']} / {t['searched']} / {t['pruned']} / {t['reused']}"


def _same(old: dict[str, object] | None, new: dict[str, object]) -> str:
    """ "file": the plan files are equal; "plan": the chosen plan is (``Plan.options`` and
    ``notes`` differ: meshes pruned); "NO" otherwise."""
    if old is None:
        return "-"
    if old["plan_sha"] == new["plan_sha"]:
        return "file"
    return "plan" if old["chosen_sha"] == new["chosen_sha"] else "NO"


def scale_table(rows: list[str], runs: int, before: str | None) -> None:
    print(f"\nPlanning at scale (seconds, best of {runs}; each cell a fresh process)")
    head = ["model", "devices", "batch", "mesh", "before", "after", "speed-up"]
    head += [
        "capture / cand. / search / estimate / assemble",
        "meshes / searched / pruned / reused",
    ]
    head += ["chosen", "same plan"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        _, _, _, devices, batch = ROWS[row]
        for mode in ("fixed", "free"):
            after = best_of(runs, "scale", row, mode, None)
            old = best_of(1, "scale", row, mode, before) if before else None
            mesh = f"dp={devices // TP} x tp={TP}, Megatron" if mode == "fixed" else "free"
            cells = [row.upper(), str(devices), str(batch), mesh]
            cells.append(f"{old['total_s']:.1f} s" if old else "-")
            cells.append(f"**{after['total_s']:.2f} s**")
            cells.append(f"{old['total_s'] / after['total_s']:.0f}x" if old else "-")
            cells += [_phases(after), _counts(after)]
            cells.append(f"{after['mesh']}, {after['settings']}, {after['step_s']:.1f} s/step")
            cells.append(_same(old, after))
            print("| " + " | ".join(cells) + " |", flush=True)


def small_table(runs: int, before: str | None) -> None:
    s = SMALL
    print(
        f"\nSmall network: GPT {s['layers']} layers, width {s['width']}, {s['heads']} heads, "
        f"seq {s['seq']}, vocab {s['vocab']}, batch {s['batch']}, 8 devices (ms / s)"
    )
    head = ["searcher", "search cold", "search warm", "plan fixed mesh", "plan free mesh"]
    if before:
        head += ["before: cold / warm / fixed / free", "same plans"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in SEARCHERS:
        after = [best_of(runs, "small", name, m, None) for m in ("search", "fixed", "free")]
        cells = [
            name,
            f"{after[0]['cold_s'] * 1e3:.0f} ms",
            f"**{after[0]['warm_s'] * 1e3:.0f} ms**",
            f"**{after[1]['total_s']:.2f} s**",
            f"**{after[2]['total_s']:.2f} s** ({after[2]['mesh']})",
        ]
        if before:
            old = [best_of(runs, "small", name, m, before) for m in ("search", "fixed", "free")]
            cells.append(
                f"{old[0]['cold_s'] * 1e3:.0f} ms / {old[0]['warm_s'] * 1e3:.0f} ms / "
                f"{old[1]['total_s']:.2f} s / {old[2]['total_s']:.2f} s"
            )
            cells.append(", ".join(_same(o, a) for o, a in zip(old[1:], after[1:], strict=True)))
        print("| " + " | ".join(cells) + " |", flush=True)


# --------------------------------------------------------------------------- issue 5's table

ISSUE5 = [(2, 768, 12, 8, 2), (12, 768, 12, 8, 8), (24, 2048, 16, 64, 8), (48, 4096, 32, 256, 8)]
ISSUE5.append((96, 12288, 96, 1024, 8))


def issue5_table(quick: bool) -> None:
    """GPTs planned on a fixed Megatron mesh (one sequence per dp rank): build, capture,
    search + plan, JSON (the table of the "Planning time" section of docs/benchmarks-history.md)."""
    import torch

    import plait
    from plait.graph import capture
    from plait.models import GPTConfig, TinyGPT, annotate_megatron, gpt_loss
    from plait.planning import plan_graph

    print(f"{'layers':>6} {'hidden':>6} {'devices':>7} {'mesh':>13} {'ops':>6} {'params':>8} "
          f"{'build':>7} {'capture':>8} {'search':>7} {'json':>6} {'total':>7}")  # fmt: skip
    for layers, hidden, heads, devices, tp in ISSUE5[:3] if quick else ISSUE5:
        dp = devices // tp
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = TinyGPT(
                GPTConfig(vocab=VOCAB, seq=SEQ, width=hidden, heads=heads, layers=layers)
            )
            ids = torch.zeros(dp, SEQ, dtype=torch.long)
        annotate_megatron(model, tp=tp)
        t1 = time.perf_counter()
        graph = capture(model, (ids, ids), gpt_loss)
        t2 = time.perf_counter()
        cfg = plait.ParallelConfig(mode="auto", mesh={"dp": dp, "tp": tp}, hardware="a100-80g")
        plan = plan_graph(graph, cfg, model=model)
        t3 = time.perf_counter()
        plan.to_json()
        t4 = time.perf_counter()
        params = sum(p.meta.numel for p in graph.parameters().values()) / 1e9
        print(f"{layers:>6} {hidden:>6} {devices:>7} {f'dp={dp},tp={tp}':>13} {len(graph.ops):>6} "
              f"{params:>7.2f}B {t1 - t0:>6.2f}s {t2 - t1:>7.2f}s {t3 - t2:>6.2f}s "
              f"{t4 - t3:>5.2f}s {t4 - t0:>6.2f}s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1.3B and 13B, small network")
    parser.add_argument("--rows", nargs="*", choices=sorted(ROWS), help="model sizes to plan")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes per cell (best)")
    parser.add_argument("--before", metavar="DIR", help="also time the plait package in DIR")
    parser.add_argument("--no-small", action="store_true", help="skip the small-network table")
    parser.add_argument("--no-scale", action="store_true", help="skip the model-size table")
    parser.add_argument("--issue5", action="store_true", help="issue 5's fixed-mesh table")
    parser.add_argument("--cell", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        kind, a, b = args.cell
        out = cell_scale(a, b) if kind == "scale" else cell_small(a, b)
        print(json.dumps(out))
        return
    if args.issue5:
        issue5_table(args.quick)
        return
    import torch

    rev = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}, commit {rev or '?'}; hardware profile a100-80g, "
        f"sharding_propagation unless named"
    )
    rows = args.rows or (["1.3b", "13b"] if args.quick else list(ROWS))
    if not args.no_scale:
        scale_table(rows, args.runs, args.before)
    if not args.no_small:
        small_table(args.runs, args.before)


if __name__ == "__main__":
    main()
