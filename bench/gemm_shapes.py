"""Matmul time by shape: the datasheet profiles' GEMM pricing against published measurements.

Issue 17 item 2 asks for matmul efficiency by shape "published for the profiles". What is
published, by shape, and where (the data files' headers give commits and caveats):

- ``bench/data/h100_gemm_openxla.csv``: OpenXLA's default GEMM performance table for sm_90
  (H100), bf16, batch 1, 125 shapes with m, n, k in 256 .. 4096. The ``h100`` profile's
  GEMM constants (compute efficiency 0.78, memory efficiency 0.7, ``matmul_latency`` 6 us)
  were fitted to the 55 rows marked ``fit``; the other 70 are held out.
  ``bench/data/h100_gemm_openxla_batched.csv``: 20 batched products of the same table
  (batch 2 and 4), held out too.
- ``bench/data/a100_gemm_published.csv``: fp16 GEMMs on (very probably) an A100: Triton's
  tutorial cuBLAS squares and the EleutherAI cookbook's transformer-layer GEMMs. Not used in
  the fit: the A100 profile takes the H100's constants, and this table checks them.

Each row is priced as plait's cost model prices one matmul kernel
(``plait.cost.compute.op_seconds(..., matmul=True)``: ``max(flops / (peak x 0.78),
bytes / (bandwidth x 0.7)) + 6 us``, never under the 7 us floor), against the same op priced
the way the profiles did before (efficiency 0.7 for both, the 7 us floor, no GEMM latency).

    .venv/bin/python bench/gemm_shapes.py            # summary tables
    .venv/bin/python bench/gemm_shapes.py --rows     # and every H100 shape
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.cost import HardwareProfile, get_profile
from plait.cost.compute import op_seconds

DATA = Path(__file__).resolve().parent / "data"


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One published measurement: ``batch`` products ``C[m, n] = A[m, k] @ B[k, n]``."""

    batch: int
    m: int
    n: int
    k: int
    tflops: float
    label: str

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def nbytes(self, element: int) -> int:
        return element * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)

    def measured_s(self) -> float:
        return self.flops / (self.tflops * 1e12)


def read_table(path: Path) -> list[Gemm]:
    """The rows of a data file (``#`` lines are its header of sources)."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    rows = []
    for r in csv.DictReader(lines):
        label = r.get("set") or (f"{r['source']}: {r['what']}" if "source" in r else "batched")
        rows.append(
            Gemm(
                int(r.get("batch", 1)),
                int(r["m"]),
                int(r["n"]),
                int(r["k"]),
                float(r["tflops"]),
                label,
            )
        )
    return rows


def before(profile: HardwareProfile) -> HardwareProfile:
    """The profile as it priced matmuls before the published fit: 0.7 for compute, no GEMM
    latency (the 7 us floor only)."""
    return dataclasses.replace(profile, compute_efficiency=0.7, matmul_latency=0.0)


def predicted_s(g: Gemm, profile: HardwareProfile, dtype: str) -> float:
    element = 2 if dtype in ("bfloat16", "float16") else 4
    return op_seconds(g.flops, g.nbytes(element), dtype, profile, matmul=True)


def ratios(rows: Iterable[Gemm], profile: HardwareProfile, dtype: str) -> list[float]:
    """Predicted over measured seconds, a row each (above 1: plait predicts it slower)."""
    return [predicted_s(g, profile, dtype) / g.measured_s() for g in rows]


def summary(r: list[float]) -> str:
    errors = [abs(math.log(x)) for x in r]
    within = sum(e < math.log(1.25) for e in errors)
    geo = math.exp(statistics.mean(math.log(x) for x in r))
    median = math.exp(statistics.median(errors)) - 1
    return f"{within}/{len(r)} | {median:.1%} | {geo:.3f} | {min(r):.2f} .. {max(r):.2f}"


def h100_tables(show_rows: bool) -> None:
    rows = read_table(DATA / "h100_gemm_openxla.csv")
    h100 = get_profile("h100")
    print("## H100, bf16: OpenXLA's published GEMM table (sm_90, batch 1)\n")
    print("| rows | pricing | within 25 % | median error | geo-mean pred/meas | range |")
    print("|---|---|---|---|---|---|")
    for name, subset in (
        ("fit (55)", [g for g in rows if g.label == "fit"]),
        ("held out (70)", [g for g in rows if g.label == "held_out"]),
        ("all (125)", rows),
    ):
        print(f"| {name} | now | {summary(ratios(subset, h100, 'bfloat16'))} |")
        print(f"| {name} | before | {summary(ratios(subset, before(h100), 'bfloat16'))} |")
    print("\nBy the smallest of m, n, k (all 125 rows; now / before):\n")
    print("| smallest dim | rows | within 25 % now | before | geo-mean now | before |")
    print("|---:|---:|---|---|---:|---:|")
    for d in sorted({min(g.m, g.n, g.k) for g in rows}):
        sub = [g for g in rows if min(g.m, g.n, g.k) == d]
        now, old = ratios(sub, h100, "bfloat16"), ratios(sub, before(h100), "bfloat16")
        w_now = sum(abs(math.log(x)) < math.log(1.25) for x in now)
        w_old = sum(abs(math.log(x)) < math.log(1.25) for x in old)
        g_now = math.exp(statistics.mean(math.log(x) for x in now))
        g_old = math.exp(statistics.mean(math.log(x) for x in old))
        print(f"| {d} | {len(sub)} | {w_now} | {w_old} | {g_now:.3f} | {g_old:.3f} |")
    batched = read_table(DATA / "h100_gemm_openxla_batched.csv")
    print("\nBatched products (batch 2 and 4, both operands batched; none used in the fit):\n")
    print("| rows | pricing | within 25 % | median error | geo-mean pred/meas | range |")
    print("|---|---|---|---|---|---|")
    print(f"| batched ({len(batched)}) | now | {summary(ratios(batched, h100, 'bfloat16'))} |")
    old = before(h100)
    print(f"| batched ({len(batched)}) | before | {summary(ratios(batched, old, 'bfloat16'))} |")
    if show_rows:
        print("\n| m x n x k | set | published TFLOP/s | predicted | pred/meas time | before |")
        print("|---|---|---:|---:|---:|---:|")
        for g in rows:
            t = predicted_s(g, h100, "bfloat16")
            old = predicted_s(g, before(h100), "bfloat16")
            print(
                f"| {g.m} x {g.n} x {g.k} | {g.label} | {g.tflops:.1f} | "
                f"{g.flops / t / 1e12:.1f} | {t / g.measured_s():.2f} | "
                f"{old / g.measured_s():.2f} |"
            )


def a100_table() -> None:
    rows = read_table(DATA / "a100_gemm_published.csv")
    a100 = get_profile("a100-80g")
    print("\n## A100, fp16: published GEMMs (Triton tutorial, EleutherAI cookbook)\n")
    print(
        "| source: GEMM | batch x m x n x k | published TFLOP/s | predicted | pred/meas time | before |"
    )
    print("|---|---|---:|---:|---:|---:|")
    now_r, old_r = [], []
    for g in rows:
        t = predicted_s(g, a100, "float16")
        old = predicted_s(g, before(a100), "float16")
        now_r.append(t / g.measured_s())
        old_r.append(old / g.measured_s())
        print(
            f"| {g.label} | {g.batch} x {g.m} x {g.n} x {g.k} | {g.tflops:.1f} | "
            f"{g.flops / t / 1e12:.1f} | {now_r[-1]:.2f} | {old_r[-1]:.2f} |"
        )
    print(
        f"\nA100 rows within 25 %, median error, geo-mean, range: now {summary(now_r)}; "
        f"before {summary(old_r)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="print every H100 shape")
    args = parser.parse_args()
    h100_tables(args.rows)
    a100_table()


if __name__ == "__main__":
    main()
