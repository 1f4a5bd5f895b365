"""plait's op catalogue: per-op sharding rules, pure functions of shapes and layouts.

Each rule says, for the layouts of an op's parameters (or a full strategy), which layouts its
inputs need and which layout its output has, including pending partial sums that the op must
reduce (MindSpore's forward communication). Rules never touch ``torch.distributed``.
"""

from plait.rules.embedding import EmbeddingRule
from plait.rules.linear import LinearRule, matmul_signature

__all__ = ["EmbeddingRule", "LinearRule", "matmul_signature"]
