"""Rules for ``nn.Linear`` (``x @ w.T + b``) and matmul.

PyTorch's Linear weight is ``[out, in]``; a strategy for it refers to those dims. Signature
``x[b..., k] * w[n, k] -> y[b..., n]`` with ``k`` summed: column parallel splits ``n``
(weight ``(tp, 1)``), row parallel splits ``k`` (weight ``(1, tp)``) and leaves a partial
sum that the op reduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.errors import ShardingError
from plait.layout import OpSignature, TensorLayout, resolve_strategy
from plait.mesh import MeshSpec
from plait.rules.common import batch_axes, resolve_output, to_mesh

__all__ = ["LinearLayouts", "LinearRule", "matmul_signature"]

StrategyLike = Sequence[int] | TensorLayout


def linear_signature(x_ndim: int) -> OpSignature:
    batch = tuple(f"b{i}" for i in range(x_ndim - 1))
    return OpSignature("linear", ((*batch, "k"), ("n", "k")), (*batch, "n"), ("input", "weight"))


def matmul_signature(x_ndim: int, w_ndim: int) -> OpSignature:
    """``x[..., m, k] @ w[..., k, n]``; batch dims of ``w`` align with ``x``'s from the right."""
    if x_ndim < 2 or w_ndim < 2 or w_ndim > x_ndim:
        raise ShardingError(
            f"plait.ops.matmul takes x with >= 2 dims and w with 2..x.ndim dims, got {x_ndim} and {w_ndim}"
        )
    batch = tuple(f"b{i}" for i in range(x_ndim - 2))
    w_batch = batch[len(batch) - (w_ndim - 2) :] if w_ndim > 2 else ()
    return OpSignature(
        "matmul", ((*batch, "m", "k"), (*w_batch, "k", "n")), (*batch, "m", "n"), ("x", "w")
    )


@dataclass(frozen=True, slots=True)
class LinearLayouts:
    """Layouts of one linear call: what its inputs need and what its output is."""

    input: TensorLayout
    weight: TensorLayout
    bias: TensorLayout | None
    output: TensorLayout
    natural_output: TensorLayout


@dataclass(frozen=True, slots=True)
class LinearRule:
    """The sharding of one ``nn.Linear``: its weight layout plus optional in/out strategies."""

    where: str
    mesh: MeshSpec
    dp_axis: str
    weight: TensorLayout
    has_bias: bool
    in_strategy: StrategyLike | None = None
    out_strategy: StrategyLike | None = None

    def layouts(self, x_ndim: int) -> LinearLayouts:
        """Resolve the layouts for an input with ``x_ndim`` dims."""
        sig = linear_signature(x_ndim)
        x = self._input_layout(x_ndim, sig)
        k_axes, n_axes = self.weight.dims[1], self.weight.dims[0]
        natural = TensorLayout(
            self.mesh, (*x.dims[:-1], n_axes), tuple(a for a in self.mesh.axis_names if a in k_axes)
        )
        out = resolve_output(natural, self.out_strategy, self.where)
        bias = TensorLayout(self.mesh, (out.dims[-1],)) if self.has_bias else None
        if bias is not None and out.dims[-1] != n_axes:
            raise ShardingError(
                f"{self.where}: out_strategy moves the output's last dim to axes {out.dims[-1]!r} "
                f"but the bias is laid out on {n_axes!r}; split the last output dim as the weight's dim 0"
            )
        return LinearLayouts(x, self.weight, bias, out, natural)

    def _input_layout(self, x_ndim: int, sig: OpSignature) -> TensorLayout:
        k_axes = self.weight.dims[1]
        if self.in_strategy is None:
            used = [a for axes in self.weight.dims for a in axes]
            batch = batch_axes(self.mesh, self.dp_axis, used)
            return TensorLayout(self.mesh, (batch,) + ((),) * (x_ndim - 2) + (k_axes,))
        if isinstance(self.in_strategy, TensorLayout):
            x = to_mesh(self.in_strategy, self.mesh, self.where)
            if x.ndim != x_ndim:
                raise ShardingError(
                    f"{self.where}: in layout {x.describe()} has {x.ndim} dims, the input has {x_ndim}"
                )
        else:
            resolved = resolve_strategy(
                sig, (tuple(self.in_strategy), self.weight.splits()), self.mesh, self.where
            )
            x = resolved.inputs[0]
            if resolved.inputs[1].dims != self.weight.dims:
                raise ShardingError(
                    f"{self.where}: in_strategy {tuple(self.in_strategy)!r} puts the weight on "
                    f"{resolved.inputs[1].describe()} but its parameter layout is {self.weight.describe()}; "
                    "give the weight's layout with a Layout, or change one of the two"
                )
        if x.dims[-1] != k_axes:
            raise ShardingError(
                f"{self.where}: the input's last dim is laid out on {x.dims[-1]!r} but the weight's "
                f"dim 1 (in_features) on {k_axes!r}; a Linear needs them split alike"
            )
        return x
