"""Hardware profiles: peak compute, memory, links, with the sources of every number.

A :class:`HardwareProfile` is a value the cost model reads; it is never looked up from a live
device. Built-in profiles carry datasheet numbers (the vendors' published datasheets, cited in each
profile's ``source``); ``local`` is measured on the current machine
by ``plait calibrate`` and read from a JSON file, or, when there is none, conservative CPU
defaults that say so in their ``source``.

Peaks are what the vendor quotes; ``compute_efficiency`` and ``memory_efficiency`` scale them
down to what kernels reach, and ``matmul_latency`` adds a GEMM's fixed cost: on the NVIDIA
profiles 0.78, 0.7 and 6 us, fitted to a published table of measured H100 GEMMs by shape (and
checked on the A100 against published GEMM figures: ``bench/gemm_shapes.py``); on the Ascend
profile 0.7 for both, as meta-pytorch/autoparallel's estimator assumes, with no GEMM latency.
Measured profiles already hold achieved numbers, so their efficiencies are 1.0.

What a profile is not: a description of the cluster. Nodes, and which mesh axes cross them,
come from :class:`plait.cost.comm.Topology`.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from plait.cost.errors import CostError
from plait.cost.link import Link

__all__ = [
    "BUILTIN_NAMES",
    "PROFILE_FORMAT",
    "UNCALIBRATED",
    "HardwareProfile",
    "builtin_profiles",
    "default_profile_path",
    "get_profile",
    "load_profile",
    "local_defaults",
    "save_profile",
]

PROFILE_FORMAT = "plait-hardware-profile"
PROFILE_VERSION = 1
DTYPES = ("float32", "tf32", "bfloat16", "float16")

GIB = 2**30

UNCALIBRATED = (
    "UNCALIBRATED: conservative CPU defaults, not measured here, often 10x off; run `plait "
    "calibrate --world-size N` with N the processes a job runs here"
)
"""What every report of a prediction on :func:`local_defaults` prints beside it (see
:attr:`HardwareProfile.uncalibrated`)."""


@dataclass(frozen=True, eq=True)
class HardwareProfile:
    """One device type and its links.

    Example:
        >>> h100 = get_profile("h100")
        >>> h100.peak("bfloat16") / 1e12, h100.intra_node.bandwidth / 1e9
        (989.0, 450.0)
    """

    name: str
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per dtype name: "float32", "tf32", "bfloat16", "float16"."""
    memory_bytes: int
    """Device memory (HBM; for CPUs, host RAM shared by the processes on it)."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes per second."""
    intra_node: Link
    inter_node: Link
    devices_per_node: int
    source: str
    """Where the numbers come from (datasheets, papers, or the calibration run)."""
    compute_efficiency: float = 1.0
    """Fraction of ``peak_flops`` that kernels reach."""
    memory_efficiency: float = 1.0
    """Fraction of ``memory_bandwidth`` that kernels reach."""
    kernel_latency: float = 0.0
    """Floor on one op's time, seconds (kernel launch; autoparallel uses 7 us on GPUs)."""
    matmul_latency: float = 0.0
    """Seconds a matmul kernel adds to its roofline time: the fill and drain of its tiles'
    pipelines and its launch, which its arithmetic does not hide, so a GEMM takes
    ``matmul_latency + max(compute, memory)`` rather than the larger of the two alone. It is
    what makes a small or thin product reach a small share of the peak on a GPU. 6 us on the
    datasheet GPUs (fitted, with their ``compute_efficiency``, to OpenXLA's published H100
    GEMM table: ``bench/gemm_shapes.py``); 0 on ``local``, whose measured
    :attr:`matmul_efficiency` points stand for the shape."""
    op_overhead: float = 0.0
    """Host seconds every op (and every optimizer kernel) pays on top of its roofline time:
    the framework's dispatch, autograd and Python around the kernel. It adds to a CPU's time
    (the host is the device) where a GPU's host work overlaps its queue; ``plait calibrate``
    measures it on ``local``, the datasheet profiles leave it 0."""
    call_overhead: float = 0.0
    """Host seconds of one aten call, its floor included: the unit the optimizer's elementwise
    kernels pay (``op_overhead`` is per captured op, which dispatches several calls in eager
    forward and backward). Measured by ``plait calibrate`` on ``local``; 0: ``op_overhead``
    stands for it (the datasheet profiles, where both are 0)."""
    comm_overlap: float = 0.0
    """Fraction of a collective's seconds that hide behind compute running at the same time
    (data-parallel reductions beside backward, prefetched ZeRO-3 gathers:
    :mod:`plait.planning.overlap`), in [0, 1]. 1 on the datasheet GPUs (NCCL's kernels run on
    their own stream); measured by ``plait calibrate`` on ``local``, where the cores that
    compute also run gloo's threads; 0 (nothing hides) when not measured."""
    wait_latency: float = 0.0
    """Seconds a rank spends in a transfer waiting for its peer, while the ranks compute
    between transfers (a step: its collectives and a pipeline's sends). Where ranks share
    cores they arrive apart (the scheduler ran one and not the other) and a blocked rank waits
    for a core to run again: measured by ``plait calibrate`` on ``local`` as the mean time a
    small all-reduce between rank pairs takes when both compute the same between them, less
    its time when the pair starts it in step (1 to 2 ms with four ranks on two cores, nothing
    between idle ranks).
    Every intra-node transfer pays it once (:meth:`plait.cost.comm.Topology.axis_seconds`); 0
    on the datasheet profiles (collectives in lock step, the link's latency alone)."""
    matmul_efficiency: tuple[tuple[int, float], ...] = ()
    """A matmul's share of the peak by its smallest dimension: ``(dim, fraction)`` points,
    dims rising, read linearly in ``log2(dim)`` between them and flat beyond (a thin product,
    e.g. one attention head's ``128 x 32 x 128``, reaches less of the peak than a square one).
    Measured by ``plait calibrate`` on ``local`` (fp32, against its square ``n x n`` product);
    empty on the datasheet profiles, where :attr:`matmul_latency` prices the shape (a GPU's
    share depends on the whole shape, its size as much as its thinnest side: a point per
    smallest dimension fits the published H100 table on half its shapes, the latency on 121
    of 125)."""
    batched_matmul_efficiency: tuple[tuple[int, float], ...] = ()
    """The same curve for a product with a batch dimension in both operands (attention's
    heads: ``(b, h, s, d) @ (b, h, d, s)`` on head-split, transposed views), which reaches less
    of the peak than a 2-D product of the same smallest dimension (on a CPU: operands out of
    cache, strided reads). Measured by ``plait calibrate`` on ``local``; empty:
    :attr:`matmul_efficiency` stands for batched products too."""
    elementwise_rates: tuple[tuple[str, float], ...] = ()
    """Elements per second one op's forward and backward together reach, by the op's aten
    name (``gelu``, ``softmax``, ``layer_norm``, ``cross_entropy_loss``, ...): a floor under
    the op's time where its arithmetic (exp, erf, a reduction per row) outruns its bytes.
    Measured by ``plait calibrate`` on ``local`` (fp32: on a CPU, gelu's forward and backward
    run at about a fifth of a copy's element rate); empty on the datasheet GPUs, where these
    ops are bound by memory and their bytes alone price them."""
    measured: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Raw calibration data (sizes and timings), kept for reports; empty for built-ins."""

    def __post_init__(self) -> None:
        self._check_peaks()
        for name in ("memory_bandwidth", "compute_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise CostError(
                    f"HardwareProfile {self.name!r}: {name}={value!r} is not allowed; give a number > 0"
                )
        for name in ("compute_efficiency", "memory_efficiency"):
            if getattr(self, name) > 1:
                raise CostError(
                    f"HardwareProfile {self.name!r}: {name}={getattr(self, name)!r} is above 1; "
                    "an efficiency is the fraction of the peak reached, in (0, 1]"
                )
        for name in ("memory_bytes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CostError(
                    f"HardwareProfile {self.name!r}: {name}={value!r} is not allowed; give an integer >= 1"
                )
        for name in (
            "kernel_latency",
            "matmul_latency",
            "op_overhead",
            "call_overhead",
            "wait_latency",
        ):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise CostError(
                    f"HardwareProfile {self.name!r}: {name}={value!r} is not allowed; give "
                    "seconds >= 0"
                )
        self._check_efficiency_points("matmul_efficiency")
        self._check_efficiency_points("batched_matmul_efficiency")
        self._check_elementwise_rates()
        if not _is_number(self.comm_overlap) or not 0 <= self.comm_overlap <= 1:
            raise CostError(
                f"HardwareProfile {self.name!r}: comm_overlap={self.comm_overlap!r} is not "
                "allowed; give the fraction of communication that hides behind compute, in [0, 1]"
            )
        if not isinstance(self.intra_node, Link) or not isinstance(self.inter_node, Link):
            raise CostError(
                f"HardwareProfile {self.name!r}: intra_node and inter_node must be Link values"
            )
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "measured", MappingProxyType(dict(self.measured)))

    def _check_efficiency_points(self, name: str) -> None:
        given = getattr(self, name)
        points = tuple(tuple(p) for p in given)
        dims = [p[0] for p in points if len(p) == 2]
        ok = len(dims) == len(points) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims
        )
        ok = ok and dims == sorted(set(dims))
        ok = ok and all(_is_number(f) and 0 < f <= 1 for _, f in points)
        if not ok:
            raise CostError(
                f"HardwareProfile {self.name!r}: {name}={given!r} "
                "is not allowed; give (dim, fraction) pairs, dims distinct integers >= 1 in "
                "rising order, fractions in (0, 1], e.g. ((32, 0.6), (128, 0.9))"
            )
        object.__setattr__(self, name, tuple((int(d), float(f)) for d, f in points))

    def _check_elementwise_rates(self) -> None:
        pairs: tuple[tuple[Any, ...], ...] = tuple(tuple(p) for p in self.elementwise_rates)
        names = [p[0] for p in pairs if len(p) == 2]
        ok = len(names) == len(pairs) and all(isinstance(n, str) and n for n in names)
        ok = ok and len(set(names)) == len(names)
        ok = ok and all(_is_number(r) and r > 0 for _, r in pairs)
        if not ok:
            raise CostError(
                f"HardwareProfile {self.name!r}: elementwise_rates={self.elementwise_rates!r} "
                "is not allowed; give (aten op name, elements per second) pairs, names distinct "
                "and rates > 0, e.g. (('gelu', 5e8), ('softmax', 7e8))"
            )
        object.__setattr__(self, "elementwise_rates", tuple((n, float(r)) for n, r in pairs))

    @property
    def uncalibrated(self) -> bool:
        """True for ``local`` with nothing measured (:func:`local_defaults`, when ``plait
        calibrate`` has written no file): its numbers are guesses, not this machine's, and a
        plan made on it says so (``Plan.hardware_uncalibrated``). Datasheet profiles and
        calibrated ``local`` files are not."""
        return self.name == "local" and not self.measured

    def matmul_share(self, smallest_dim: int, batched: bool = False) -> float:
        """The share of the peak a matmul whose smallest dimension is ``smallest_dim``
        reaches (:attr:`matmul_efficiency`, or :attr:`batched_matmul_efficiency` for a
        ``batched`` product where it has points; 1 without points)."""
        points = (batched and self.batched_matmul_efficiency) or self.matmul_efficiency
        if not points or smallest_dim >= points[-1][0]:
            return points[-1][1] if points else 1.0
        if smallest_dim <= points[0][0]:
            return points[0][1]
        for (d0, f0), (d1, f1) in itertools.pairwise(points):
            if smallest_dim <= d1:
                t = (math.log2(smallest_dim) - math.log2(d0)) / (math.log2(d1) - math.log2(d0))
                return f0 + t * (f1 - f0)
        return points[-1][1]  # not reached: the last point caught it

    def elementwise_rate(self, op_name: str) -> float | None:
        """Elements per second of ``op_name``'s forward and backward
        (:attr:`elementwise_rates`), None where not measured."""
        for name, rate in self.elementwise_rates:
            if name == op_name:
                return rate
        return None

    def _check_peaks(self) -> None:
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise CostError(
                f"HardwareProfile {self.name!r}: peak_flops={self.peak_flops!r} is not allowed; "
                f"give a dict of dtype name ({', '.join(DTYPES)}) to FLOP/s"
            )
        for dtype, flops in self.peak_flops.items():
            if dtype not in DTYPES or not _is_number(flops) or flops <= 0:
                raise CostError(
                    f"HardwareProfile {self.name!r}: peak_flops[{dtype!r}]={flops!r} is not "
                    f"allowed; keys are {list(DTYPES)} and values FLOP/s > 0"
                )

    def __hash__(self) -> int:
        # The mappings are read-only views; hash their items so profiles can key caches.
        items = tuple(sorted(self.peak_flops.items()))
        return hash((self.name, items, self.memory_bytes, self.memory_bandwidth, self.intra_node))

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (torch's name without ``torch.``, or "tf32")."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            config = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
            usable = [f"precision={config[d]!r}" for d in sorted(self.peak_flops) if d in config]
            raise CostError(
                f"hardware {self.name!r} has no peak FLOP/s for dtype {dtype!r} (it lists "
                f"{sorted(self.peak_flops)}); plan with ParallelConfig("
                f"{' or '.join(usable) or 'another precision'}) or another hardware profile"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "devices_per_node": self.devices_per_node,
            "compute_efficiency": self.compute_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "kernel_latency": self.kernel_latency,
            "matmul_latency": self.matmul_latency,
            "op_overhead": self.op_overhead,
            "call_overhead": self.call_overhead,
            "comm_overlap": self.comm_overlap,
            "wait_latency": self.wait_latency,
            "matmul_efficiency": [list(p) for p in self.matmul_efficiency],
            "batched_matmul_efficiency": [list(p) for p in self.batched_matmul_efficiency],
            "elementwise_rates": [list(p) for p in self.elementwise_rates],
            "source": self.source,
            "measured": dict(self.measured),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "profile") -> HardwareProfile:
        """Inverse of :meth:`to_dict`; ``where`` names the file in errors."""
        if data.get("format") != PROFILE_FORMAT or data.get("version") != PROFILE_VERSION:
            raise CostError(
                f"{where}: format {data.get('format')!r} version {data.get('version')!r} is not a "
                f"plait hardware profile ({PROFILE_FORMAT!r} version {PROFILE_VERSION}); "
                "write it again with `plait calibrate`"
            )
        try:
            return cls(
                name=data["name"],
                peak_flops=data["peak_flops"],
                memory_bytes=data["memory_bytes"],
                memory_bandwidth=data["memory_bandwidth"],
                intra_node=Link(**data["intra_node"]),
                inter_node=Link(**data["inter_node"]),
                devices_per_node=data["devices_per_node"],
                source=data["source"],
                compute_efficiency=data.get("compute_efficiency", 1.0),
                memory_efficiency=data.get("memory_efficiency", 1.0),
                kernel_latency=data.get("kernel_latency", 0.0),
                matmul_latency=data.get("matmul_latency", 0.0),
                op_overhead=data.get("op_overhead", 0.0),
                call_overhead=data.get("call_overhead", 0.0),
                comm_overlap=data.get("comm_overlap", 0.0),
                wait_latency=data.get("wait_latency", 0.0),
                matmul_efficiency=tuple(tuple(p) for p in data.get("matmul_efficiency", ())),
                batched_matmul_efficiency=tuple(
                    tuple(p) for p in data.get("batched_matmul_efficiency", ())
                ),
                elementwise_rates=tuple(tuple(p) for p in data.get("elementwise_rates", ())),
                measured=data.get("measured", {}),
            )
        except (KeyError, TypeError) as e:
            raise CostError(
                f"{where}: hardware profile is missing or has a malformed field ({e}); "
                "write it again with `plait calibrate`"
            ) from None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ------------------------------------------------------------------------------ built-ins

# Sources: the vendors' datasheets and NCCL's published tuning constants.
_NV_A100 = "NVIDIA A100 datasheet (via glennklockwood.com/garden/processors/A100)"
_NV_H100 = "NVIDIA H100 SXM5 datasheet (via glennklockwood.com/garden/processors/h100)"
_NCCL = (
    "link latencies: NCCL tuning tables as ported in meta-pytorch/autoparallel "
    "nccl_cost_model.py (ring LL: base 6.6 us, per hop 0.6 us NVLink, 2.7 us network)"
)
_EFF = "efficiency 0.7 and 7 us kernel floor as in meta-pytorch/autoparallel's estimator"
_GEMM = (
    "GEMMs: compute efficiency 0.78, memory efficiency 0.7 and 6 us a kernel added "
    "(matmul_latency), fitted to 55 bf16 shapes of OpenXLA's published H100 GEMM table "
    "(xla/service/gpu/model/matmul_interpolator_data.h, sm_90, batch 1) and within 25 % on 68 of "
    "the 70 held-out shapes (bench/gemm_shapes.py); on the A100 the same constants price the "
    "published fp16 GEMMs of a transformer layer (EleutherAI cookbook sample results) within 5 % "
    "and Triton's cuBLAS squares of 2048 to 4096 within 13 %; other ops: efficiency 0.7 and a 7 "
    "us floor as in meta-pytorch/autoparallel's estimator"
)
_HBM = "HBM capacity: vendor 'GB' taken as GiB (HBM stacks are binary)"
_OVERLAP = (
    "communication overlaps compute fully (comm_overlap 1): collectives run on their own "
    "stream, as PyTorch DDP overlaps its bucket all-reduces with backward (Li et al., VLDB "
    "2020); the slowdown the two cause each other is not modelled"
)

_NVLINK3 = Link(bandwidth=300e9, latency=0.6e-6, overhead=6.6e-6)  # 600 GB/s total
_NVLINK4 = Link(bandwidth=450e9, latency=0.6e-6, overhead=6.6e-6)  # 900 GB/s total
_IB_HDR = Link(bandwidth=25e9, latency=2.7e-6, overhead=6.6e-6)  # 200 Gb/s, 1 NIC per GPU
_IB_NDR = Link(bandwidth=50e9, latency=2.7e-6, overhead=6.6e-6)  # 400 Gb/s, 1 NIC per GPU


def _a100(name: str, memory_gib: int, bandwidth: float) -> HardwareProfile:
    return HardwareProfile(
        name=name,
        peak_flops={"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
        memory_bytes=memory_gib * GIB,
        memory_bandwidth=bandwidth,
        intra_node=_NVLINK3,
        inter_node=_IB_HDR,
        devices_per_node=8,
        source=(
            f"{_NV_A100}: dense fp16/bf16 312, TF32 156, FP32 19.5 TFLOP/s; {memory_gib} GB HBM "
            f"at {bandwidth / 1e9:g} GB/s; NVLink3 600 GB/s total (300 per direction); "
            "DGX A100: 8 GPUs, 8 x InfiniBand HDR 200 Gb/s (25 GB/s) per node (Megatron-LM "
            f"SC21, Selene). {_NCCL}. {_GEMM}. {_HBM}. {_OVERLAP}."
        ),
        compute_efficiency=0.78,
        memory_efficiency=0.7,
        kernel_latency=7e-6,
        matmul_latency=6e-6,
        comm_overlap=1.0,
    )


def _hopper(name: str, memory_gib: int, bandwidth: float, confidence: str) -> HardwareProfile:
    return HardwareProfile(
        name=name,
        peak_flops={"float32": 66.9e12, "tf32": 494.7e12, "bfloat16": 989e12, "float16": 989e12},
        memory_bytes=memory_gib * GIB,
        memory_bandwidth=bandwidth,
        intra_node=_NVLINK4,
        inter_node=_IB_NDR,
        devices_per_node=8,
        source=(
            f"{_NV_H100}{confidence}: dense bf16/fp16 989, TF32 494.7, FP32 66.9 TFLOP/s; "
            f"{memory_gib} GB HBM at {bandwidth / 1e12:g} TB/s; NVLink4 900 GB/s total (450 per "
            "direction); DGX H100: 8 GPUs, 8 x NDR 400 Gb/s (50 GB/s) per node. "
            f"{_NCCL}. {_GEMM}. {_HBM}. {_OVERLAP}."
        ),
        compute_efficiency=0.78,
        memory_efficiency=0.7,
        kernel_latency=7e-6,
        matmul_latency=6e-6,
        comm_overlap=1.0,
    )


def _ascend_910() -> HardwareProfile:
    return HardwareProfile(
        name="ascend-910",
        # Ascend 910 computes matmuls in fp16 on its cube units; it has no bf16 (910B does).
        peak_flops={"float16": 256e12},
        memory_bytes=32 * GIB,
        memory_bandwidth=1.2e12,
        intra_node=Link(bandwidth=30e9, latency=2.7e-6, overhead=6.6e-6),
        inter_node=Link(bandwidth=25e9, latency=2.7e-6, overhead=6.6e-6),
        devices_per_node=8,
        source=(
            "Huawei Ascend 910, Hot Chips 2019 summaries: 256 TFLOP/s fp16, 512 TOPS int8 "
            "(confidence A); 32 GB HBM2 at ~1.2 TB/s (confidence C); HCCS 3 x 240 Gb/s "
            "(30 GB/s per link; one link per ring neighbour); 2 x 100 Gb/s RoCE v2 (25 GB/s) "
            "across nodes. Atlas 800 servers hold 8 devices in two HCCS groups of 4; the "
            "profile treats the 8 as one node. Latencies: no published figure; NCCL's network "
            f"constants assumed. {_EFF}; no per-shape GEMM figures are published for it, so "
            "every matmul shape runs at the one efficiency. "
            f"{_HBM}. {_OVERLAP}."
        ),
        compute_efficiency=0.7,
        memory_efficiency=0.7,
        kernel_latency=7e-6,
        comm_overlap=1.0,
    )


@functools.cache
def builtin_profiles() -> Mapping[str, HardwareProfile]:
    """The datasheet profiles by name (read-only; built once)."""
    profiles = [
        _a100("a100-40g", 40, 1555e9),
        _a100("a100-80g", 80, 2039e9),
        _hopper("h100", 80, 3.35e12, ""),
        _hopper("h200", 141, 4.8e12, " (H200: same die and peaks as H100, confidence B)"),
        _ascend_910(),
    ]
    return MappingProxyType({p.name: p for p in profiles})


BUILTIN_NAMES = ("a100-40g", "a100-80g", "h100", "h200", "ascend-910")


# ---------------------------------------------------------------------------------- local


def local_defaults() -> HardwareProfile:
    """Conservative CPU numbers for ``local`` when no calibration file exists."""
    return HardwareProfile(
        name="local",
        peak_flops={"float32": 50e9, "bfloat16": 10e9, "float16": 5e9},
        memory_bytes=16 * GIB,
        memory_bandwidth=5e9,
        intra_node=Link(bandwidth=1e9, latency=50e-6),  # gloo over loopback
        inter_node=Link(bandwidth=1.25e9, latency=100e-6),  # 10 GbE
        devices_per_node=8,
        source="uncalibrated defaults; run `plait calibrate`",
        kernel_latency=10e-6,
    )


def default_profile_path() -> Path:
    """Where ``plait calibrate`` writes and ``local`` reads: ``$PLAIT_HOME/local.json``, else
    ``~/.cache/plait/local.json``."""
    home = os.environ.get("PLAIT_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "plait"
    return base / "local.json"


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """Read a profile written by :func:`save_profile` (or ``plait calibrate``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CostError(
            f"hardware profile {str(path)!r} cannot be read ({e.strerror}); check the path or "
            "write it with `plait calibrate --out PATH`"
        ) from None
    except json.JSONDecodeError as e:
        raise CostError(
            f"hardware profile {str(path)!r} is not JSON ({e}); write it again with `plait calibrate`"
        ) from None
    if not isinstance(data, dict):
        raise CostError(
            f"hardware profile {str(path)!r} holds {type(data).__name__}, not an object; "
            "write it again with `plait calibrate`"
        )
    return HardwareProfile.from_dict(data, where=str(path))


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` as JSON (parents created; replaced atomically); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def get_profile(
    name: str | None = None, path: str | os.PathLike[str] | None = None
) -> HardwareProfile:
    """The profile called ``name`` (``ParallelConfig.hardware``); None means ``local``.

    ``local`` reads ``path`` (default :func:`default_profile_path`); a missing default file
    gives :func:`local_defaults`, a missing explicit ``path`` is an error.
    """
    if name is None or name == "local":
        if path is not None:
            return load_profile(path)
        default = default_profile_path()
        return load_profile(default) if default.exists() else local_defaults()
    profiles = builtin_profiles()
    if name not in profiles:
        raise CostError(
            f"hardware profile {name!r} is unknown; use 'local' or one of {list(BUILTIN_NAMES)}"
        )
    return profiles[name]
