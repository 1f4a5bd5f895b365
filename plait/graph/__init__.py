"""The captured program: :class:`OpGraph` and how a model becomes one.

- :mod:`plait.graph.opgraph`: :class:`OpGraph`, :class:`OpNode`, :class:`GraphInput`,
  :class:`TensorMeta`, :class:`LayerGroup` (pure data, no torch).
- :mod:`plait.graph.export`: :func:`capture` and :func:`capture_program` (``torch.export``).
- :mod:`plait.graph.convert`: an ``ExportedProgram`` -> graph inputs, ops and outputs.
- :mod:`plait.graph.repeat`: repeated layers: finding them, tracing two, cloning the rest.
- :mod:`plait.graph.higher_order`, :mod:`plait.graph.literals`, :mod:`plait.graph.functional`:
  what export leaves that is not a plain aten op (vmap, cond, reentrant checkpoints, tensor
  literals, writes into views), rewritten before conversion.
- :mod:`plait.graph.sites`: where in the user's model a capture failed (module and line).

FLOP and byte counts of one op live in :mod:`plait.cost.flops`.
"""

# opgraph first: plait.cost (imported by the conversion for FLOPs) reads GraphInput from here.
from plait.graph.opgraph import (  # isort: skip
    ITEMSIZE,
    GraphInput,
    LayerGroup,
    OpGraph,
    OpNode,
    Ref,
    TensorMeta,
    value_ref,
)
from plait.graph.export import (
    AUTOCAST_META,
    GRAD_ENABLED_META,
    ExecutableCapture,
    LossFn,
    batch_leaves,
    capture,
    capture_program,
    in_mode,
)
from plait.graph.repeat import LayerRun, find_repeated_layers

__all__ = [
    "AUTOCAST_META",
    "GRAD_ENABLED_META",
    "ITEMSIZE",
    "ExecutableCapture",
    "GraphInput",
    "LayerGroup",
    "LayerRun",
    "LossFn",
    "OpGraph",
    "OpNode",
    "Ref",
    "TensorMeta",
    "batch_leaves",
    "capture",
    "capture_program",
    "find_repeated_layers",
    "in_mode",
    "value_ref",
]
