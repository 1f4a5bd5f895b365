"""``plait calibrate``: measure this machine and write the ``local`` hardware profile.

Everything is measured inside the job's own world: ``world_size`` processes started
together on this machine, each with the torch threads ``plait run`` gives a worker
(``cores // world_size``, at least 1), all measuring at once, so a number is what one rank
gets while the others run too (four ranks on two cores each see about half a core). The
profile takes the median over ranks of each compute figure (the best of several timed
repetitions on each rank) and the slowest rank of each collective:

    quantity                     how                                          profile field
    matmul FLOP/s per dtype      torch.mm of n x n matrices: 2 n^3 / seconds  peak_flops
    matmul share by shape        fp32 torch.mm with one dimension d small     matmul_efficiency
                                 (512 x d x 512 and 512 x 512 x d), over
                                 the n x n rate
    network efficiency           forward and backward of 4 MLP blocks         compute_efficiency
                                 (256 -> 1024 -> 256, 512 rows) over the
                                 n x n rate
    batched product share        attention's q @ k^T and p @ v on head-split  batched_matmul_
                                 views (4 x 8 heads of 128 x d), over the     efficiency
                                 n x n rate
    element rates                forward and backward of gelu, silu, tanh,    elementwise_rates
                                 sigmoid, softmax, log_softmax, layer_norm,
                                 cross_entropy on 512 x 1024 fp32: elements
                                 per second
    memory bandwidth             dst.copy_(src) of a large tensor: 2 B/s      memory_bandwidth
    op floor                     torch.add on one element                     kernel_latency
    per-op host cost             forward and backward of a small stack of     op_overhead,
                                 layers on tiny tensors, per captured op      call_overhead
                                 and pass (3 per op: forward and its
                                 backward) less the floor, and per aten
                                 call (the optimizer's kernels)
    collective alpha and beta    gloo all_reduce between the processes,      intra_node
                                 small to large messages, fitted to
                                 t = 2(p-1) alpha + 2(p-1)/p * bytes / bw
    wait latency                 a small all-reduce within rank pairs (the    wait_latency
                                 two kinds of a 2-D mesh) that compute the
                                 same between them, as a step's ranks do:
                                 the mean time from arriving to its end,
                                 less the time when started in step
    overlap                      the largest all_reduce started async while   comm_overlap
                                 matmuls of about its length run: the share
                                 of the shorter of the two that the pair
                                 saves against running them one after the
                                 other

Not measured: the inter-node link (one machine cannot see it); the profile keeps the
uncalibrated 10 GbE default and says so in ``source``. Numbers are achieved throughput, so
the memory efficiency is 1.0; the compute efficiency is what a stack of linear layers reaches
of the square product's rate (below). The collective measurement runs real processes through
``calibrate``'s ``spawn`` (:func:`plait.launch.local.run_workers`, given by the caller); it is
the only place in the cost model that touches ``torch.distributed``, and only inside the
spawned workers.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

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
    "calibrate_in_world",
    "fit_alpha_beta",
    "format_profile",
    "measure_batched_shares",
    "measure_copy_bandwidth",
    "measure_elementwise_rates",
    "measure_host_costs",
    "measure_kernel_latency",
    "measure_matmul_flops",
    "measure_network_efficiency",
    "mismatch",
    "worker_threads",
]


ELEMENTWISE_SHAPE = (512, 1024)
"""Rows x columns of the fp32 tensor each elementwise op is measured on (2 MiB: a layer's
activations on a rank)."""


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
    thin_dims: tuple[int, ...] = (16, 32, 64, 128, 256)
    """The small dimension d of the thin matmuls (``matmul_efficiency``), below matmul_size."""
    network_width: int = 256
    """Width of the MLP blocks whose forward and backward give ``compute_efficiency``."""
    elementwise_shape: tuple[int, int] = ELEMENTWISE_SHAPE
    """Rows x columns of the fp32 tensor the element rates are measured on."""
    wait_products: int = 8
    """256 x 256 products each rank computes between the all-reduces that measure
    ``wait_latency`` (8: about 7 ms of a core; a step whose ranks compute longer between
    collectives arrive further apart)."""
    rounds: int = 1
    """Times the host and latency figures are measured (the op floor, the per-op and per-call
    host costs, all-reduce times, the wait latency: cheap, and on a shared machine the
    noisiest), the rounds one after another; each is the median of its rounds, so a burst of
    another job's load spoils one round, not the figure. The throughput figures are measured
    once."""

    @classmethod
    def quick(cls) -> CalibrationSettings:
        return cls(
            matmul_size=512,
            copy_bytes=64 * 2**20,
            budget_s=0.3,
            message_bytes=(4, 4096, 65536, 2**20, 4 * 2**20),
            collective_reps=8,
            thin_dims=(32, 128),
        )

    @classmethod
    def brief(cls) -> CalibrationSettings:
        """A few seconds inside a job's own workers (``make demo``'s calibration): every
        figure measured on small sizes for 40 ms, the host and latency ones in 3 rounds; the
        ranks compute 4 products between the all-reduces that time ``wait_latency`` (a small
        model computes a few ms between its collectives)."""
        return cls(
            matmul_size=256,
            copy_bytes=8 * 2**20,
            budget_s=0.04,
            message_bytes=(4, 65536, 2**20),
            collective_reps=8,
            thin_dims=(32, 128),
            network_width=64,
            elementwise_shape=(128, 1024),
            wait_products=4,
            rounds=3,
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


def _seconds(
    fn: Callable[[], object], budget_s: float, min_reps: int = 2, *, shared: bool = False
) -> float:
    """Seconds of one call of ``fn`` (one warm-up first), repeating for about ``budget_s``:
    the fastest call alone, or with ``shared`` (other ranks measuring on the same cores) the
    mean over the whole window, which is the throughput a rank gets while it shares them (the
    fastest call there is one the scheduler happened to give a whole core)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    reps = 0
    while reps < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return (time.perf_counter() - start) / reps if shared else best


def measure_matmul_flops(
    dtype: torch.dtype, n: int, budget_s: float = 0.3, *, shared: bool = False
) -> float:
    """Achieved FLOP/s of an n x n x n ``torch.mm`` in ``dtype`` on this CPU."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = _seconds(lambda: torch.mm(a, b, out=out), budget_s, shared=shared)
    return 2 * n**3 / seconds


def measure_matmul_shares(
    dims: Sequence[int], peak: float, budget_s: float = 0.3, *, shared: bool = False
) -> dict[int, float]:
    """Per small dimension ``d``: the fp32 FLOP/s of ``512 x d x 512`` and ``512 x 512 x d``
    products (mean of the two) over ``peak`` (the n x n rate), at most 1."""
    shares = {}
    for d in dims:
        rates = []
        for m, k, n in ((512, d, 512), (512, 512, d)):
            gen = torch.Generator().manual_seed(0)
            a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
            out = torch.empty(m, n)
            seconds = _seconds(functools.partial(torch.mm, a, b, out=out), budget_s, shared=shared)
            rates.append(2 * m * n * k / seconds)
        shares[d] = min(1.0, statistics.mean(rates) / peak)
    return shares


def measure_network_efficiency(
    peak: float, width: int = 256, budget_s: float = 0.3, *, shared: bool = False
) -> float:
    """The share of ``peak`` (the square product's fp32 rate) a stack of linear layers
    reaches in forward and backward together: 4 blocks of ``width -> 4 width -> width`` on
    ``512 x width`` rows, as a transformer's MLP runs them, at most 1. Inside a network the
    weights and activations stream from memory between products, which an isolated square
    product, its operands in cache, never sees."""
    gen = torch.Generator().manual_seed(0)
    layers: list[torch.nn.Linear] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(512, width, generator=gen)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    # forward, input and weight gradients (the first layer's input gradient is not needed)
    flops = 3 * sum(2 * 512 * m.in_features * m.out_features for m in layers)
    flops -= 2 * 512 * width * 4 * width
    seconds = _seconds(step, budget_s, min_reps=3, shared=shared)
    return min(1.0, flops / seconds / peak)


ATTENTION_SEQ = 128
"""Sequence length of the batched products calibrate measures (4 x 8 heads)."""


def measure_batched_shares(
    dims: Sequence[int], peak: float, budget_s: float = 0.3, *, shared: bool = False
) -> dict[int, float]:
    """Per head dimension ``d``: the fp32 FLOP/s of attention's two batched products on
    head-split views, as a model makes them (``q @ k^T`` with ``k`` transposed, ``p @ v``:
    ``4 x 8`` heads of ``128 x d``), mean of the two, over ``peak``, at most 1."""
    shares = {}
    b, h, s = 4, 8, ATTENTION_SEQ
    for d in dims:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(b, s, h * d, generator=gen)
        q = x.view(b, s, h, d).transpose(1, 2)
        p = torch.randn(b, h, s, s, generator=gen)
        flops = 2 * b * h * s * s * d
        rates = [
            flops
            / _seconds(
                functools.partial(torch.matmul, q, q.transpose(-1, -2)), budget_s, shared=shared
            ),
            flops / _seconds(functools.partial(torch.matmul, p, q), budget_s, shared=shared),
        ]
        shares[d] = min(1.0, statistics.mean(rates) / peak)
    return shares


def _elementwise_ops(
    shape: tuple[int, int] = ELEMENTWISE_SHAPE,
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The ops whose forward-and-backward element rate calibrate measures, by the aten name
    a capture gives them: those whose arithmetic can outrun their bytes on a CPU."""
    import torch.nn.functional as F

    cols = shape[1]
    weight, bias = torch.ones(cols, requires_grad=True), torch.zeros(cols, requires_grad=True)
    labels = torch.arange(shape[0]) % cols
    return {
        "gelu": F.gelu,
        "silu": F.silu,
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
        "softmax": lambda x: x.softmax(-1),
        "log_softmax": lambda x: x.log_softmax(-1),
        "layer_norm": lambda x: F.layer_norm(x, (cols,), weight, bias),
        "cross_entropy_loss": lambda x: F.cross_entropy(x, labels),
    }


def measure_elementwise_rates(
    budget_s: float = 0.3,
    *,
    shared: bool = False,
    shape: tuple[int, int] = ELEMENTWISE_SHAPE,
) -> dict[str, float]:
    """Per op of :func:`_elementwise_ops`: elements per second of its forward and backward
    together on an fp32 tensor of ``shape`` (default :data:`ELEMENTWISE_SHAPE`)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).requires_grad_()
    rates = {}
    for name, fn in _elementwise_ops(shape).items():

        def step(fn: Callable[[torch.Tensor], torch.Tensor] = fn) -> None:
            y = fn(x)
            y.backward(torch.ones_like(y))
            x.grad = None

        rates[name] = x.numel() / _seconds(step, budget_s, shared=shared)
    return rates


def measure_copy_bandwidth(nbytes: int, budget_s: float = 0.3, *, shared: bool = False) -> float:
    """Achieved memory bandwidth in B/s: a copy reads and writes ``nbytes`` each."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _seconds(lambda: dst.copy_(src), budget_s, shared=shared)
    return 2 * src.numel() * 4 / seconds


def measure_kernel_latency(budget_s: float = 0.1, *, shared: bool = False) -> float:
    """Seconds of a one-element ``torch.add`` (the floor under any op): the median call, or
    with ``shared`` the mean (see :func:`_seconds`)."""
    a, b = torch.ones(1), torch.ones(1)
    out = torch.empty(1)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 100 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        torch.add(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times) if shared else statistics.median(times)


def _tiny_layers(width: int = 16, depth: int = 8) -> torch.nn.Sequential:
    """A stack of transformer-like layers on tiny tensors: its step is all host cost."""
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [
            torch.nn.LayerNorm(width),
            torch.nn.Linear(width, 2 * width),
            torch.nn.GELU(),
            torch.nn.Linear(2 * width, width),
        ]
    return torch.nn.Sequential(*layers)


def measure_host_costs(
    kernel_latency: float, budget_s: float = 0.3, *, shared: bool = False
) -> tuple[float, float]:
    """``(op_overhead, call_overhead)``: host seconds per captured op and pass beyond the
    floor, and per aten call, from a forward and backward of :func:`_tiny_layers` (tiny
    tensors: no arithmetic to speak of).

    The cost model charges ``op_overhead`` per op its capture (torch.export) makes, once for
    the forward and twice for the backward: the stack captures as one op per module
    (``layer_norm``, ``linear``, ``gelu``, ``linear``), each of which runs several aten calls
    in eager forward and backward (a linear's view, transpose and addmm; autograd's
    accumulation), all of which its price carries. ``call_overhead`` divides the same step
    over those aten calls, counted: what one elementwise kernel (the optimizer's) costs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _tiny_layers()
    x = torch.randn(2, 4, 16)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    seconds = _seconds(step, budget_s, min_reps=5, shared=shared)
    ops = len(model)  # the captured ops: one aten op per module of the stack
    return max(0.0, seconds / (3 * ops) - kernel_latency), seconds / Count.calls


def worker_threads(world_size: int) -> int:
    """Torch threads a worker of a ``world_size`` job on this machine runs with, as ``plait
    run`` (like torchrun) sets ``OMP_NUM_THREADS``: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _rank_measurements(settings: CalibrationSettings, threads: int) -> dict[str, Any]:
    """Worker body (under :func:`plait.testing.run_workers`): this rank's compute figures,
    measured while every other rank measures the same, then its all-reduce timings."""
    # The one torch.distributed use of the cost model: real collectives, inside a worker.
    import torch.distributed as dist  # noqa: TID251

    torch.set_num_threads(threads)
    local = _measure_local(settings, sync=dist.barrier, shared=True)
    dist.barrier()
    rounds = [
        {
            "local": local,
            "all_reduce": _all_reduce_times(settings.message_bytes, settings.collective_reps),
            "overlap": _overlap_fraction(max(settings.message_bytes), settings.collective_reps),
            "wait_latency": _wait_latency(6 * settings.collective_reps, settings.wait_products),
        }
    ]
    for _ in range(settings.rounds - 1):
        dist.barrier()
        latency = measure_kernel_latency(min(settings.budget_s, 0.1), shared=True)
        dist.barrier()
        host = measure_host_costs(latency, settings.budget_s, shared=True)
        dist.barrier()
        rounds.append(
            {
                "local": {
                    "kernel_latency": latency,
                    "op_overhead": host[0],
                    "call_overhead": host[1],
                },
                "all_reduce": _all_reduce_times(settings.message_bytes, settings.collective_reps),
                "wait_latency": _wait_latency(6 * settings.collective_reps, settings.wait_products),
            }
        )
    return cast("dict[str, Any]", _median_of_rounds(rounds))


def _median_of_rounds(rounds: Sequence[Any]) -> Any:
    """The rounds' measurements (dicts, lists and numbers) as one: each number the median of
    the rounds that have it (nan where each of them has nan); the first round holds every
    figure, later rounds the host and latency ones alone."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: _median_of_rounds([r[k] for r in rounds if k in r]) for k in first}
    if isinstance(first, list):
        return [_median_of_rounds(list(z)) for z in zip(*rounds, strict=True)]
    if all(r == first for r in rounds) or not isinstance(first, int | float):
        return first
    values = [float(r) for r in rounds]
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _all_reduce_times(message_bytes: Sequence[int], reps: int) -> list[float]:
    """Median all_reduce seconds per message size on this rank (inside a worker)."""
    import torch.distributed as dist  # noqa: TID251

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


def _wait_latency(reps: int, products: int = 8) -> float:
    """Seconds a small all-reduce between two ranks costs a step beyond its time between
    ranks already in step (inside a worker; nan on a rank in no pair).

    The ranks compute the same between the all-reduces (``products`` 256 x 256 matmuls), as a
    step's ranks do between its collectives, and alternate between the two kinds of pair a
    2-D mesh has, neighbours ``(r, r ^ 1)`` (a tensor-parallel group) and ranks two apart
    ``(r, r ^ 2)`` (a data-parallel group across it). The figure is the **mean** over ``reps``
    all-reduces of the time from the rank's arrival to the end, less the median time of the
    same all-reduce started straight after a barrier: a step pays the sum of its waits, so
    their mean, not the typical one. Ranks that share cores arrive apart (the scheduler ran
    one and not the other) and one blocked waits for a core to run again, so on four ranks
    of two cores this is a millisecond or two where between idle ranks it is nothing."""
    import torch.distributed as dist  # noqa: TID251

    rank, world = dist.get_rank(), dist.get_world_size()
    # every rank creates every group, in the same order (new_group is collective)
    groups = [g for stride in (1, 2) if (g := _pair_group(rank, world, stride)) is not None]
    message = torch.zeros(1024)
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    in_step, spread = [], []
    dist.barrier()
    for i in range(reps):
        for _ in range(products):
            torch.mm(a, a)
        if groups:
            t0 = time.perf_counter()
            dist.all_reduce(message, group=groups[i % len(groups)])
            spread.append(time.perf_counter() - t0)
    for i in range(max(4, reps // 2)):
        dist.barrier()
        if groups:
            t0 = time.perf_counter()
            dist.all_reduce(message, group=groups[i % len(groups)])
            in_step.append(time.perf_counter() - t0)
    dist.barrier()
    if not groups:
        return float("nan")
    return max(0.0, statistics.fmean(spread) - statistics.median(in_step))


def _pair_group(rank: int, world: int, stride: int) -> Any:
    """This rank's group of the pairs ``(r, r ^ stride)`` (every rank makes every pair's
    group, as ``new_group`` asks); None when ``rank`` has no partner or the world has no such
    pair."""
    import torch.distributed as dist  # noqa: TID251

    pairs = [[r, r ^ stride] for r in range(world) if r & stride == 0 and r ^ stride < world]
    if not pairs:
        return None
    mine = None
    for pair in pairs:
        group = dist.new_group(pair)
        if rank in pair:
            mine = group
    return mine


def _overlap_fraction(nbytes: int, reps: int) -> float:
    """How much of an all_reduce of ``nbytes`` hides behind matmuls of about its length that
    run while it is in flight (inside a worker): ``(comm + compute - both) / min(comm,
    compute)``, medians of ``reps`` timings each, in [0, 1]. gloo runs a collective on its
    own threads, so on spare cores it hides entirely; on cores the ranks' compute already
    fills, little does."""
    import torch.distributed as dist  # noqa: TID251

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    a = torch.randn(128, 128)

    def timed(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    dist.all_reduce(buf)  # warm-up
    comm = timed(lambda: dist.all_reduce(buf))
    one = timed(lambda: torch.mm(a, a))
    matmuls = max(1, round(comm / max(one, 1e-9)))
    # every rank runs the same collectives in the same order; only the matmul count differs

    def compute() -> None:
        for _ in range(matmuls):
            torch.mm(a, a)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    alone = timed(compute)
    together = timed(both)
    saved = comm + alone - together
    return min(1.0, max(0.0, saved / max(min(comm, alone), 1e-12)))


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


def _measure_local(
    settings: CalibrationSettings, sync: Callable[[], object] = lambda: None, shared: bool = False
) -> dict[str, Any]:
    """This process's compute figures; ``sync`` runs before each (a barrier in a world, so
    the ranks measure each figure together, ``shared``: see :func:`_seconds`)."""
    n, budget = settings.matmul_size, settings.budget_s

    def measured(fn: Callable[..., float], *args: Any) -> float:
        sync()
        return fn(*args, shared=shared)

    latency = measured(measure_kernel_latency, min(budget, 0.1))
    fp32 = measured(measure_matmul_flops, torch.float32, n, budget)
    dims = [d for d in settings.thin_dims if d < n]
    sync()
    shares = measure_matmul_shares(dims, fp32, budget / (2 * max(1, len(dims))), shared=shared)
    heads = [d for d in settings.thin_dims if d <= ATTENTION_SEQ]
    sync()
    batched = measure_batched_shares(heads, fp32, budget / (2 * max(1, len(heads))), shared=shared)
    sync()
    elementwise = measure_elementwise_rates(
        budget / 8, shared=shared, shape=settings.elementwise_shape
    )
    sync()
    host = measure_host_costs(latency, budget, shared=shared)
    sync()
    network = measure_network_efficiency(
        fp32, settings.network_width, budget_s=budget, shared=shared
    )
    return {
        "matmul_size": n,
        "matmul_shares": {str(d): f for d, f in shares.items()},
        "batched_shares": {str(d): f for d, f in batched.items()},
        "elementwise_rates": elementwise,
        "peak_flops": {
            "float32": fp32,
            "bfloat16": measured(measure_matmul_flops, torch.bfloat16, n, budget),
            "float16": measured(measure_matmul_flops, torch.float16, max(64, n // 2), budget),
        },
        "copy_bytes": settings.copy_bytes,
        "memory_bandwidth": measured(measure_copy_bandwidth, settings.copy_bytes, budget),
        "kernel_latency": latency,
        "op_overhead": host[0],
        "call_overhead": host[1],
        "network_efficiency": network,
    }


Spawn = Callable[..., list[Any]]
"""``spawn(fn, world_size, *args)``: ``fn(*args)`` on ``world_size`` gloo processes, each
rank's result (:func:`plait.launch.local.run_workers`)."""


def _measure_world(
    spawn: Spawn, settings: CalibrationSettings, world_size: int
) -> dict[str, Any]:
    """Every rank's figures, measured together: the median rank's compute figures and the
    slowest rank's all-reduce times (a collective is done when its slowest rank is)."""
    threads = worker_threads(world_size)
    per_rank = spawn(_rank_measurements, world_size, settings, threads)
    return _combine(per_rank, settings, threads)


def _combine(
    per_rank: Sequence[dict[str, Any]], settings: CalibrationSettings, threads: int
) -> dict[str, Any]:
    """The world's figures from every rank's :func:`_rank_measurements`: the median rank's
    compute figures, the slowest rank's all-reduce times."""
    locals_ = [r["local"] for r in per_rank]

    def median(*keys: str) -> float:
        values = []
        for x in locals_:
            for key in keys:
                x = x[key]
            values.append(float(cast(float, x)))
        return statistics.median(values)

    local = {
        "matmul_size": settings.matmul_size,
        "peak_flops": {dtype: median("peak_flops", dtype) for dtype in locals_[0]["peak_flops"]},
        "matmul_shares": {d: median("matmul_shares", d) for d in locals_[0]["matmul_shares"]},
        "batched_shares": {d: median("batched_shares", d) for d in locals_[0]["batched_shares"]},
        "elementwise_rates": {
            op: median("elementwise_rates", op) for op in locals_[0]["elementwise_rates"]
        },
        "copy_bytes": settings.copy_bytes,
        "memory_bandwidth": median("memory_bandwidth"),
        "kernel_latency": median("kernel_latency"),
        "op_overhead": median("op_overhead"),
        "call_overhead": median("call_overhead"),
        "network_efficiency": median("network_efficiency"),
        "threads_per_rank": threads,
        "per_rank": locals_,
    }
    times = [max(t) for t in zip(*(r["all_reduce"] for r in per_rank), strict=True)]
    local["overlap_per_rank"] = [r["overlap"] for r in per_rank]
    waits = [r["wait_latency"] for r in per_rank if not math.isnan(r["wait_latency"])]
    local["wait_latency_per_rank"] = waits
    return {
        "local": local,
        "all_reduce": times,
        "overlap": statistics.median(r["overlap"] for r in per_rank),
        "wait_latency": statistics.median(waits),
    }


def calibrate(
    spawn: Spawn,
    world_size: int = 2,
    out: str | os.PathLike[str] | None = None,
    quick: bool = False,
    settings: CalibrationSettings | None = None,
) -> HardwareProfile:
    """Measure this machine, write the ``local`` profile to ``out`` (default
    :func:`~plait.cost.hardware.default_profile_path`) and return it. ``spawn`` runs the
    measurement on ``world_size`` processes (:func:`plait.launch.local.run_workers`, given by
    the caller: the cost model starts no process of its own, nor imports the launcher)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
        raise CostError(
            f"calibrate: world_size={world_size!r} is not allowed; collectives need at least 2 "
            "processes, e.g. --world-size 2"
        )
    settings = settings or (CalibrationSettings.quick() if quick else CalibrationSettings.full())
    world = _measure_world(spawn, settings, world_size)
    how = f"`plait calibrate{' --quick' if quick else ''}`"
    profile = _profile_of(world, settings, world_size, how, quick=quick)
    save_profile(profile, out if out is not None else default_profile_path())
    return profile


def _profile_of(
    world: dict[str, Any],
    settings: CalibrationSettings,
    world_size: int,
    how: str,
    *,
    quick: bool,
    when: str | None = None,
) -> HardwareProfile:
    """The ``local`` profile of a world's combined figures (:func:`_combine`); ``how`` names
    the run in its source and ``measured["how"]`` (e.g. "`plait calibrate --quick`")."""
    local, times = world["local"], world["all_reduce"]
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
        "when": when or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "how": how,
    }
    defaults = local_defaults()
    return HardwareProfile(
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
            f"measured by {how} on {platform.node()} "
            f"({platform.machine()}, {cpus} CPUs, torch {torch.__version__}) at "
            f"{measured['when']}: per rank of {world_size} processes measuring together "
            f"({local['threads_per_rank']} torch thread(s) each): torch.mm FLOP/s, tensor "
            "copy bandwidth, thin fp32 products and attention's batched ones against the "
            "square one, the element rates of activations and norms, the op floor and "
            "per-op host cost; gloo all_reduce among them "
            "fitted to alpha-beta, and how much of it hides behind matmuls; a small "
            "all-reduce's wait between rank pairs computing between them; memory is the host's "
            "RAM, shared by its processes; "
            "inter_node not measured (10 GbE default)"
        ),
        kernel_latency=local["kernel_latency"],
        compute_efficiency=local["network_efficiency"],
        op_overhead=local["op_overhead"],
        call_overhead=local["call_overhead"],
        comm_overlap=world["overlap"],
        wait_latency=world["wait_latency"],
        matmul_efficiency=_share_points(local["matmul_shares"], settings.matmul_size),
        batched_matmul_efficiency=tuple(
            sorted((int(d), f) for d, f in local["batched_shares"].items())
        ),
        elementwise_rates=tuple(sorted(local["elementwise_rates"].items())),
        measured=measured,
    )


def calibrate_in_world(
    settings: CalibrationSettings | None = None,
    out: str | os.PathLike[str] | None = None,
    how: str = "a job's own workers",
) -> HardwareProfile:
    """Every rank of the current process group calls this: the ranks measure together, as
    :func:`calibrate`'s spawned workers do, but on the job's own processes and threads (no
    processes started: ``make demo`` calibrates in a few seconds with
    :meth:`CalibrationSettings.brief`, the default). Every rank returns the same profile;
    rank 0 writes it to ``out`` when given, before any rank returns."""
    # The cost model's other torch.distributed use (calibrate's is in its spawned workers):
    # the caller's world, joined by plait.init().
    import torch.distributed as dist  # noqa: TID251

    settings = settings or CalibrationSettings.brief()
    world_size = dist.get_world_size()
    if world_size < 2:
        raise CostError(
            "calibrate_in_world: the world has 1 process; collectives need at least 2 (run "
            "under `plait run --worker-num N`, or `plait calibrate --world-size N`)"
        )
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    mine = _rank_measurements(settings, torch.get_num_threads())
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, {**mine, "when": when})
    world = _combine(per_rank, settings, torch.get_num_threads())
    profile = _profile_of(world, settings, world_size, how, quick=True, when=per_rank[0]["when"])
    if out is not None and dist.get_rank() == 0:
        save_profile(profile, out)
    dist.barrier()
    return profile


def mismatch(profile: HardwareProfile, world_size: int, threads: int | None = None) -> str | None:
    """Why a saved ``local`` profile does not describe a job of ``world_size`` processes on
    this machine (``threads`` torch threads each, default as ``plait run`` gives them), or
    None when it does: measured on this host (name, CPU count, torch) by as many processes
    with as many threads."""
    m = profile.measured
    if not m:
        return "it holds no measurements (uncalibrated)"
    threads = worker_threads(world_size) if threads is None else threads
    here = {"host": platform.node(), "cpus": os.cpu_count() or 1, "torch": torch.__version__}
    for key, value in here.items():
        if m.get(key) != value:
            return f"it was measured with {key} {m.get(key)!r}, this machine has {value!r}"
    ranks = (m.get("all_reduce") or {}).get("world_size")
    if ranks != world_size:
        return f"it was measured by {ranks} processes, this job runs {world_size}"
    if m.get("threads_per_rank") != threads:
        return (
            f"it was measured with {m.get('threads_per_rank')} torch thread(s) a process, "
            f"this job runs {threads}"
        )
    return None


def _share_points(shares: dict[str, float], square: int) -> tuple[tuple[int, float], ...]:
    """The thin products' shares by dimension, then the square product's (1 by definition)."""
    points = sorted((int(d), f) for d, f in shares.items())
    return (*points, (square, 1.0))


def format_profile(profile: HardwareProfile) -> str:
    """A few lines for people: the numbers of ``profile`` in human units."""
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(profile.peak_flops.items()))
    intra, inter = profile.intra_node, profile.inter_node
    return "\n".join(
        [
            f"hardware profile {profile.name!r}",
            f"  matmul GFLOP/s:    {peaks}",
            f"  compute efficiency: {profile.compute_efficiency:.2f} of that in a network "
            "(linear layers, forward and backward)",
            f"  memory:            {profile.memory_bytes / 2**30:.1f} GiB at "
            f"{profile.memory_bandwidth / 1e9:.2f} GB/s",
            f"  op floor:          {profile.kernel_latency * 1e6:.1f} us",
            f"  per-op host cost:  {profile.op_overhead * 1e6:.1f} us a captured op and pass, "
            f"{profile.call_overhead * 1e6:.1f} us an aten call",
            f"  comm overlap:      {profile.comm_overlap:.2f} of a collective hides behind compute",
            f"  wait latency:      {profile.wait_latency * 1e3:.2f} ms a transfer waits for its "
            "peers (a small all-reduce between ranks computing between them, beyond its "
            "time in step)",
            "  matmul share:      "
            + _points(
                profile.matmul_efficiency,
                " (of the peak, by smallest dimension)",
                "every shape at the peak x compute_efficiency",
            ),
            "  batched products:  "
            + _points(
                profile.batched_matmul_efficiency,
                " (attention's, by head dimension)",
                "as the matmul share",
            ),
            "  element rates:     "
            + (
                ", ".join(f"{n} {r / 1e6:.0f}" for n, r in profile.elementwise_rates)
                + " M elements/s (forward and backward)"
                if profile.elementwise_rates
                else "none (bytes price every elementwise op)"
            ),
            f"  intra-node link:   {intra.bandwidth / 1e9:.3f} GB/s, {intra.latency * 1e6:.1f} us "
            "per step",
            f"  inter-node link:   {inter.bandwidth / 1e9:.3f} GB/s, {inter.latency * 1e6:.1f} us "
            "per step",
            f"  devices per node:  {profile.devices_per_node}",
            f"  source: {profile.source}",
        ]
    )


def _points(points: Sequence[tuple[int, float]], what: str, without: str) -> str:
    """``d=32 0.60, d=128 0.90`` and what they are, or what stands in for them."""
    return ", ".join(f"d={d} {f:.2f}" for d, f in points) + what if points else without
