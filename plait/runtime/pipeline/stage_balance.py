"""Pipeline stages without marks or a plan: the layer list cut where per-stage cost balances.

There is no captured graph here (the pipeline traces the model after the cut), so a module's
cost is its multiply-accumulates per token, read off its parameters: every parameter element
of a module that multiplies (a linear layer, a convolution, a norm's scale) is one per token,
counted in each module that uses it (a head tied to the token embedding counts the shared
weight); an embedding looks up one row per token, so it costs its width. That is
proportional to a transformer layer's forward FLOPs apart from attention's score matrix.

The model's longest ``nn.ModuleList``/``nn.Sequential`` is the layer list. Modules defined
before it (the embeddings) join the first stage's cost, modules after it (final norm, LM
head; the loss reads their output) the last stage's; the layers are then cut by
:func:`plait.search.stages.balanced_cuts` (the busiest stage as light as can be; ties to the
stages nearest an even share, from the last back).
"""

from __future__ import annotations

from torch import nn

from plait.errors import ConfigError
from plait.search.stages import balanced_cuts

__all__ = ["balanced_layer_starts", "balanced_starts", "module_cost"]

_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def module_cost(module: nn.Module) -> int:
    """Multiply-accumulates per token of ``module`` and everything in it (module doc)."""
    total = 0
    for m in module.modules():
        own = list(m.parameters(recurse=False))
        if isinstance(m, _LOOKUPS):
            total += m.embedding_dim
        else:
            total += sum(p.numel() for p in own)
    return total


def balanced_layer_starts(model: nn.Module, stages: int) -> list[str]:
    """The layer each stage after the first begins with: the model's longest list of layers
    cut by :func:`balanced_starts`; refused by name when there is no list or too few layers."""
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList | nn.Sequential) and name
    ]
    if not lists:
        raise ConfigError(
            f"cannot cut {type(model).__name__} into {stages} pipeline stages automatically: "
            "it has no nn.ModuleList or nn.Sequential of layers; mark the stages with "
            "plait.pipeline_stage(module, k)"
        )
    name, layers = max(lists, key=lambda item: len(item[1]))
    n = len(layers)
    if n < stages:
        raise ConfigError(
            f"cannot cut {type(model).__name__} into {stages} pipeline stages: its longest "
            f"list of layers, {name!r}, has {n}; a stage would have no layer. Use at most "
            f"{n} stages (pipeline_stages x virtual_stages), or mark the stages with "
            "plait.pipeline_stage(module, k)"
        )
    return balanced_starts(model, name, layers, stages)


def balanced_starts(model: nn.Module, name: str, layers: nn.Module, stages: int) -> list[str]:
    """The layer of list ``name`` (``layers``, inside ``model``) each stage after the first
    begins with, per-stage cost balanced with the modules before the list in the first stage
    and those after it in the last."""
    before, after = _beside(model, name.split("."))
    costs = [float(module_cost(layer)) for layer in layers.children()]
    costs[0] += sum(map(module_cost, before))
    costs[-1] += sum(map(module_cost, after))
    return [f"{name}.{k}" for k in balanced_cuts(costs, stages)]


def _beside(holder: nn.Module, path: list[str]) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules defined before and after the module at ``path`` under ``holder``, at every
    level (a list inside ``model.transformer`` sees the transformer's other children and the
    model's: those after the transformer come after everything inside it)."""
    head, rest = path[0], path[1:]
    before: list[nn.Module] = []
    after: list[nn.Module] = []
    seen = False
    for child_name, child in holder.named_children():
        if child_name == head:
            seen = True
        else:
            (after if seen else before).append(child)
    if rest:
        inner_before, inner_after = _beside(holder.get_submodule(head), rest)
        before += inner_before
        after = inner_after + after
    return before, after
