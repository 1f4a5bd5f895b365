"""``plait.annotate.megatron``: Megatron tensor parallelism for models plait did not write.

Finds the attention and MLP blocks, the vocabulary embedding and the LM head of a model by
structure (:mod:`plait.annotate.structure`) and marks them with :func:`plait.shard` the way
Megatron-LM splits them, over one mesh axis:

- q, k, v and the MLP's up (and gate) projections column parallel: each device computes whole
  heads and a slice of the intermediate width, no communication;
- the attention output and the MLP's down projection row parallel: their partial sums are
  all-reduced once each in forward (and the column-parallel inputs' gradients once each in
  backward);
- the vocabulary embedding and the LM head split over the vocabulary (a tied head gets the
  same layout as the embedding it shares its weight with).

Everything is checked before anything is marked: a head count, key/value head count,
intermediate size or vocabulary that ``tp`` does not divide is refused by name, and the model
is left as it was. Structures it does not recognise are listed in the report, never guessed.
The marks are read by ``plait.parallelize`` in ``mode="semi_auto"``; any other annotation is
still the user's to add.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from plait.annotate.marks import get_shard_spec, shard, split_sequence
from plait.annotate.structure import Block, Projection, Structure, find_structure
from plait.errors import ConfigError, ShardingError
from plait.layout import Layout, TensorLayout

__all__ = ["Matched", "MegatronReport", "Unrecognised", "megatron"]

_USE_CACHE_NOTE = (
    "model.config.use_cache is True: in training Hugging Face models then concatenate keys "
    "and values onto an empty cache tensor, which plait runs whole, gathering every head; set "
    "model.config.use_cache = False to keep attention split"
)


@dataclass(frozen=True)
class Matched:
    """One module the structure matched, and how it is split.

    ``strategy`` is ``"column"`` (outputs split), ``"row"`` (inputs split, outputs summed),
    ``"vocab"`` (embedding rows) or ``"whole"``; ``layouts`` the parameters' layouts passed
    to ``plait.shard`` (empty when whole).
    """

    path: str
    role: str
    block: str
    strategy: str
    layouts: Mapping[str, TensorLayout]


@dataclass(frozen=True)
class Unrecognised:
    """A module left whole (data parallel), and why."""

    path: str
    kind: str
    reason: str


@dataclass(frozen=True)
class MegatronReport:
    """What :func:`megatron` matched and annotated, and what it did not recognise."""

    tp: int
    axis: str
    matched: tuple[Matched, ...]
    unrecognised: tuple[Unrecognised, ...]
    notes: tuple[str, ...] = ()
    sequence_parallel: tuple[str, ...] = ()
    """Modules whose outputs are split along the sequence (``sequence_parallel=True``)."""

    @property
    def roles(self) -> dict[str, tuple[str, str]]:
        """``{module path: (role, strategy)}`` of every matched module."""
        return {m.path: (m.role, m.strategy) for m in self.matched}

    def __str__(self) -> str:
        head = f"plait.annotate.megatron: tp={self.tp} over mesh axis {self.axis!r}"
        if self.sequence_parallel:
            head += " with sequence parallel (outputs split along the sequence: 'seq' below)"
        seq = set(self.sequence_parallel)
        rows = [
            (m.path, m.role, m.strategy + (", seq out" if m.path in seq else ""),
             _layouts_text(m.layouts))
            for m in self.matched
        ]  # fmt: skip
        lines = [head, *_table(("module", "role", "split", "parameters"), rows)]
        if self.unrecognised:
            lines += ["", "not recognised (left whole, data parallel):"]
            lines += _table(
                ("module", "kind", "reason"),
                [(u.path or "(model)", u.kind, u.reason) for u in self.unrecognised],
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _layouts_text(layouts: Mapping[str, TensorLayout]) -> str:
    if not layouts:
        return "-"
    dims = {
        name: ", ".join("/".join(axes) or "-" for axes in layout.dims)
        for name, layout in layouts.items()
    }
    return " ".join(f"{name}[{d}]" for name, d in dims.items())


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    # The last column is free text: only the others are padded.
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]

    def line(row: tuple[str, ...]) -> str:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        return "  ".join([*cells, row[-1]]).rstrip()

    return [line(header), *(line(r) for r in rows)]


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class _Plan:
    """One module's annotation before it is applied."""

    module: nn.Module
    matched: Matched


def _column(p: Projection, lay: Layout, axis: str) -> dict[str, TensorLayout]:
    # Linear weight [out, in], Conv1D weight [in, out]: column parallel splits "out".
    weight = lay(axis, "None") if p.kind == "linear" else lay("None", axis)
    layouts = {"weight": weight}
    if getattr(p.module, "bias", None) is not None:
        layouts["bias"] = lay(axis)  # each device adds the bias of its own output columns
    return layouts


def _row(p: Projection, lay: Layout, axis: str) -> dict[str, TensorLayout]:
    # The bias of a row-parallel projection stays whole: it is added once, after the sum.
    return {"weight": lay("None", axis) if p.kind == "linear" else lay(axis, "None")}


_COLUMN_ROLES = {"q", "k", "v", "gate", "up"}
_ROLE_NAMES = {"o": "out"}


def _block_plans(block: Block, lay: Layout, axis: str) -> list[_Plan]:
    plans = []
    for p, role in block.roles:
        column = role in _COLUMN_ROLES
        layouts = _column(p, lay, axis) if column else _row(p, lay, axis)
        name = f"{block.kind} {_ROLE_NAMES.get(role, role)}"
        matched = Matched(p.path, name, block.path, "column" if column else "row", layouts)
        plans.append(_Plan(p.module, matched))
    return plans


def _vocab_plans(s: Structure, lay: Layout, axis: str, split: bool) -> list[_Plan]:
    plans = []
    if s.embedding is not None:
        path, emb = s.embedding
        layouts = {"weight": lay(axis, "None")} if split else {}
        plans.append(
            _Plan(emb, Matched(path, "embedding", "", "vocab" if split else "whole", layouts))
        )
    if s.head is not None:
        tied = f" (tied to {s.embedding[0]})" if s.head_tied and s.embedding else ""
        layouts = _column(s.head, lay, axis) if split else {}
        strategy = "column" if split else "whole"
        plans.append(
            _Plan(s.head.module, Matched(s.head.path, f"head{tied}", "", strategy, layouts))
        )
    return plans


def _tied_plans(model: nn.Module, plans: list[_Plan]) -> list[_Plan]:
    """The same layouts on every other module holding a planned parameter.

    A tied parameter (BERT's decoder bias is also ``cls.predictions.bias``; a head sharing the
    embedding's weight) has one layout, and the planner reads it under whichever module the
    captured graph names it by: annotating every holder says the same thing everywhere.
    """
    planned: dict[int, tuple[TensorLayout, str]] = {}
    holders = {(id(p.module), name) for p in plans for name in p.matched.layouts}
    for plan in plans:
        for name, layout in plan.matched.layouts.items():
            param = plan.module.get_parameter(name)
            planned.setdefault(id(param), (layout, f"{plan.matched.path}.{name}"))
    extra: list[_Plan] = []
    for path, module in model.named_modules():
        layouts = {
            name: planned[id(p)][0]
            for name, p in module.named_parameters(recurse=False)
            if id(p) in planned and (id(module), name) not in holders
        }
        if layouts:
            sources = ", ".join(planned[id(module.get_parameter(n))][1] for n in layouts)
            role = f"holds {sources} (tied)"
            extra.append(_Plan(module, Matched(path, role, "", "tied", layouts)))
    return extra


# --------------------------------------------------------------------------- checks


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _size_errors(s: Structure, tp: int, split_vocab: bool) -> list[str]:
    errors = []
    for block in s.blocks:
        for what, size in block.sizes:
            if size % tp:
                errors.append(
                    f"{block.path} ({block.kind}) has {size} {what}, which tp={tp} does not "
                    f"divide: Megatron gives every device whole {what.split()[-1]} (rule: tp "
                    f"divides the {what}); use tp in {_divisors(size)}"
                )
    if split_vocab and s.embedding is not None and s.embedding[1].num_embeddings % tp:
        path, emb = s.embedding
        errors.append(
            f"{path} (embedding) has a vocabulary of {emb.num_embeddings}, which tp={tp} does "
            "not divide (rule: tp divides the vocabulary, split across devices); pad it, e.g. "
            f"model.resize_token_embeddings(n, pad_to_multiple_of={tp}), or pass "
            "vocab_parallel=False to keep embedding and head whole"
        )
    return errors


def _conflicts(plans: list[_Plan]) -> list[str]:
    errors = []
    for plan in plans:
        spec = get_shard_spec(plan.module)
        old = spec.parameter_strategy if spec else {}
        for name, layout in plan.matched.layouts.items():
            if name in old and old[name] != layout:
                was = old[name]
                was_text = was.describe() if isinstance(was, TensorLayout) else repr(was)
                errors.append(
                    f"{plan.matched.path}.{name} is already annotated {was_text}, Megatron "
                    f"would make it {layout.describe()}; remove the earlier plait.shard"
                )
    return errors


def _tie_conflicts(plans: list[_Plan]) -> list[str]:
    """A parameter two matched modules share but would split differently."""
    seen: dict[int, tuple[TensorLayout, str]] = {}
    errors = []
    for plan in plans:
        for name, layout in plan.matched.layouts.items():
            where = f"{plan.matched.path}.{name}"
            first = seen.setdefault(id(plan.module.get_parameter(name)), (layout, where))
            if first[0] != layout:
                errors.append(
                    f"{where} is the same parameter as {first[1]}, matched as "
                    f"{plan.matched.role} ({layout.describe()}) there as {first[0].describe()}: "
                    "a tied parameter has one layout; annotate these modules by hand"
                )
    return errors


def _check_arguments(tp: object, axis: object) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(
            f"plait.annotate.megatron: tp={tp!r}; tp is the size of the tensor-parallel mesh "
            "axis, an int >= 1"
        )
    if not isinstance(axis, str) or not axis or axis == "None":
        raise ConfigError(
            f"plait.annotate.megatron: axis={axis!r}; name the tensor-parallel mesh axis, "
            "e.g. axis='tp' for ParallelConfig(mesh={'dp': 2, 'tp': 2})"
        )


def _kind_of(model: nn.Module, path: str) -> str:
    return type(model.get_submodule(path)).__name__


def megatron(
    model: nn.Module,
    tp: int,
    *,
    axis: str = "tp",
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
) -> MegatronReport:
    """Annotate ``model`` for Megatron tensor parallelism over mesh axis ``axis`` of size ``tp``.

    Matches by structure (see :mod:`plait.annotate.structure`): attention blocks (q, k, v
    column parallel, the output projection row parallel), MLPs (up and gate column, down row)
    and, with ``vocab_parallel``, the vocabulary embedding and the LM head (split over the
    vocabulary; a tied head gets its embedding's layout). Use with
    ``ParallelConfig(mode="semi_auto", mesh={..., axis: tp})``.

    Returns:
        A :class:`MegatronReport`; ``print(report)`` shows every matched module with its role
        and split, and every module left whole with the reason.

    Raises:
        ConfigError: ``tp`` is not an int >= 1 or ``axis`` is not a mesh axis name.
        ShardingError: ``tp`` does not divide a matched block's heads, key/value heads or
            intermediate size, or the vocabulary; or a module already carries a different
            annotation. Nothing is annotated then.
    """
    _check_arguments(tp, axis)
    structure = find_structure(model)
    errors = _size_errors(structure, tp, vocab_parallel)
    lay = Layout((tp,), (axis,))
    plans = [p for b in structure.blocks for p in _block_plans(b, lay, axis)]
    plans = _vocab_plans(structure, lay, axis, vocab_parallel) + plans
    plans += _tied_plans(model, plans)
    errors += _conflicts(plans) + _tie_conflicts(plans)
    if errors:
        raise ShardingError(
            "plait.annotate.megatron: nothing was annotated:\n  " + "\n  ".join(errors)
        )
    for plan in plans:
        if plan.matched.layouts:
            shard(plan.module, parameter_strategy=dict(plan.matched.layouts))
    split = _sequence_split(structure, plans) if sequence_parallel else []
    for _, module in split:
        split_sequence(module, axis)
    others = [
        Matched(p, "other embedding (not the vocabulary)", "", "whole", {})
        for p in structure.other_embeddings
    ]
    return MegatronReport(
        tp,
        axis,
        tuple(_in_model_order(model, [p.matched for p in plans] + others)),
        tuple(
            Unrecognised(path, _kind_of(model, path), reason)
            for path, reason in structure.unrecognised.items()
        ),
        _notes(model),
        tuple(path for path, _ in split),
    )


def _sequence_split(structure: Structure, plans: list[_Plan]) -> list[tuple[str, nn.Module]]:
    """The modules whose outputs sequence parallel splits along the sequence: the vocabulary
    embedding (the residual stream starts split) and every row-parallel projection."""
    found: list[tuple[str, nn.Module]] = []
    if structure.embedding is not None:
        found.append(structure.embedding)
    found += [(p.matched.path, p.module) for p in plans if p.matched.strategy == "row"]
    return found


def _notes(model: nn.Module) -> tuple[str, ...]:
    """What the user should know that is not about one module."""
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    generates = callable(can_generate) and can_generate() is True
    if generates and getattr(config, "use_cache", False) is True:
        return (_USE_CACHE_NOTE,)
    return ()


def _in_model_order(model: nn.Module, matched: list[Matched]) -> list[Matched]:
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return sorted(matched, key=lambda m: order.get(m.path, -1))
