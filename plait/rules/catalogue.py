"""The op catalogue: every rule by aten target, strategies, memory, and user strategy tuples.

:func:`default_catalogue` builds the registry once from the family modules (matmul,
pointwise, norm, softmax, embedding, attention, view, reduction, conv, pooling, loss,
creation); a :class:`Catalogue` is read-only. An op without a rule is offered only
:func:`~plait.rules.registry.replicated_strategy`, and :meth:`Catalogue.covers` says so, so a
plan can report it (DESIGN decision 3).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from plait.errors import ShardingError
from plait.graph import OpNode
from plait.mesh import MeshSpec
from plait.rules.attention import attention_rules
from plait.rules.conv import conv_rules
from plait.rules.creation import creation_rules
from plait.rules.einsum import local_bytes, saved_inputs
from plait.rules.embedding import embedding_rules
from plait.rules.loss import loss_rules
from plait.rules.matmul import matmul_rules
from plait.rules.norm import norm_rules
from plait.rules.pointwise import pointwise_rules
from plait.rules.pooling import pooling_rules
from plait.rules.reduction import reduction_rules
from plait.rules.registry import OpRule, OpStrategy, replicated_strategy
from plait.rules.softmax import softmax_rules
from plait.rules.view import view_rules

__all__ = ["Catalogue", "OpMemory", "default_catalogue", "op_memory", "strategy_from_cuts"]


class _MemoryRule(Protocol):
    """Optional extras a rule may offer for memory accounting (EinsumRule has both)."""

    def weight_inputs(self, op: OpNode) -> tuple[int, ...]: ...

    def saved_bytes(self, op: OpNode, strategy: OpStrategy, params: frozenset[int]) -> int: ...


@dataclass(frozen=True, slots=True)
class OpMemory:
    """Bytes per device of one op under one strategy.

    ``parameters``: local pieces of its parameter inputs; ``saved``: activations the backward
    reads (parameters excluded: they are counted once, above); ``output``: its outputs' local
    pieces (a pending sum occupies a full local piece).
    """

    parameters: int
    saved: int
    output: int

    def __post_init__(self) -> None:
        for name in ("parameters", "saved", "output"):
            if getattr(self, name) < 0:
                raise ShardingError(f"OpMemory.{name} = {getattr(self, name)}; bytes are >= 0")

    @property
    def total(self) -> int:
        return self.parameters + self.saved + self.output


@dataclass(frozen=True)
class Catalogue:
    """Rules by aten target (``"aten.linear.default"``); immutable once built."""

    rules: tuple[OpRule, ...]
    _by_target: MappingProxyType[str, OpRule] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_target: dict[str, OpRule] = {}
        for rule in self.rules:
            for target in rule.targets:
                if target in by_target:
                    raise ShardingError(
                        f"op catalogue: target {target!r} has two rules (families "
                        f"{by_target[target].family!r} and {rule.family!r}); give each target one rule"
                    )
                by_target[target] = rule
        object.__setattr__(self, "_by_target", MappingProxyType(by_target))

    def rule_for(self, target: str) -> OpRule | None:
        return self._by_target.get(target)

    def covers(self, op: OpNode) -> bool:
        """True when ``op``'s target has a rule (an op without one runs replicated)."""
        return op.target in self._by_target

    def targets(self) -> tuple[str, ...]:
        """Every covered target, sorted."""
        return tuple(sorted(self._by_target))

    def families(self) -> dict[str, tuple[str, ...]]:
        """Covered targets by family."""
        out: dict[str, list[str]] = {}
        for target, rule in sorted(self._by_target.items()):
            out.setdefault(rule.family, []).append(target)
        return {k: tuple(v) for k, v in out.items()}

    def missing(self, ops: Iterable[OpNode]) -> tuple[str, ...]:
        """Targets among ``ops`` without a rule, sorted and unique."""
        return tuple(sorted({op.target for op in ops if not self.covers(op)}))

    def strategies(self, op: OpNode, mesh: MeshSpec) -> list[OpStrategy]:
        """Every strategy of ``op`` on ``mesh``, fully replicated first."""
        rule = self.rule_for(op.target)
        if rule is None:
            return [replicated_strategy(op, mesh)]
        return rule.strategies(op, mesh)

    def op_memory(
        self, op: OpNode, strategy: OpStrategy, params: Collection[int] | None = None
    ) -> OpMemory:
        """Bytes per device of ``op`` under ``strategy`` (see :class:`OpMemory`).

        ``params`` are the indices in ``op.inputs`` that are parameters; by default the
        rule's weight slots, as many as ``op.params`` names (the last inputs for ops whose
        rule names no slots).
        """
        rule = self.rule_for(op.target)
        found = frozenset(params) if params is not None else _param_inputs(op, rule)
        metas = zip(op.input_metas, strategy.inputs, strict=True)
        parameters = sum(local_bytes(m, lay) for i, (m, lay) in enumerate(metas) if i in found)
        saver = getattr(rule, "saved_bytes", None)
        saved = saver(op, strategy, found) if saver else saved_inputs(op, strategy, found)
        output = sum(
            local_bytes(m, lay) for m, lay in zip(op.outputs, strategy.outputs, strict=True)
        )
        return OpMemory(parameters, saved, output)

    def strategy_from_cuts(
        self, op: OpNode, cuts: Iterable[Iterable[int]], mesh: MeshSpec
    ) -> OpStrategy:
        """The strategy of ``op`` whose strategy tuple (:meth:`OpStrategy.cuts`) is ``cuts``.

        Several strategies may share a tuple (the same splits on other axes); as in MindSpore
        the one whose split dims take the innermost mesh axes, in order of first appearance,
        is chosen (reference 5.1: the device matrix is laid from the right).
        """
        want = tuple(tuple(c) for c in cuts)
        options = self.strategies(op, mesh)
        matches = [s for s in options if s.cuts() == want]
        if not matches:
            valid = sorted({s.cuts() for s in options})
            raise ShardingError(
                f"{op.name} ({op.target}, inputs {[m.shape for m in op.input_metas]}): strategy "
                f"{want!r} is not one this op can run on mesh {mesh.as_dict()!r}; valid strategy "
                f"tuples are {valid!r}; pick one of them"
            )
        return min(matches, key=lambda s: _right_laid_rank(s, mesh))


def _param_inputs(op: OpNode, rule: OpRule | None) -> frozenset[int]:
    count = len(op.params)
    if count == 0:
        return frozenset()
    slots = getattr(rule, "weight_inputs", None)
    found = slots(op) if slots else ()
    if not found:
        found = tuple(range(len(op.inputs)))[-count:]
    return frozenset(found[:count])


def _right_laid_rank(strategy: OpStrategy, mesh: MeshSpec) -> tuple[int, ...]:
    """0 for the MindSpore-laid strategy (split dims on the innermost axes, in dim order)."""
    order: list[str] = []
    for layout in strategy.inputs:
        for axes in layout.dims:
            for a in axes:
                if a not in order:
                    order.append(a)
    idx = [mesh.axis_index(a) for a in order]
    inner = list(range(mesh.ndim - len(idx), mesh.ndim))
    return (0 if idx == inner else 1, -sum(idx), *idx)


@functools.cache
def default_catalogue() -> Catalogue:
    """plait's catalogue of op rules (built once; read-only)."""
    families = (
        matmul_rules,
        pointwise_rules,
        norm_rules,
        softmax_rules,
        embedding_rules,
        attention_rules,
        view_rules,
        reduction_rules,
        conv_rules,
        pooling_rules,
        loss_rules,
        creation_rules,
    )
    return Catalogue(tuple(rule for family in families for rule in family()))


def op_memory(op: OpNode, strategy: OpStrategy, params: Collection[int] | None = None) -> OpMemory:
    """:meth:`Catalogue.op_memory` of the default catalogue."""
    return default_catalogue().op_memory(op, strategy, params)


def strategy_from_cuts(op: OpNode, cuts: Iterable[Iterable[int]], mesh: MeshSpec) -> OpStrategy:
    """:meth:`Catalogue.strategy_from_cuts` of the default catalogue."""
    return default_catalogue().strategy_from_cuts(op, cuts, mesh)
