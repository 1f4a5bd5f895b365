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

__all__ = ["embedding_rule", "embedding_rules", "server_lookup_rule"]


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


def server_lookup_rule(op: OpNode) -> Einsum | None:
    """``plait.ps_lookup(ids[...], anchor[], table, dim) -> [..., D]`` (a parameter server's
    table, :mod:`plait.ps.ops`): each device looks up its own ids, so the ids' dims split the
    output's leading dims; the rows come from the servers, never split over the mesh."""
    ids, anchor = ref_index(op, 0, "ids"), ref_index(op, 1, "anchor")
    if ids is None or anchor is None:
        return None
    batch = tuple(f"i{d}" for d in range(op.input_metas[ids].ndim))
    letters: list[tuple[str, ...]] = [()] * len(op.inputs)
    letters[ids] = batch
    names = {"i0": "batch", **{f"i{d}": f"ids{d}" for d in range(1, len(batch))}}
    return einsum_for(op, letters, [(*batch, "d")], names=names)


def embedding_rules() -> tuple[EinsumRule, ...]:
    """The catalogue's embedding family (the backward reads the ids only)."""
    return (
        EinsumRule(
            "embedding",
            ("aten.embedding.default",),
            embedding_rule,
            weights=((0, "weight"),),
        ),
        EinsumRule(
            "embedding",
            ("plait.ps_lookup.default",),
            server_lookup_rule,
            weights=((1, "anchor"),),
        ),
    )
