"""Convolution family: ``conv1d/2d/3d``, ``convolution`` (incl. transposed).

``x[N, Cin, *spatial] * w[Cout, Cin/groups, *kernel] -> y[N, Cout, *spatial']``: the batch
``N`` splits freely, output channels split the weight's dim 0 and the bias (MindSpore's
"out-channel" split), input channels are contracted and leave a pending sum. Spatial dims stay
whole: a split would need a halo exchange (MindSpore does it on Ascend only). Grouped
convolutions (``groups != 1``) keep both channel dims whole. Transposed convolution's weight is
``[Cin, Cout/groups, *kernel]``.
"""

from __future__ import annotations

from plait.graph import OpNode
from plait.rules.args import arg, ref_index
from plait.rules.einsum import FIXED, Einsum, EinsumRule, einsum_for

__all__ = ["conv_rules"]


def conv_rule(op: OpNode) -> Einsum | None:
    x, w, b = ref_index(op, 0, "input"), ref_index(op, 1, "weight"), ref_index(op, 2, "bias")
    general = op.target.startswith("aten.convolution")
    groups = arg(op, 8 if general else 6, "groups", 1)
    transposed = general and arg(op, 6, "transposed") is True
    if x is None or w is None or not isinstance(groups, int) or len(op.outputs) != 1:
        return None
    nd, k = op.input_metas[x].ndim, op.input_metas[w].ndim - 2
    if nd not in (k + 1, k + 2):
        return None
    cin, cout = ("k", "n") if groups == 1 else (FIXED, FIXED)
    lead = ("b",) if nd == k + 2 else ()  # unbatched input: [Cin, *spatial]
    spatial = (FIXED,) * k
    letters: list[tuple[str, ...]] = [()] * len(op.inputs)
    letters[x] = (*lead, cin, *spatial)
    letters[w] = (cin, cout, *spatial) if transposed else (cout, cin, *spatial)
    if b is not None:
        letters[b] = (cout,)
    names = {"b": "batch", "n": "out_channels", "k": "in_channels"}
    return einsum_for(op, letters, [(*lead, cout, *spatial)], names=names, reduce={"k": "sum"})


def conv_rules() -> tuple[EinsumRule, ...]:
    targets = (
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv3d.default",
        "aten.convolution.default",
    )
    return (EinsumRule("conv", targets, conv_rule, weights=((1, "weight"), (2, "bias"))),)
