"""Rule for ``nn.Embedding`` (a gather of rows of ``weight[vocab, hidden]``).

Splitting the vocab dim gives each device a slice of the table; out-of-slice ids look up
zeros and the output is a partial sum reduced by an all-reduce (Megatron's vocab-parallel
embedding, MindSpore's Gather with axis 0 split). Splitting the hidden dim splits the
output's last dim, with no communication.
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.rules.args import ref_index
from plait.rules.einsum import Einsum, EinsumRule, einsum_for

__all__ = ["embedding_rule", "embedding_rules"]


def embedding_rule(op: OpNode) -> Einsum | None:
    """``embedding(weight[V, D], ids[...]) -> [..., D]`` for the op catalogue.

    Splitting ``V`` (vocab) leaves a pending sum (out-of-slice ids look up zeros); ``D``
    (hidden) splits the output's last dim; the ids' dims split the output's leading dims.
    """
    w, ids = ref_index(op, 0, "weight"), ref_index(op, 1, "indices")
    if w is None or ids is None or op.input_metas[w].ndim != 2:
        return None
    batch = tuple(f"i{d}" for d in range(op.input_metas[ids].ndim))
    letters: list[tuple[str, ...]] = [()] * len(op.inputs)
    letters[w], letters[ids] = ("v", "d"), batch
    names = {"v": "vocab", "d": "hidden", "i0": "batch"}
    names.update({f"i{d}": f"ids{d}" for d in range(1, len(batch))})
    return einsum_for(op, letters, [(*batch, "d")], names=names, reduce={"v": "sum"})


def embedding_rules() -> tuple[EinsumRule, ...]:
    """The catalogue's embedding family (the backward reads the ids only)."""
    return (
        EinsumRule(
            "embedding",
            ("aten.embedding.default",),
            embedding_rule,
            weights=((0, "weight"),),
        ),
    )
