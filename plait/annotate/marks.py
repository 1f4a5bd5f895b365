"""The marks themselves: ``plait.shard``, ``plait.recompute``, ``plait.pipeline_stage``.

``plait.shard`` marks how a module's tensors are split; :func:`split_sequence` marks a
module's outputs split along the sequence (Megatron's sequence parallel).

MindSpore's ``Cell.shard(in_strategy, out_strategy, parameter_plan)`` for PyTorch modules.
A strategy is a tuple of split counts per tensor dim, or a :class:`~plait.layout.TensorLayout`
made by calling a :class:`~plait.layout.Layout`. Strategies refer to PyTorch's own dims: an
``nn.Linear`` weight is ``[out_features, in_features]``, so ``(2, 1)`` is column parallel and
``(1, 2)`` row parallel. Annotations are stored on the module and read by
:func:`plait.parallelize`; nothing is split until then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from torch import nn

from plait.errors import ConfigError, ShardingError
from plait.layout import TensorLayout
from plait.mesh import MeshSpec

__all__ = [
    "ServerMark",
    "ShardSpec",
    "get_shard_spec",
    "on_server",
    "parameter_layouts",
    "pipeline_stage",
    "pipeline_stage_marks",
    "server_marks",
    "shard",
    "split_sequence",
]

StrategyLike = tuple[int, ...] | TensorLayout
M = TypeVar("M", bound=nn.Module)
_ATTR = "_plait_shard"


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """The annotation of one module."""

    in_strategy: tuple[StrategyLike | None, ...] | None = None
    out_strategy: tuple[StrategyLike | None, ...] | None = None
    parameter_strategy: Mapping[str, StrategyLike] = field(default_factory=dict)
    sequence_split: tuple[str, int] | None = None
    """(mesh axis, dim): the values leaving the module split along that dim (the sequence)
    over that axis, their dim 0 split as the batch is (:func:`split_sequence`)."""


def _normalise_one(value: object, where: str) -> StrategyLike | None:
    if value is None or isinstance(value, TensorLayout):
        return value
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
    ):
        if any(n < 1 for n in value):
            raise ShardingError(
                f"{where}: strategy {tuple(value)!r} has a split < 1; splits are integers >= 1"
            )
        return tuple(value)
    raise ShardingError(
        f"{where}: {value!r} is not a strategy; use a tuple of split counts such as (2, 1), or "
        "a layout such as Layout((2, 2), ('dp', 'tp'))('dp', 'None')"
    )


def _normalise_many(value: object, where: str) -> tuple[StrategyLike | None, ...] | None:
    if value is None:
        return None
    if isinstance(value, TensorLayout):
        return (value,)
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ShardingError(
            f"{where}: {value!r} is not a tuple of per-tensor strategies, e.g. ((2, 1),)"
        )
    if all(isinstance(n, int) for n in value):
        raise ShardingError(
            f"{where}: {tuple(value)!r} is one strategy, but this takes one per tensor; wrap it: ({tuple(value)!r},)"
        )
    return tuple(_normalise_one(v, f"{where}[{i}]") for i, v in enumerate(value))


def shard(
    module: M,
    in_strategy: object = None,
    out_strategy: object = None,
    parameter_strategy: Mapping[str, object] | None = None,
) -> M:
    """Annotate ``module`` with strategies; returns the module.

    Args:
        module: an ``nn.Linear``, ``nn.Embedding`` (plait's op rules) or any module, whose inner
            ops then follow DTensor's propagation from the given layouts.
        in_strategy: one strategy per positional tensor input, e.g. ``((2, 1),)``.
        out_strategy: one strategy per output; for Linear and Embedding it may add the summed
            axes to one dim (``((4, 1),)`` after a row split of 2 on dp=2), turning the
            all-reduce of partial sums into a reduce-scatter.
        parameter_strategy: ``{parameter name: strategy}``, names relative to ``module``.

    Raises:
        ShardingError: a strategy is malformed or names a parameter the module lacks; or the
            module was annotated before with a different strategy for the same parameter.
    """
    if not isinstance(module, nn.Module):
        raise ShardingError(f"plait.shard expects an nn.Module, got {type(module).__name__}")
    where = f"plait.shard({type(module).__name__})"
    params = dict(module.named_parameters())
    new: dict[str, StrategyLike] = {}
    for name, value in (parameter_strategy or {}).items():
        if name not in params:
            raise ShardingError(
                f"{where}: parameter_strategy names {name!r}, which is not a parameter of the "
                f"module; its parameters are {sorted(params)!r}"
            )
        s = _normalise_one(value, f"{where}.parameter_strategy[{name!r}]")
        assert s is not None
        new[name] = s
    old = get_shard_spec(module)
    merged = dict(old.parameter_strategy) if old else {}
    for name, s in new.items():
        if name in merged and merged[name] != s:
            raise ShardingError(
                f"{where}: parameter {name!r} was annotated {_text(merged[name])} and now "
                f"{_text(s)}; a parameter has one layout, remove one of the annotations"
            )
        merged[name] = s
    spec = ShardSpec(
        _normalise_many(in_strategy, f"{where}.in_strategy")
        if in_strategy is not None
        else (old.in_strategy if old else None),
        _normalise_many(out_strategy, f"{where}.out_strategy")
        if out_strategy is not None
        else (old.out_strategy if old else None),
        merged,
        old.sequence_split if old else None,
    )
    object.__setattr__(module, _ATTR, spec)
    return module


def split_sequence(module: M, axis: str = "tp", *, dim: int = 1) -> M:
    """Mark the values leaving ``module`` as split along ``dim`` (the sequence) over mesh axis
    ``axis``, dim 0 keeping the batch's data-parallel split; returns the module.

    Megatron's sequence parallel: on a row-parallel module (the attention's output
    projection, the MLP's down projection) the pending sum of its output is reduce-scattered
    over the sequence instead of all-reduced, and the norms, dropouts and residual adds that
    follow run on a slice of the sequence (their activations divided by the axis size); the
    next column-parallel module all-gathers its input. Resolved against the job's mesh when it
    is planned (the data-parallel axis is ``ParallelConfig.dp_axis``, left whole where the
    mesh lacks it); :func:`plait.annotate.megatron` with ``sequence_parallel=True`` marks the
    modules for you.

    Raises:
        ShardingError: ``module`` is not an ``nn.Module``, ``axis`` is not a non-empty
            string, ``dim`` is not an int >= 1 (dim 0 is the batch), or the module was marked
            with another axis or dim before.
    """
    if not isinstance(module, nn.Module):
        raise ShardingError(
            f"plait.annotate.split_sequence expects an nn.Module, got {type(module).__name__}"
        )
    where = f"plait.annotate.split_sequence({type(module).__name__})"
    if not isinstance(axis, str) or not axis:
        raise ShardingError(f"{where}: axis must be a mesh axis name such as 'tp', got {axis!r}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ShardingError(
            f"{where}: dim must be the sequence dim, an int >= 1 (dim 0 is the batch), got {dim!r}"
        )
    old = get_shard_spec(module)
    if old is not None and old.sequence_split not in (None, (axis, dim)):
        raise ShardingError(
            f"{where}: the module was marked split along dim {old.sequence_split[1]} over "
            f"{old.sequence_split[0]!r} before; a value has one layout, remove one mark"
        )
    spec = ShardSpec(
        old.in_strategy if old else None,
        old.out_strategy if old else None,
        dict(old.parameter_strategy) if old else {},
        (axis, dim),
    )
    object.__setattr__(module, _ATTR, spec)
    return module


def get_shard_spec(module: nn.Module) -> ShardSpec | None:
    return getattr(module, _ATTR, None)


def _text(s: StrategyLike) -> str:
    return s.describe() if isinstance(s, TensorLayout) else repr(s)


def parameter_layouts(model: nn.Module, mesh: MeshSpec) -> dict[str, TensorLayout]:
    """Every parameter's layout from the model's ``parameter_strategy`` annotations (replicated
    where none is given), validated against the mesh and the parameter shapes.

    Pure and immediate: ``parallelize`` calls it so that a bad annotation is refused by name
    before any process waits on another, even when planning waits for the first batch. A
    parameter shared by two modules must be annotated alike in both.
    """
    from plait.layout import resolve_tensor_strategy
    from plait.rules.common import to_mesh

    found: dict[int, tuple[TensorLayout, str]] = {}
    for path, module in model.named_modules():
        spec = get_shard_spec(module)
        for pname, strategy in (spec.parameter_strategy if spec else {}).items():
            where = f"{path}.{pname}" if path else pname
            p = module.get_parameter(pname)
            if isinstance(strategy, TensorLayout):
                layout = to_mesh(strategy, mesh, where)
                layout.check_shape(tuple(p.shape), where)
            else:
                layout = resolve_tensor_strategy(strategy, mesh, where, tuple(p.shape))
            prev = found.get(id(p))
            if prev is not None and prev[0] != layout:
                raise ShardingError(
                    f"parameter {where} (also reached as {prev[1]}) is annotated "
                    f"{layout.describe()} here and {prev[0].describe()} there; a shared "
                    "parameter has one layout: make the two annotations agree"
                )
            found.setdefault(id(p), (layout, where))
    return {
        name: found[id(p)][0] if id(p) in found else TensorLayout.replicated(mesh, p.ndim)
        for name, p in model.named_parameters()
    }


_RECOMPUTE_ATTR = "_plait_recompute"


def recompute(module: nn.Module, mode: str = "full") -> nn.Module:
    """Recompute ``module``'s forward in backward instead of keeping its activations.

    MindSpore's ``Cell.recompute()``: every op inside the module (and its sub-modules) is
    recomputed before backward needs it, except the module's outputs, which are kept.
    ``mode="selective"`` keeps the outputs of matrix products, convolutions and attention
    kernels and recomputes only the cheap ops (activations, norms, softmax), as Megatron's
    selective recompute. Runs in every mode that runs a plan (``data_parallel``, ``semi_auto``,
    ``auto``); ``ParallelConfig(recompute=...)`` does the same for every repeated layer.
    Returns ``module``.
    """
    if mode not in ("full", "selective", "none"):
        raise ConfigError(
            f"plait.recompute({type(module).__name__}, mode={mode!r}): mode must be 'full', "
            "'selective' or 'none' (to undo)"
        )
    object.__setattr__(module, _RECOMPUTE_ATTR, mode)
    return module


def recompute_marks(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(module path, mode) of every sub-module marked by :func:`recompute`, in model order."""
    return tuple(
        (name, getattr(m, _RECOMPUTE_ATTR))
        for name, m in model.named_modules()
        if getattr(m, _RECOMPUTE_ATTR, "none") != "none"
    )


_HOST_ATTR = "_plait_on_host"


def on_host(module: nn.Module, host: bool = True) -> nn.Module:
    """Keep ``module`` and compute it on the host: its parameters, gradients and optimizer
    states live in host memory, its forward and backward run on the CPU, and its inputs and
    outputs are copied across (MindSpore's host and device heterogeneous training,
    ``Primitive.set_device("CPU")``; the Wide&Deep recipe puts the embedding table there).
    For memory-heavy, compute-light modules such as a large embedding table. The same as
    naming the module in ``ParallelConfig.host_modules``; ``host=False`` undoes the mark.
    Returns ``module``.
    """
    if not isinstance(host, bool):
        raise ConfigError(
            f"plait.on_host({type(module).__name__}, host={host!r}): give True or False"
        )
    object.__setattr__(module, _HOST_ATTR, host)
    return module


def host_marks(model: nn.Module) -> tuple[str, ...]:
    """Paths of the sub-modules marked by :func:`on_host`, in model order."""
    return tuple(name for name, m in model.named_modules() if getattr(m, _HOST_ATTR, False))


_SERVER_ATTR = "_plait_server"


@dataclass(frozen=True, slots=True)
class ServerMark:
    """How ``plait.on_server`` put a table on the parameter servers."""

    init_in_server: bool = False
    """The servers make its rows (it never exists whole on a worker)."""
    seed: int = 0
    """Seed of the rows made on the servers (``plait.ps.initial_table`` gives them whole)."""


def on_server(
    module: M, *, init_in_server: bool = False, seed: int = 0, server: bool = True
) -> M:
    """Keep embedding table ``module`` (``nn.Embedding`` or ``nn.EmbeddingBag``) on the
    parameter servers of a ``mode="parameter_server"`` job, each server holding a split of
    its rows with their optimizer states (MindSpore's ``set_param_ps``). The same as naming
    it in ``ParallelConfig.server_modules``. ``init_in_server``: the servers make its rows
    (N(0, 1), from ``seed``), so it may be built on the meta device and never exist whole on
    a worker. ``server=False`` undoes the mark. Returns ``module``."""
    for name, value in (("init_in_server", init_in_server), ("server", server)):
        if not isinstance(value, bool):
            raise ConfigError(
                f"plait.on_server({type(module).__name__}, {name}={value!r}): give True or False"
            )
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31:
        raise ConfigError(
            f"plait.on_server({type(module).__name__}, seed={seed!r}): give an integer in "
            "0..2**31-1"
        )
    mark = ServerMark(init_in_server, seed) if server else None
    object.__setattr__(module, _SERVER_ATTR, mark)
    return module


def server_marks(model: nn.Module) -> tuple[str, ...]:
    """Paths of the sub-modules marked by :func:`on_server`, in model order."""
    return tuple(
        name for name, m in model.named_modules() if getattr(m, _SERVER_ATTR, None) is not None
    )


_STAGE_ATTR = "_plait_pipeline_stage"


def pipeline_stage(module: nn.Module, stage: int) -> nn.Module:
    """Put ``module`` (and everything inside it) in pipeline stage ``stage``.

    MindSpore's ``cell.pipeline_stage = k``. Stages run in model order: every module marked
    ``k`` must come after every module marked ``k - 1``, and each of the
    ``ParallelConfig.pipeline_stages`` (times ``virtual_stages``) stages needs at least one
    marked module; modules left unmarked go with the stage around them (the embeddings before
    the first marked layer in stage 0, the head after the last in the last stage). Without
    marks plait splits the model's longest list of layers evenly. Returns ``module``.
    """
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise ConfigError(
            f"plait.pipeline_stage({type(module).__name__}, {stage!r}): the stage is an int >= 0"
        )
    object.__setattr__(module, _STAGE_ATTR, stage)
    return module


def pipeline_stage_marks(model: nn.Module) -> tuple[tuple[str, int], ...]:
    """(module path, stage) of every sub-module marked by :func:`pipeline_stage`, in model
    order."""
    return tuple(
        (name, getattr(m, _STAGE_ATTR))
        for name, m in model.named_modules()
        if getattr(m, _STAGE_ATTR, None) is not None
    )
