"""Attention family: ``scaled_dot_product_attention`` (with grouped-query attention).

Shapes: ``q[..., H, L, E]``, ``k[..., Hk, S, E]``, ``v[..., Hk, S, Ev]`` -> ``out[..., H, L, Ev]``.
Batch dims split freely. Heads split when ``Hk == H``, or under GQA (``enable_gqa``, ``H`` a
multiple of ``Hk``) when the split divides ``Hk``: query heads ``[j*H/s, (j+1)*H/s)`` then read
exactly kv heads ``[j*Hk/s, (j+1)*Hk/s)``. Query positions ``L`` split only without a causal
mask (a causal mask is placed by absolute position); key positions ``S`` and ``E`` are
reduced inside the softmax and never split. An explicit ``attn_mask`` broadcast to
``[..., H, L, S]`` is split alike. Backward keeps q, k, v, the output and the float32
logsumexp ``[..., H, L]``, not the ``L x S`` score matrix.
"""

from __future__ import annotations

import math

from plait.graph import OpNode
from plait.rules.args import arg, ref_index
from plait.rules.einsum import FIXED, Einsum, EinsumRule, aligned, einsum_for, local_bytes
from plait.rules.registry import OpStrategy

__all__ = ["attention_rules"]


def sdpa_rule(op: OpNode) -> Einsum | None:
    q, k, v = (ref_index(op, i, n) for i, n in enumerate(("query", "key", "value")))
    mask = ref_index(op, 3, "attn_mask")
    if q is None or k is None or v is None or op.input_metas[q].ndim < 2:
        return None
    qs, ks = op.input_metas[q].shape, op.input_metas[k].shape
    nd = len(qs)
    if op.input_metas[k].ndim != nd or op.input_metas[v].ndim != nd:
        return None
    causal = arg(op, 5, "is_causal", False) is True
    gqa = arg(op, 7, "enable_gqa", False) is True
    batch = [f"b{i}" for i in range(nd - 2)]
    sizes: dict[str, int] = {}
    if nd >= 3 and qs[-3] != ks[-3]:
        if not gqa or qs[-3] % ks[-3]:
            return None
        sizes[batch[-1]] = ks[-3]  # GQA: a heads split must divide the kv heads
    for i in range(nd - 3):
        if qs[i] != ks[i]:
            batch[i] = FIXED  # broadcast batch dims stay whole
    q_letters = (*batch, FIXED if causal else "l", FIXED)
    kv_letters = (*batch, FIXED, FIXED)
    letters: list[tuple[str, ...]] = [()] * len(op.inputs)
    letters[q], letters[k], letters[v] = q_letters, kv_letters, kv_letters
    out = op.outputs[0].shape
    if mask is not None:
        scores = (*out[:-1], ks[-2])
        letters[mask] = aligned(op.input_metas[mask].shape, scores, (*q_letters[:-1], FIXED))
    names = {"b0": "batch", "l": "query"}
    if nd >= 3:
        names[f"b{nd - 3}"] = "heads"
    return einsum_for(op, letters, [q_letters], names=names, sizes=sizes)


def _saved_sdpa(op: OpNode, strategy: OpStrategy, params: frozenset[int]) -> int:
    """q, k, v, the output and the logsumexp (float32, one per query row)."""
    total = sum(
        local_bytes(m, lay)
        for i, (m, lay) in enumerate(zip(op.input_metas, strategy.inputs, strict=True))
        if i < 3
    )
    out_meta, out_layout = op.outputs[0], strategy.outputs[0]
    total += local_bytes(out_meta, out_layout)
    rows = out_meta.numel // max(1, out_meta.shape[-1])
    return total + 4 * rows // math.prod(out_layout.splits())


def attention_rules() -> tuple[EinsumRule, ...]:
    return (
        EinsumRule(
            "attention",
            ("aten.scaled_dot_product_attention.default",),
            sdpa_rule,
            saved=_saved_sdpa,
        ),
    )
