"""Per-device training memory: model states under ZeRO levels, and activations.

**Model states** (Rajbhandari et al., "ZeRO", SC 2020). Per
parameter element, with mixed-precision Adam: 2 B parameter + 2 B gradient + K = 12 B optimizer
states (fp32 master copy, momentum, variance); with fp32 Adam: 4 + 4 + 8 (momentum, variance).
``Psi`` is the parameter count per device after tensor and pipeline sharding, ``N_d`` the size
of the optimizer-shard group (the data-parallel size):

    optimizer_shard  parameters        gradients         optimizer
    None             Psi * 2           Psi * 2           Psi * K
    1 (ZeRO-1)       Psi * 2           Psi * 2           Psi * K / N_d
    2 (ZeRO-2)       Psi * 2           Psi * 2 / N_d     Psi * K / N_d
    3 (ZeRO-3)       Psi * 2 / N_d     Psi * 2 / N_d     Psi * K / N_d

(7.5B parameters, N_d = 64, mixed precision: 120, 31.4, 16.6 and 1.875 GB, the paper's
Figure 1.) Sharded terms round up: the largest shard is what a device holds.

**Activations** of one transformer layer for one micro-batch (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", MLSys 2023), sequence ``s``, micro-batch
``b``, hidden ``h``, heads ``a``, tensor parallel ``t``, activations of ``e`` bytes (2 in the
paper) and 1-byte dropout masks:

    per layer                        e = 2 (the paper's table)
    no parallelism                   s b h (34 + 5 a s / h)
    tensor parallel                  s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence parallel       s b h / t (34 + 5 a s / h)
    ... + selective recompute        s b h (10 + 24/t), 34 s b h / t
    full recompute                   2 s b h (layer input only; / t with sequence parallel)

The general-``e`` form these come from: the parts split by tensor parallelism are 12 e s b h
(Q, K, V, the projection input, the two 4h MLP tensors) plus the attention scores
(2 e + 1) a s^2 b (softmax output, its dropout mask and output); the parts kept whole are
(4 e + 2) s b h (two layer-norm inputs, attention and MLP inputs, two dropout masks).
Sequence parallelism splits the whole part too; selective recompute drops the scores.

**What a plan's step holds** (docs/memory.md, "How the plan predicts memory"): the closed
forms above describe a GPT layer; a plan's prediction walks its captured graph instead
(:mod:`plait.cost.step_memory`, with what autograd saves per op from :mod:`plait.cost.saved`),
adding :func:`model_state_memory`'s terms at each moment of the step, where this module's
:func:`training_memory` adds everything at once.

**Pipeline** (Narayanan et al., SC21): with 1F1B, stage ``i`` of ``p`` holds ``min(p - i, m)``
micro-batches' activations; GPipe holds all ``m``; interleaving with ``v`` chunks holds
``((p - i - 1) * 2 + (v - 1) * p + 1) / v`` stage-sized micro-batches (Megatron-LM's warm-up
count + 1), which for stage 0 is ``p (1 + (p - 1)/(p v))`` as Korthikanti et al. state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Literal, cast

from plait.cost.errors import CostError

# Types only: the graph package counts FLOPs and bytes with plait.cost.flops, so the cost
# model reads graphs without importing their module (no cost <-> graph import cycle).
if TYPE_CHECKING:
    from plait.config import ParallelConfig

__all__ = [
    "MemoryBreakdown",
    "MemoryModel",
    "StateBytes",
    "in_flight_micro_batches",
    "model_state_memory",
    "training_memory",
    "transformer_activation_bytes",
]

Recompute = Literal["none", "full", "selective"]
Accumulation = Literal["none", "in_place", "summed"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zero_bubble_v"]


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CostError(f"{name}={value!r} is not allowed; give an integer >= {minimum}")


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes per parameter element of the three model states (Adam)."""

    parameter: int
    gradient: int
    optimizer: int

    def __post_init__(self) -> None:
        for name in ("parameter", "gradient", "optimizer"):
            _check_int(f"StateBytes.{name}", getattr(self, name), 0)

    @classmethod
    def for_precision(cls, precision: str) -> StateBytes:
        """ZeRO's accounting: fp32 -> 4 + 4 + 8; bf16/fp16 mixed -> 2 + 2 + 12 (K = 12).

        plait's runtime autocasts over fp32 parameters (it keeps 4 + 4 + 8 whatever the
        precision); pass ``StateBytes(4, 4, 8)`` to model that instead.
        """
        if precision == "fp32":
            return cls(4, 4, 8)
        if precision in ("bf16", "fp16"):
            return cls(2, 2, 12)
        raise CostError(
            f"precision {precision!r} is unknown to the memory model; use 'fp32', 'bf16' or 'fp16'"
        )


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes per device by kind; ``total`` is their sum."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("parameters", "gradients", "optimizer", "activations"):
            _check_int(f"MemoryBreakdown.{name}", getattr(self, name), 0)
        total = self.parameters + self.gradients + self.optimizer + self.activations
        object.__setattr__(self, "total", total)

    def as_dict(self) -> dict[str, int]:
        """``{"parameters", "gradients", "optimizer", "activations"}`` (``Plan.memory_by_kind``)."""
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
        }


def _shard(numel: int, per_element: int, group: int, sharded: bool) -> int:
    return math.ceil(numel / group) * per_element if sharded else numel * per_element


def model_state_memory(
    param_numel: int,
    *,
    shard_group: int = 1,
    optimizer_shard: int | None = None,
    precision: str = "fp32",
    state_bytes: StateBytes | None = None,
) -> MemoryBreakdown:
    """Parameters, gradients and optimizer states of one device (activations 0).

    Args:
        param_numel: parameter elements on this device after tensor/pipeline sharding.
        shard_group: devices the optimizer shard splits over (the data-parallel size, or
            HSDP's shard group size, ``optimizer_weight_shard_size``).
        optimizer_shard: None, or ZeRO level 1, 2 or 3 (``ParallelConfig.optimizer_shard``).
        precision: "fp32", "bf16" or "fp16"; picks :meth:`StateBytes.for_precision`.
        state_bytes: overrides the per-element bytes.

    Example:
        >>> m = model_state_memory(7_500_000_000, shard_group=64, optimizer_shard=1, precision="bf16")
        >>> m.total / 1e9
        31.40625
    """
    _check_int("param_numel", param_numel, 0)
    _check_int("shard_group", shard_group, 1)
    if optimizer_shard not in (None, 1, 2, 3) or isinstance(optimizer_shard, bool):
        raise CostError(
            f"optimizer_shard={optimizer_shard!r} is not allowed; use None, 1, 2 or 3 (ZeRO levels)"
        )
    sb = state_bytes or StateBytes.for_precision(precision)
    level = optimizer_shard or 0
    return MemoryBreakdown(
        parameters=_shard(param_numel, sb.parameter, shard_group, level >= 3),
        gradients=_shard(param_numel, sb.gradient, shard_group, level >= 2),
        optimizer=_shard(param_numel, sb.optimizer, shard_group, level >= 1),
        activations=0,
    )


def transformer_activation_bytes(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    layers: int = 1,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
    itemsize: int = 2,
) -> int:
    """Activation bytes kept for backward by ``layers`` GPT layers, one micro-batch, one device.

    The formulas of Korthikanti et al. (module doc); ``itemsize`` is the activations' bytes
    per element (2 for bf16/fp16, 4 for fp32), dropout masks stay 1 byte.

    Example:
        >>> transformer_activation_bytes(seq=2048, micro_batch=1, hidden=12288, heads=96)
        2868903936
    """
    for name, value in (("seq", seq), ("micro_batch", micro_batch), ("hidden", hidden)):
        _check_int(name, value, 1)
    for name, value in (("heads", heads), ("tensor_parallel", tensor_parallel)):
        _check_int(name, value, 1)
    _check_int("layers", layers, 0)
    _check_int("itemsize", itemsize, 1)
    t, e = tensor_parallel, itemsize
    sbh = seq * micro_batch * hidden
    if recompute == "full":
        per_layer = Fraction(e * sbh, t if sequence_parallel else 1)
    elif recompute in ("none", "selective"):
        whole = Fraction((4 * e + 2) * sbh, t if sequence_parallel else 1)
        split = Fraction(12 * e * sbh, t)
        scores = Fraction((2 * e + 1) * heads * seq * seq * micro_batch, t)
        per_layer = whole + split + (scores if recompute == "none" else 0)
    else:
        raise CostError(
            f"recompute={recompute!r} is not allowed; use 'none', 'full' or 'selective'"
        )
    return math.ceil(per_layer * layers)


def in_flight_micro_batches(
    stage: int,
    stages: int,
    micro_batches: int,
    schedule: Schedule = "1f1b",
    chunks: int = 1,
) -> Fraction:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak.

    In units of one whole stage's activations for one micro-batch (so interleaving, whose
    chunks hold ``1/v`` of a stage each, can give a fraction).
    """
    _check_int("stages", stages, 1)
    _check_int("micro_batches", micro_batches, 1)
    _check_int("chunks", chunks, 1)
    if not isinstance(stage, int) or not 0 <= stage < stages:
        raise CostError(f"stage={stage!r} is not allowed; give a stage index in 0..{stages - 1}")
    p, i, m = stages, stage, micro_batches
    if schedule == "gpipe":
        return Fraction(m)
    if schedule == "1f1b" or (schedule in ("interleaved_1f1b", "zero_bubble") and chunks == 1):
        return Fraction(min(p - i, m))
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        # zero bubble runs the interleaved order, its weight passes deferred within it
        held = Fraction((p - i - 1) * 2 + (chunks - 1) * p + 1, chunks)
        return min(held, Fraction(m))
    if schedule == "zero_bubble_v":
        # ZB-V's peak equals 1F1B's first stage on every device (the authors' table: "1x").
        return Fraction(min(p, m))
    raise CostError(
        f"schedule={schedule!r} is not allowed; use 'gpipe', '1f1b', 'interleaved_1f1b', "
        "'zero_bubble' or 'zero_bubble_v'"
    )


def training_memory(
    param_numel: int,
    *,
    shard_group: int = 1,
    optimizer_shard: int | None = None,
    precision: str = "fp32",
    activation_bytes: int = 0,
    in_flight: Fraction | int = 1,
    state_bytes: StateBytes | None = None,
) -> MemoryBreakdown:
    """Model states (:func:`model_state_memory`) plus ``activation_bytes`` (one micro-batch,
    this device's stage) times ``in_flight`` micro-batches (:func:`in_flight_micro_batches`)."""
    _check_int("activation_bytes", activation_bytes, 0)
    if Fraction(in_flight) < 0:
        raise CostError(f"in_flight={in_flight!r} is not allowed; give a number >= 0")
    states = model_state_memory(
        param_numel,
        shard_group=shard_group,
        optimizer_shard=optimizer_shard,
        precision=precision,
        state_bytes=state_bytes,
    )
    return MemoryBreakdown(
        parameters=states.parameters,
        gradients=states.gradients,
        optimizer=states.optimizer,
        activations=math.ceil(activation_bytes * Fraction(in_flight)),
    )


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """The memory knobs of a job, applied to parameter counts and activation sizes.

    Example:
        >>> from plait.config import ParallelConfig
        >>> cfg = ParallelConfig(mesh={"dp": 4, "tp": 2}, optimizer_shard=2, precision="bf16")
        >>> MemoryModel.from_config(cfg).breakdown(1000, activation_bytes=64).as_dict()
        {'parameters': 2000, 'gradients': 500, 'optimizer': 3000, 'activations': 64}
    """

    shard_group: int = 1
    optimizer_shard: int | None = None
    precision: str = "fp32"
    recompute: Recompute = "none"
    stages: int = 1
    micro_batches: int = 1
    schedule: Schedule = "1f1b"
    state_bytes: StateBytes | None = None

    def __post_init__(self) -> None:
        _check_int("MemoryModel.shard_group", self.shard_group, 1)
        _check_int("MemoryModel.stages", self.stages, 1)
        _check_int("MemoryModel.micro_batches", self.micro_batches, 1)
        # Validate the remaining knobs by exercising them once, with their own errors.
        model_state_memory(0, optimizer_shard=self.optimizer_shard, precision=self.precision)
        in_flight_micro_batches(0, self.stages, self.micro_batches, self.schedule)
        if self.recompute not in ("none", "full", "selective"):
            raise CostError(
                f"MemoryModel.recompute={self.recompute!r} is not allowed; use 'none', 'full' "
                "or 'selective'"
            )

    @classmethod
    def from_config(cls, config: ParallelConfig) -> MemoryModel:
        """Knobs of a :class:`~plait.ParallelConfig`; the shard group is its dp axis size, or
        its HSDP shard groups' (``optimizer_weight_shard_size``) when set."""
        return cls(
            shard_group=config.optimizer_weight_shard_size or config.data_parallel_size,
            optimizer_shard=config.optimizer_shard,
            precision=config.precision,
            # the config's "auto" is the planner's to resolve: __post_init__ refuses it here
            recompute=cast(Recompute, config.recompute),
            stages=config.pipeline_stages,
            micro_batches=config.micro_batches,
            schedule=config.schedule,
        )

    def breakdown(
        self, param_numel: int, *, activation_bytes: int = 0, stage: int = 0, chunks: int = 1
    ) -> MemoryBreakdown:
        """Memory of a device of pipeline ``stage`` holding ``param_numel`` parameter elements
        and ``activation_bytes`` of activations per micro-batch (already under ``recompute``)."""
        in_flight = in_flight_micro_batches(
            stage, self.stages, self.micro_batches, self.schedule, chunks
        )
        return training_memory(
            param_numel,
            shard_group=self.shard_group,
            optimizer_shard=self.optimizer_shard,
            precision=self.precision,
            activation_bytes=activation_bytes,
            in_flight=in_flight,
            state_bytes=self.state_bytes,
        )
