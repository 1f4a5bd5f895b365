"""Finding a transformer's parts by structure: projections, attention, MLPs, vocabulary.

Pure reading of a module tree, for :func:`plait.annotate.megatron`: nothing is annotated and
no tensor is touched. What counts as structure:

- a *projection* is an ``nn.Linear`` (weight ``[out, in]``) or Hugging Face's ``Conv1D``
  (GPT-2; weight ``[in, out]``, recognised by its ``nf`` attribute equal to the weight's
  second dim);
- a module's *projections* are those among its children and grandchildren, in registration
  order (which is call order in every Hugging Face model): BERT keeps q/k/v in
  ``attention.self`` and the output projection in ``attention.output``, one level apart;
- an *attention* block has a head count or head width (``num_heads``, ``head_dim``, ... on
  it or a child) and, left unclaimed by deeper blocks, exactly four projections q, k, v, o
  with q, k, v reading the same width ``d``, k and v of one width (GQA: fewer kv heads), o
  reading q's width back to ``d``; or two, a fused q|k|v and o, which is reported, not split;
- an *MLP* block has exactly two or three unclaimed projections, none held by a module with
  a head count: one or two "up" (and gate) projections ``d -> I`` then a "down" ``I -> d``;
- the *vocabulary* is the model's input embedding (``get_input_embeddings()`` where the model
  has it, else the one ``nn.Embedding`` with the most rows) and the *head* the projection
  tied to it, or ``get_output_embeddings()``, or the last projection mapping ``dim -> vocab``.

Blocks are matched deepest first, attention before MLP (so BERT's q, k, v are never read as
an MLP). Anything left is reported with the reason of the nearest block that failed to match.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from torch import nn

__all__ = ["Block", "Projection", "Structure", "find_structure"]

ProjectionKind = Literal["linear", "conv1d"]

_HEAD_COUNT = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads")
_KV_COUNT = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_HEAD_WIDTH = ("head_dim", "attention_head_size", "head_size")


@dataclass(frozen=True)
class Projection:
    """A Linear or Conv1D: its path and sizes in PyTorch's ``x @ W.T`` sense."""

    path: str
    module: nn.Module
    kind: ProjectionKind
    in_features: int
    out_features: int
    owner: nn.Module | None = None  # the module holding it, where the search knows it

    def describe(self) -> str:
        return f"{self.path} ({type(self.module).__name__} {self.in_features}->{self.out_features})"


@dataclass(frozen=True)
class Block:
    """A matched attention or MLP block: its projections by role and its split sizes."""

    path: str
    kind: Literal["attention", "mlp"]
    roles: tuple[tuple[Projection, str], ...]  # (projection, "q"|"k"|"v"|"o"|"gate"|"up"|"down")
    sizes: tuple[tuple[str, int], ...]  # what tp must divide: ("attention heads", 4), ...


@dataclass
class Structure:
    """Everything found in one model."""

    blocks: list[Block] = field(default_factory=list)
    embedding: tuple[str, nn.Embedding] | None = None
    head: Projection | None = None
    head_tied: bool = False
    other_embeddings: list[str] = field(default_factory=list)
    # projection path -> why it is not split; module path -> why its parameters are not split
    unrecognised: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- projections


def as_projection(path: str, module: nn.Module) -> Projection | None:
    """The module as a projection, or None. Conv1D is recognised by shape, not imported."""
    if isinstance(module, nn.Linear):
        return Projection(path, module, "linear", module.in_features, module.out_features)
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)
    if (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, nn.Parameter)
        and weight.ndim == 2
        and nf == weight.shape[1]
    ):
        return Projection(path, module, "conv1d", int(weight.shape[0]), int(weight.shape[1]))
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _near_projections(path: str, module: nn.Module, claimed: set[str]) -> list[Projection]:
    """Unclaimed projections among the module's children and grandchildren, in order."""
    found: list[Projection] = []
    for name, child in module.named_children():
        child_path = _join(path, name)
        p = as_projection(child_path, child)
        if p is not None:
            found.append(replace(p, owner=module))
            continue
        for grand_name, grand in child.named_children():
            q = as_projection(_join(child_path, grand_name), grand)
            if q is not None:
                found.append(replace(q, owner=child))
    return [p for p in found if p.path not in claimed]


def _int_attr(modules: list[nn.Module], names: tuple[str, ...]) -> int | None:
    for m in modules:
        for name in names:
            value = getattr(m, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _head_evidence(
    module: nn.Module, with_children: bool, skip: frozenset[int] = frozenset()
) -> tuple[int | None, int | None]:
    """(head count, head width) read from the module's (and its children's) attributes;
    children in ``skip`` (attention blocks already matched) say nothing about this module."""
    children = [c for c in module.children() if id(c) not in skip] if with_children else []
    modules = [module, *children]
    return _int_attr(modules, _HEAD_COUNT), _int_attr(modules, _HEAD_WIDTH)


def _kv_heads(module: nn.Module) -> int | None:
    return _int_attr([module, *module.children()], _KV_COUNT)


# --------------------------------------------------------------------------- attention


def _head_width(module: nn.Module, q_out: int) -> int | str:
    """The width of one head, or why it cannot be known."""
    heads, width = _head_evidence(module, with_children=True)
    if width is None and heads is not None:
        if q_out % heads:
            return f"its q width {q_out} is not a multiple of its {heads} heads"
        width = q_out // heads
    if width is None:
        return "no head count or head width"
    if q_out % width:
        return f"its q width {q_out} is not a multiple of its head width {width}"
    if heads is not None and q_out // width != heads:
        return f"its q width {q_out} / head width {width} is not its {heads} heads"
    return width


def _match_separate_qkv(path: str, module: nn.Module, ps: list[Projection]) -> Block | str:
    q, k, v, o = ps
    if not (q.in_features == k.in_features == v.in_features == o.out_features):
        return "q, k, v do not read the width the output projection writes"
    if k.out_features != v.out_features or q.out_features % k.out_features:
        return "k and v differ in width, or q's width is not a multiple of theirs"
    if o.in_features != q.out_features:
        return "the output projection does not read q's width"
    width = _head_width(module, q.out_features)
    if isinstance(width, str):
        return width
    kv = k.out_features // width if k.out_features % width == 0 else 0
    declared_kv = _kv_heads(module)
    if kv == 0 or (declared_kv is not None and declared_kv != kv):
        return f"k's width {k.out_features} is not a whole number of {width}-wide heads"
    roles = ((q, "q"), (k, "k"), (v, "v"), (o, "o"))
    sizes = (("attention heads", q.out_features // width), ("key/value heads", kv))
    return Block(path, "attention", roles, sizes)


@dataclass(frozen=True)
class _Fused:
    """An attention whose q, k and v come from one projection: understood, not split."""

    qkv: Projection
    out: Projection

    def reasons(self) -> dict[str, str]:
        return {
            self.qkv.path: (
                "fused q|k|v projection: which of its output columns belong to which head is "
                "not in its structure (GPT-2 stacks q|k|v, GPT-NeoX interleaves them per "
                "head), so a column split would be a guess; split it by hand with plait.shard "
                "if you know its layout"
            ),
            self.out.path: (
                f"output projection of the fused q|k|v {self.qkv.path}: split only together "
                "with its heads"
            ),
        }


def _as_fused(ps: list[Projection]) -> _Fused | None:
    qkv, o = ps
    extra = qkv.out_features - o.in_features  # the k and v columns
    if qkv.in_features == o.out_features and extra > 0 and extra % 2 == 0:
        return _Fused(qkv, o)
    return None


def _match_attention(
    path: str, module: nn.Module, claimed: set[str], matched: frozenset[int]
) -> Block | _Fused | str | None:
    """A Block, a fused attention, the reason it looks like attention but does not match, or
    None (not attention: no head count or head width, its matched attention children aside)."""
    heads, width = _head_evidence(module, with_children=True, skip=matched)
    if heads is None and width is None:
        return None
    ps = _near_projections(path, module, claimed)
    if len(ps) == 4:
        return _match_separate_qkv(path, module, ps)
    if len(ps) == 2 and (fused := _as_fused(ps)) is not None:
        return fused
    shapes = ", ".join(p.describe() for p in ps) or "none"
    return (
        "has a head count but its projections are not q, k, v then an output projection "
        f"(found: {shapes})"
    )


# --------------------------------------------------------------------------- MLP


def _up_role(p: Projection) -> str:
    # Labels only: gate and up are split alike, so a wrong label changes no annotation.
    return "gate" if "gate" in p.path.rsplit(".", 1)[-1] else "up"


def _has_heads(module: nn.Module | None) -> bool:
    return module is not None and _head_evidence(module, with_children=False) != (None, None)


def _match_mlp(path: str, module: nn.Module, claimed: set[str]) -> Block | None:
    ps = _near_projections(path, module, claimed)
    if len(ps) not in (2, 3) or any(_has_heads(p.owner) for p in ps):
        return None  # projections held by a module with a head count are never an MLP
    *ups, down = ps
    d, inner = down.out_features, down.in_features
    if any(u.in_features != d or u.out_features != inner for u in ups):
        return None
    roles = (*((u, _up_role(u)) for u in ups), (down, "down"))
    return Block(path, "mlp", roles, (("intermediate size", inner),))


# --------------------------------------------------------------------------- vocabulary


def _hf_module(model: nn.Module, getter: str) -> nn.Module | None:
    fn = getattr(model, getter, None)
    if not callable(fn):
        return None
    try:
        found = fn()
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def _find_embedding(model: nn.Module, structure: Structure) -> None:
    embeddings = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Embedding)]
    token = _hf_module(model, "get_input_embeddings")
    chosen = [(p, m) for p, m in embeddings if m is token]
    if not chosen and embeddings:
        most = max(m.num_embeddings for _, m in embeddings)
        chosen = [(p, m) for p, m in embeddings if m.num_embeddings == most]
    if len(chosen) == 1:
        structure.embedding = chosen[0]  # type: ignore[assignment]
    else:
        for p, _ in chosen:
            structure.unrecognised[p] = (
                "several embeddings of the same largest size: which one is the vocabulary is "
                "not in the structure; left whole"
            )
    token_path = structure.embedding[0] if structure.embedding else None
    structure.other_embeddings = [
        p for p, _ in embeddings if p != token_path and p not in structure.unrecognised
    ]


def _find_head(model: nn.Module, structure: Structure, projections: list[Projection]) -> None:
    if structure.embedding is None:
        return
    emb = structure.embedding[1]
    vocab, dim = emb.num_embeddings, emb.embedding_dim
    tied = [p for p in projections if getattr(p.module, "weight", None) is emb.weight]
    out = _hf_module(model, "get_output_embeddings")
    fits = [p for p in projections if p.out_features == vocab and p.in_features == dim]
    if tied:
        structure.head, structure.head_tied = tied[-1], True
    elif out is not None and any(p.module is out for p in fits):
        structure.head = next(p for p in fits if p.module is out)
    elif fits and fits[-1] is projections[-1]:
        structure.head = fits[-1]  # the model's last projection maps dim -> vocab


# --------------------------------------------------------------------------- the whole model


def _deepest_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    modules = list(model.named_modules())
    return sorted(modules, key=lambda pm: -(pm[0].count(".") + 1 if pm[0] else 0))


def _claim(block: Block, structure: Structure, claimed: set[str]) -> None:
    structure.blocks.append(block)
    claimed.update(p.path for p, _ in block.roles)


def _match_blocks(model: nn.Module, structure: Structure, claimed: set[str]) -> dict[str, str]:
    """Attention blocks then MLPs, deepest first; the reasons of near misses by module."""
    near_misses: dict[str, str] = {}
    matched: set[int] = set()
    order = _deepest_first(model)
    for path, module in order:
        found = _match_attention(path, module, claimed, frozenset(matched))
        if isinstance(found, Block):
            _claim(found, structure, claimed)
            matched.add(id(module))
        elif isinstance(found, _Fused):
            # Understood but not split: claimed so that no outer block reads it as an MLP.
            structure.unrecognised.update(found.reasons())
            claimed.update(found.reasons())
        elif isinstance(found, str):
            near_misses[path] = found
    for path, module in order:
        mlp = _match_mlp(path, module, claimed)
        if mlp is not None:
            _claim(mlp, structure, claimed)
    return near_misses


def _reason_for(path: str, near_misses: dict[str, str]) -> str:
    """The reason of the nearest enclosing module that looked like a block and failed."""
    parts = path.split(".")
    for n in range(len(parts) - 1, -1, -1):
        owner = ".".join(parts[:n])
        if owner in near_misses:
            return f"in {owner or 'the model'}: {near_misses[owner]}"
    return "not part of an attention block, an MLP or the vocabulary head; left whole"


def _odd_parameters(model: nn.Module) -> Iterator[tuple[str, str]]:
    """Modules other than projections and embeddings holding parameters of 2 dims or more."""
    for path, module in model.named_modules():
        if as_projection(path, module) is not None or isinstance(module, nn.Embedding):
            continue
        big = [
            f"{name} {list(p.shape)}"
            for name, p in module.named_parameters(recurse=False)
            if p.ndim >= 2
        ]
        if big:
            yield (
                path,
                (
                    f"{type(module).__name__} holds {', '.join(big)}: not a Linear, Conv1D or "
                    "Embedding, so not split; left whole"
                ),
            )


def find_structure(model: nn.Module) -> Structure:
    """The attention and MLP blocks, vocabulary embedding and head of ``model``."""
    structure = Structure()
    projections = [
        p for p in (as_projection(path, m) for path, m in model.named_modules()) if p is not None
    ]
    _find_embedding(model, structure)
    _find_head(model, structure, projections)
    claimed = {structure.head.path} if structure.head else set()
    near_misses = _match_blocks(model, structure, claimed)
    matched = {p.path for b in structure.blocks for p, _ in b.roles}
    if structure.head:
        matched.add(structure.head.path)
    for p in projections:
        if p.path not in matched and p.path not in structure.unrecognised:
            structure.unrecognised[p.path] = _reason_for(p.path, near_misses)
    structure.unrecognised.update(_odd_parameters(model))
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    structure.blocks.sort(key=lambda b: order[b.roles[0][0].path])
    structure.unrecognised = dict(
        sorted(structure.unrecognised.items(), key=lambda kv: order.get(kv[0], -1))
    )
    return structure
