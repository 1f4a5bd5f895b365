"""Repeated layers: find them, and capture a long run from two traced members.

Sibling modules of an ``nn.ModuleList``/``nn.Sequential`` that are structurally identical
(same class, parameter and buffer names, shapes and dtypes, same submodule tree and plain
hyperparameters) form a :class:`~plait.graph.LayerGroup` when their captured ops correspond
one to one (:func:`verified_groups`).

Tracing costs about 2 ms per op, so a 96-layer model takes ~9 s. The fast path traces a copy
whose list keeps only the first two members of each run longer than two (:func:`shortened`),
checks that they correspond, and synthesises members 2..N-1 by cloning member 1's ops with
renamed values, parameters and module paths (:func:`expand_run`). When the members do not
chain (ops between members, a member reading anything but its predecessor and shared values,
later ops reading member 0) it raises :class:`NotRepeatable` and capture traces the whole model.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from plait.graph.convert import Captured, input_name
from plait.graph.opgraph import GraphInput, LayerGroup, OpNode, value_ref

__all__ = [
    "LayerRun",
    "NotRepeatable",
    "corresponds",
    "expand_run",
    "find_repeated_layers",
    "shortened",
    "tag_layers",
    "verified_groups",
]

# Hyperparameter names that number a member instead of configuring it (HF's layer_idx,
# Megatron's layer_number): they differ between identical layers by design.
_POSITION_ATTR = re.compile(r"(^|_)(idx|index|id|number)$")


@dataclass(frozen=True, slots=True)
class LayerRun:
    """Consecutive structurally identical children of one container module."""

    container: str  # FQN of the ModuleList/Sequential ("" for the root)
    keys: tuple[str, ...]  # the members' keys in the container, in order

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(_join(self.container, k) for k in self.keys)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_plain(value: object) -> bool:
    if isinstance(value, tuple | list):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _hyperparameters(module: nn.Module) -> tuple[tuple[str, object], ...]:
    return tuple(
        (k, tuple(v) if isinstance(v, list) else v)
        for k, v in sorted(vars(module).items())
        if not k.startswith("_")
        and k != "training"
        and not _POSITION_ATTR.search(k)
        and _is_plain(v)
    )


def _signature(module: nn.Module) -> tuple[object, ...]:
    """What two layers must share to be interchangeable in a plan."""
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad)
        for n, p in module.named_parameters(remove_duplicate=False)
    )
    buffers = tuple(
        (n, tuple(b.shape), b.dtype) for n, b in module.named_buffers(remove_duplicate=False)
    )
    tree = tuple(
        (n, type(m), _hyperparameters(m)) for n, m in module.named_modules(remove_duplicate=False)
    )
    return (params, buffers, tree)


def _runs_of(container: str, module: nn.Module) -> list[LayerRun]:
    children = [(k, m) for k, m in module._modules.items() if m is not None]
    runs: list[LayerRun] = []
    start = 0
    signatures = [_signature(m) for _, m in children]
    for i in range(1, len(children) + 1):
        if i == len(children) or signatures[i] != signatures[start]:
            has_params = any(True for _ in children[start][1].parameters())
            if i - start >= 2 and has_params:
                runs.append(LayerRun(container, tuple(k for k, _ in children[start:i])))
            start = i
    return runs


def find_repeated_layers(model: nn.Module) -> list[LayerRun]:
    """Runs of >= 2 structurally identical, parameter-holding siblings in ModuleLists and
    Sequentials, outermost first (lists inside a run's members are not searched)."""
    runs: list[LayerRun] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name == m or name.startswith(m + ".") for m in taken):
            continue
        if isinstance(module, nn.ModuleList | nn.Sequential):
            found = _runs_of(name, module)
            runs.extend(found)
            taken.extend(m for run in found for m in run.members)
    return runs


def _member_of(path: str, runs: Sequence[LayerRun]) -> str | None:
    for run in runs:
        if run.container and not path.startswith(run.container + "."):
            continue
        key = path[len(run.container) + 1 :] if run.container else path
        key = key.split(".", 1)[0]
        if key in run.keys:
            return _join(run.container, key)
    return None


def corresponds(a: Sequence[OpNode], b: Sequence[OpNode]) -> bool:
    if len(a) != len(b) or not a:
        return False
    return all(
        (x.target, x.input_metas, x.outputs, x.args, x.kwargs)
        == (y.target, y.input_metas, y.outputs, y.args, y.kwargs)
        for x, y in zip(a, b, strict=True)
    )


class NotRepeatable(Exception):
    """The shortened capture cannot stand for the full model: trace it whole instead."""


def shortened(model: nn.Module, runs: Iterable[LayerRun]) -> nn.Module:
    """A shallow copy of ``model`` whose long runs keep only their first two members.

    Only the modules on the path to each container are copied; parameters are shared and
    the user's model is untouched. Kept keys stay as they were, so FQNs are the real ones.
    """
    root = model
    for run in runs:
        drop = set(run.keys[2:])
        path = run.container.split(".") if run.container else []
        root = _replace(root, path, drop)
    return root


def _replace(module: nn.Module, path: list[str], drop: set[str]) -> nn.Module:
    clone = copy.copy(module)
    if not path:
        clone._modules = type(module._modules)(
            (k, v) for k, v in module._modules.items() if k not in drop
        )
        return clone
    clone._modules = type(module._modules)(module._modules)
    child = module._modules[path[0]]
    assert child is not None
    clone._modules[path[0]] = _replace(child, path[1:], drop)
    return clone


def _rename_path(path: str, old: str, new: str) -> str:
    if path == old:
        return new
    return new + path[len(old) :] if path.startswith(old + ".") else path


def _owned(g: GraphInput, member: str) -> bool:
    """Whether graph input ``g`` is a parameter, buffer or constant of ``member``."""
    return g.kind != "input" and (g.target == member or g.target.startswith(member + "."))


class _Expansion:
    """Synthesises members 2..N-1 of a run from members 0 and 1 of a shortened capture.

    Member ``j`` is member 1 with its values renamed: what member 1 reads from member 0 it
    reads from member ``j-1``; what it reads from before the run (shared tables, the batch)
    it reads unchanged. Ops after the run read the last member instead of member 1.
    """

    def __init__(self, cap: Captured, run: LayerRun) -> None:
        self.cap, self.members = cap, run.members
        first = [i for i, op in enumerate(cap.ops) if op.layer == self.members[0]]
        second = [i for i, op in enumerate(cap.ops) if op.layer == self.members[1]]
        if not first or first != list(range(first[0], first[0] + len(first))):
            raise NotRepeatable
        if second != list(range(first[-1] + 1, first[-1] + 1 + len(second))):
            raise NotRepeatable  # other ops run between or inside the members
        self.end = second[-1] + 1
        self.template = [cap.ops[i] for i in second]
        if not corresponds([cap.ops[i] for i in first], self.template):
            raise NotRepeatable
        self.inputs = {g.name: g for g in cap.inputs}
        reads = (r for i in range(first[0], self.end) for r in cap.ops[i].inputs)
        if any(r in self.inputs and self.inputs[r].kind == "constant" for r in reads):
            raise NotRepeatable  # export numbers lifted constants per use: trace whole
        self.position0 = {cap.ops[i].name: p for p, i in enumerate(first)}
        self.names = [[cap.ops[i].name for i in first], [op.name for op in self.template]]

    def _input(self, ref: str, old: str, new: str) -> str:
        g = self.inputs[ref]
        return input_name(g.kind, _rename_path(g.target, old, new))

    def _remap(self, ref: str, j: int, local: dict[str, str]) -> str:
        op, _, index = ref.partition(":")
        if op in local:
            return value_ref(local[op], int(index or 0))
        if op in self.position0:  # member 1 reads member 0: member j reads member j-1
            return value_ref(self.names[j - 1][self.position0[op]], int(index or 0))
        g = self.inputs.get(ref)
        if g is not None and _owned(g, self.members[1]):
            return self._input(ref, self.members[1], self.members[j])
        if g is not None and _owned(g, self.members[0]):
            return self._input(ref, self.members[0], self.members[j - 1])
        return ref

    def _clone(self, j: int) -> list[OpNode]:
        old, new = self.members[1], self.members[j]
        local = {t.name: f"{t.name}@{j}" for t in self.template}
        self.names.append([local[t.name] for t in self.template])
        return [
            dataclasses.replace(
                t,
                name=local[t.name],
                inputs=tuple(self._remap(r, j, local) for r in t.inputs),
                params=tuple(_rename_path(p, old, new) for p in t.params),
                module_path=_rename_path(t.module_path, old, new),
                layer=new,
            )
            for t in self.template
        ]

    def _relink(self, ref: str, last: dict[str, str]) -> str:
        op, _, index = ref.partition(":")
        if op in self.position0:
            raise NotRepeatable  # a later op reads member 0: the model is not a chain
        if op in last:
            return value_ref(last[op], int(index or 0))
        g = self.inputs.get(ref)
        if g is not None and _owned(g, self.members[1]):
            return self._input(ref, self.members[1], self.members[-1])
        return ref

    def apply(self) -> None:
        cap = self.cap
        clones = [op for j in range(2, len(self.members)) for op in self._clone(j)]
        last = dict(zip(self.names[1], self.names[-1], strict=True))
        after = [
            dataclasses.replace(op, inputs=tuple(self._relink(r, last) for r in op.inputs))
            for op in cap.ops[self.end :]
        ]
        cap.ops[self.end :] = [*clones, *after]
        cap.outputs[:] = [self._relink(r, last) for r in cap.outputs]
        cap.inputs[:] = _expand_inputs(cap.inputs, self.members)


def _expand_inputs(inputs: Sequence[GraphInput], members: Sequence[str]) -> list[GraphInput]:
    """Insert members 2..N-1's parameters and buffers after each run of member 1's, which
    is where export lifts them for the whole model (module order)."""
    out: list[GraphInput] = []
    pending: list[GraphInput] = []

    def flush() -> None:
        for j in range(2, len(members)):
            for g in pending:
                target = _rename_path(g.target, members[1], members[j])
                # requires_grad is copied from member 1: members of a run have equal flags
                # (requires_grad is part of the structural signature, _signature).
                out.append(dataclasses.replace(g, name=input_name(g.kind, target), target=target))
        pending.clear()

    for g in inputs:
        if _owned(g, members[1]) and (not pending or pending[-1].kind == g.kind):
            pending.append(g)
        else:
            flush()
            if _owned(g, members[1]):
                pending.append(g)
        out.append(g)
    flush()
    return out


def expand_run(cap: Captured, run: LayerRun) -> None:
    """Synthesise members 2..N-1 of ``run`` in ``cap``, in place, from members 0 and 1.

    Raises :class:`NotRepeatable` when the two traced members cannot stand for the rest.
    """
    _Expansion(cap, run).apply()


def tag_layers(cap: Captured, runs: Sequence[LayerRun]) -> None:
    if runs:
        cap.ops[:] = [
            dataclasses.replace(op, layer=_member_of(op.module_path, runs)) for op in cap.ops
        ]


def verified_groups(cap: Captured, runs: Sequence[LayerRun]) -> list[LayerGroup]:
    """Groups whose members' ops correspond; ops of the others lose their layer tag."""
    by_member: dict[str, list[OpNode]] = {}
    for op in cap.ops:
        if op.layer is not None:
            by_member.setdefault(op.layer, []).append(op)
    groups: list[LayerGroup] = []
    rejected: set[str] = set()
    for run in runs:
        first = by_member.get(run.members[0], [])
        if all(corresponds(first, by_member.get(m, [])) for m in run.members[1:]):
            groups.append(LayerGroup(run.container, run.members))
        else:
            rejected.update(run.members)
    if rejected:
        cap.ops[:] = [
            dataclasses.replace(op, layer=None) if op.layer in rejected else op for op in cap.ops
        ]
    return groups
