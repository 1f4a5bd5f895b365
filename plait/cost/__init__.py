"""The cost model: seconds and bytes of a plan on a named hardware profile.

Pure planning code (no ``torch.distributed``):

- :mod:`plait.cost.link`: :class:`Link`, one level's alpha-beta terms (the bottom).
- :mod:`plait.cost.hardware`: :class:`HardwareProfile`, the built-in datasheet profiles
  (a100-40g, a100-80g, h100, h200, ascend-910) and ``local`` (``plait calibrate``'s file).
- :mod:`plait.cost.comm`: :class:`Topology` (which mesh axes cross nodes), alpha-beta ring
  collective times.
- :mod:`plait.cost.compute`: roofline op times, backward FLOPs.
- :mod:`plait.cost.memory`: ZeRO model-state memory, transformer activations, pipeline
  in-flight micro-batches, :class:`MemoryBreakdown`.
- :mod:`plait.cost.saved`: what autograd saves for each op's backward (and what selective
  recompute keeps).
- :mod:`plait.cost.step_memory`: one training step walked value by value on a device (graph
  activations, the step's peak).

``plait.cost.calibrate`` (the measurement behind ``plait calibrate``) is imported on use.
"""

from plait.cost.comm import CollectiveKind, Topology, collective_seconds, wire_bytes
from plait.cost.compute import (
    backward_flops,
    compute_dtype,
    op_seconds,
    training_flops,
    training_seconds,
)
from plait.cost.errors import CostError
from plait.cost.hardware import (
    BUILTIN_NAMES,
    UNCALIBRATED,
    HardwareProfile,
    builtin_profiles,
    default_profile_path,
    get_profile,
    load_profile,
    local_defaults,
    save_profile,
)
from plait.cost.link import Link
from plait.cost.memory import (
    MemoryBreakdown,
    MemoryModel,
    StateBytes,
    in_flight_micro_batches,
    model_state_memory,
    training_memory,
    transformer_activation_bytes,
)
from plait.cost.step_memory import graph_activation_bytes

__all__ = [
    "BUILTIN_NAMES",
    "UNCALIBRATED",
    "CollectiveKind",
    "CostError",
    "HardwareProfile",
    "Link",
    "MemoryBreakdown",
    "MemoryModel",
    "StateBytes",
    "Topology",
    "backward_flops",
    "builtin_profiles",
    "collective_seconds",
    "compute_dtype",
    "default_profile_path",
    "get_profile",
    "graph_activation_bytes",
    "in_flight_micro_batches",
    "load_profile",
    "local_defaults",
    "model_state_memory",
    "op_seconds",
    "save_profile",
    "training_flops",
    "training_memory",
    "training_seconds",
    "transformer_activation_bytes",
    "wire_bytes",
]
