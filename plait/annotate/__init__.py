"""Semi-automatic annotations: what a user marks on a model before ``plait.parallelize``.

- :mod:`plait.annotate.marks`: ``shard`` (how a module's tensors are split), ``split_sequence``
  (a module's outputs split along the sequence: Megatron's sequence parallel), ``recompute``,
  ``on_host``, ``on_server`` and ``pipeline_stage``, and the readers of those marks.
- :mod:`plait.annotate.tensor_parallel`: ``megatron(model, tp)``, which finds the attention
  and MLP blocks, embeddings and LM head of a model by structure and marks them with
  ``shard`` as Megatron splits them, returning a report of what it matched and what not.

Every name is re-exported here, so ``from plait.annotate import shard`` works as before.
"""

from plait.annotate.marks import (
    ServerMark,
    ShardSpec,
    StrategyLike,
    get_shard_spec,
    host_marks,
    on_host,
    on_server,
    parameter_layouts,
    pipeline_stage,
    pipeline_stage_marks,
    recompute,
    recompute_marks,
    server_marks,
    shard,
    split_sequence,
)
from plait.annotate.tensor_parallel import Matched, MegatronReport, Unrecognised, megatron

__all__ = [
    "Matched",
    "MegatronReport",
    "ServerMark",
    "ShardSpec",
    "StrategyLike",
    "Unrecognised",
    "get_shard_spec",
    "host_marks",
    "megatron",
    "on_host",
    "on_server",
    "parameter_layouts",
    "pipeline_stage",
    "pipeline_stage_marks",
    "recompute",
    "recompute_marks",
    "server_marks",
    "shard",
    "split_sequence",
]
