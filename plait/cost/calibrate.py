"""``plait calibrate``: measure this machine and write the ``local`` hardware profile.

What is measured (each the best of several timed repetitions, to see through the noise of a
shared machine):

    quantity                     how                                          profile field
    matmul FLOP/s per dtype      torch.mm of n x n matrices: 2 n^3 / seconds  peak_flops
    memory bandwidth             dst.copy_(src) of a large tensor: 2 B/s      memory_bandwidth
    op floor                     torch.add on one element                     kernel_latency
    collective alpha and beta    gloo all_reduce between local processes,    intra_node
                                 small to large messages, fitted to
                                 t = 2(p-1) alpha + 2(p-1)/p * bytes / bw

Not measured: the inter-node link (one machine cannot see it); the profile keeps the
uncalibrated 10 GbE default and says so in ``source``. Numbers are achieved throughput, so
the efficiencies are 1.0. The collective measurement runs real processes through
:func:`plait.testing.run_workers`; it is the only place in the cost model that touches
``torch.distributed``, and only inside the spawned workers.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plait.cost.errors import CostError
from plait.cost.hardware import (
    HardwareProfile,
    default_profile_path,
    local_defaults,
    save_profile,
)
from plait.cost.link import Link

__all__ = [
    "CalibrationSettings",
    "calibrate",
    "fit_alpha_beta",
    "format_profile",
    "measure_copy_bandwidth",
    "measure_kernel_latency",
    "measure_matmul_flops",
]


@dataclass(frozen=True, slots=True)
class CalibrationSettings:
    """Sizes and time budgets of one calibration run."""

    matmul_size: int
    """n of the n x n fp32 and bf16 matmuls (fp16, slow on many CPUs, uses n / 2)."""
    copy_bytes: int
    """Bytes of the tensor copied to measure memory bandwidth."""
    budget_s: float
    """Seconds spent repeating each local measurement (at least 2 repetitions)."""
    message_bytes: tuple[int, ...]
    """All-reduce message sizes, small (latency) to large (bandwidth)."""
    collective_reps: int
    """All-reduces timed per message size."""

    @classmethod
    def quick(cls) -> CalibrationSettings:
        return cls(
            matmul_size=512,
            copy_bytes=64 * 2**20,
            budget_s=0.3,
            message_bytes=(4, 4096, 65536, 2**20, 4 * 2**20),
            collective_reps=8,
        )

    @classmethod
    def full(cls) -> CalibrationSettings:
        return cls(
            matmul_size=1024,
            copy_bytes=256 * 2**20,
            budget_s=1.5,
            message_bytes=(4, 1024, 16384, 262144, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20),
            collective_reps=20,
        )


def _best_seconds(fn: Callable[[], object], budget_s: float, min_reps: int = 2) -> float:
    """Fastest of repeated calls (one warm-up first), repeating for about ``budget_s``."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    reps = 0
    while reps < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def measure_matmul_flops(dtype: torch.dtype, n: int, budget_s: float = 0.3) -> float:
    """Achieved FLOP/s of an n x n x n ``torch.mm`` in ``dtype`` on this CPU."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), budget_s)
    return 2 * n**3 / seconds


def measure_copy_bandwidth(nbytes: int, budget_s: float = 0.3) -> float:
    """Achieved memory bandwidth in B/s: a copy reads and writes ``nbytes`` each."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), budget_s)
    return 2 * src.numel() * 4 / seconds


def measure_kernel_latency(budget_s: float = 0.1) -> float:
    """Median seconds of a one-element ``torch.add`` (the floor under any op)."""
    a, b = torch.ones(1), torch.ones(1)
    out = torch.empty(1)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 100 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        torch.add(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _all_reduce_times(message_bytes: Sequence[int], reps: int) -> list[float]:
    """Worker body (runs under :func:`plait.testing.run_workers`): median all_reduce seconds
    per message size on this rank."""
    # The one torch.distributed use of the cost model: real collectives, inside a worker.
    import torch.distributed as dist  # noqa: TID251

    torch.set_num_threads(1)  # the ranks share this machine's cores
    medians = []
    for nbytes in message_bytes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        dist.all_reduce(buf)  # warm-up: connection set-up and allocation
        dist.barrier()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return medians


def fit_alpha_beta(message_bytes: Sequence[int], seconds: Sequence[float], group_size: int) -> Link:
    """Fit ``t = a + b * nbytes`` to all_reduce timings (weights 1/t^2: relative error,
    so small messages pin the latency and large ones the bandwidth) and read the ring model
    ``t = 2(p-1) latency + 2(p-1)/p * nbytes / bandwidth`` off it."""
    if len(message_bytes) != len(seconds) or len(message_bytes) < 2 or group_size < 2:
        raise CostError(
            f"fit_alpha_beta needs >= 2 (size, seconds) pairs of equal length and group_size "
            f">= 2; got {len(message_bytes)} sizes, {len(seconds)} times, group {group_size}"
        )
    w = [1.0 / max(t, 1e-9) ** 2 for t in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, message_bytes, strict=True)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, message_bytes, strict=True))
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, message_bytes, seconds, strict=True))
    slope = sxy / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    # Noise can tip either term below zero; fall back to what the extremes say directly.
    if slope <= 0:
        slope = max(seconds[-1] - seconds[0], 1e-12) / max(message_bytes[-1] - message_bytes[0], 1)
    if intercept <= 0:
        intercept = min(seconds)
    p = group_size
    return Link(bandwidth=2 * (p - 1) / p / slope, latency=intercept / (2 * (p - 1)))


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return local_defaults().memory_bytes


def _measure_local(settings: CalibrationSettings) -> dict[str, Any]:
    n, budget = settings.matmul_size, settings.budget_s
    return {
        "matmul_size": n,
        "peak_flops": {
            "float32": measure_matmul_flops(torch.float32, n, budget),
            "bfloat16": measure_matmul_flops(torch.bfloat16, n, budget),
            "float16": measure_matmul_flops(torch.float16, max(64, n // 2), budget),
        },
        "copy_bytes": settings.copy_bytes,
        "memory_bandwidth": measure_copy_bandwidth(settings.copy_bytes, budget),
        "kernel_latency": measure_kernel_latency(min(budget, 0.1)),
    }


def _measure_collectives(settings: CalibrationSettings, world_size: int) -> list[float]:
    from plait.launch.local import run_workers  # spawns processes: import on use

    per_rank = run_workers(
        _all_reduce_times, world_size, settings.message_bytes, settings.collective_reps
    )
    # A collective is done when its slowest rank is.
    return [max(times) for times in zip(*per_rank, strict=True)]


def calibrate(
    world_size: int = 2,
    out: str | os.PathLike[str] | None = None,
    quick: bool = False,
    settings: CalibrationSettings | None = None,
) -> HardwareProfile:
    """Measure this machine, write the ``local`` profile to ``out`` (default
    :func:`~plait.cost.hardware.default_profile_path`) and return it."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
        raise CostError(
            f"calibrate: world_size={world_size!r} is not allowed; collectives need at least 2 "
            "processes, e.g. --world-size 2"
        )
    settings = settings or (CalibrationSettings.quick() if quick else CalibrationSettings.full())
    local = _measure_local(settings)
    times = _measure_collectives(settings, world_size)
    link = fit_alpha_beta(settings.message_bytes, times, world_size)
    cpus = os.cpu_count() or 1
    measured = {
        **local,
        "all_reduce": {
            "world_size": world_size,
            "message_bytes": list(settings.message_bytes),
            "seconds": times,
        },
        "host": platform.node(),
        "machine": platform.machine(),
        "cpus": cpus,
        "torch": torch.__version__,
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick,
    }
    defaults = local_defaults()
    profile = HardwareProfile(
        name="local",
        peak_flops=local["peak_flops"],
        memory_bytes=_physical_memory(),
        memory_bandwidth=local["memory_bandwidth"],
        intra_node=link,
        inter_node=defaults.inter_node,
        # A CPU host runs as many ranks as asked (gloo over loopback); take at least 8 as one
        # node, like a GPU server. Topology(devices_per_node=...) says otherwise.
        devices_per_node=max(cpus, 8),
        source=(
            f"measured by `plait calibrate{' --quick' if quick else ''}` on {platform.node()} "
            f"({platform.machine()}, {cpus} CPUs, torch {torch.__version__}) at "
            f"{measured['when']}: torch.mm FLOP/s, tensor copy bandwidth, gloo all_reduce "
            f"over {world_size} local processes fitted to alpha-beta; memory is the host's "
            "RAM, shared by its processes; inter_node not measured (10 GbE default)"
        ),
        kernel_latency=local["kernel_latency"],
        measured=measured,
    )
    save_profile(profile, out if out is not None else default_profile_path())
    return profile


def format_profile(profile: HardwareProfile) -> str:
    """A few lines for people: the numbers of ``profile`` in human units."""
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(profile.peak_flops.items()))
    intra, inter = profile.intra_node, profile.inter_node
    return "\n".join(
        [
            f"hardware profile {profile.name!r}",
            f"  matmul GFLOP/s:    {peaks}",
            f"  memory:            {profile.memory_bytes / 2**30:.1f} GiB at "
            f"{profile.memory_bandwidth / 1e9:.2f} GB/s",
            f"  op floor:          {profile.kernel_latency * 1e6:.1f} us",
            f"  intra-node link:   {intra.bandwidth / 1e9:.3f} GB/s, {intra.latency * 1e6:.1f} us "
            "per step",
            f"  inter-node link:   {inter.bandwidth / 1e9:.3f} GB/s, {inter.latency * 1e6:.1f} us "
            "per step",
            f"  devices per node:  {profile.devices_per_node}",
            f"  source: {profile.source}",
        ]
    )
