"""Recompute and optimizer offload on one device: peak memory and step time (issue 14).

One process (a world of one; NCCL on a GPU, gloo on CPU), one GPT, AdamW, the same batches,
six ways taking turns on the same device:

* ``plain``: ``ParallelConfig(mode="data_parallel")`` on its plain-tensor path (the baseline);
* ``program``: the compiled per-rank program with nothing else (``mode="semi_auto"``);
* ``selective`` / ``full``: ``recompute="selective"`` / ``"full"`` (every block);
* ``offload``: ``offload="optimizer"``: AdamW's states and step on the host;
* ``act-host``: ``offload="activations"``: what backward reads waits in host memory;
* ``host-emb``: ``host_modules=("tok",)``: the token embedding kept and computed on the host
  with its gradient and AdamW states (MindSpore's heterogeneous training), on the plain path;
* ``compiled``: the per-rank program through ``torch.compile`` (``compile=True``).

On CUDA each case's peak is ``torch.cuda.max_memory_allocated`` over its timed steps, and the
bytes kept from forward for backward are the program's own count. Each case's losses must
equal the baseline's (``--rtol``), so they do equal work. On CPU (no GPU) the script runs the
same cases with peak memory left out: a check that it works before a GPU is lent.

Run: ``python bench/gpu_memory.py`` (``--device cpu --width 128 --layers 2 --seq 64`` for a
quick CPU check).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from typing import Any

import torch

import plait
from plait import ParallelConfig
from plait.models import GPTConfig, TinyGPT, gpt_loss, token_batches


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) in every case")
    p.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated cases, the first the baseline"
    )
    return p.parse_args()


CASES: dict[str, dict[str, Any]] = {
    "plain": {"mode": "data_parallel"},
    "program": {"mode": "semi_auto"},
    "selective": {"mode": "semi_auto", "recompute": "selective"},
    "full": {"mode": "semi_auto", "recompute": "full"},
    "offload": {"mode": "semi_auto", "offload": "optimizer"},
    "act-host": {"mode": "semi_auto", "offload": "activations"},
    "host-emb": {"mode": "data_parallel", "host_modules": ("tok",)},
    "compiled": {"mode": "semi_auto", "compile": True},
}


def _adamw(params: Any, fused: bool = False) -> torch.optim.Optimizer:
    # fused=True: torch's fused AdamW kernels, on the GPU and on the host alike
    return torch.optim.AdamW(params, lr=1e-4, fused=fused or None)


def main() -> None:
    args = _args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    cuda = args.device == "cuda"
    plait.init(backend="nccl" if cuda else "gloo")
    device = torch.device(args.device)
    cfg = GPTConfig(
        vocab=args.vocab, seq=args.seq, width=args.width, heads=args.heads, layers=args.layers
    )
    torch.manual_seed(0)
    base = TinyGPT(cfg).to(device)
    batches = [
        (ids.to(device), targets.to(device))
        for ids, targets in token_batches(cfg, args.batch, args.warmup + args.steps)
    ]
    params = sum(p.numel() for p in base.parameters())
    print(
        f"GPT width {cfg.width}, {cfg.layers} layers, seq {cfg.seq}, vocab {cfg.vocab}, batch "
        f"{args.batch}: {params / 1e6:.1f} M parameters, on {device} "
        f"({torch.cuda.get_device_name() if cuda else 'cpu'}), torch {torch.__version__}"
    )
    rows = []
    reference: list[float] | None = None
    for name in args.cases.split(","):
        settings = CASES[name]
        try:
            rows.append(_case(name, settings, base, batches, args, cuda))
        except Exception as e:  # report and go on: one failing case must not hide the others
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}")
            continue
        if reference is None:
            reference = rows[-1]["losses"]
        else:
            for a, b in zip(rows[-1]["losses"], reference, strict=True):
                if abs(a - b) > args.rtol * abs(b):
                    print(f"{name}: loss {a} differs from the baseline's {b}")
    _table(rows, cuda)


def _case(
    name: str, settings: dict[str, Any], base: Any, batches: list[Any], args: Any, cuda: bool
) -> dict[str, Any]:
    model = copy.deepcopy(base)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    started = time.perf_counter()
    job = plait.parallelize(
        model,
        ParallelConfig(mesh={"dp": 1}, **settings),
        optimizer=functools.partial(_adamw, fused=args.fused),
        loss_fn=gpt_loss,
        example_batch=batches[0],
    )
    setup = time.perf_counter() - started
    losses = [job.step(b) for b in batches[: args.warmup]]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for b in batches[args.warmup :]:
        t = time.perf_counter()
        losses.append(job.step(b))  # returns a float: the step is complete
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    if settings.get("host_modules"):
        _print_host_placement(job, settings["host_modules"])
    program = getattr(job, "program", None)
    kept = getattr(program, "saved_bytes", None) if program is not None else None
    moved = getattr(program, "offloaded_bytes", 0) if program is not None else 0
    if moved:
        kept = (0, -moved)  # shown as bytes moved to the host (negative)
    del job, model
    return {
        "case": name,
        "setup_s": setup,
        "step_s": statistics.median(times),
        "peak": peak,
        "kept": kept[1] if kept else None,
        "losses": losses,
    }


def _print_host_placement(job: Any, paths: tuple[str, ...]) -> None:
    """Where the host modules' parameters, gradients and optimizer states are."""
    for path in paths:
        for name, p in job.model.get_submodule(path).named_parameters():
            state = job.optimizer.state.get(p, {})
            where = {k: str(v.device) for k, v in state.items() if isinstance(v, torch.Tensor)}
            grad = None if p.grad is None else p.grad.device
            print(f"  {path}.{name}: parameter on {p.device}, gradient on {grad}, states {where}")


def _table(rows: list[dict[str, Any]], cuda: bool) -> None:
    base = rows[0] if rows else None
    print(f"{'case':<10} {'step ms':>9} {'x plain':>8} {'peak GiB':>9} {'x plain':>8} "
          f"{'kept GiB':>9} {'setup s':>8}")  # fmt: skip
    for r in rows:
        ratio = r["step_s"] / base["step_s"] if base else float("nan")
        peak = f"{r['peak'] / 2**30:9.2f}" if cuda else f"{'-':>9}"
        peak_ratio = (
            f"{r['peak'] / base['peak']:8.2f}" if cuda and base and base["peak"] else f"{'-':>8}"
        )
        kept = f"{r['kept'] / 2**30:9.3f}" if r["kept"] is not None else f"{'-':>9}"
        print(f"{r['case']:<10} {r['step_s'] * 1e3:9.1f} {ratio:8.2f} {peak} {peak_ratio} {kept} "
              f"{r['setup_s']:8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
