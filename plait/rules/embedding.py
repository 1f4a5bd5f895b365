"""Rule for ``nn.Embedding`` (a gather of rows of ``weight[vocab, hidden]``).

Splitting the vocab dim gives each device a slice of the table; out-of-slice ids look up
zeros and the output is a partial sum reduced by an all-reduce (Megatron's vocab-parallel
embedding, MindSpore's Gather with axis 0 split). Splitting the hidden dim splits the
output's last dim, with no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.errors import ShardingError
from plait.graph import OpNode
from plait.layout import TensorLayout, resolve_tensor_strategy
from plait.mesh import MeshSpec
from plait.rules.args import ref_index
from plait.rules.common import batch_axes, resolve_output, to_mesh
from plait.rules.einsum import Einsum, EinsumRule, einsum_for

__all__ = ["EmbeddingLayouts", "EmbeddingRule", "embedding_rule", "embedding_rules"]


@dataclass(frozen=True, slots=True)
class EmbeddingLayouts:
    input: TensorLayout
    weight: TensorLayout
    output: TensorLayout
    natural_output: TensorLayout


@dataclass(frozen=True, slots=True)
class EmbeddingRule:
    """The sharding of one ``nn.Embedding``."""

    where: str
    mesh: MeshSpec
    dp_axis: str
    weight: TensorLayout
    in_strategy: Sequence[int] | TensorLayout | None = None
    out_strategy: Sequence[int] | TensorLayout | None = None

    def layouts(self, ids_ndim: int) -> EmbeddingLayouts:
        ids = self._ids_layout(ids_ndim)
        vocab_axes, hidden_axes = self.weight.dims
        natural = TensorLayout(self.mesh, (*ids.dims, hidden_axes), vocab_axes)
        out = resolve_output(natural, self.out_strategy, self.where)
        return EmbeddingLayouts(ids, self.weight, out, natural)

    def _ids_layout(self, ndim: int) -> TensorLayout:
        used = {a for axes in self.weight.dims for a in axes}
        if self.in_strategy is None:
            batch = batch_axes(self.mesh, self.dp_axis, list(used))
            return TensorLayout(self.mesh, (batch,) + ((),) * (ndim - 1))
        if isinstance(self.in_strategy, TensorLayout):
            ids = to_mesh(self.in_strategy, self.mesh, self.where)
        else:
            if len(self.in_strategy) != ndim:
                raise ShardingError(
                    f"{self.where}: in_strategy {tuple(self.in_strategy)!r} has {len(self.in_strategy)} "
                    f"entries but the ids have {ndim} dims; give one split per dim"
                )
            free = [a for a in self.mesh.axis_names if a not in used]
            sub = MeshSpec(tuple(free), tuple(self.mesh.axis_size(a) for a in free))
            ids = TensorLayout(
                self.mesh, resolve_tensor_strategy(self.in_strategy, sub, self.where).dims
            )
        clash = used & {a for axes in ids.dims for a in axes}
        if clash:
            raise ShardingError(
                f"{self.where}: the ids are split on axes {sorted(clash)!r} that also split the "
                "embedding table; use other axes for the ids"
            )
        return ids


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
