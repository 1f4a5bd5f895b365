"""Compute cost: a roofline per op, and the FLOPs of the backward pass.

One op on one device takes

    seconds = max(max(flops / (peak(dtype) * compute_efficiency),
                      nbytes / (memory_bandwidth * memory_efficiency))
                  + matmul_latency,                     # matmuls only
                  kernel_latency)                       # only when the op does any work
              + op_overhead                             # every op, views included

i.e. it is bound either by arithmetic or by memory traffic, never faster than a kernel
launch, plus the host's own cost of issuing it (0 on the datasheet GPUs, whose host work
overlaps the kernels; measured on a CPU ``local`` profile, where it does not). A matmul
also pays its kernel's fixed cost, the fill and drain its arithmetic does not hide
(``matmul_latency``): what makes a small product reach a small share of a GPU's peak. The
efficiencies and latencies come from the :class:`HardwareProfile`: on the NVIDIA profiles
0.78 for arithmetic, 0.7 for memory, 6 us a GEMM and a 7 us floor, fitted to a published
table of measured H100 GEMMs (``bench/gemm_shapes.py``); 1.0 and measured on ``local``.

Backward FLOPs: an op with a weight computes two products per forward product (dX and dW),
so its backward is 2x its forward and a training step 3x (the "6 N" rule for transformers:
2 forward + 4 backward FLOPs per parameter per token). An op without weights computes only
dX: 1x. Full recomputation runs the forward once more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from plait.cost.errors import CostError
from plait.cost.flops import elementwise_name, is_batched_matmul, matmul_dims
from plait.cost.hardware import HardwareProfile

if TYPE_CHECKING:
    from plait.graph.opgraph import TensorMeta

__all__ = [
    "PRECISION_DTYPES",
    "backward_flops",
    "compute_dtype",
    "elementwise_seconds",
    "is_matmul",
    "matmul_share",
    "op_seconds",
    "optimizer_seconds",
    "training_flops",
    "training_seconds",
]

PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``ParallelConfig.precision`` -> the dtype whose peak the matmuls run at."""


def compute_dtype(precision: str) -> str:
    """The dtype name for a ``ParallelConfig.precision`` value ("bf16" -> "bfloat16")."""
    try:
        return PRECISION_DTYPES[precision]
    except KeyError:
        raise CostError(
            f"precision {precision!r} is unknown to the cost model; use one of "
            f"{list(PRECISION_DTYPES)}"
        ) from None


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise CostError(f"{name}={value!r} is not allowed; give a number >= 0")


def op_seconds(
    flops: float,
    nbytes: float,
    dtype: str,
    hardware: HardwareProfile,
    share: float = 1.0,
    work_s: float = 0.0,
    matmul: bool = False,
) -> float:
    """Roofline time of one op on one device (its local share of FLOPs and bytes).
    ``share``: the part of the peak its shape reaches (a matmul's
    :meth:`~plait.cost.hardware.HardwareProfile.matmul_share`; 1 for other ops). ``work_s``:
    seconds of arithmetic the FLOP count does not see (an activation's exp or erf at its
    measured element rate: :func:`elementwise_seconds`), a third floor beside compute and
    memory. ``matmul``: the op is one matmul kernel, which adds the profile's
    ``matmul_latency``.

    Example:
        >>> from plait.cost.hardware import get_profile
        >>> a100 = get_profile("a100-80g")
        >>> square = (2 * 4096**3, 3 * 4096**2 * 2)  # FLOPs, bytes of a bf16 4096^3 GEMM
        >>> round(op_seconds(*square, "bfloat16", a100, matmul=True) * 1e3, 3)  # ms
        0.571
    """
    _check_count("flops", flops)
    _check_count("nbytes", nbytes)
    if flops == 0 and nbytes == 0 and work_s == 0:
        return hardware.op_overhead
    rate = hardware.peak(dtype) * hardware.compute_efficiency * share
    compute = flops / rate if flops else 0.0
    memory = nbytes / (hardware.memory_bandwidth * hardware.memory_efficiency)
    roofline = max(compute, memory, work_s) + (hardware.matmul_latency if matmul else 0.0)
    return max(roofline, hardware.kernel_latency) + hardware.op_overhead


def matmul_share(
    target: str,
    input_metas: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta],
    hardware: HardwareProfile,
) -> float:
    """The share of the peak an op reaches by its shape: a matmul's by its smallest dimension
    (:func:`~plait.cost.flops.matmul_dims`, the whole op's: a split rarely cuts the smallest),
    1 for any other op or on a profile without per-shape figures."""
    if not hardware.matmul_efficiency:
        return 1.0
    dims = matmul_dims(target, input_metas, outputs)
    if dims is None:
        return 1.0
    return hardware.matmul_share(min(dims), batched=is_batched_matmul(target, input_metas))


def is_matmul(
    target: str, input_metas: Sequence[TensorMeta], outputs: Sequence[TensorMeta]
) -> bool:
    """Whether an op is one matmul kernel (linear, mm, bmm, addmm, ...: a product with a tile
    to speak of), which pays the profile's ``matmul_latency``."""
    return matmul_dims(target, input_metas, outputs) is not None


def elementwise_seconds(
    target: str, input_metas: Sequence[TensorMeta], hardware: HardwareProfile
) -> float:
    """Seconds of an op's forward and backward together at its measured element rate
    (:attr:`~plait.cost.hardware.HardwareProfile.elementwise_rates`, over its first input's
    elements: the activation, the scores, the logits), 0 where the profile has no rate for
    it. The whole op's: a sharded op does ``1/pieces`` of it."""
    if not hardware.elementwise_rates or not input_metas:
        return 0.0
    rate = hardware.elementwise_rate(elementwise_name(target))
    return 0.0 if rate is None else input_metas[0].numel / rate


def backward_flops(forward_flops: float, has_weight: bool = True) -> float:
    """FLOPs of the backward of an op: 2x forward with a weight (dX, dW), else 1x (dX)."""
    _check_count("forward_flops", forward_flops)
    return forward_flops * (2 if has_weight else 1)


def training_flops(forward_flops: float, has_weight: bool = True, recompute: bool = False) -> float:
    """Forward + backward (+ the recomputed forward) FLOPs of one op in a training step."""
    extra_forward = forward_flops if recompute else 0
    return forward_flops + backward_flops(forward_flops, has_weight) + extra_forward


def training_seconds(
    forward_flops: float,
    forward_bytes: float,
    dtype: str,
    hardware: HardwareProfile,
    *,
    has_weight: bool = True,
    recompute: bool = False,
    matmul: bool = False,
) -> float:
    """Roofline time of one op's forward + backward (+ recomputed forward) on one device.

    Each pass is its own kernel(s) with its own floor; the backward reads and writes about
    twice the forward's bytes with a weight (two products), as many without. A ``matmul``'s
    backward is two GEMMs with a weight (dX, dW), each paying ``matmul_latency``.
    """
    factor = 2 if has_weight else 1
    forward = op_seconds(forward_flops, forward_bytes, dtype, hardware, matmul=matmul)
    backward = op_seconds(
        backward_flops(forward_flops, has_weight),
        forward_bytes * factor,
        dtype,
        hardware,
        matmul=matmul,
    )
    if matmul and has_weight:
        backward += hardware.matmul_latency  # the second GEMM's own fill and drain
    return forward * (2 if recompute else 1) + backward


ADAM_KERNELS = 12
"""Elementwise kernels torch's single-tensor AdamW runs per parameter tensor (weight decay,
two moment updates, bias corrections, the denominator, the update): each is one aten call
and pays the host's ``call_overhead`` (``op_overhead`` where that is not measured). Fused
and foreach AdamW run fewer; on the datasheet profiles both are 0 and only the bytes count."""
ADAM_BYTES_PER_ELEMENT = 28
"""fp32 AdamW reads the parameter, its gradient and two moments and writes the parameter and
the moments back: 7 x 4 bytes per element, memory bound."""


def optimizer_seconds(tensors: int, elements: float, hardware: HardwareProfile) -> float:
    """One optimizer step over ``tensors`` local parameter tensors of ``elements`` elements
    in all (AdamW, the optimizer plait's plans assume: see :data:`ADAM_KERNELS`)."""
    _check_count("tensors", tensors)
    _check_count("elements", elements)
    bandwidth = hardware.memory_bandwidth * hardware.memory_efficiency
    per_kernel = hardware.call_overhead or hardware.op_overhead
    return tensors * ADAM_KERNELS * per_kernel + (elements * ADAM_BYTES_PER_ELEMENT / bandwidth)
